"""The small ops of the CPU backend, in numpy: embedding rows, RMSNorm, add, RoPE, GLU, argmax.

Stateless functions writing into `out`, as the backend interface asks (service/backends/base.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from service.backends.cpu import kernels as K
from service.backends.rope_angles import rope_cos_sin
from service.gguf import quants
from service.gguf.quants import QuantType
from service.gguf.reader import TensorInfo


@dataclass
class CpuEmbedding:
    raw: np.ndarray                  # (vocab, row_bytes) u8, the file's own rows
    qtype: QuantType
    n_embd: int


def load_embedding(tensor: TensorInfo) -> CpuEmbedding:
    vocab, e = tensor.shape
    return CpuEmbedding(tensor.raw.reshape(vocab, -1), tensor.qtype, e)


def embed(table: CpuEmbedding, ids, scale, out) -> None:
    rows = table.raw[ids]                                              # (T, row_bytes) u8
    out[...] = quants.dequantize(rows, table.qtype, (len(ids), table.n_embd))
    if scale != 1.0:
        out *= np.float32(scale)


def rms_norm(x, w, eps, out) -> None:
    ms = np.square(x).sum(axis=-1) / np.float32(x.shape[-1])                   # (...,) f32
    np.multiply(x, (1.0 / np.sqrt(ms + np.float32(eps)))[..., None], out=out)
    out *= w


def rope_table(n_ctx, n_dims, base, scaling=None) -> tuple[np.ndarray, np.ndarray]:
    return rope_cos_sin(n_ctx, n_dims, base, scaling)                 # (n_ctx, n_dims/2) x 2


def rope(x, positions, table, neox) -> None:
    cos, sin = table[0][positions][:, None, :], table[1][positions][:, None, :]  # (T, 1, d/2)
    half = cos.shape[-1]
    if neox:
        a, b = x[..., :half], x[..., half:2 * half]
    else:
        a, b = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
    a0 = a.copy()
    a[...] = a0 * cos - b * sin
    b[...] = a0 * sin + b * cos


def glu(gate, up, activation, out) -> None:
    # out must not alias gate or up.
    if activation == "silu":
        np.negative(gate, out=out)
        np.exp(out, out=out)
        out += 1.0
        np.divide(gate, out, out=out)
    else:  # gelu_tanh: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
        g = gate
        np.multiply(g, g, out=out)
        out *= np.float32(0.044715)
        out += 1.0
        out *= g
        out *= np.float32(np.sqrt(2.0 / np.pi))
        np.tanh(out, out=out)
        out += 1.0
        out *= g
        out *= np.float32(0.5)
    out *= up


def softplus_gate(a, g) -> None:
    """a (T, H, D) *= softplus(g), g (T, H, 1 | D): ggml's softplus, v > 20 ? v : log(1 + exp(v))
    in float32 (1 + exp(v) rounded to f32 first, as ggml and the CUDA kernel compute it, not
    log1p: for v below about -16 that is log(1) = 0)."""
    g = np.asarray(g, np.float32)
    sp = np.where(g > 20.0, g, np.log(np.float32(1.0) + np.exp(np.minimum(g, np.float32(20.0)))))
    a *= sp.astype(np.float32)


def argmax(logits, out) -> None:
    K.argmax_rows(logits, out)
