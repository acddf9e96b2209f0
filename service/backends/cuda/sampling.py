"""Step I/O and token choice of the CUDA backend (the model runner's contract,
service/engine/runner.py): one packed int32 upload per step from pinned memory, token choice on
the device (cuda/sampling.cu), one int32 readback into pinned memory and one event wait.
Scratch is sized once by prepare_sampling.

A mixin of CudaBackend: it uses the backend's stream, `_launch` and `zeros`.
"""

from __future__ import annotations

from typing import Any

import cupy as cp
import numpy as np

from service.backends.cuda.types import I32, ceil_div, check_dtype, view_rows
from service.backends.step_format import N_PARAMS, OUT_WORDS

SAMPLE_THREADS = 512      # block of sample_rows (cuda/sampling.cu SAMPLE_THREADS)


class SamplingOps:
    """host_buffer / upload_step / download_step / record_tokens / chosen_ids / sample of
    CudaBackend."""

    _sample_work: Any = None          # (rows * V,) f32 penalised logits, one row per logits row
    _sample_rows: int = 0
    _sample_vocab: int = 0
    _step_done: Any = None            # the event download_step waits on

    def host_buffer(self, n: int) -> np.ndarray:
        mem = cp.cuda.alloc_pinned_memory(max(1, n) * 4)
        buf = np.frombuffer(mem, np.int32, n)                      # (n,) i32 pinned
        buf[:] = 0
        return buf

    @staticmethod
    def _check_words(host, device, what: str) -> int:
        check_dtype(host, np.int32, f"{what} host")
        check_dtype(device, np.int32, f"{what} device")
        if device.ndim != 1 or not device.flags.c_contiguous or not host.flags.c_contiguous:
            raise ValueError(f"{what}: buffers must be contiguous 1-D")
        return min(host.size, device.size)

    def upload_step(self, host, device) -> None:
        n = self._check_words(host, device, "upload_step")
        if n != host.size:
            raise ValueError(f"upload_step: {host.size} words into {device.size}")
        cp.cuda.runtime.memcpyAsync(device.data.ptr, host.ctypes.data, n * 4,
                                    cp.cuda.runtime.memcpyHostToDevice, self.stream.ptr)

    def download_step(self, device, host) -> None:
        n = self._check_words(host, device, "download_step")
        if n != device.size:
            raise ValueError(f"download_step: {device.size} words into {host.size}")
        if n:
            cp.cuda.runtime.memcpyAsync(host.ctypes.data, device.data.ptr, n * 4,
                                        cp.cuda.runtime.memcpyDeviceToHost, self.stream.ptr)
        if self._step_done is None:
            self._step_done = cp.cuda.Event(block=False, disable_timing=True)
        self._step_done.record(self.stream)
        self._step_done.synchronize()

    def prepare_sampling(self, rows: int, vocab: int) -> None:
        self._sample_work = self.zeros((max(1, rows) * vocab,), "float32")   # (rows * V,) f32
        self._sample_rows, self._sample_vocab = rows, vocab
        self._step_done = cp.cuda.Event(block=False, disable_timing=True)

    def record_tokens(self, ids, slots, positions, hist) -> None:
        T = ids.shape[0]
        for a, what in ((ids, "ids"), (slots, "slots"), (positions, "positions")):
            check_dtype(a, np.int32, f"record_tokens {what}")
            if a.shape != (T,) or not a.flags.c_contiguous:
                raise ValueError(f"record_tokens {what}: shape {a.shape}, expected ({T},)")
        check_dtype(hist, np.int32, "record_tokens hist")
        if hist.ndim != 2 or not hist.flags.c_contiguous:
            raise ValueError(f"record_tokens hist: {hist.shape} must be contiguous 2-D")
        self._launch("record_tokens", (ceil_div(T, 128),), (128,),
                     [ids, slots, positions, I32(T), I32(hist.shape[0]), I32(hist.shape[1]),
                      hist])

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
            self._launch("chosen_ids", (ceil_div(L, 128),), (128,),
                         [records, I32(OUT_WORDS), I32(L), out])

    def sample(self, logits, params, hist, out) -> None:
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
        if self._sample_work is None or L > self._sample_rows or V != self._sample_vocab:
            raise ValueError(f"sample: {L} rows of {V} exceed prepare_sampling's "
                             f"{self._sample_rows} of {self._sample_vocab}")
        self._launch("sample_rows", (L,), (SAMPLE_THREADS,),
                     [logits, I32(ld), I32(V), params, hist, I32(hist.shape[1]),
                      self._sample_work, out])
