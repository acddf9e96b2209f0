"""The contract with cuda/*.cu: the numbers Python and the kernels share, and the kernel
registry, every kernel declared once with the file that defines it and its argument list (numpy
only: the compile check and the CPU tests import it).

Shared numbers are defined here only and reach the kernels as NVRTC -D defines
(`cuda_defines`, passed by sources.OPTIONS); no kernel file defines them, each file that uses
one stops with #error without it (tests/unit/test_cuda_kernels.py checks both).

A family is one line: a name pattern, its source file, its signature and the values the
pattern runs over (e.g. `gemv_<type>_c<NC>r<R>` over the weight types of layout.py and the
column variants gemv.cu instantiates). The launcher finds a kernel's source here by its full
name (no prefix matching) and checks the count and kinds of the arguments of every launch
against the signature; `make check-cuda` compares the registry with the compiled kernels (every
registered name compiled, every compiled `extern "C"` kernel registered, each signature equal
to the PTX entry's parameter list: `compiled_mismatches`).

Signature syntax: space-separated groups `name,name,...:kind`, kinds as `Arg` below.
"""

from __future__ import annotations

import enum
import functools
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from service.backends.cuda.layout import LAYOUTS
from service.formats import BACKEND_KV_TYPES
from service.gguf.quants import IQ4_NL_VALUES


class Arg(enum.Enum):
    """The kind of one kernel argument, as the launchers pass it."""

    PTR = "ptr"    # a device array, or types.NULL where the kernel takes a null pointer
    I32 = "i32"    # numpy int32
    F32 = "f32"    # numpy float32
    I64 = "i64"    # numpy int64
    U64 = "u64"    # numpy uint64


# The PTX parameter types each kind compiles to: pointers and 64-bit integers are 64-bit words.
_PTX = {Arg.PTR: ("u64", "s64", "b64"), Arg.I64: ("u64", "s64", "b64"),
        Arg.U64: ("u64", "s64", "b64"), Arg.I32: ("u32", "s32", "b32"), Arg.F32: ("f32",)}
_SCALARS = {np.int32: Arg.I32, np.float32: Arg.F32, np.int64: Arg.I64, np.uint64: Arg.U64}
_NOT_POINTERS = {*_SCALARS, int, float, bool, type(None)}      # CuPy would pass these by value


@dataclass(frozen=True)
class Kernel:
    name: str
    source: str                    # the file under cuda/ that defines it
    params: tuple[str, ...]        # argument names, in order
    kinds: tuple[Arg, ...]
    keeps_blocks: bool             # a GEMV: reads the activation blocks, writes none of them
    expect: tuple[type | None, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # the numpy scalar type each argument must have (None: a pointer)
        types = {k: t for t, k in _SCALARS.items()}
        object.__setattr__(self, "expect",
                           tuple(None if k is Arg.PTR else types[k] for k in self.kinds))

    @property
    def signature(self) -> str:
        args = ", ".join(f"{p}: {k.value}" for p, k in zip(self.params, self.kinds, strict=True))
        return f"{self.name}({args})"

    def check(self, args: Sequence[Any]) -> None:
        """TypeError naming the kernel and its signature when args do not match it: a scalar
        kind wants exactly its numpy type; a pointer a device array (any object but a scalar),
        or NULL."""
        if len(args) == len(self.kinds):
            for a, want in zip(args, self.expect, strict=True):
                t = type(a)
                if t is not want and not (want is None and (
                        t not in _NOT_POINTERS or t is np.uint64 and a == 0)):
                    break
            else:
                return
        got = ", ".join(_kind_of(a) for a in args)
        raise TypeError(f"{self.name}: arguments ({got}) do not match {self.signature}")


def _kind_of(a: Any) -> str:
    k = _SCALARS.get(type(a))
    return k.value if k is not None else "ptr" if hasattr(a, "data") else type(a).__name__


@dataclass(frozen=True)
class Family:
    pattern: str                               # str.format pattern of the kernels' names
    source: str
    signature: str
    values: tuple[dict[str, Any], ...] = ({},)  # one kernel per entry
    keeps_blocks: bool = False

    def kernels(self) -> Iterable[Kernel]:
        params, kinds = _parse(self.signature)
        for v in self.values:
            yield Kernel(self.pattern.format(**v), self.source, params, kinds, self.keeps_blocks)


def _parse(signature: str) -> tuple[tuple[str, ...], tuple[Arg, ...]]:
    params: list[str] = []
    kinds: list[Arg] = []
    for group in signature.split():
        names, kind = group.split(":")
        for n in names.split(","):
            params.append(n)
            kinds.append(Arg(kind))
    return tuple(params), tuple(kinds)


def _each(**axes: Sequence[Any]) -> tuple[dict[str, Any], ...]:
    """Every combination of the axes' values, the first axis outermost."""
    out: list[dict[str, Any]] = [{}]
    for name, values in axes.items():
        out = [{**d, name: v} for d in out for v in values]
    return tuple(out)


# ---------------------------------------------------------------- numbers the kernels share
GEMV_WARPS = 4            # gemv.cu: warps per block (32, GEMV_WARPS), a row (or R) per warp
MMA_WARPS = 8             # gemv_mma.cu: warps per block (32, MMA_WARPS), split-K over them
MMA_U32 = 4               # gemv_mma.cu: 32-element blocks per unit of the split-K (K-quants: 8)
# gemv_mma.cu: m-tiles of 16 rows per block by the tile's columns (NC): the 64-column tile
# holds 64 x 16 rows of accumulators per warp (32 rows spill registers); the rows of a block
# change no sum, so every tile gives a column the same bits
MMA_TILE_M = {8: 2, 16: 2, 32: 2, 64: 1}
QUANT_WARPS = 4           # quantize.cu quantize_act: block (32, QUANT_WARPS), a group per warp
ROW_THREADS = 256         # elementwise.cu embed, add_rows, glu[_quant], moe_combine: threads per
                          # block along a row, grid (ceil(N / ROW_THREADS), rows)
MOE_ROUTE_THREADS = 64    # elementwise.cu moe_route: threads per block, a warp per token
MOE_MAX_EXPERTS = 512     # elementwise.cu moe_route: experts a warp holds (16 a lane); moe.cu
                          # moe_group: experts its shared counts hold
MOE_GROUP_THREADS = 1024  # moe.cu moe_group: threads of its one block (a warp per expert)
MOE_GROUP_CHUNK = 4096    # moe.cu moe_group: expert ids staged in shared memory at a time
NORM_MAX_THREADS = 256    # act_quant.cuh: the largest norm block (types.norm_block)
NORM_REGS = 32            # act_quant.cuh: row elements a norm thread holds in registers
ROPE_KV_MAX_D = 512       # rope_kv.cu: the head size its shared row holds
ATT_WARPS = 4             # attention.cu: block (32, ATT_WARPS)
ATT_MAX_D, ATT_MAX_DV = 512, 256   # attention.cu: head sizes (K, V) its shared memory holds
AT_ROWS = 32              # attention_tiled.cu: query rows per block
AT_KEYS = 32              # attention_tiled.cu: keys per shared-memory tile
AT_WARPS = 4              # attention_tiled.cu: block (32, AT_WARPS)
ARGMAX_THREADS = 1024     # sampling.cu argmax_rows: threads per row
SAMPLE_THREADS = 512      # sampling.cu sample_rows: threads per row


# kv_quant.cuh / kv_read.cuh: u16 words per 32-group beside a quantized KV row's codes (d; d, lo;
# d, qh low, qh high; d, lo, qh low, qh high: ggml's block fields), as kv.py allocates them
KV_SIDE_WORDS = {"f16": 0, "bf16": 0, "q8_0": 1, "q5_1": 4, "q5_0": 3, "q4_1": 2, "q4_0": 1}
# bits of one element's code in the codes plane
KV_CODE_BITS = {"f16": 16, "bf16": 16, "q8_0": 8, "q5_1": 4, "q5_0": 4, "q4_1": 4, "q4_0": 4}
# kv_read.cuh: the reader of each KV type in the attention kernels, and the kind bits the launch
# passes it (kk, vk). The four 4/5-bit types share the reader `nib`, its rule chosen by the bits
# (KV_KIND_HIGH: a fifth bit, KV_KIND_MIN: an offset), so the attention kernels exist per reader
# pair (16) rather than per type pair (49): a third of the compile time.
KV_KIND_HIGH, KV_KIND_MIN = 1, 2
KV_READ = {"f16": ("f16", 0), "bf16": ("bf16", 0), "q8_0": ("q8_0", 0),
           "q5_1": ("nib", KV_KIND_HIGH | KV_KIND_MIN), "q5_0": ("nib", KV_KIND_HIGH),
           "q4_1": ("nib", KV_KIND_MIN), "q4_0": ("nib", 0)}
KV_READERS = tuple(dict.fromkeys(r for r, _ in KV_READ.values()))   # kv_read.cuh's order


def mma_rows(nc: int) -> int:
    """Output rows per block of the tensor-core GEMV tile of nc columns."""
    return 16 * MMA_TILE_M[nc]


def mma_unit_groups(kernel: str) -> int:
    """32-element groups per unit of the tensor-core family's split of K over warps: a K-quant
    super-block (8), else MMA_U32 blocks; the one-column split kernel (gemv_mma_<type>_c1s)
    holds 32 / this many rows a block."""
    return 8 if kernel.endswith("_k") else MMA_U32


def cuda_defines() -> dict[str, int | str]:
    """The shared numbers by their names in the kernels (sources.OPTIONS: -DNAME=value); a
    table goes as its comma-separated values (an array initializer's body)."""
    return {"GEMV_WARPS": GEMV_WARPS, "MMA_WARPS": MMA_WARPS, "MMA_U32": MMA_U32,
            **{f"MMA_M_C{nc}": m for nc, m in MMA_TILE_M.items()}, "QUANT_WARPS": QUANT_WARPS,
            "ROW_THREADS": ROW_THREADS,
            "MOE_ROUTE_THREADS": MOE_ROUTE_THREADS, "MOE_GROUP_THREADS": MOE_GROUP_THREADS,
            "MOE_GROUP_CHUNK": MOE_GROUP_CHUNK, "MOE_MAX_EXPERTS": MOE_MAX_EXPERTS,
            "NORM_MAX_THREADS": NORM_MAX_THREADS, "NORM_REGS": NORM_REGS,
            "ROPE_KV_MAX_D": ROPE_KV_MAX_D, "ATT_WARPS": ATT_WARPS, "ATT_MAX_D": ATT_MAX_D,
            "ATT_MAX_DV": ATT_MAX_DV, "AT_ROWS": AT_ROWS, "AT_KEYS": AT_KEYS,
            "AT_WARPS": AT_WARPS, "ARGMAX_THREADS": ARGMAX_THREADS,
            "SAMPLE_THREADS": SAMPLE_THREADS,
            "IQ4_NL_VALUES": ",".join(str(v) for v in IQ4_NL_VALUES),
            **{f"KV_SIDE_{t.upper()}": n for t, n in KV_SIDE_WORDS.items() if n},
            "KV_KIND_HIGH": KV_KIND_HIGH, "KV_KIND_MIN": KV_KIND_MIN}


# ---------------------------------------------------------------- what the .cu files instantiate
QUANT_TYPES = tuple(lay.kernel for lay in LAYOUTS.values() if lay.quantized)   # quant_types.cuh
FLOAT_TYPES = tuple(lay.kernel for lay in LAYOUTS.values() if not lay.quantized)
KV_TYPES = tuple(str(t) for t in BACKEND_KV_TYPES["cuda"])        # kv_quant.cuh, kv_read.cuh
# gemv.cu GEMV_VARIANTS: (columns, rows per warp)
GEMV_VARIANTS = ((1, 1), (1, 2), (2, 2), (4, 2), (8, 2), (16, 2), (2, 4), (4, 4), (8, 4),
                 (16, 4))
# gemv_mma.cu: gemv_mma_<type>_c<NC> (tiles of NC columns), gemv_mma_<type>_c1[p][n] (one
# column in the tiles' order of additions, a warp per row; n: with the residual add and the next
# RMSNorm) and gemv_mma_<type>_c1s[p] (the same bits, the tiles' split of K over a block's warps)
GEMV_MMA_TYPES = ("q4_k", "q6_k", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q5_k")
GEMV_MMA_NC = tuple(MMA_TILE_M)     # the tiles' columns
# Types whose steps of 33..64 rows take the 64-column tile; the others (the K-quants, whose
# 64-column tile holds 16 rows) run 32-column tiles over grid.y: on the H200, 4096 x 14336,
# Q4_K c64 123 us against 2 x 44.5 for two c32 tiles, Q8_0 c64 105 us against 2 x 63.3
# (bench/gpu_bench.py --only gemv --quick, 2026-12-04).
GEMV_MMA_C64_TYPES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
# gemv.cu: gemv_<type>_c1r1pn (c1r1p: every type); gemv_mma.cu: gemv_mma_<type>_c1p
GEMV_PREFETCH_TYPES = ("q4_k", "q6_k")
# One-column GEMVs of Q4_K / Q6_K matrices (GEMV_PREFETCH_TYPES, measured faster there) with at
# most this many rows run the prefetching loop (c1r1p; c1p in the tensor-core family; the
# CudaBackend `gemv_prefetch_rows` default).
GEMV_PREFETCH_ROWS = 4096
ATT_SIZES = (128, 256)                   # attention*.cu _d128 / _d256: Dv <= 128 / 256
# moe.cu MOEG_DOWN / MOEG_GLU: columns per tile -> rows per warp of the expert-grouped down
# GEMV and of the gate | up GEMV with the GLU (2R weight rows per warp)
MOEG_ROWS = {1: 1, 2: 2, 4: 4, 8: 4}
MOEG_GLU_ROWS = {1: 1, 2: 1, 4: 2, 8: 2}

_PLANES = "p0,p1,p2,p3:ptr"
_GEMV_TAIL = "n_cols:i32 ids:ptr rows_per_expert,act_div:i32 out:ptr ldo,accumulate:i32"
_PAGING = "table:ptr max_blocks,lb:i32"
_WIDTHS = [{"nc": nc, "r": r, "v": ""} for nc, r in GEMV_VARIANTS]
_MOEG_TAIL = "tiles,n_tiles,rows:ptr cap,rows_per_expert,act_div:i32"
_MOEG = tuple({"nc": nc, "r": r} for nc, r in MOEG_ROWS.items())
_MOEG_GLU = tuple({"nc": nc, "r": r} for nc, r in MOEG_GLU_ROWS.items())

FAMILIES = (
    # gemv.cu
    Family("gemv_{t}_c{nc}r{r}{v}", "gemv.cu", f"{_PLANES} K,N:i32 qa,ads:ptr {_GEMV_TAIL}",
           tuple({"t": t, **w} for t in QUANT_TYPES
                 for w in (*_WIDTHS, {"nc": 1, "r": 1, "v": "e"}, {"nc": 1, "r": 1, "v": "p"})),
           keeps_blocks=True),
    Family("gemv_{t}_c1r1{v}n", "gemv.cu",
           f"{_PLANES} K,N:i32 qa,ads,out,done,nw:ptr eps:f32 B:i32 h,hqa,hads:ptr",
           (*_each(t=QUANT_TYPES, v=("",)), *_each(t=GEMV_PREFETCH_TYPES, v=("p",))),
           keeps_blocks=True),
    Family("gemv_{t}_c{nc}r{r}{v}", "gemv.cu", f"W:ptr K,N:i32 x:ptr ldx:i32 {_GEMV_TAIL}",
           tuple({"t": t, **w} for t in FLOAT_TYPES for w in _WIDTHS), keeps_blocks=True),
    # gemv_mma.cu
    Family("gemv_mma_{t}_c{nc}", "gemv_mma.cu",
           f"{_PLANES} K,N:i32 qa,ads:ptr n_cols:i32 out:ptr ldo,accumulate:i32",
           _each(t=GEMV_MMA_TYPES, nc=GEMV_MMA_NC), keeps_blocks=True),
    Family("gemv_mma_{t}_c1{v}", "gemv_mma.cu",
           f"{_PLANES} K,N:i32 qa,ads:ptr n_cols:i32 out:ptr ldo,accumulate:i32",
           (*_each(t=GEMV_MMA_TYPES, v=("",)), *_each(t=GEMV_PREFETCH_TYPES, v=("p",))),
           keeps_blocks=True),
    Family("gemv_mma_{t}_c1s{v}", "gemv_mma.cu",
           f"{_PLANES} K,N:i32 qa,ads:ptr n_cols:i32 out:ptr ldo,accumulate:i32",
           _each(t=GEMV_MMA_TYPES, v=("", "p")), keeps_blocks=True),
    Family("gemv_mma_{t}_c1{v}n", "gemv_mma.cu",
           f"{_PLANES} K,N:i32 qa,ads,out,done,nw:ptr eps:f32 B:i32 h,hqa,hads:ptr",
           (*_each(t=GEMV_MMA_TYPES, v=("",)), *_each(t=GEMV_PREFETCH_TYPES, v=("p",))),
           keeps_blocks=True),
    # quantize.cu
    Family("quantize_act", "quantize.cu", "x:ptr ldx,C,K:i32 qa,ads:ptr"),
    Family("kv_store_{t}", "quantize.cu",
           f"src:ptr st,sh,D:i32 slots,positions:ptr {_PAGING} Hkv:i32 codes,scales:ptr",
           _each(t=KV_TYPES)),
    Family("kv_move", "quantize.cu",
           f"planes,row_bytes:ptr {_PAGING} slots,src,dst:ptr n:i32"),
    # elementwise.cu
    Family("embed_{t}", "elementwise.cu", f"{_PLANES} E:i32 ids:ptr scale:f32 out:ptr",
           _each(t=QUANT_TYPES + FLOAT_TYPES)),
    Family("rms_norm", "elementwise.cu", "x:ptr n1,s0,s1,D:i32 w:ptr eps:f32 out:ptr o0,o1:i32"),
    Family("rms_norm_quant", "elementwise.cu",
           "x:ptr ldx,D:i32 w:ptr eps:f32 out:ptr ldo:i32 qa,ads:ptr"),
    Family("rms_norm_add", "elementwise.cu", "o:ptr ldo,D:i32 w:ptr eps:f32 x:ptr ldx:i32"),
    Family("add_rows", "elementwise.cu", "a:ptr lda:i32 b:ptr ldb,N:i32 out:ptr ldo:i32"),
    # writes only the tap's buffer, never a GEMV input: the activation blocks stay valid
    Family("copy_rows", "elementwise.cu", "src:ptr lds,N:i32 out:ptr ldo:i32",
           keeps_blocks=True),
    Family("glu", "elementwise.cu", "gate:ptr ldg:i32 up:ptr ldu,F,act:i32 out:ptr ldo:i32"),
    Family("glu_quant", "elementwise.cu",
           "gate:ptr ldg:i32 up:ptr ldu,F,act:i32 out:ptr ldo:i32 qa,ads:ptr"),
    Family("rope", "elementwise.cu", "x:ptr s0,s1:i32 positions,cos_t,sin_t:ptr half,neox:i32"),
    Family("moe_route", "elementwise.cu",
           "logits:ptr ld,T,n_expert,n_used,normalize,sigmoid:i32 bias:ptr scale:f32 "
           "ids,weights:ptr"),
    Family("softplus_gate", "elementwise.cu", "a:ptr lda,HD,Dv:i32 g:ptr ldg,G:i32"),
    Family("moe_combine", "elementwise.cu", "y,w:ptr n_used,E:i32 out:ptr ldo:i32"),
    # rope_kv.cu
    Family("rope_kv_{k}_{v}", "rope_kv.cu",
           "q:ptr q0,q1:i32 k:ptr k0,k1:i32 v:ptr v0,v1,H,Hkv,D,Dv:i32 qn,kn:ptr eps:f32 "
           f"positions,slots,kv_positions,cos_t,sin_t:ptr half,neox:i32 {_PAGING} "
           "kc,ks,vc,vs:ptr", _each(k=KV_TYPES, v=KV_TYPES)),
    # attention.cu, attention_tiled.cu
    Family("attn_{k}_{v}_d{d}", "attention.cu",
           "q:ptr q0,q1,H,Hkv,D,Dv:i32 kq,kd,vq,vd,slots,positions,attn_lo,attn_mask:ptr "
           f"{_PAGING} window:i32 scale:f32 chunk:i32 part_ml,part_acc,counters,out:ptr "
           "o0,o1:i32 qa,ads:ptr kk,vk:i32", _each(k=KV_READERS, v=KV_READERS, d=ATT_SIZES)),
    Family("attnt_{k}_{v}_d{d}", "attention_tiled.cu",
           "q:ptr q0,q1,T,H,Hkv,D,Dv,QT:i32 kq,kd,vq,vd,slots,positions:ptr "
           f"{_PAGING} window:i32 scale:f32 out:ptr o0,o1,kk,vk:i32",
           _each(k=KV_READERS, v=KV_READERS, d=ATT_SIZES)),
    # sampling.cu
    Family("argmax_rows", "sampling.cu", "logits:ptr ld,V:i32 out:ptr"),
    Family("record_tokens", "sampling.cu", "ids,slots,positions:ptr T,n_slots,n_ctx:i32 hist:ptr"),
    Family("chosen_ids", "sampling.cu", "records:ptr ld,L:i32 out:ptr"),
    Family("feed_ids", "sampling.cu", "records:ptr ld,L:i32 src:ptr T:i32 ids:ptr"),
    Family("sample_rows", "sampling.cu", "logits:ptr ld,V:i32 params,hist:ptr n_ctx:i32 "
                                         "adj,masks:ptr mask_w:i32 work,counts,out:ptr"),
    # dequant.cu
    Family("dequant_{t}", "dequant.cu", f"{_PLANES} K:i32 r0,n:i64 out:ptr",
           _each(t=QUANT_TYPES + FLOAT_TYPES)),
    Family("round_f16", "dequant.cu", "x:ptr ldx,T,K:i32 out:ptr"),
    # moe.cu
    Family("moe_group", "moe.cu", "ids:ptr P,n_expert,cap,nc:i32 counts,rows,tiles,n_tiles:ptr"),
    Family("moeg_{t}_c{nc}r{r}", "moe.cu",
           f"{_PLANES} K,N:i32 qa,ads:ptr {_MOEG_TAIL} out:ptr ldo:i32",
           tuple({"t": t, **w} for t in QUANT_TYPES for w in _MOEG), keeps_blocks=True),
    Family("moeg_glu_{t}_c{nc}r{r}", "moe.cu",
           f"g0,g1,g2,g3,u0,u1,u2,u3:ptr K,N:i32 qa,ads:ptr {_MOEG_TAIL} act:i32 out:ptr "
           "ldo:i32", tuple({"t": t, **w} for t in QUANT_TYPES for w in _MOEG_GLU),
           keeps_blocks=True),
    Family("moeg_{t}_c{nc}r{r}", "moe.cu",
           f"W:ptr K,N:i32 x:ptr ldx:i32 {_MOEG_TAIL} out:ptr ldo:i32",
           tuple({"t": t, **w} for t in FLOAT_TYPES for w in _MOEG), keeps_blocks=True),
    Family("moeg_glu_{t}_c{nc}r{r}", "moe.cu",
           f"Wg,Wu:ptr K,N:i32 x:ptr ldx:i32 {_MOEG_TAIL} act:i32 out:ptr ldo:i32",
           tuple({"t": t, **w} for t in FLOAT_TYPES for w in _MOEG_GLU), keeps_blocks=True),
)


@functools.cache
def registry() -> dict[str, Kernel]:
    """Every kernel by name (built at first use)."""
    out: dict[str, Kernel] = {}
    for fam in FAMILIES:
        for k in fam.kernels():
            if k.name in out:
                raise ValueError(f"kernel {k.name} declared twice")
            out[k.name] = k
    return out


def kernel(name: str) -> Kernel:
    try:
        return registry()[name]
    except KeyError:
        raise KeyError(f"no kernel {name} in the registry (service/backends/cuda/"
                       "kernels.py)") from None


# ---------------------------------------------------------------- registry vs compiled PTX
_ENTRY = re.compile(r"\.entry\s+(\w+)\s*\(([^)]*)\)")
_PARAM = re.compile(r"\.param\s+\.(\w+)\s+\w+")


def ptx_entries(ptx: str) -> dict[str, tuple[str, ...]]:
    """The kernels of a PTX text: name -> parameter types ('u64', 'u32', 'f32', ...)."""
    return {m.group(1): tuple(_PARAM.findall(m.group(2))) for m in _ENTRY.finditer(ptx)}


def registered_sources() -> set[str]:
    return {k.source for k in registry().values()}


def compiled_mismatches(source: str, ptx: str) -> list[str]:
    """How the kernels compiled from `source` (its PTX) differ from the registry: a registered
    kernel not compiled, a compiled kernel not registered (or registered to another file), a
    parameter list that is not the registered signature. One line each; [] when they agree."""
    kernels, entries = registry(), ptx_entries(ptx)
    mine = {n for n, k in kernels.items() if k.source == source}
    out = [f"{n} is registered but not compiled" for n in sorted(mine - entries.keys())]
    for name, types in entries.items():
        k = kernels.get(name)
        if k is None or k.source != source:
            out.append(f"{name} is compiled but "
                       + ("not registered" if k is None else f"registered to {k.source}"))
        elif len(types) != len(k.kinds) or any(
                t not in _PTX[kind] for t, kind in zip(types, k.kinds, strict=True)):
            out.append(f"{name} is compiled as ({', '.join(types)}), registered as "
                       f"{k.signature}")
    return out
