"""The CUDA KV cache planes (service/backends/cuda/kv.py; cuda/kv_quant.cuh) as ggml blocks, on
the host: the GPU tests decode the caches they read back with it, the CPU layout tests check it
against gguf's blocks."""

from __future__ import annotations

import numpy as np

from service.backends.cuda.kernels import KV_SIDE_WORDS


def planes_as_blocks(codes: np.ndarray, side: np.ndarray | None, kind: str) -> np.ndarray:
    """The planes of a KV cache type as ggml blocks (n, type_size) uint8: each 32-group's side
    words (d; d, m; d, qh; d, m, qh: kernels.KV_SIDE_WORDS) are its block's leading fields in
    ggml's order, its codes (the u8 codes plane's 32 | 16 bytes) the rest; f16/bf16 (no side
    plane) one 2-byte element a block."""
    if side is None:
        return codes.view(np.uint8).reshape(-1, 2)
    n = side.size // KV_SIDE_WORDS[kind]           # one group per KV_SIDE_WORDS u16 words
    code_bytes = codes.view(np.uint8)              # the plane is bytes already (kv.py)
    assert code_bytes.size % n == 0, (code_bytes.size, n)
    return np.concatenate([side.view(np.uint8).reshape(n, -1), code_bytes.reshape(n, -1)], 1)
