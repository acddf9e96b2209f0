"""Re-quantize a GGUF file, optionally keeping only its first N blocks (a self-drafter).

A layer-truncated copy of a model shares its vocabulary, tokenizer and embeddings, so it can
draft for the full model without any training: `specstream quantize IN OUT --type q4_0
--layers 4` writes blocks 0..3 plus everything outside the blocks (token embedding, output norm,
output head) at 4 bits.

Types (`MODES`, one row per `--type`): every tensor of two or more dimensions is encoded as the
mode's backbone type, except `dflash.*` tensors (a drafter's own, whose near-tie corrections need
8 bits or more, docs/design.md#dspark-markov-head) which get the mode's dflash type.
One-dimensional tensors (norms, biases) are written as F32. A tensor is copied unchanged (same
type, same bytes) when it already has its target type, when its rows are not whole blocks of
the target type, or when it is an MoE router (`ffn_gate_inp`: expert selection flips on small
errors, and llama.cpp's quantizer leaves
routers alone too). Otherwise it is decoded with `service.gguf.quants.dequantize` and encoded
with `gguf.quants` through `service.gguf.quants.quantize`, a chunk of rows at a time.

Metadata is copied key by key (service/gguf/writer.py's `copy_metadata`), with
`general.file_type` set to the mode's file type and, with `--layers N`, `<arch>.block_count` N
and the per-layer arrays cut to their first N entries.
"""

from __future__ import annotations

import os
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from typing import NamedTuple

import numpy as np

from service.errors import ConfigError
from service.gguf.quants import QuantType, block_spec, dequantize, quantize
from service.gguf.reader import GGUFFile, TensorInfo
from service.gguf.writer import copy_metadata, write_tensor_data

CHUNK_ELEMENTS = 1 << 22       # elements converted per step: temporaries stay ~16 MiB in f32
_BLOCK = re.compile(r"^blk\.(\d+)\.")
KEEP_SOURCE = ("ffn_gate_inp.",)


class Mode(NamedTuple):
    backbone: QuantType        # tensors of 2+ dimensions
    dflash: QuantType          # `dflash.*` tensors of 2+ dimensions
    file_type: int             # general.file_type (llama.cpp's LlamaFileType)


MODES: dict[str, Mode] = {
    "q8_0": Mode(QuantType.Q8_0, QuantType.Q8_0, 7),     # MOSTLY_Q8_0
    "q4_0": Mode(QuantType.Q4_0, QuantType.Q4_0, 2),     # MOSTLY_Q4_0
    "q4-mix": Mode(QuantType.Q4_0, QuantType.Q8_0, 2),
}


@dataclass
class RequantResult:
    path: Path
    n_tensors: int
    n_bytes: int
    seconds: float
    types: Counter = field(default_factory=Counter)   # output type name -> tensor count
    skipped_keys: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- pure decisions
def output_type(mode: Mode, name: str, shape: tuple[int, ...], src: QuantType) -> QuantType:
    """The type tensor `name` of row-major `shape` and type `src` is written as."""
    if len(shape) < 2:
        return QuantType.F32
    if any(k in name for k in KEEP_SOURCE):
        return src
    want = mode.dflash if name.startswith("dflash.") else mode.backbone
    return want if shape[-1] % block_spec(want).block_size == 0 else src


def keeps_tensor(name: str, n_layers: int | None) -> bool:
    """Tensors of blocks >= n_layers are dropped; tensors outside the blocks are all kept."""
    m = _BLOCK.match(name)
    return n_layers is None or m is None or int(m.group(1)) < n_layers


def _nbytes(qtype: QuantType, shape: tuple[int, ...]) -> int:
    spec = block_spec(qtype)
    return prod(shape) // spec.block_size * spec.type_size


# ---------------------------------------------------------------- tensor data
def convert_rows(t: TensorInfo, dst: QuantType):
    """Yield the bytes of tensor `t` encoded as `dst`, a chunk of whole rows at a time."""
    if dst == t.qtype:
        yield t.raw
        return
    k = t.shape[-1]
    rows = prod(t.shape[:-1])
    src_row = _nbytes(t.qtype, (k,))
    step = max(1, CHUNK_ELEMENTS // k)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        x = dequantize(t.raw[r0 * src_row:r1 * src_row], t.qtype, (r1 - r0, k))   # (r, K) f32
        yield quantize(x, dst)                                                  # (r, bytes) u8


def _problems(src: Path, dst: Path, mode: str, n_layers: int | None) -> list[tuple[str, str]]:
    problems = []
    if mode not in MODES:
        problems.append(("type", f"unknown type {mode!r}; one of " + ", ".join(MODES)))
    if n_layers is not None and n_layers < 1:
        problems.append(("layers", f"{n_layers} is out of range; it must be at least 1"))
    if not dst.parent.is_dir():
        problems.append(("out", f"{dst.parent} is not a directory"))
    if dst.exists() and src.exists() and dst.resolve() == src.resolve():
        problems.append(("out", "the output would overwrite the input"))
    return problems


def requantize(src: str | os.PathLike, dst: str | os.PathLike, mode: str,
               n_layers: int | None = None) -> RequantResult:
    """Write `dst`: `src` re-encoded per MODES[mode], keeping blocks 0..n_layers-1 (all if
    None)."""
    import gguf

    src, dst = Path(src), Path(dst)
    if problems := _problems(src, dst, mode, n_layers):
        raise ConfigError(problems)
    t0 = time.perf_counter()
    f = GGUFFile(src)
    arch = f.require("general.architecture", str)
    old_blocks = int(f.require(f"{arch}.block_count", int))
    if n_layers is not None and n_layers > old_blocks:
        raise ConfigError([("layers", f"{n_layers} is out of range; {src.name} has "
                                      f"{old_blocks} blocks (allowed range 1..{old_blocks})")])
    m = MODES[mode]
    plan = [(t, output_type(m, t.name, t.shape, t.qtype)) for t in f.tensors.values()
            if keeps_tensor(t.name, n_layers)]
    part = dst.with_name(dst.name + ".part")        # renamed into place once complete
    w = gguf.GGUFWriter(str(part), arch)
    skipped = copy_metadata(f, w, m.file_type, n_layers)
    for t, qtype in plan:
        w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), _nbytes(qtype, t.shape),
                          raw_dtype=qtype)
    write_tensor_data(w, (convert_rows(t, qtype) for t, qtype in plan), part, dst)
    return RequantResult(dst, len(plan), dst.stat().st_size, time.perf_counter() - t0,
                         Counter(q.name for _, q in plan), skipped)

