"""Seeded random weights for the synthetic drafter files (synth_eagle3.py, synth_dflash.py), and
their encoding as GGUF tensors.

Every tensor comes from its own generator seeded by (seed, name), so a file depends on its
options only: 2-D weights normal with standard deviation `std`, 1-D (norm) weights
1 + uniform(-NORM_JITTER, NORM_JITTER), the d2t table a sorted seeded subset of the target's ids
(I64). 2-D weights are written as F32, F16 or Q8_0 (the gguf package's quantizer); 1-D ones
always F32.
"""

from __future__ import annotations

import hashlib

import numpy as np

QUANTS = ("F32", "F16", "Q8_0")
NORM_JITTER = 0.05
D2T = "d2t"


def tensor_rng(seed: int, name: str) -> np.random.Generator:
    h = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return np.random.default_rng(int.from_bytes(h[:8], "little"))


def random_weights(shapes: dict[str, tuple[int, ...]], seed: int, std: float,
                   vocab_size: int) -> dict[str, np.ndarray]:
    """name -> array for every (name, row-major shape); d2t draws from [0, vocab_size)."""
    out = {}
    for name, shape in shapes.items():
        g = tensor_rng(seed, name)
        if name == D2T:
            ids = g.choice(vocab_size, shape[0], replace=False)
            out[name] = np.sort(ids).astype(np.int64)                       # (Vd,) i64
        elif len(shape) == 1:                                               # norm weights
            out[name] = (1 + g.uniform(-NORM_JITTER, NORM_JITTER, shape)).astype(np.float32)
        else:
            out[name] = (g.standard_normal(shape) * std).astype(np.float32)
    return out


def encode(name: str, a: np.ndarray, quant: str):
    """(raw bytes array, gguf quant type) of tensor `name` written at `quant`."""
    import gguf

    qt = gguf.GGMLQuantizationType
    if name == D2T:
        return a, qt.I64
    if a.ndim == 1 or quant == "F32":
        return a, qt.F32
    if quant == "F16":
        return a.astype(np.float16), qt.F16
    return gguf.quants.quantize(a, qt.Q8_0), qt.Q8_0


def add_tensors(w, tensors: dict[str, np.ndarray], quant: str) -> list[list[np.ndarray]]:
    """Add every tensor's info to GGUFWriter `w`; the data chunks for write_tensor_data."""
    data = []
    for name, a in tensors.items():
        raw, dtype = encode(name, a, quant)
        w.add_tensor_info(name, a.shape, np.dtype(np.float32), raw.nbytes, raw_dtype=dtype)
        data.append([raw])
    return data
