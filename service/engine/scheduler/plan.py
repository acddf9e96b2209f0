"""What one engine iteration runs: the scheduler's StepPlan.

The scheduler (policy.py) decides it; the engine executes it in order: it uploads a changed
block table, tells the drafter about slots taken and given back (and writes the token history
of cached prefixes), runs ONE step holding the decode rows (each row's drafts, then their
verify rows) and the prefill chunks that ride along (service/engine/mixed.py packs them), then
the wide step: chunks too wide to ride (one, or several prompts' chunks as one segmented step,
each computed as in a step of its own), and commits what came back.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from service.engine.scheduler.sequence import Sequence


@dataclass(frozen=True)
class DecodeRow:
    """A decoding sequence in this step: its seed and the drafts it verifies."""

    seq: Sequence
    n_draft: int        # tokens to draft after the seed (a tree: n_draft + 1 nodes); 0: plain


@dataclass(frozen=True)
class PrefillChunk:
    """Positions [start, start + len(tokens)) of a sequence's prompt, or of its context being
    recomputed after a preemption."""

    seq: Sequence
    start: int
    tokens: list[int]
    choose: bool        # the prompt's last chunk: its last row chooses the first token


@dataclass(frozen=True)
class SlotChange:
    """A sequence took a KV slot (`started`) or gave it back (preempted): per-slot drafter state
    follows it, and a cached prefix's token history is written into the slot."""

    slot: int
    seq: Sequence
    started: bool
    cached: int = 0     # started: leading context positions whose KV came from the prefix cache


@dataclass(frozen=True)
class StepPlan:
    decode: tuple[DecodeRow, ...]         # ONE step: these decode rows, in this order ...
    prefill: tuple[PrefillChunk, ...]     # ... and these chunks (<= 64 rows each), FIFO
    wide: tuple[PrefillChunk, ...]        # then these chunks in one (segmented) step
    block_table: np.ndarray | None        # (n_slots, max_blocks) i32 to upload; None: unchanged
    slot_changes: tuple[SlotChange, ...]  # in the order they happened
    preempted: int = 0                    # sequences preempted for this plan's blocks
    cached_tokens: int = 0                # positions admitted from the prefix cache

    @property
    def sequences(self) -> list[Sequence]:
        """The sequences this plan steps (decode rows, then the prefill chunks')."""
        return ([r.seq for r in self.decode] + [c.seq for c in self.prefill]
                + [c.seq for c in self.wide])

    @property
    def mixed_rows(self) -> int:
        """Rows of the shared step before padding: the decode rows' seeds and drafts and the
        riding chunks' tokens."""
        return (sum(r.n_draft + 1 for r in self.decode)
                + sum(len(c.tokens) for c in self.prefill))
