"""Seeded synthetic GGUF files: real architectures' shapes, metadata and tokenizer, random quant
blocks whose scale fields are set so every dequantized weight is finite with a chosen spread.

Used to benchmark at sizes no real model in reach has. A file is built from three tables:
`PRESETS` (hyperparameters of an architecture) and `MIXES` (which quant type each tensor gets,
following llama.cpp's per-tensor rules for its file types), both in synth_plan.py, and `_FILLS`
(per block type: which bytes hold scales and how they are set). Tensor data are streamed in
fixed-size chunks, each from its own generator seeded by (seed, tensor name, chunk index), so the
bytes do not depend on the thread count and a tensor's bytes do not depend on the other tensors
(a tensor of a `--layers 2` file equals the full file's tensor of that name when the mix gives
both the same type); `random_tensor` makes one tensor's bytes alone, for benchmarks.

Block contents: codes (4/5/6/8-bit quants) are uniformly random bytes; each block's f16 scale d
is `d0 * u` with u uniform in [0.5, 1.5) per block, and d0 chosen so that the weights' standard
deviation is `WEIGHT_STD`. Types with a min (Q4_1, Q5_1, Q4_K, Q5_K) get mins that centre every
(sub-)block on zero. Real Q4_0 and Q5_0 files store d = max / -8 (Q5_0: / -16), whose sign
varies; here the sign is random too, which cancels the -0.5 mean of their codes. Norm weights are
1 + uniform(-0.05, 0.05); float weights are uniform with std `WEIGHT_STD`.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from service.errors import ConfigError
from service.gguf.quants import IQ4_NL_VALUES, QuantType, block_spec
from service.tools.synth_plan import (
    MIXES,
    PRESETS,
    TensorPlan,
    model_metadata,
    plan_tensors,
    vocab_metadata,
)
from service.tools.synth_plan import TINY_VOCAB as TINY_VOCAB

WEIGHT_STD = 0.02
NORM_JITTER = 0.05
CHUNK_BYTES = 1 << 20         # bytes generated per task; fixed, so files do not depend on threads
_JITTER_MS = 13.0 / 12.0      # E[u^2] for u uniform in [0.5, 1.5)
Q = QuantType


# ---------------------------------------------------------------- block fills
@dataclass(frozen=True)
class _Fill:
    """How random blocks of one type are made valid.

    `code_ms` is E[c^2] of a uniformly random code c after the block's centring, `scale_ms` the
    E[s^2] of the sub-block scales the fill writes (1 without sub-blocks); the weights' variance
    is d0^2 * E[u^2] * scale_ms * code_ms. `write(blocks, d)` sets the scale fields of
    (n, type_size) uint8 `blocks` from the (n,) f32 block scales `d`.
    """

    code_ms: float
    scale_ms: float
    write: Callable[[np.ndarray, np.ndarray], None]
    signed_d: bool = False


_FILLS: dict[QuantType, _Fill] = {}


def _levels_ms(n: int, offset: float = 0.0) -> float:
    """E[(c - (n - 1) / 2 + offset)^2] for c uniform on 0..n-1."""
    return (n * n - 1) / 12.0 + offset * offset


def _sq_mean(lo: int, hi: int) -> float:
    return float(np.mean(np.arange(lo, hi + 1, dtype=np.float64) ** 2))


def _fill(qtype: QuantType, code_ms: float, scale_ms: float = 1.0, signed_d: bool = False):
    def deco(fn):
        _FILLS[qtype] = _Fill(code_ms, scale_ms, fn, signed_d)
        return fn
    return deco


def _words(blocks: np.ndarray, width: int) -> np.ndarray:
    """(n, type_size) uint8 blocks viewed as (n, type_size / width) little-endian words, so that
    each field is written as one strided column (numpy is slow on short byte columns)."""
    return blocks.view(np.uint16 if width == 2 else np.uint32)


def _f16_bits(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(n,) f32 -> (n,) uint16 bits of its f16 rounding, and that rounding as f32."""
    h = x.astype(np.float16)
    return h.view(np.uint16), h.astype(np.float32)


def _put_d(blocks: np.ndarray, at: int, d: np.ndarray) -> None:
    """The f16 block scale at byte `at` (even) of every block."""
    _words(blocks, 2)[:, at // 2] = _f16_bits(d)[0]


def _put_d_pair(blocks: np.ndarray, d: np.ndarray, ratio: float) -> None:
    """f16 d at bytes 0-1 and f16 `ratio` * d (as stored) at bytes 2-3 (a min or dmin)."""
    bits, stored = _f16_bits(d)
    second = _f16_bits(np.float32(ratio) * stored)[0]
    _words(blocks, 4)[:, 0] = bits.astype(np.uint32) | (second.astype(np.uint32) << 16)


@_fill(Q.Q8_0, _levels_ms(256, -0.5))
def _q8_0(blocks, d):              # d f16 | 32 int8 codes
    _put_d(blocks, 0, d)


@_fill(Q.Q4_0, _levels_ms(16, -0.5), signed_d=True)   # d f16 | 16 B nibbles; w = d (q - 8)
def _q4_0(blocks, d):
    _put_d(blocks, 0, d)


@_fill(Q.Q5_0, _levels_ms(32, -0.5), signed_d=True)   # d f16 | qh 4 B | qs 16 B; w = d (q - 16)
def _q5_0(blocks, d):
    _put_d(blocks, 0, d)


@_fill(Q.Q4_1, _levels_ms(16))     # d, m f16 | qs; w = d q + m, m = -7.5 d centres the block
def _q4_1(blocks, d):
    _put_d_pair(blocks, d, -7.5)


@_fill(Q.Q5_1, _levels_ms(32))     # d, m f16 | qh 4 B | qs 16 B; w = d q + m
def _q5_1(blocks, d):
    _put_d_pair(blocks, d, -15.5)


def _k_scales(blocks: np.ndarray) -> None:
    """Bytes 4-15 of Q4_K/Q5_K: eight 6-bit (scale, min) pairs, here each min equal to its
    scale and every scale uniform on 32..63: the low 6 bits of bytes 4-7 are scales 0-3 (bit 5
    set) and their top 2 bits the high bits of scales 4-7 (top bit set); bytes 8-11 (mins 0-3)
    copy bytes 4-7; bytes 12-15 hold the low nibbles of scales 4-7 and, repeated, of mins 4-7."""
    w = _words(blocks, 4)                                  # (n, type_size / 4) u32
    w[:, 1] |= np.uint32(0xA0A0A0A0)
    w[:, 2] = w[:, 1]
    w[:, 3] = (w[:, 3] & np.uint32(0x0F0F0F0F)) * np.uint32(0x11)   # no carry: 0x0F * 0x11


@_fill(Q.Q4_K, _levels_ms(16), _sq_mean(32, 63))   # d, dmin | scales 12 B | qs 128 B
def _q4_k(blocks, d):                # w = d sc q - dmin m with m = sc: dmin = 7.5 d centres it
    _put_d_pair(blocks, d, 7.5)
    _k_scales(blocks)


@_fill(Q.Q5_K, _levels_ms(32), _sq_mean(32, 63))   # d, dmin | scales 12 B | qh 32 | qs 128
def _q5_k(blocks, d):
    _put_d_pair(blocks, d, 15.5)
    _k_scales(blocks)


@_fill(Q.Q6_K, _levels_ms(64, -0.5), _sq_mean(64, 127))  # ql 128 | qh 64 | int8 sc 16 | d f16
def _q6_k(blocks, d):                # w = d sc (q - 32); scales uniform on 64..127
    sc = _words(blocks, 2)[:, 96:104]                      # bytes 192-207 as (n, 8) u16
    sc &= np.uint16(0x3F3F)
    sc |= np.uint16(0x4040)
    _put_d(blocks, 208, d)


@_fill(Q.Q2_K, _levels_ms(4), _sq_mean(8, 15))   # scales 16 B | qs 64 B | d, dmin f16
def _q2_k(blocks, d):                # w = d sc q - dmin m with m = sc on 8..15: dmin = 1.5 d
    sc = _words(blocks, 4)[:, 0:4]                         # bytes 0-15 as (n, 4) u32
    sc &= np.uint32(0x07070707)
    sc |= np.uint32(0x08080808)
    sc *= np.uint32(0x11)                                  # min nibble = scale nibble, no carry
    bits, stored = _f16_bits(d)
    _words(blocks, 2)[:, 40] = bits
    _words(blocks, 2)[:, 41] = _f16_bits(np.float32(1.5) * stored)[0]


@_fill(Q.Q3_K, _levels_ms(8, -0.5), _sq_mean(16, 31), signed_d=True)
def _q3_k(blocks, d):                # hmask 32 | qs 64 | scales 12 | d; w = d (sc - 32) q
    _words(blocks, 2)[:, 52:54] = np.uint16(0xFFFF)        # high scale bits 3: sc-32 on 16..31
    _put_d(blocks, 108, d)


_IQ4_MS = float(np.mean(np.square(IQ4_NL_VALUES, dtype=np.float64)))


@_fill(Q.IQ4_NL, _IQ4_MS, signed_d=True)     # d f16 | qs 16 B; w = d kv[q]
def _iq4_nl(blocks, d):
    _put_d(blocks, 0, d)


@_fill(Q.IQ4_XS, _IQ4_MS, _sq_mean(16, 31), signed_d=True)   # d | scales_h | scales_l 4 | qs
def _iq4_xs(blocks, d):              # w = d (ls - 32) kv[q]; high scale bits 3: ls-32 on 16..31
    _words(blocks, 2)[:, 1] = np.uint16(0xFFFF)
    _put_d(blocks, 0, d)


def _float_chunk(bits: np.random.SFC64, n: int, qtype: QuantType, center: float,
                 half_width: float) -> np.ndarray:
    """n values uniform in center +- half_width, stored as qtype: (n * size,) uint8."""
    r = bits.random_raw((n + 1) // 2).view(np.uint32)[:n]
    r >>= np.uint32(9)
    r |= np.uint32(0x3F800000)            # f32 bits of 1 + 23 random mantissa bits: [1, 2)
    x = r.view(np.float32)                                                  # (n,) f32
    x -= np.float32(1.5)
    x *= np.float32(2 * half_width)
    x += np.float32(center)
    if qtype is Q.F16:
        return x.astype(np.float16).view(np.uint8)
    if qtype is Q.BF16:   # round to nearest even on the top 16 bits of the f32
        u = x.view(np.uint32)
        u += np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
        return (u >> np.uint32(16)).astype(np.uint16).view(np.uint8)
    return x.view(np.uint8)


def _chunk_bytes(t: TensorPlan, seed: int, index: int, n_blocks: int,
                 std: float = WEIGHT_STD) -> np.ndarray:
    """Bytes of blocks [index * per_chunk, + n_blocks) of tensor `t`: (n_blocks * type_size,)."""
    spec = block_spec(t.qtype)
    h = int.from_bytes(hashlib.blake2b(t.name.encode(), digest_size=8).digest(), "little")
    bits = np.random.SFC64(np.random.SeedSequence([seed, h, index]))
    if spec.block_size == 1:
        if t.norm:
            return _float_chunk(bits, n_blocks, t.qtype, 1.0, NORM_JITTER)
        return _float_chunk(bits, n_blocks, t.qtype, 0.0, std * 3 ** 0.5)
    n_bytes = n_blocks * spec.type_size
    blocks = bits.random_raw((n_bytes + 7) // 8).view(np.uint8)[:n_bytes]
    blocks = blocks.reshape(n_blocks, spec.type_size)                     # (n, type_size) u8
    fill = _FILLS[t.qtype]
    jitter = bits.random_raw((n_blocks + 3) // 4).view(np.uint16)[:n_blocks]
    u = np.float32(0.5) + (jitter & np.uint16(0x7FFF)).astype(np.float32) / np.float32(32768)
    d0 = std / (fill.code_ms * fill.scale_ms * _JITTER_MS) ** 0.5
    d = u * np.float32(d0)                                                 # (n,) f32
    if fill.signed_d:
        d = np.where(jitter >= 0x8000, -d, d)
    fill.write(blocks, d)
    return blocks.reshape(-1)


# ---------------------------------------------------------------- writing
@dataclass(frozen=True)
class SynthResult:
    path: Path
    n_bytes: int
    n_tensors: int
    seconds: float


def _add_metadata(w, md: dict) -> None:
    from gguf import GGUFValueType

    for key, value in md.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif value and isinstance(value[0], int):
            w.add_key_value(key, value, GGUFValueType.ARRAY, GGUFValueType.INT32)
        else:
            w.add_array(key, value)


def random_tensor(qtype: QuantType, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """The bytes of a weight tensor of `qtype` and row-major `shape` made as `synthesize` makes
    them (valid blocks, weights of std WEIGHT_STD): (n_bytes,) uint8."""
    t = TensorPlan("random", tuple(shape), qtype, norm=False)
    return np.concatenate([_chunk_bytes(t, seed, i, n) for _, i, n in _chunks([t])])


def _chunks(plan: list[TensorPlan]) -> Iterator[tuple[TensorPlan, int, int]]:
    for t in plan:
        spec = block_spec(t.qtype)
        n_blocks = int(np.prod(t.shape)) // spec.block_size
        per = max(1, CHUNK_BYTES // spec.type_size)
        for index, start in enumerate(range(0, n_blocks, per)):
            yield t, index, min(per, n_blocks - start)


def synthesize(path: str | os.PathLike, preset: str, quant: str, seed: int = 0,
               n_layer: int | None = None, threads: int = 0, data: bool = True,
               weight_std: float = WEIGHT_STD) -> SynthResult:
    """Write a synthetic GGUF. `data=False` writes the header and leaves the tensor data a hole
    of zeros (a sparse file): shapes and metadata only, for loaders' checks. `weight_std`: the
    weights' standard deviation (norm weights stay near 1); the llama.cpp oracle fixtures use
    a larger one than the benchmarks' default, for logits with a spread."""
    import gguf

    problems = []
    if preset not in PRESETS:
        problems.append(("preset", f"unknown preset {preset!r}; one of " + ", ".join(PRESETS)))
    if quant not in MIXES:
        problems.append(("quant", f"unknown quant mix {quant!r}; one of " + ", ".join(MIXES)))
    if n_layer is not None and not 1 <= n_layer <= 1024:
        problems.append(("layers", f"{n_layer} is out of range; allowed range is 1..1024"))
    if threads < 0:
        problems.append(("threads", f"{threads} is negative; 0 means all cores"))
    if not 0.0 < weight_std <= 4.0:
        problems.append(("weight_std", f"{weight_std} is out of range (0, 4]"))
    if not Path(path).parent.is_dir():
        problems.append(("out", f"{Path(path).parent} is not a directory"))
    if problems:
        raise ConfigError(problems)
    t0 = time.perf_counter()
    p, mix = PRESETS[preset], MIXES[quant]
    n_layer = n_layer or p.n_layer
    plan = plan_tensors(p, mix, n_layer)
    path = Path(path)
    w = gguf.GGUFWriter(str(path), p.arch)
    _add_metadata(w, model_metadata(preset, p, mix, n_layer) | vocab_metadata(p.vocab, p.n_vocab))
    for t in plan:
        w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.n_bytes,
                          raw_dtype=t.qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout, align = w.fout[0], w.data_alignment
    try:
        if data:
            _write_data(fout, plan, seed, align, threads or os.cpu_count() or 1, weight_std)
        else:
            end = fout.tell()
            for t in plan:
                end = -(-end // align) * align + t.n_bytes
            fout.truncate(-(-end // align) * align)
    finally:
        w.close()
    return SynthResult(path, path.stat().st_size, len(plan), time.perf_counter() - t0)


def _write_data(fout, plan: list[TensorPlan], seed: int, align: int, threads: int,
                std: float = WEIGHT_STD) -> None:
    """Generate chunks on `threads` threads (numpy releases the GIL) and write them in order,
    keeping at most 2 * threads chunks in memory."""
    pending: deque = deque()
    current = None

    def pad() -> None:
        fout.write(bytes(-fout.tell() % align))

    with ThreadPoolExecutor(threads) as pool:
        jobs = _chunks(plan)
        while True:
            while len(pending) < 2 * threads:
                job = next(jobs, None)
                if job is None:
                    break
                pending.append((job[0], pool.submit(_chunk_bytes, job[0], seed, *job[1:], std)))
            if not pending:
                break
            t, future = pending.popleft()
            if t is not current:
                pad()
                current = t
            fout.write(future.result().data)
    pad()
