"""CUDA backend: CuPy launchers for the raw kernels in cuda/, weights quantized on the GPU,
and one captured CUDA graph per step shape.

The only module that imports CuPy. Every op is a raw kernel (no CuPy elementwise temporaries),
launched on the backend's own stream into buffers allocated at load time, so a step can be
captured into a CUDA graph and replayed: the first step of a shape runs eagerly (it loads the
kernels), the second is captured, later ones replay. Kernels read token ids, positions and KV
slots from device buffers and never take a KV length from the host, so one graph per
(tokens, logits) shape serves every position.

Shapes below: T tokens in the step, K/N the input/output width of a matrix, E the model width.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import cupy as cp
import numpy as np

from service.backends import cuda_sources
from service.backends.base import Backend, KVCache
from service.backends.cuda_layout import PlaneLayout, layout_of, split_planes
from service.gguf.reader import TensorInfo

GEMV_WARPS = 4            # warps per GEMV block (cuda/gemv.cu GEMV_WARPS)
GEMV_NC = (1, 2, 4, 8, 16)   # column variants of cuda/gemv.cu; wider steps: chunks of 16
GRAPH_MAX_TOKENS = 16     # steps up to this many tokens are captured (decode and verify)
ATT_CHUNK = 128           # KV positions per attention split: one 32-key tile per warp
ATT_MAX_D, ATT_MAX_DV = 512, 256
ROPE_KV_MAX_D = 512       # cuda/rope_kv.cu ROPE_KV_MAX_D
KV_TYPES = ("f16", "q8_0", "q4_0")
_I32, _F32 = np.int32, np.float32
_NULL = np.uint64(0)


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
class _Scratch:
    """Buffers every step reuses (sized by prepare)."""

    qa: Any = None                    # (rows * K) int8 activation codes
    ads: Any = None                   # (rows * K/32, 2) f32 (d, sum of codes)
    part_ml: Any = None               # (T, H, S, 2) f32 attention split (max, sum)
    part_acc: Any = None              # (T, H, S, Dv) f32 attention split accumulators
    counters: Any = None              # (T * H) int32 attention splits done, 0 between launches
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


def _norm_block(d: int) -> int:
    """Threads of a block that normalizes rows of d (elementwise.cu's norm_block): the order of
    the norm's sum depends on it, so every kernel computing a norm of d uses the same."""
    return min(256, _ceil(d, 32) * 32)


def gemv_variant(n_cols: int, rows_per_warp: int) -> int:
    """Columns per block row (NC) of the GEMV kernel for a step of n_cols columns: n_cols
    rounded up to a variant, 16 (chunks of 16) above; the one-row-per-warp kernel has NC = 1."""
    if rows_per_warp == 1:
        return 1
    return next((nc for nc in GEMV_NC if nc >= n_cols), GEMV_NC[-1])


# (pointer, rows, row width, row stride) of a matrix view: what the 8-bit activation blocks in
# the scratch were made from.
ViewKey = tuple[int, int, int, int]


def _matrix_key(a) -> ViewKey:
    rows, _, ld, _, k = _rows(a)
    return a.data.ptr, rows, k, ld


def _overlaps(a, key: ViewKey) -> bool:
    """Whether the matrix view a shares a byte with the view `key` names (f32 both)."""
    p, rows, k, ld = _matrix_key(a)
    q, rows2, k2, ld2 = key
    return p < q + ((rows2 - 1) * ld2 + k2) * 4 and q < p + ((rows - 1) * ld + k) * 4


class CudaBackend(Backend):
    name = "cuda"
    kv_types = KV_TYPES

    def __init__(self, threads: int = 0, graphs: bool = True, device: int = 0,
                 invariant_tokens: int = 16, gemv_rows: int = 2):
        """gemv_rows: output rows per warp of the GEMVs, 2 (the default) or 1 (the earlier
        kernel, kept for benchmarks; one column per block row). Both give the same bits."""
        # CPU threads do not apply; every GEMV column and attention query is computed the same
        # way at any step size, so steps of any width are invariant here.
        del threads, invariant_tokens
        if gemv_rows not in (1, 2):
            raise ValueError(f"gemv_rows must be 1 or 2, not {gemv_rows}")
        cp.cuda.Device(device).use()
        self.graphs = graphs
        self.gemv_rows = gemv_rows
        self.stream = cp.cuda.Stream(non_blocking=True)
        self._modules: dict[str, Any] = {}
        self._kernels: dict[str, Any] = {}
        self._staging: dict[int, np.ndarray] = {}     # pinned upload buffers per destination
        self._shared: dict[str, CudaMatrix] = {}      # tensors loaded once (tied embeddings)
        self._graphs: dict[tuple, tuple[Any, Any]] = {}
        self._seen: set[tuple] = set()
        self._s = _Scratch()
        # Which matrix view's 8-bit blocks the scratch (qa, ads) holds, as written by a fused
        # op (*_for_matmul); None when none. Host state that follows the op sequence alone, so
        # a captured step records the same launches as its eager run: kept across GEMV
        # launches (they only read the blocks), cleared by every other launch.
        self._blocks: ViewKey | None = None
        self._max_k = 32
        self.weight_bytes = 0

    # ---------------------------------------------------------------- kernels
    def _fn(self, name: str):
        fn = self._kernels.get(name)
        if fn is None:
            src = next((f for prefix, f in _KERNEL_SOURCE if name.startswith(prefix)), None)
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
        if not name.startswith("gemv_"):
            self._blocks = None
        with self.stream:
            self._fn(name)(grid, block, tuple(args))

    # ---------------------------------------------------------------- memory
    def zeros(self, shape, dtype="float32"):
        self._blocks = None          # the new array may reuse a freed view's memory
        with self.stream:
            return cp.zeros(shape, dtype=dtype)

    def to_host(self, x):
        out = cp.asnumpy(x, stream=self.stream)
        self.stream.synchronize()
        return out

    def upload_ints(self, host, out):
        self._blocks = None
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
    def _upload_planes(self, raw: np.ndarray, layout: PlaneLayout) -> list[Any]:
        planes = []
        for p in split_planes(raw, layout):
            d = cp.empty(p.size, cp.uint8)
            d.set(p, stream=self.stream)
            planes.append(d)
            self.weight_bytes += p.size
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
        raw = tensors[0].raw if len(tensors) == 1 else np.concatenate([t.raw for t in tensors])
        m = CudaMatrix(layout, rows, k, self._upload_planes(raw, layout))
        if len(tensors) == 1:
            self._shared[tensors[0].name] = m
        self._max_k = max(self._max_k, k)
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
        m = CudaMatrix(layout, n_expert * n, k, self._upload_planes(tensor.raw, layout),
                       n_expert)
        return m

    def upload_vector(self, host) -> Any:
        with self.stream:
            return cp.asarray(np.ascontiguousarray(host, dtype=np.float32))

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
        s, z = self._s, self.zeros
        rows = max_tokens * max(1, moe_used)
        s.qa = z((rows * self._max_k,), "int8")
        s.ads = z((rows * self._max_k // 32, 2), "float32")
        n_split = _ceil(n_ctx, ATT_CHUNK)
        s.part_ml = z((max_tokens * n_head * n_split, 2), "float32")
        s.part_acc = z((max_tokens * n_head * n_split * head_dim_v,), "float32")
        s.counters = z((max_tokens * n_head,), "int32")       # the kernel leaves them at 0
        if moe_used:
            f = moe_ff
            s.moe = {"logits": z((max_tokens, moe_experts)), "ids": z((rows,), "int32"),
                     "w": z((rows,)), "g": z((rows, f)), "u": z((rows, f)),
                     "a": z((rows, f)), "y": z((rows, n_embd))}

    # ---------------------------------------------------------------- step graphs
    def run_step(self, key, inputs, fn):
        self._blocks = None              # a step starts and ends knowing no blocks
        try:
            return self._run_step(key, inputs, fn)
        finally:
            self._blocks = None

    def _run_step(self, key, inputs, fn):
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
        self._launch("rms_norm", (n0 * n1,), (_norm_block(D),),
                     [x, _I32(n1), _I32(s0), _I32(s1), _I32(D), w, _F32(eps), out, _I32(p0),
                      _I32(p1)])

    def _block_room(self, rows: int, k: int) -> bool:
        """Whether rows x k activations fit the 8-bit block scratch as whole 32-groups."""
        return self._s.qa is not None and k % 32 == 0 and rows * k <= self._s.qa.size

    def _block_args(self, rows: int, k: int) -> list[Any]:
        return [self._s.qa[: rows * k], self._s.ads[: rows * k // 32]]

    def rms_norm_for_matmul(self, x, w, eps, out):
        if x.ndim != 2 or out.ndim != 2 or not self._block_room(*out.shape):
            self.rms_norm(x, w, eps, out)
            return
        T, _, ldx, _, D = _rows(x)
        _, _, ldo, _, _ = _rows(out)
        if out.shape != (T, D) or w.shape != (D,):
            raise ValueError(f"rms_norm_for_matmul: x {x.shape}, out {out.shape}, w {w.shape}")
        for a, what in ((x, "x"), (w, "w"), (out, "out")):
            _check(a, np.float32, f"rms_norm_for_matmul {what}")
        self._launch("rms_norm_quant", (T,), (_norm_block(D),),
                     [x, _I32(ldx), _I32(D), w, _F32(eps), out, _I32(ldo),
                      *self._block_args(T, D)])
        self._blocks = _matrix_key(out)

    def rms_norm_add(self, o, w, eps, x):
        T, _, ldo, _, D = _rows(o)
        _, _, ldx, _, _ = _rows(x)
        if o.ndim != 2 or x.shape != o.shape or w.shape != (D,):
            raise ValueError(f"rms_norm_add: o {o.shape}, x {x.shape}, w {w.shape}")
        for a, what in ((o, "o"), (w, "w"), (x, "x")):
            _check(a, np.float32, f"rms_norm_add {what}")
        self._launch("rms_norm_add", (T,), (_norm_block(D),),
                     [o, _I32(ldo), _I32(D), w, _F32(eps), x, _I32(ldx)])

    def _quantize(self, x) -> tuple[Any, Any]:
        """The 8-bit blocks of x (T, K): the scratch's when a fused op just wrote x's, else
        made now. Blocks made here are not remembered: x may be written by anything (a copy
        from the host) before the next matmul, only the backend's own producers are known."""
        T, _, ldx, _, K = _rows(x)
        if self._blocks == _matrix_key(x):
            qa, ads = self._block_args(T, K)
            return qa, ads
        if not self._block_room(T, K):
            raise ValueError(f"activations {x.shape} exceed the prepared buffers or K % 32")
        qa, ads = self._block_args(T, K)
        self._launch("quantize_act", (_ceil(T * K // 32, 4),), (32, 4),
                     [x, _I32(ldx), _I32(T), _I32(K), qa, ads])
        return qa, ads

    def _gemv(self, x, w: CudaMatrix, out, ids=None, n_pairs: int = 0, act_div: int = 1,
              accumulate: bool = False):
        T, _, ldx, _, K = _rows(x)
        C, _, ldo, _, N = _rows(out)
        if x.ndim != 2 or out.ndim != 2 or K != w.k or N != w.n:
            raise ValueError(f"matmul: x {x.shape} / out {out.shape} vs W ({w.n}, {w.k})")
        _check(x, np.float32, "matmul x")
        _check(out, np.float32, "matmul out")
        R = self.gemv_rows
        if ids is None:
            if C != T:
                raise ValueError(f"matmul: {T} input rows, {C} output rows")
            nc = gemv_variant(T, R)
            grid, ids_arg, rpe = (_ceil(N, GEMV_WARPS * R), _ceil(T, nc)), _NULL, 0
        else:                                 # gathered experts: one column per block row
            _check(ids, np.int32, "matmul ids")
            if C != n_pairs or ids.size < n_pairs:
                raise ValueError(f"gathered matmul: {n_pairs} pairs, out {out.shape}")
            nc = 1
            grid, ids_arg, rpe = (_ceil(N, GEMV_WARPS * R), n_pairs), ids, w.n
        tail = [_I32(C), ids_arg, _I32(rpe), _I32(act_div), out, _I32(ldo),
                _I32(1 if accumulate else 0)]
        if w.layout.quantized:
            qa, ads = self._quantize(x)
            args = [*w.args(), _I32(K), _I32(N), qa, ads, *tail]
        else:
            args = [w.planes[0], _I32(K), _I32(N), x, _I32(ldx), *tail]
        self._launch(f"gemv_{w.layout.kernel}_c{nc}r{R}", grid, (32, GEMV_WARPS), args)
        if self._blocks is not None and _overlaps(out, self._blocks):
            self._blocks = None

    def matmul(self, x, w: CudaMatrix, out):
        self._gemv(x, w, out)

    def matmul_add(self, x, w: CudaMatrix, out, tmp):
        del tmp                               # the GEMV adds into out itself
        self._gemv(x, w, out, accumulate=True)

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
        self._glu("glu", gate, up, activation, out, [])

    def glu_for_matmul(self, gate, up, activation, out):
        if out.ndim != 2 or not self._block_room(*out.shape):
            self.glu(gate, up, activation, out)
            return
        self._glu("glu_quant", gate, up, activation, out, self._block_args(*out.shape))
        self._blocks = _matrix_key(out)

    def _glu(self, kernel: str, gate, up, activation, out, blocks: list[Any]):
        T, _, ldg, _, F = _rows(gate)
        _, _, ldu, _, _ = _rows(up)
        _, _, ldo, _, _ = _rows(out)
        if gate.ndim != 2 or up.shape != gate.shape or out.shape != gate.shape:
            raise ValueError(f"{kernel}: gate {gate.shape}, up {up.shape}, out {out.shape}")
        act = {"silu": 0, "gelu_tanh": 1}[activation]
        self._launch(kernel, (_ceil(F, 256), T), (256,),
                     [gate, _I32(ldg), up, _I32(ldu), _I32(F), _I32(act), out, _I32(ldo),
                      *blocks])

    def kv_write(self, cache: CudaKVCache, layer, k, v, slots, positions):
        for src, (codes, scales), t in ((k, cache.k[layer], cache.type_k),
                                        (v, cache.v[layer], cache.type_v)):
            T, H, st, sh, D = _rows(src)
            self._launch(f"kv_store_{t}", (T, H), (32, _ceil(D, 32)),
                         [src, _I32(st), _I32(sh), _I32(D), slots, positions,
                          _I32(cache.n_ctx), _I32(H), codes,
                          scales if scales is not None else _NULL])

    def rope_kv(self, q, k, v, q_norm, k_norm, eps, positions, slots, table, neox,
                cache: CudaKVCache, layer):
        T, H, q0, q1, D = _rows(q)
        Tk, Hkv, k0, k1, Dk = _rows(k)
        Tv, Hv, v0, v1, Dv = _rows(v)
        half = table[0].shape[1]
        if (q.ndim, k.ndim, v.ndim) != (3, 3, 3) or not T == Tk == Tv or Hkv != Hv \
                or (Hkv, D, Dk, Dv) != (cache.n_head_kv, cache.head_dim, cache.head_dim,
                                        cache.head_dim_v) \
                or D > ROPE_KV_MAX_D or 2 * half > D:
            raise ValueError(f"rope_kv: q {q.shape}, k {k.shape}, v {v.shape}, rotary "
                             f"{2 * half}, cache heads {cache.n_head_kv} x {cache.head_dim}/"
                             f"{cache.head_dim_v}")
        for a, what in ((q, "q"), (k, "k"), (v, "v"), (q_norm, "q_norm"), (k_norm, "k_norm")):
            if a is not None:
                _check(a, np.float32, f"rope_kv {what}")
        for a in (q_norm, k_norm):
            if a is not None and a.shape != (D,):
                raise ValueError(f"rope_kv: norm weights {a.shape}, heads of {D}")
        _check(positions, np.int32, "rope_kv positions")
        _check(slots, np.int32, "rope_kv slots")
        (kc, ks), (vc, vs) = cache.k[layer], cache.v[layer]
        opt = [a if a is not None else _NULL for a in (q_norm, k_norm, ks, vs)]
        self._launch(f"rope_kv_{cache.type_k}_{cache.type_v}", (T, H + 2 * Hkv),
                     (_norm_block(D),),
                     [q, _I32(q0), _I32(q1), k, _I32(k0), _I32(k1), v, _I32(v0), _I32(v1),
                      _I32(H), _I32(Hkv), _I32(D), _I32(Dv), opt[0], opt[1], _F32(eps),
                      positions, slots, table[0], table[1], _I32(half), _I32(1 if neox else 0),
                      _I32(cache.n_ctx), kc, opt[2], vc, opt[3]])

    def attention(self, q, cache: CudaKVCache, layer, slots, positions, kv_len, window, scale,
                  out):
        self._attention(q, cache, layer, slots, positions, window, scale, out, False)

    def attention_for_matmul(self, q, cache: CudaKVCache, layer, slots, positions, kv_len,
                             window, scale, out):
        self._attention(q, cache, layer, slots, positions, window, scale, out, True)

    def _attention(self, q, cache: CudaKVCache, layer, slots, positions, window, scale, out,
                   for_matmul: bool):
        # kv_len is not used: positions come from the device, no host length in the launch
        T, H, q0, q1, D = _rows(q)
        To, Ho, o0, o1, Dv = _rows(out)
        Hkv = cache.n_head_kv
        if (q.ndim, out.ndim) != (3, 3) or (To, Ho) != (T, H) or H % Hkv \
                or (D, Dv) != (cache.head_dim, cache.head_dim_v):
            raise ValueError(f"attention: q {q.shape}, out {out.shape}, cache heads {Hkv} x "
                             f"{cache.head_dim}/{cache.head_dim_v}")
        _check(q, np.float32, "attention q")
        _check(out, np.float32, "attention out")
        n_split = _ceil(cache.n_ctx, ATT_CHUNK)
        s = self._s
        if s.part_ml is None or T * H * n_split > s.part_ml.shape[0] or T * H > s.counters.size:
            raise ValueError(f"attention over {T} tokens exceeds the prepared buffers")
        # the output's 8-bit blocks as rows of H * Dv, when its heads are contiguous
        quant = for_matmul and o1 == Dv and Dv % 32 == 0 and self._block_room(T, H * Dv)
        blocks = self._block_args(T, H * Dv) if quant else [_NULL, _NULL]
        (kq, kd), (vq, vd) = cache.k[layer], cache.v[layer]
        ml, acc = s.part_ml[: T * H * n_split], s.part_acc[: T * H * n_split * Dv]
        self._launch(f"attn_{cache.type_k}_{cache.type_v}", (n_split, H, T), (32, 4),
                     [q, _I32(q0), _I32(q1), _I32(H), _I32(Hkv), _I32(D), _I32(Dv), kq,
                      kd if kd is not None else kq, vq, vd if vd is not None else vq, slots,
                      positions, _I32(cache.n_ctx), _I32(window), _F32(scale), _I32(ATT_CHUNK),
                      ml, acc, s.counters, out, _I32(o0), _I32(o1), *blocks])
        if quant:
            self._blocks = (out.data.ptr, T, H * Dv, o0)

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


# Kernel name prefix -> source file, the first match wins (rope_kv_* before rope).
_KERNEL_SOURCE = (("gemv_", "gemv.cu"), ("quantize_", "quantize.cu"), ("kv_", "quantize.cu"),
                  ("embed_", "elementwise.cu"), ("rms_", "elementwise.cu"),
                  ("add_", "elementwise.cu"), ("glu", "elementwise.cu"),
                  ("rope_kv_", "rope_kv.cu"), ("rope", "elementwise.cu"),
                  ("moe_", "elementwise.cu"), ("attn_", "attention.cu"),
                  ("argmax_", "sampling.cu"))
