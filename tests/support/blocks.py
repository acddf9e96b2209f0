"""Random but valid GGUF blocks of every weight type, for kernel tests (numpy only).

Quant bytes are uniform random; every f16 scale field is overwritten with a finite positive
value (d ~ 2^-7 .. 2^-5, so weights are O(0.01-0.1) like a real model's), which makes every
block decode to finite numbers.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from service.gguf.reader import TensorInfo

# Byte offsets of the f16 scale/min fields in each block type (ggml's block structs).
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
              "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q2_K": (80, 82), "Q3_K": (108,),
              "IQ4_NL": (0,), "IQ4_XS": (0,)}
ALL_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K",
             "Q6_K", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS")


def qtype(name: str) -> GGMLQuantizationType:
    return GGMLQuantizationType[name]


def block_size(name: str) -> int:
    return GGML_QUANT_SIZES[qtype(name)][0]


def random_tensor(name: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """(rows * K) elements of type `name` as the file's raw bytes, (n_bytes,) uint8."""
    bs, ts = GGML_QUANT_SIZES[qtype(name)]
    if k % bs:
        raise ValueError(f"{name}: K={k} not a multiple of {bs}")
    if name == "F32":
        return rng.normal(0, 0.05, rows * k).astype(np.float32).view(np.uint8)
    if name == "F16":
        return rng.normal(0, 0.05, rows * k).astype(np.float16).view(np.uint8)
    if name == "BF16":
        f = rng.normal(0, 0.05, rows * k).astype(np.float32).view(np.uint32)
        return (f >> 16).astype(np.uint16).view(np.uint8)
    n_blocks = rows * k // bs
    raw = rng.integers(0, 256, (n_blocks, ts), dtype=np.uint8)
    for off in F16_FIELDS[name]:
        d = rng.uniform(2.0 ** -7, 2.0 ** -5, n_blocks).astype(np.float16)
        raw[:, off:off + 2] = d.view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(-1)


def random_tensor_info(name: str, rows: int, k: int, seed: int, label: str = "w") -> TensorInfo:
    """A (rows, K) weight of type `name` as the reader gives it, random_tensor's bytes drawn
    from `seed`; its tensor name `label.type.rowsxK.seed` (a backend that keeps uploaded weights
    by name sees one tensor per distinct call)."""
    raw = random_tensor(name, rows, k, np.random.default_rng(seed))
    return TensorInfo(f"{label}.{name}.{rows}x{k}.{seed}", qtype(name), (rows, k), raw)
