"""CUDA backend: CuPy launchers for the raw kernels in cuda/, weights quantized on the GPU,
and one captured CUDA graph per step shape.

With cuda_upload.py (the pinned staging ring the weights go through), the only module that
imports CuPy. Every op is a raw kernel (no CuPy elementwise temporaries; cuBLAS for the prefill
GEMM), launched on the backend's own stream into buffers allocated at load time, so a step can be
captured into a CUDA graph and replayed: the first step of a shape runs eagerly (it loads the
kernels), the second is captured, later ones replay. Kernels read token ids, positions and KV
slots from device buffers and never take a KV length from the host, so one graph per
(tokens, logits) shape serves every position. Steps wider than the decode/verify widths
(prefill chunks, run eagerly) take their matmuls through dequantize + cuBLAS GEMM (the section
at the end of the class).

Shapes below: T tokens in the step, K/N the input/output width of a matrix, E the model width.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import cupy as cp
import numpy as np
import structlog

from service.backends import cuda_sources
from service.backends.base import Backend, KVCache
from service.backends.cuda_layout import LAYOUTS, PlaneLayout, layout_of, split_planes
from service.backends.cuda_upload import PinnedUploader
from service.gguf.quants import dequantize
from service.gguf.reader import TensorInfo

GEMV_COLS = 16            # columns per GEMV block row (cuda/gemv.cu GEMV_COLS)
GRAPH_MAX_TOKENS = 16     # steps up to this many tokens are captured (decode and verify)
ATT_CHUNK = 128           # KV positions per attention split: one 32-key tile per warp
ATT_MAX_D, ATT_MAX_DV = 512, 256
KV_TYPES = ("f16", "q8_0", "q4_0")
_I32, _F32 = np.int32, np.float32
_NULL = np.uint64(0)
# Steps of at least this many tokens (and more than the invariant decode/verify widths) run
# their matmuls as dequantize + cuBLAS GEMM. The GEMV costs ~9 us per column of a 33 MB matrix
# at 16 columns (docs/BENCHMARKS.md: Q4_K 14336x4096, c=16 148.6 us), while dequantizing that
# matrix to f16 (117 MB written) and a GEMM of <= 64 columns take about as long as 8 such
# columns: past the 16 columns a step of the GEMV kernel takes, the GEMM wins at every width.
# bench/gpu_prefill.py prints the measured crossover.
PREFILL_GEMM_MIN_TOKENS = 17
# cuBLAS / CUDA library enum values (cublas_api.h, library_types.h), spelled out so they do not
# depend on which names a CuPy version exports.
_BLAS_OP_N, _BLAS_OP_T, _BLAS_POINTER_HOST = 0, 1, 0
_BLAS_COMPUTE_32F, _BLAS_GEMM_DEFAULT = 68, -1
_R_32F, _R_16F = 0, 2
log = structlog.get_logger(__name__)


@dataclass
class CudaMatrix:
    """W (rows, K) in GPU planes; `rows` = n_expert * n for a stack of experts."""

    layout: PlaneLayout
    rows: int
    k: int
    planes: list[Any]                 # cupy uint8 arrays, p0..p3 of quant_types.cuh
    n_expert: int = 1

    @property
    def n(self) -> int:               # output rows of one expert
        return self.rows // self.n_expert

    def args(self) -> list[Any]:
        ps = self.planes + [self.planes[0]] * (4 - len(self.planes))
        return ps[:4]


@dataclass
class CudaKVCache(KVCache):
    k: list[tuple[Any, Any]]         # per layer (codes, scales) planes; scales None for f16
    v: list[tuple[Any, Any]]
    type_k: str
    type_v: str
    n_slots: int
    n_ctx: int
    n_head_kv: int
    head_dim: int
    head_dim_v: int


@dataclass
class _GemmScratch:
    """Buffers of the prefill GEMM path (sized by prepare)."""

    limit: int                        # bytes the weight tile may take at most
    max_elems: int = 0                # rows * K of the largest matrix loaded (GEMM candidates)
    xh: Any = None                    # (max_tokens * max K) f16 bits: x rounded to f16
    wh: Any = None                    # (tile_elems,) f16 bits: a tile of W's rows
    blas: int = 0                     # cuBLAS handle (pointer mode host)
    lib: Any = None                   # cupy_backends' cublas module (imported at first use)
    one: Any = field(default_factory=lambda: np.ones(1, np.float32))    # alpha, host
    zero: Any = field(default_factory=lambda: np.zeros(1, np.float32))  # beta, host


@dataclass
class _Scratch:
    """Buffers every step reuses (sized by prepare)."""

    qa: Any = None                    # (rows * K) int8 activation codes
    ads: Any = None                   # (rows * K/32, 2) f32 (d, sum of codes)
    part_ml: Any = None               # (T, H, S, 2) f32 attention split (max, sum)
    part_acc: Any = None              # (T, H, S, Dv) f32 attention split accumulators
    moe: dict[str, Any] = field(default_factory=dict)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _rows(a) -> tuple[int, int, int, int, int]:
    """An up-to-3-D view with a contiguous last axis as (n0, n1, stride0, stride1, D)."""
    item = a.itemsize
    if a.strides[-1] != item and a.shape[-1] > 1:
        raise ValueError(f"last axis must be contiguous, strides {a.strides}")
    if a.ndim == 1:
        return 1, 1, 0, 0, a.shape[0]
    if a.ndim == 2:
        return a.shape[0], 1, a.strides[0] // item, 0, a.shape[1]
    if a.ndim == 3:
        return a.shape[0], a.shape[1], a.strides[0] // item, a.strides[1] // item, a.shape[2]
    raise ValueError(f"expected 1-3 dimensions, got shape {a.shape}")


def _check(a, dtype, what: str) -> None:
    if a.dtype != dtype:
        raise TypeError(f"{what}: dtype {a.dtype}, expected {np.dtype(dtype)}")


class CudaBackend(Backend):
    name = "cuda"
    kv_types = KV_TYPES

    def __init__(self, threads: int = 0, graphs: bool = True, device: int = 0,
                 invariant_tokens: int = 16, upload: str = "pinned",
                 prefill_gemm_min_tokens: int | None = PREFILL_GEMM_MIN_TOKENS,
                 staging_buffers: int = 3, staging_mib: int = 64,
                 prefill_scratch_mib: int = 128):
        """upload: "pinned" (a ring of `staging_buffers` pinned buffers of `staging_mib` MiB,
        copies overlapped with reading the file) or "pageable" (one synchronous copy per plane).
        prefill_gemm_min_tokens: matmuls of steps with at least this many tokens, and more than
        `invariant_tokens` (decode and verify steps stay on the step-size-invariant GEMV), go
        through dequantize + cuBLAS GEMM; None keeps every matmul on the GEMV. Weight tiles of
        the GEMM are dequantized into a scratch of at most `prefill_scratch_mib` MiB."""
        # CPU threads do not apply; every GEMV column and attention query is computed the same
        # way at any step size, so steps up to invariant_tokens are invariant here.
        del threads
        if upload not in ("pinned", "pageable"):
            raise ValueError(f"upload must be 'pinned' or 'pageable', not {upload!r}")
        cp.cuda.Device(device).use()
        self.upload = upload
        self._uploader = (PinnedUploader(staging_buffers, staging_mib << 20,
                                         min(8, os.cpu_count() or 1))
                          if upload == "pinned" else None)
        self.prefill_gemm_min_tokens = (None if prefill_gemm_min_tokens is None
                                        else max(prefill_gemm_min_tokens, invariant_tokens + 1))
        self._gs = _GemmScratch(limit=prefill_scratch_mib << 20)
        self.tensor_bytes = 0             # file bytes of the tensors loaded
        self._load_t0: float | None = None
        self.graphs = graphs
        self.stream = cp.cuda.Stream(non_blocking=True)
        self._modules: dict[str, Any] = {}
        self._kernels: dict[str, Any] = {}
        self._staging: dict[int, np.ndarray] = {}     # pinned upload buffers per destination
        self._shared: dict[str, CudaMatrix] = {}      # tensors loaded once (tied embeddings)
        self._graphs: dict[tuple, tuple[Any, Any]] = {}
        self._seen: set[tuple] = set()
        self._s = _Scratch()
        self._max_k = 32
        self.weight_bytes = 0

    # ---------------------------------------------------------------- kernels
    def _fn(self, name: str):
        fn = self._kernels.get(name)
        if fn is None:
            src = _KERNEL_SOURCE.get(name.split("_")[0], None)
            if src is None:
                raise KeyError(f"no kernel {name}")
            mod = self._modules.get(src)
            if mod is None:
                mod = cp.RawModule(code=cuda_sources.source_text(src),
                                   options=cuda_sources.OPTIONS)
                self._modules[src] = mod
            fn = self._kernels[name] = mod.get_function(name)
        return fn

    def _launch(self, name: str, grid, block, args) -> None:
        with self.stream:
            self._fn(name)(grid, block, tuple(args))

    # ---------------------------------------------------------------- memory
    def zeros(self, shape, dtype="float32"):
        with self.stream:
            return cp.zeros(shape, dtype=dtype)

    def to_host(self, x):
        out = cp.asnumpy(x, stream=self.stream)
        self.stream.synchronize()
        return out

    def upload_ints(self, host, out):
        host = np.asarray(host, dtype=out.dtype)
        key = out.data.ptr
        stage = self._staging.get(key)
        if stage is None or stage.size < host.size:
            mem = cp.cuda.alloc_pinned_memory(max(host.size, out.size) * out.itemsize)
            stage = np.frombuffer(mem, out.dtype, max(host.size, out.size))
            self._staging[key] = stage
        # The previous step has been read back (to_host synchronizes) before the next upload,
        # so the staging buffer is free to overwrite.
        stage[: host.size] = host
        out[: host.size].set(stage[: host.size], stream=self.stream)

    def synchronize(self) -> None:
        self.stream.synchronize()

    # ---------------------------------------------------------------- weights
    def _upload_planes(self, raws: list[np.ndarray], layout: PlaneLayout) -> list[Any]:
        """The planes of the blocks of `raws` stacked by rows, on the device."""
        self._start_load()
        n = sum(r.size for r in raws)
        self.tensor_bytes += n
        self.weight_bytes += n            # the planes hold exactly the file's bytes
        if self._uploader is not None:
            planes, ready = self._uploader.upload(raws, layout)
            self.stream.wait_event(ready)     # kernels wait on the device, the host does not
            return planes
        raw = raws[0] if len(raws) == 1 else np.concatenate(raws)
        planes = []
        for p in split_planes(raw, layout):
            d = cp.empty(p.size, cp.uint8)
            d.set(p, stream=self.stream)
            planes.append(d)
        self.stream.synchronize()
        return planes

    def can_fuse(self, tensors: list[TensorInfo]) -> bool:
        return len({t.qtype for t in tensors}) == 1 and len({t.shape[-1] for t in tensors}) == 1

    def load_matrix(self, tensors: list[TensorInfo]) -> CudaMatrix:
        if not self.can_fuse(tensors):
            raise ValueError("cannot fuse tensors of different types or widths: "
                             + ", ".join(f"{t.name} {t.qtype.name}" for t in tensors))
        if len(tensors) == 1 and tensors[0].name in self._shared:
            return self._shared[tensors[0].name]
        layout = layout_of(tensors[0].qtype)
        k = tensors[0].shape[-1]
        self._check_width(k, layout, tensors[0].name)
        rows = sum(int(np.prod(t.shape[:-1])) for t in tensors)
        m = CudaMatrix(layout, rows, k, self._upload_planes([t.raw for t in tensors], layout))
        if len(tensors) == 1:
            self._shared[tensors[0].name] = m
        self._max_k = max(self._max_k, k)
        self._gs.max_elems = max(self._gs.max_elems, rows * k)
        return m

    @staticmethod
    def _check_width(k: int, layout: PlaneLayout, name: str) -> None:
        if k % max(32, layout.block_size) and layout.quantized:
            raise ValueError(f"{name}: width {k} is not a multiple of "
                             f"{max(32, layout.block_size)}")

    def load_experts(self, tensor: TensorInfo) -> CudaMatrix:
        n_expert, n, k = tensor.shape
        layout = layout_of(tensor.qtype)
        self._check_width(k, layout, tensor.name)
        self._max_k = max(self._max_k, k)
        m = CudaMatrix(layout, n_expert * n, k, self._upload_planes([tensor.raw], layout),
                       n_expert)
        return m

    def upload_vector(self, host) -> Any:
        host = np.ascontiguousarray(host, dtype=np.float32)
        if self._uploader is None or self._load_t0 is None:
            with self.stream:
                return cp.asarray(host)
        # While loading, through the staging ring: a pageable copy would wait for the stream.
        planes, ready = self._uploader.upload([host.reshape(-1).view(np.uint8)], LAYOUTS["F32"])
        self.stream.wait_event(ready)
        return planes[0].view(cp.float32).reshape(host.shape)

    def load_vector(self, tensor: TensorInfo) -> Any:
        self._start_load()
        v = self.upload_vector(dequantize(tensor.raw, tensor.qtype, tensor.shape))  # (n,) f32
        self.tensor_bytes += tensor.raw.size
        self.weight_bytes += v.nbytes
        return v

    def load_embedding(self, tensor: TensorInfo) -> CudaMatrix:
        return self.load_matrix([tensor])

    def new_kv_cache(self, n_layer, n_slots, n_ctx, n_head_kv, head_dim, head_dim_v,
                     type_k, type_v) -> CudaKVCache:
        for t, d in ((type_k, head_dim), (type_v, head_dim_v)):
            if t not in KV_TYPES:
                raise ValueError(f"KV cache type {t!r} not supported by the CUDA backend")
            if t != "f16" and d % 32:
                raise ValueError(f"KV cache type {t} needs a head size that is a multiple "
                                 f"of 32, this model's is {d}")
        if head_dim > ATT_MAX_D or head_dim_v > ATT_MAX_DV:
            raise ValueError(f"head sizes {head_dim}/{head_dim_v} exceed the attention "
                             f"kernel's {ATT_MAX_D}/{ATT_MAX_DV}")
        rows = n_slots * n_ctx * n_head_kv

        def planes(t, d):
            with self.stream:
                if t == "f16":
                    return cp.zeros(rows * d, cp.uint16), None
                codes = cp.zeros(rows * (d if t == "q8_0" else d // 2), cp.uint8)
                return codes, cp.zeros(rows * (d // 32), cp.uint16)

        k = [planes(type_k, head_dim) for _ in range(n_layer)]
        v = [planes(type_v, head_dim_v) for _ in range(n_layer)]
        return CudaKVCache(k, v, type_k, type_v, n_slots, n_ctx, n_head_kv, head_dim,
                           head_dim_v)

    def prepare(self, *, max_tokens: int, n_head: int, head_dim_v: int, n_ctx: int,
                n_embd: int, moe_experts: int = 0, moe_used: int = 0, moe_ff: int = 0) -> None:
        self.finish_load()
        self._prepare_gemm(max_tokens)
        s, z = self._s, self.zeros
        rows = max_tokens * max(1, moe_used)
        s.qa = z((rows * self._max_k,), "int8")
        s.ads = z((rows * self._max_k // 32, 2), "float32")
        n_split = _ceil(n_ctx, ATT_CHUNK)
        s.part_ml = z((max_tokens * n_head * n_split, 2), "float32")
        s.part_acc = z((max_tokens * n_head * n_split * head_dim_v,), "float32")
        if moe_used:
            f = moe_ff
            s.moe = {"logits": z((max_tokens, moe_experts)), "ids": z((rows,), "int32"),
                     "w": z((rows,)), "g": z((rows, f)), "u": z((rows, f)),
                     "a": z((rows, f)), "y": z((rows, n_embd))}

    # ---------------------------------------------------------------- step graphs
    def run_step(self, key, inputs, fn):
        t = key[0]
        if not self.graphs or t > GRAPH_MAX_TOKENS:
            return fn()
        full = (*key, *(a.data.ptr for a in inputs))
        hit = self._graphs.get(full)
        if hit is not None:
            graph, result = hit
            graph.launch(stream=self.stream)
            return result
        if full not in self._seen:        # first use: eager, loads every kernel it needs
            self._seen.add(full)
            return fn()
        self.stream.begin_capture()
        try:
            result = fn()
        finally:
            graph = self.stream.end_capture()
        self._graphs[full] = (graph, result)
        graph.launch(stream=self.stream)
        return result

    @property
    def n_graphs(self) -> int:
        return len(self._graphs)

    # ---------------------------------------------------------------- ops
    def embed(self, table: CudaMatrix, ids, scale, out):
        T, E = out.shape
        _check(ids, np.int32, "embed ids")
        if not out.flags.c_contiguous or E != table.k:
            raise ValueError(f"embed: out {out.shape} must be contiguous (T, {table.k})")
        self._launch(f"embed_{table.layout.kernel}", (T, _ceil(E, 256)), (256,),
                     [*table.args(), _I32(E), ids, _F32(scale), out])

    def rms_norm(self, x, w, eps, out):
        n0, n1, s0, s1, D = _rows(x)
        o0, o1, p0, p1, Do = _rows(out)
        if (n0, n1, D) != (o0, o1, Do) or w.shape != (D,):
            raise ValueError(f"rms_norm: x {x.shape}, out {out.shape}, w {w.shape}")
        block = min(256, _ceil(D, 32) * 32)
        self._launch("rms_norm", (n0 * n1,), (block,),
                     [x, _I32(n1), _I32(s0), _I32(s1), _I32(D), w, _F32(eps), out, _I32(p0),
                      _I32(p1)])

    def _quantize(self, x) -> tuple[Any, Any]:
        T, _, ldx, _, K = _rows(x)
        if K % 32 or T * K > self._s.qa.size:
            raise ValueError(f"activations {x.shape} exceed the prepared buffers or K % 32")
        qa, ads = self._s.qa[: T * K], self._s.ads[: T * K // 32]
        self._launch("quantize_act", (_ceil(T * K // 32, 4),), (32, 4),
                     [x, _I32(ldx), _I32(T), _I32(K), qa, ads])
        return qa, ads

    def _gemv(self, x, w: CudaMatrix, out, ids=None, n_pairs: int = 0, act_div: int = 1):
        T, _, ldx, _, K = _rows(x)
        C, _, ldo, _, N = _rows(out)
        if K != w.k or N != w.n:
            raise ValueError(f"matmul: x {x.shape} / out {out.shape} vs W ({w.n}, {w.k})")
        _check(x, np.float32, "matmul x")
        _check(out, np.float32, "matmul out")
        if ids is None:
            if C != T:
                raise ValueError(f"matmul: {T} input rows, {C} output rows")
            grid, ids_arg, rpe = (_ceil(N, 4), _ceil(T, GEMV_COLS)), _NULL, 0
        else:
            grid, ids_arg, rpe = (_ceil(N, 4), n_pairs), ids, w.n
        if w.layout.quantized:
            qa, ads = self._quantize(x)
            args = [*w.args(), _I32(K), _I32(N), qa, ads, _I32(C), ids_arg, _I32(rpe),
                    _I32(act_div), out, _I32(ldo)]
        else:
            args = [w.planes[0], _I32(K), _I32(N), x, _I32(ldx), _I32(C), ids_arg, _I32(rpe),
                    _I32(act_div), out, _I32(ldo)]
        self._launch(f"gemv_{w.layout.kernel}", grid, (32, 4), args)

    def matmul(self, x, w: CudaMatrix, out):
        if self._gemm_wanted(x):
            return self._gemm_matmul(x, w, out)
        self._gemv(x, w, out)

    def add(self, a, b, out):
        T, _, lda, _, N = _rows(a)
        To, _, ldo, _, No = _rows(out)
        if b.ndim == 1:
            ldb = 0
            if b.shape[0] != N:
                raise ValueError(f"add: bias {b.shape} vs rows of {N}")
        else:
            _, _, ldb, _, _ = _rows(b)
            if b.shape != a.shape:
                raise ValueError(f"add: {a.shape} + {b.shape}")
        if (T, N) != (To, No):
            raise ValueError(f"add: out {out.shape} vs {a.shape}")
        self._launch("add_rows", (_ceil(N, 256), T), (256,),
                     [a, _I32(lda), b, _I32(ldb), _I32(N), out, _I32(ldo)])

    def rope_table(self, n_ctx, n_dims, base):
        inv = base ** (-np.arange(0, n_dims, 2, dtype=np.float64) / n_dims)    # (n_dims/2,)
        ang = np.arange(n_ctx, dtype=np.float64)[:, None] * inv[None, :]      # (n_ctx, n/2)
        return (self.upload_vector(np.cos(ang).astype(np.float32)),
                self.upload_vector(np.sin(ang).astype(np.float32)))

    def rope(self, x, positions, table, neox):
        T, H, s0, s1, _ = _rows(x)
        half = table[0].shape[1]
        self._launch("rope", (T, H), (64,),
                     [x, _I32(s0), _I32(s1), positions, table[0], table[1], _I32(half),
                      _I32(1 if neox else 0)])

    def glu(self, gate, up, activation, out):
        T, _, ldg, _, F = _rows(gate)
        _, _, ldu, _, _ = _rows(up)
        _, _, ldo, _, _ = _rows(out)
        act = {"silu": 0, "gelu_tanh": 1}[activation]
        self._launch("glu", (_ceil(F, 256), T), (256,),
                     [gate, _I32(ldg), up, _I32(ldu), _I32(F), _I32(act), out, _I32(ldo)])

    def kv_write(self, cache: CudaKVCache, layer, k, v, slots, positions):
        for src, (codes, scales), t in ((k, cache.k[layer], cache.type_k),
                                        (v, cache.v[layer], cache.type_v)):
            T, H, st, sh, D = _rows(src)
            args = [src, _I32(st), _I32(sh), _I32(D), slots, positions, _I32(cache.n_ctx),
                    _I32(H), codes]
            if scales is not None:
                args.append(scales)
            self._launch(f"kv_store_{t}", (T, H), (32, _ceil(D, 32)), args)

    def attention(self, q, cache: CudaKVCache, layer, slots, positions, kv_len, window, scale,
                  out):
        del kv_len   # positions come from the device: no host length in the launch
        T, H, q0, q1, D = _rows(q)
        _, _, o0, o1, Dv = _rows(out)
        n_split = _ceil(cache.n_ctx, ATT_CHUNK)
        s = self._s
        if T * H * n_split > s.part_ml.shape[0]:
            raise ValueError(f"attention over {T} tokens exceeds the prepared buffers")
        (kq, kd), (vq, vd) = cache.k[layer], cache.v[layer]
        ml, acc = s.part_ml[: T * H * n_split], s.part_acc[: T * H * n_split * Dv]
        self._launch(f"attn_split_{cache.type_k}_{cache.type_v}", (n_split, H, T), (32, 4),
                     [q, _I32(q0), _I32(q1), _I32(H), _I32(cache.n_head_kv), _I32(D),
                      _I32(Dv), kq, kd if kd is not None else kq, vq,
                      vd if vd is not None else vq, slots, positions, _I32(cache.n_ctx),
                      _I32(window), _F32(scale), _I32(ATT_CHUNK), ml, acc])
        self._launch("attn_combine", (H, T), (256,),
                     [ml, acc, _I32(H), _I32(n_split), _I32(Dv), slots, out, _I32(o0),
                      _I32(o1)])

    def moe(self, x, router: CudaMatrix, gate: CudaMatrix, up: CudaMatrix, down: CudaMatrix,
            n_used, normalize, activation, out):
        T = x.shape[0]
        m, P = self._s.moe, T * n_used
        logits, ids, w = m["logits"][:T], m["ids"][:P], m["w"][:P]
        self._gemv(x, router, logits)                                  # (T, n_expert)
        self._launch("moe_route", (_ceil(T, 64),), (64,),
                     [logits, _I32(logits.shape[1]), _I32(T), _I32(router.n), _I32(n_used),
                      _I32(1 if normalize else 0), ids, w])
        g, u, a, y = m["g"][:P], m["u"][:P], m["a"][:P], m["y"][:P]
        self._gemv(x, gate, g, ids, P, n_used)                         # (P, F)
        self._gemv(x, up, u, ids, P, n_used)
        self.glu(g, u, activation, a)
        self._gemv(a, down, y, ids, P, 1)                              # (P, E)
        _, _, ldo, _, E = _rows(out)
        self._launch("moe_combine", (_ceil(E, 256), T), (256,),
                     [y, w, _I32(n_used), _I32(E), out, _I32(ldo)])

    def argmax(self, logits, out):
        T, _, ld, _, V = _rows(logits)
        _check(out, np.int32, "argmax out")
        self._launch("argmax_rows", (T,), (1024,), [logits, _I32(ld), _I32(V), out])

    # ---------------------------------------------------------------- start and end of loading
    def _start_load(self) -> None:
        if self._load_t0 is not None:
            return
        self._load_t0 = time.perf_counter()
        if self._uploader is not None:
            self._uploader.after(self.stream)

    def finish_load(self) -> None:
        """The end of loading (prepare calls it): the one wait for every weight copy, the
        staging ring freed, the weight bytes on the device and the file bytes they came from
        logged (the planes hold the file's bytes exactly: no dequantized copy)."""
        if self._load_t0 is None:
            return
        if self._uploader is not None:
            self._uploader.finish()
        seconds = time.perf_counter() - self._load_t0
        self._load_t0 = None
        log.info("weights on the GPU", upload=self.upload, weight_bytes=self.weight_bytes,
                 tensor_bytes=self.tensor_bytes, seconds=round(seconds, 3))

    # ---------------------------------------------------------------- prefill GEMM
    # A step of T >= prefill_gemm_min_tokens tokens: x rounded to f16 once per matmul, W's rows
    # dequantized to f16 tile by tile into a scratch (cuda/dequant.cu), and
    # out[:, tile rows] = x W_tile^T by cuBLAS with f16 inputs and f32 accumulation and output,
    # written straight into out's columns. F16 weights go to cuBLAS as they are.
    # In cuBLAS's column-major terms: C (rows, T; ldc = ldo) = op_T(W tile stored (K, rows))
    # times x stored (K, T).
    def _gemm_wanted(self, x) -> bool:
        m = self.prefill_gemm_min_tokens
        return m is not None and x.shape[0] >= m

    def _prepare_gemm(self, max_tokens: int) -> None:
        g = self._gs
        m = self.prefill_gemm_min_tokens
        if m is None or max_tokens < m or not g.max_elems:
            g.xh = g.wh = None
            return
        tile = min(g.max_elems, max(g.limit // 2, 64 * self._max_k))
        if not g.blas:
            # Imported here: a CuPy without a loadable cuBLAS still serves, on the GEMV only.
            try:
                from cupy_backends.cuda.libs import cublas

                g.blas, g.lib = cublas.create(), cublas
                cublas.setPointerMode(g.blas, _BLAS_POINTER_HOST)
            except (ImportError, OSError, RuntimeError) as e:
                log.warning("cuBLAS unavailable: every matmul stays on the GEMV", error=str(e))
                self.prefill_gemm_min_tokens = None
                g.xh = g.wh = None
                return
        g.xh = self.zeros((max_tokens * self._max_k,), "uint16")     # (T*K,) f16 bits
        g.wh = self.zeros((tile,), "uint16")                         # (rows*K,) f16 bits

    def round_f16(self, x, out) -> None:
        """out[: T*K] (f16 bits, rows of K) = x (T, K) f32 rounded to nearest even."""
        T, _, ldx, _, K = _rows(x)
        _check(x, np.float32, "round_f16 x")
        _check(out, np.uint16, "round_f16 out")
        if out.ndim != 1 or out.size < T * K:
            raise ValueError(f"round_f16: out {out.shape} cannot hold {T}x{K}")
        self._launch("round_f16", (_ceil(K, 256), T), (256,),
                     [x, _I32(ldx), _I32(T), _I32(K), out])

    def dequant_rows(self, w: CudaMatrix, r0: int, n_rows: int, out) -> None:
        """out[: n_rows*K] (f16 bits, rows of K) = W[r0 : r0 + n_rows] rounded to f16."""
        _check(out, np.uint16, "dequant out")
        n = n_rows * w.k
        if not (0 <= r0 and n_rows > 0 and r0 + n_rows <= w.rows) or out.ndim != 1 \
                or out.size < n:
            raise ValueError(f"dequant: rows [{r0}, {r0 + n_rows}) of {w.rows} into "
                             f"{out.shape}")
        self._launch(f"dequant_{w.layout.kernel}", (_ceil(_ceil(n, 8), 256),), (256,),
                     [*w.args(), _I32(w.k), np.int64(r0), np.int64(n), out])

    def _gemm_matmul(self, x, w: CudaMatrix, out) -> None:
        T, _, _, _, K = _rows(x)
        C, _, ldo, _, N = _rows(out)
        g = self._gs
        if K != w.k or N != w.n or C != T or w.n_expert != 1:
            raise ValueError(f"matmul: x {x.shape} / out {out.shape} vs W ({w.n}, {w.k})")
        _check(x, np.float32, "matmul x")
        _check(out, np.float32, "matmul out")
        if g.xh is None or T * K > g.xh.size:
            raise ValueError(f"GEMM of {T}x{K} exceeds the prepared buffers")
        xh = g.xh[: T * K]
        self.round_f16(x, xh)
        direct = w.layout.kernel == "f16"
        tile = N if direct else min(N, g.wh.size // K)
        if tile < N and tile >= 128:
            tile -= tile % 128            # whole GEMM tiles except in the last one
        if tile < 1:
            raise ValueError(f"GEMM scratch holds no row of width {K}")
        with self.stream:
            for r0 in range(0, N, tile):
                n = min(tile, N - r0)
                if direct:
                    a = w.planes[0].data.ptr + r0 * K * 2
                else:
                    self.dequant_rows(w, r0, n, g.wh)
                    a = g.wh.data.ptr
                g.lib.setStream(g.blas, self.stream.ptr)
                g.lib.gemmEx(g.blas, _BLAS_OP_T, _BLAS_OP_N, n, T, K, g.one.ctypes.data,
                             a, _R_16F, K, xh.data.ptr, _R_16F, K, g.zero.ctypes.data,
                             out.data.ptr + r0 * 4, _R_32F, ldo, _BLAS_COMPUTE_32F,
                             _BLAS_GEMM_DEFAULT)


# Kernel name prefix -> source file.
_KERNEL_SOURCE = {"gemv": "gemv.cu", "quantize": "quantize.cu", "kv": "quantize.cu",
                  "embed": "elementwise.cu", "rms": "elementwise.cu", "add": "elementwise.cu",
                  "glu": "elementwise.cu", "rope": "elementwise.cu", "moe": "elementwise.cu",
                  "attn": "attention.cu", "argmax": "sampling.cu", "dequant": "dequant.cu",
                  "round": "dequant.cu"}
