"""Seeded random weights for the synthetic drafter files (synth_eagle3.py, synth_dflash.py), their
encoding as GGUF tensors, and the file layout both write (write_drafter).

Every tensor comes from its own generator seeded by (seed, name), so a file depends on its
options only: 2-D weights normal with standard deviation `std`, 1-D (norm) weights
1 + uniform(-NORM_JITTER, NORM_JITTER), the d2t table a sorted seeded subset of the target's ids
(I64). 2-D weights are written as F32, F16 or Q8_0 (the gguf package's quantizer); 1-D ones
always F32.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

from service.gguf.reader import GGUFFile

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


def geometry(spec, n_layer: int) -> list[tuple[str, int]]:
    """The `<arch>.*` integer keys of a drafter's decoder shape (spec: an Eagle3Spec or a
    DflashSpec), in the order the files list them."""
    return [("embedding_length", spec.n_embd), ("block_count", n_layer),
            ("feed_forward_length", spec.n_ff), ("context_length", spec.n_ctx_train),
            ("attention.head_count", spec.n_head), ("attention.head_count_kv", spec.n_head_kv),
            ("attention.key_length", spec.head_dim), ("attention.value_length", spec.head_dim),
            ("rope.dimension_count", spec.rope_dims), ("vocab_size", spec.vocab_size)]


def write_drafter(out: Path, target: GGUFFile, arch: str, spec, u32: list[tuple[str, int]],
                  tensors: dict[str, np.ndarray], quant: str,
                  extra: Callable = lambda w: None,
                  drop_key: Callable[[str], bool] = lambda k: False) -> None:
    """Write a drafter file of architecture `arch` for `target`: the target's tokenizer keys
    (but those drop_key names, which `extra` writes itself), the name, `<arch>.target_layers`,
    the u32 keys `<arch>.<key>`, the RMS epsilon and RoPE base, what `extra(writer)` adds,
    then the tensors at `quant`; written to a .part file and renamed, nothing left behind on
    an error."""
    import gguf

    from service.gguf.writer import copy_metadata, write_tensor_data

    part = out.with_name(out.name + ".part")
    w = gguf.GGUFWriter(str(part), arch)
    try:
        copy_metadata(target, w, None, None,
                      drop=lambda k: not k.startswith("tokenizer.") or drop_key(k))
        w.add_name(f"{arch} synth for {target.get('general.name', target.path.stem)}")
        w.add_array(f"{arch}.target_layers", [int(k) for k in spec.target_layers])
        for key, v in u32:
            w.add_uint32(f"{arch}.{key}", int(v))
        w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", spec.rms_eps)
        w.add_float32(f"{arch}.rope.freq_base", spec.rope_base)
        extra(w)
        data = add_tensors(w, tensors, quant)
    except BaseException:
        w.close()
        part.unlink(missing_ok=True)
        raise
    write_tensor_data(w, data, part, out)
