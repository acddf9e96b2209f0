"""Weight matrices of the CPU backend: load-time repacking and out = x @ W^T (plus the
mixture-of-experts op, which is matmuls).

Quantized weights are repacked exactly into int8 codes with per-group f32 scale and offset
(kernels.py); float weights are kept as W^T in f32 for BLAS. Steps of up to `invariant_tokens`
tokens (decode, speculative verify) compute every row exactly as a single-token step would;
longer steps (prefill chunks) dequantize tiles of rows and go through sgemm.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from service.backends import act_quant
from service.backends.base import Segments, segment_rows
from service.backends.cpu import kernels as K
from service.backends.cpu import ops
from service.backends.cpu.threads import ThreadBudget
from service.errors import ModelFormatError
from service.gguf import quants
from service.gguf.quants import QuantType
from service.gguf.reader import TensorInfo

TILE_ROWS = 512         # rows dequantized per sgemm in prefill steps (2.4 MB at K = 1152)
_EMPTY = np.zeros((0, 0), dtype=np.float32)


@dataclass
class CpuMatrix:
    """A repacked weight matrix (N, K): format 'q8' (affine int8 groups) or 'f32'."""

    fmt: str
    n: int
    k: int
    data: np.ndarray                 # q8: (N, K) i8 | f32: (K, N) f32 (W^T)
    scale: np.ndarray = field(default_factory=lambda: _EMPTY)   # (N, K/group) f32
    offset: np.ndarray = field(default_factory=lambda: _EMPTY)  # (N, K/group) f32 | (0, 0)
    group: int = 32
    src: QuantType = QuantType.F32   # the file's type (selects llama.cpp's activation rounding)


def _format_of(t: TensorInfo) -> tuple[str, int]:
    spec = quants.block_spec(t.qtype)
    if spec.bits == 32:
        return "f32", 0
    _, _, _, group = quants.affine_rows(t.raw[: spec.type_size], t.qtype, (1, spec.block_size))
    return "q8", group


def _rows(t: TensorInfo) -> tuple[int, int]:
    """A tensor viewed as a (rows, K) matrix."""
    return int(np.prod(t.shape[:-1])), t.shape[-1]


class CpuMatmul:
    """Loads weight matrices and multiplies by them; owns the prefill tiles' scratch.

    act_quant: False (float32 activations, the reference), True (llama.cpp's CPU rounding by
    the weight type, act_quant.llamacpp_round_trip) or "gpu" (the CUDA GEMVs' 8-bit blocks for
    quantized weights, act_quant.gpu_round_trip)."""

    def __init__(self, threads: ThreadBudget, act_quant: bool | str, invariant_tokens: int):
        self.threads = threads
        self.act_quant = act_quant
        self.invariant_tokens = invariant_tokens
        self._tile: np.ndarray | None = None      # (TILE_ROWS, K) f32 scratch, grown once

    # ---------------------------------------------------------------- loading
    @staticmethod
    def can_fuse(tensors: list[TensorInfo]) -> bool:
        fmts = {_format_of(t) for t in tensors}
        return len(fmts) == 1 and len({t.shape[-1] for t in tensors}) == 1

    def load_matrix(self, tensors: list[TensorInfo]) -> CpuMatrix:
        if not self.can_fuse(tensors):
            raise ModelFormatError("cannot fuse tensors of different formats: "
                                   + ", ".join(f"{t.name} {t.qtype.name}" for t in tensors))
        fmt, _ = _format_of(tensors[0])
        k = tensors[0].shape[-1]
        n = sum(int(np.prod(t.shape[:-1])) for t in tensors)
        if fmt == "f32":
            w = np.concatenate([quants.dequantize(t.raw, t.qtype, _rows(t)) for t in tensors])
            return CpuMatrix("f32", n, k, np.ascontiguousarray(w.T),  # (K, N) f32
                             src=tensors[0].qtype)
        parts = [quants.affine_rows(t.raw, t.qtype, _rows(t)) for t in tensors]
        codes = np.concatenate([p[0] for p in parts])                    # (N, K) i8
        scale = np.ascontiguousarray(np.concatenate([p[1] for p in parts]), np.float32)
        offset = np.ascontiguousarray(np.concatenate([p[2] for p in parts]), np.float32)
        group = parts[0][3]
        if not offset.any():
            offset = _EMPTY
        return CpuMatrix("q8", n, k, np.ascontiguousarray(codes, np.int8), scale, offset, group,
                         tensors[0].qtype)

    def load_experts(self, tensor: TensorInfo) -> list[CpuMatrix]:
        n_expert = tensor.shape[0]
        per = tensor.raw.reshape(n_expert, -1)
        return [self.load_matrix([TensorInfo(f"{tensor.name}[{e}]", tensor.qtype,
                                             tensor.shape[1:], per[e])])
                for e in range(n_expert)]

    # ---------------------------------------------------------------- products
    def matmul(self, x, w: CpuMatrix, out, segments: Segments = None) -> None:
        """out = x @ W^T; each of `segments` (base.py) as a matmul of its own rows: its row
        count alone picks the path (invariant or tiled) and the thread budget, and the tiled
        runs share each dequantized tile."""
        runs = segment_rows(segments, x.shape[0])
        if self.act_quant == "gpu":
            if w.fmt == "q8":
                x = act_quant.gpu_round_trip(x)                          # (T, K) f32
        elif self.act_quant:
            x = act_quant.llamacpp_round_trip(x, w.src)                  # (T, K) f32
        if w.fmt == "q8":
            x = np.ascontiguousarray(x, dtype=np.float32)
        wide = [(a, b) for a, b in runs if b - a > self.invariant_tokens]
        for a, b in runs:
            if b - a <= self.invariant_tokens:
                self._matmul_rows(x[a:b], w, out[a:b])
        if not wide:
            return
        self.threads.enter(max(b - a for a, b in wide))
        if w.fmt == "f32":
            for a, b in wide:
                np.matmul(x[a:b], w.data, out=out[a:b])
        else:
            self._matmul_tiles(x, w, out, wide)

    def _matmul_rows(self, x, w: CpuMatrix, out) -> None:
        """out = x @ W^T, every row computed as a single-token step computes it."""
        self.threads.enter(x.shape[0])
        if w.fmt == "f32":
            for t in range(x.shape[0]):   # one row at a time: the same BLAS call for any T
                np.matmul(x[t:t + 1], w.data, out=out[t:t + 1])
            return
        xsum = np.empty((x.shape[0], w.k // w.group), np.float32)       # (T, K/group) f32
        K.group_sums(x, w.group, xsum)
        K.matmul_q8(x, xsum, w.data, w.scale, w.offset, w.group, out)

    def _matmul_tiles(self, x, w: CpuMatrix, out, runs) -> None:
        """out[a:b] = x[a:b] @ W^T for each run, W dequantized TILE_ROWS rows at a time into a
        reused scratch buffer (each tile once for every run)."""
        if self._tile is None or self._tile.shape[1] < w.k:
            self._tile = np.empty((TILE_ROWS, w.k), np.float32)
        for r0 in range(0, w.n, TILE_ROWS):
            r1 = min(w.n, r0 + TILE_ROWS)
            tile = self._tile[: r1 - r0, : w.k]                             # (rows, K) f32
            K.dequantize_rows(w.data, w.scale, w.offset, w.group, r0, tile)
            for a, b in runs:
                np.matmul(x[a:b], tile.T, out=out[a:b, r0:r1])

    def moe(self, x, router: CpuMatrix, gate, up, down, n_used, normalize, activation,
            out, *, gating="softmax", bias=None, scale=1.0) -> None:
        T = x.shape[0]
        logits = np.empty((T, router.n), np.float32)
        self.matmul(x, router, logits)
        if gating == "sigmoid":
            probs = np.float32(1.0) / (np.float32(1.0) + np.exp(-logits))   # (T, n_expert)
        else:
            logits -= logits.max(axis=-1, keepdims=True)
            probs = np.exp(logits)
            probs /= probs.sum(axis=-1, keepdims=True)                      # (T, n_expert)
        sel = probs if bias is None else probs + bias[None, :]
        top = np.argsort(-sel, axis=-1, kind="stable")[:, :n_used]          # (T, n_used)
        w = np.take_along_axis(probs, top, axis=-1)
        if normalize:
            w /= np.maximum(w.sum(axis=-1, keepdims=True), np.float32(6.103515625e-5))
        if scale != 1.0:
            w *= np.float32(scale)
        out[...] = 0.0
        f = gate[0].n
        hg = np.empty((1, f), np.float32)
        hu = np.empty((1, f), np.float32)
        ha = np.empty((1, f), np.float32)
        y = np.empty((1, x.shape[1]), np.float32)
        for t in range(T):
            xt = x[t: t + 1]
            for e, we in zip(top[t], w[t], strict=True):
                self.matmul(xt, gate[e], hg)
                self.matmul(xt, up[e], hu)
                ops.glu(hg, hu, activation, ha)
                self.matmul(ha, down[e], y)
                out[t] += we * y[0]
