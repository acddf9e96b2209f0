"""Drafters: cheap guesses of the next tokens, verified by the target model in one step.

One interface (`Drafter`) for every drafter the engine can run:
    start(seq)       a sequence took KV slot seq.slot (a drafter with state resets it there)
    propose(seq, k)  up to k tokens predicted to follow seq.history (its last token is the seed,
                     whose target KV row is not written yet)
    release(seq)     the sequence finished, was cancelled or preempted: whatever it held is free
    set_block_table(table)   the target's KV block table, for a drafter whose model shares it
    tap              the target's hidden states the drafter reads (None: none); such a drafter
                     also has extend(seq, rows, positions, hidden), called after every tapped
                     step with the rows of seq whose next token is committed (eagle3_drafter.py)
`seq` is the engine's Sequence, or a SlotView of one; a drafter reads only `slot` and `history`
(DraftState). What the target accepted is not reported separately: it is the history itself,
which a drafter with a cache compares with what it drafted (service/engine/spec/draft_model.py).

`NgramDrafter` (prompt lookup): find the most recent earlier occurrence of the last n tokens
of the sequence (trying n = ngram_size down to min_match) and propose the tokens that followed
it. A single-token match is too weak a signal: on prose it mostly proposes drafts that get
rejected, and each rejected draft still costs a verify row.
It costs no model and does well on code, quoting, summaries and repetitive text; on text with
no repeats it proposes nothing and the step degenerates to plain decoding.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from service.model.hidden import HiddenTap


class DraftState(Protocol):
    """What a drafter reads of a sequence."""

    slot: int                    # KV slot, fixed from start to release
    history: list[int]           # prompt + generated ids; the last one is the seed


@dataclass(frozen=True)
class SlotView:
    """A sequence as it was when it took or left its slot (the scheduler may have moved it on
    since: a preempted sequence no longer holds the slot it leaves)."""

    slot: int
    history: list[int]


class Drafter(abc.ABC):
    name: str
    model_name: str = ""         # the draft model's name, for ModelInfo ("" = no model)
    # propose is a cheap pure function of the history on the host: the overlapped loop may ask
    # it whether it would draft (engine/overlap.py) and decode plain steps while it would not
    pure: bool = False
    tap: HiddenTap | None = None     # target hidden states read (service/model/hidden.py)

    def start(self, seq: DraftState) -> None:  # noqa: B027 - stateless drafters keep nothing
        """`seq` now holds slot seq.slot."""

    @abc.abstractmethod
    def propose(self, seq: DraftState, k: int) -> list[int]:
        """Up to k tokens predicted to follow seq.history."""

    def release(self, seq: DraftState) -> None:  # noqa: B027 - stateless drafters keep nothing
        """`seq` no longer holds its slot."""

    def set_block_table(self, table) -> None:  # noqa: B027 - a drafter without a KV cache
        """The target's KV block table (n_slots, max_blocks) int32, for the next steps."""


class NgramDrafter(Drafter):
    name = "ngram"
    pure = True

    def __init__(self, ngram_size: int = 3, max_lookback: int = 4096, min_match: int = 2):
        self.ngram_size = ngram_size
        self.max_lookback = max_lookback
        self.min_match = min(min_match, ngram_size)

    def propose(self, seq: DraftState, k: int) -> list[int]:
        return self.lookup(seq.history, k)

    def lookup(self, history: Sequence[int], n_draft: int) -> list[int]:
        """Up to n_draft tokens predicted to follow `history` (its last token is the seed)."""
        if n_draft <= 0 or len(history) < 2:
            return []
        h = np.asarray(history[-self.max_lookback:], dtype=np.int64)     # (L,)
        L = len(h)
        for n in range(min(self.ngram_size, L - 1), self.min_match - 1, -1):
            key = h[L - n:]
            # windows[i] = h[i:i+n] for every start i whose continuation exists (i + n < L)
            windows = np.lib.stride_tricks.sliding_window_view(h[:L - 1], n)  # (L-n, n)
            hits = np.nonzero((windows == key).all(axis=1))[0]
            if len(hits):
                start = int(hits[-1]) + n                                # most recent match
                return [int(t) for t in h[start:start + n_draft]]
        return []


def create_drafter(name: str, ngram_size: int, suffix_cache_tokens: int = 65536
                   ) -> Drafter | None:
    """The stateless drafter named by the engine config, or None ('none'). The 'model' drafter
    needs its draft model loaded: service/engine/loader.py builds it."""
    if name == "model":
        raise ValueError("the model drafter is built by the loader (load_model), with its "
                         "draft model")
    if name == "suffix":
        from service.engine.spec.suffix import SuffixDrafter
        return SuffixDrafter(cache_tokens=suffix_cache_tokens)
    return NgramDrafter(ngram_size) if name == "ngram" else None
