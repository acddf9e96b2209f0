"""Token choice of the CUDA backend (cuda/sampling.cu), so only int32 ids (and log-probabilities
when asked) cross PCIe: argmax rows, the token history the repetition penalty reads, the chosen
ids of a draft chain, a step's input ids fed from the previous step's choices, and the sample
op (service/backends/cpu/sampling.py is its specification; the records' layout is
step_format.py's).

`SamplingOps` owns the sample op's per-row scratch (the penalised logits, and the token counts
of the frequency / presence penalties, zero between launches), sized once by prepare for up to
`rows` rows of `vocab` logits.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from service.backends.cuda.kernels import ARGMAX_THREADS, SAMPLE_THREADS
from service.backends.cuda.launcher import Launcher
from service.backends.cuda.memory import DeviceMemory
from service.backends.cuda.types import I32, ceil_div, check_dtype, view_rows
from service.backends.step_format import N_PARAMS, OUT_WORDS, mask_words


class SamplingOps:
    def __init__(self, launcher: Launcher) -> None:
        self.work: Any = None             # (rows * V,) f32 penalised logits, a row per logits row
        self.counts: Any = None           # (rows * V,) i32 token counts, all zero between steps
        self.rows = 0
        self.vocab = 0
        self._launcher = launcher

    def prepare(self, memory: DeviceMemory, rows: int, vocab: int) -> None:
        self.work = memory.zeros((max(1, rows) * vocab,), "float32")   # (rows * V,) f32
        self.counts = memory.zeros((max(1, rows) * vocab,), "int32")   # (rows * V,) i32
        self.rows, self.vocab = rows, vocab

    def argmax(self, logits, out) -> None:
        T, _, ld, _, V = view_rows(logits)
        check_dtype(out, np.int32, "argmax out")
        self._launcher.launch("argmax_rows", (T,), (ARGMAX_THREADS,),
                              [logits, I32(ld), I32(V), out])

    def record_tokens(self, ids, slots, positions, hist) -> None:
        T = ids.shape[0]
        for a, what in ((ids, "ids"), (slots, "slots"), (positions, "positions")):
            check_dtype(a, np.int32, f"record_tokens {what}")
            if a.shape != (T,) or not a.flags.c_contiguous:
                raise ValueError(f"record_tokens {what}: shape {a.shape}, expected ({T},)")
        check_dtype(hist, np.int32, "record_tokens hist")
        if hist.ndim != 2 or not hist.flags.c_contiguous:
            raise ValueError(f"record_tokens hist: {hist.shape} must be contiguous 2-D")
        self._launcher.launch("record_tokens", (ceil_div(T, 128),), (128,),
                              [ids, slots, positions, I32(T), I32(hist.shape[0]),
                               I32(hist.shape[1]), hist])

    def chosen_ids(self, records, out) -> None:
        L = records.shape[0]
        check_dtype(records, np.int32, "chosen_ids records")
        check_dtype(out, np.int32, "chosen_ids out")
        if records.shape != (L, OUT_WORDS) or not records.flags.c_contiguous:
            raise ValueError(f"chosen_ids records: {records.shape}, expected contiguous "
                             f"(L, {OUT_WORDS})")
        if out.shape != (L,) or not out.flags.c_contiguous:
            raise ValueError(f"chosen_ids out: {out.shape}, expected contiguous ({L},)")
        if L:
            self._launcher.launch("chosen_ids", (ceil_div(L, 128),), (128,),
                                  [records, I32(OUT_WORDS), I32(L), out])

    def feed_ids(self, records, src, ids) -> None:
        T = ids.shape[0]
        check_dtype(records, np.int32, "feed_ids records")
        if records.ndim != 2 or records.shape[1] != OUT_WORDS or not records.flags.c_contiguous:
            raise ValueError(f"feed_ids records: {records.shape}, expected contiguous "
                             f"(L, {OUT_WORDS})")
        for a, what in ((src, "src"), (ids, "ids")):
            check_dtype(a, np.int32, f"feed_ids {what}")
            if a.shape != (T,) or not a.flags.c_contiguous:
                raise ValueError(f"feed_ids {what}: {a.shape}, expected contiguous ({T},)")
        if T:
            self._launcher.launch("feed_ids", (ceil_div(T, 128),), (128,),
                                  [records, I32(OUT_WORDS), I32(records.shape[0]), src, I32(T),
                                   ids])

    def sample(self, logits, params, hist, adj, out, masks=None) -> None:
        L, _, ld, _, V = view_rows(logits)
        if logits.ndim != 2:
            raise ValueError(f"sample logits: {logits.shape}, expected (L, V)")
        if logits.shape[0] == 0:
            return
        check_dtype(logits, np.float32, "sample logits")
        for a, shape, what in ((params, (L, N_PARAMS), "params"), (out, (L, OUT_WORDS), "out")):
            check_dtype(a, np.int32, f"sample {what}")
            if a.shape != shape or not a.flags.c_contiguous:
                raise ValueError(f"sample {what}: {a.shape}, expected contiguous {shape}")
        check_dtype(hist, np.int32, "sample hist")
        if hist.ndim != 2 or not hist.flags.c_contiguous:
            raise ValueError(f"sample hist: {hist.shape} must be contiguous 2-D")
        check_dtype(adj, np.int32, "sample adj")
        if adj.ndim != 2 or adj.shape[1] != 2 or not adj.flags.c_contiguous:
            raise ValueError(f"sample adj: {adj.shape}, expected contiguous (K, 2)")
        if masks is not None:
            check_dtype(masks, np.int32, "sample masks")
            if masks.ndim != 2 or masks.shape[1] != mask_words(V) or not masks.flags.c_contiguous:
                raise ValueError(f"sample masks: {masks.shape}, expected contiguous "
                                 f"(R, {mask_words(V)})")
        if self.work is None or L > self.rows or V != self.vocab:
            raise ValueError(f"sample: {L} rows of {V} exceed prepare_sampling's "
                             f"{self.rows} of {self.vocab}")
        self._launcher.launch("sample_rows", (L,), (SAMPLE_THREADS,),
                              [logits, I32(ld), I32(V), params, hist, I32(hist.shape[1]), adj,
                               adj if masks is None else masks,
                               I32(0 if masks is None else masks.shape[1]),
                               self.work, self.counts, out])
