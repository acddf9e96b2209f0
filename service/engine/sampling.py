"""Token selection for one request, through the same function the backends' `sample` op runs.

The chain (penalty -> top-k -> top-p -> min-p -> temperature -> draw), its tie rules and the
draw are defined once, in service/backends/cpu/sampling.py, the reference of the CPU backend's
op and of cuda/sampling.cu. The draw reads the counter-based uniform of
service/backends/counter_rng.py keyed by (seed, token index): a seeded request replays exactly,
alone or batched, on either backend.

The engine samples through its model runner (the backend op, on the device); `Sampler` runs the
same reference on a host row, for tests and tools. Speculative decoding samples each verify
row exactly as plain decoding would sample that token index and accepts the drafts that equal
the rows' choices (`speculative.accept_chain`, whose docstring gives the argument).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from service.backends.cpu import sampling as ref
from service.backends.cpu.sampling import log_softmax
from service.backends.step_format import OUT_WORDS
from service.engine.runner.step import Adjustment, RowSampling
from service.engine.types import SamplingParams, TokenLogprob

__all__ = ["Sampler", "log_softmax", "resolve_seed", "top_logprobs"]


def resolve_seed(seed: int | None, greedy: bool = False) -> int:
    """`seed`, else 0 for a greedy request (it draws nothing, so no seed changes its tokens),
    else a fresh random 63-bit seed (reported back to the caller for replay)."""
    if seed is not None:
        return seed
    if greedy:
        return 0
    return int.from_bytes(os.urandom(8), "little") >> 1


class Sampler:
    """Per-request token selector. Draw i (0-based, counted by `sample` unless given) uses the
    uniform keyed by (seed, i), so the choices depend only on (params, seed, logits, i)."""

    def __init__(self, params: SamplingParams, vocab_size: int, seed: int):
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.params = params
        self.vocab_size = vocab_size
        self.seed = seed
        self.index = 0          # the next draw's token index
        self.adjust = Adjustment.of(params.logit_bias)

    def _row(self, logits: np.ndarray) -> np.ndarray:
        logits = np.asarray(logits)
        if logits.ndim != 1 or logits.shape[0] < self.vocab_size:
            raise ValueError(f"logits must be ({self.vocab_size},), got {logits.shape}")
        return np.ascontiguousarray(logits[:self.vocab_size], np.float32)

    def _record(self, recent_ids: Sequence[int], index: int, n_generated: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The op's parameter record (N_PARAMS,) i32, a one-slot history (1, n) i32 holding
        recent_ids, the newest at the row's position, and the adjustment pairs (K, 2) i32."""
        recent = np.asarray(list(recent_ids), np.int32)                      # (n,) i32
        hist = np.zeros((1, max(1, recent.size)), np.int32)
        hist[0, :recent.size] = recent
        row = RowSampling.of(self.params, self.seed, index, -1, recent.size - n_generated,
                             self.adjust)
        adj = np.zeros((1, 2), np.int32) if self.adjust is None else self.adjust.pairs
        return np.array(row.record(0, recent.size - 1), np.int32), hist, adj

    def sample(self, logits: np.ndarray, recent_ids: Sequence[int] = (),
               index: int | None = None, n_generated: int = 0) -> int:
        """Pick the next token. logits: (V,) f32 (extra trailing entries are ignored);
        recent_ids: the sequence so far, most recent last (for the repetition penalty), of which
        the last n_generated were generated (the frequency / presence penalties count those);
        index: the draw's token index (default: one more than the previous call's)."""
        if index is None:
            index, self.index = self.index, self.index + 1
        if not 0 <= n_generated <= len(recent_ids):
            raise ValueError(f"n_generated {n_generated} of {len(recent_ids)} recent ids")
        rec, hist, adj = self._record(recent_ids, index, n_generated)
        out = np.zeros(OUT_WORDS, np.int32)
        ref.sample_row(self._row(logits), rec, hist, adj, out)
        return int(out[0])

    def distribution(self, logits: np.ndarray, recent_ids: Sequence[int] = (),
                     n_generated: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """The distribution `sample()` draws from: ids (n,) int64 in ascending order and
        probs (n,) f64 summing to 1. Greedy: the argmax with probability 1."""
        row = self._row(logits)
        p = self.params
        if p.repetition_penalty != 1.0 and p.repeat_last_n > 0 and len(recent_ids):
            window = np.asarray(list(recent_ids)[-p.repeat_last_n:], np.int64)
            row = ref.penalised(row, window, np.float32(p.repetition_penalty))
        if (p.frequency_penalty or p.presence_penalty) and n_generated:
            gen = np.asarray(list(recent_ids)[len(recent_ids) - n_generated:], np.int32)
            row = ref.counted(row, gen, np.float32(p.frequency_penalty),
                              np.float32(p.presence_penalty))
        if self.adjust is not None:
            row = ref.adjusted(row, self.adjust.pairs)
        if p.greedy:
            return np.array([np.argmax(row)], np.int64), np.ones(1)
        return ref.distribution(row, p.temperature, p.top_k, p.top_p, p.min_p)


def top_logprobs(logits: np.ndarray, chosen: int, k: int) -> TokenLogprob:
    """The chosen token's logprob under softmax of the raw logits (no penalty, temperature 1),
    plus the k most likely tokens (most likely first, lower id first on ties), in float64."""
    x = np.asarray(logits, dtype=np.float64)
    m = x.max()
    lse = m + np.log(np.exp(x - m).sum())
    top = tuple((int(i), float(x[i] - lse)) for i in ref.top_ids(x, k))
    return TokenLogprob(token_id=int(chosen), logprob=float(x[chosen] - lse), top=top)
