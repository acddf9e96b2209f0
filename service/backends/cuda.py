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
from service.backends.cpu_sampling import N_PARAMS, OUT_WORDS
from service.backends.cuda_layout import PlaneLayout, layout_of, split_planes
from service.gguf.reader import TensorInfo

GEMV_COLS = 16            # columns per GEMV block row (cuda/gemv.cu GEMV_COLS)
GRAPH_MAX_TOKENS = 16     # steps up to this many tokens are captured (decode and verify)
ATT_CHUNK = 128           # KV positions per attention split: one 32-key tile per warp
ATT_MAX_D, ATT_MAX_DV = 512, 256
KV_TYPES = ("f16", "q8_0", "q4_0")
SAMPLE_THREADS = 512      # block of sample_rows (cuda/sampling.cu SAMPLE_THREADS)
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
                 invariant_tokens: int = 16):
        # CPU threads do not apply; every GEMV column and attention query is computed the same
        # way at any step size, so steps of any width are invariant here.
        del threads, invariant_tokens
        cp.cuda.Device(device).use()
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

    # ---------------------------------------------------------------- step I/O and sampling
    # The model runner's contract (service/engine/runner.py): one packed int32 upload per step
    # from pinned memory, token choice on the device (cuda/sampling.cu), one int32 readback
    # into pinned memory and one event wait. Scratch is sized once by prepare_sampling.
    _sample_work: Any = None          # (rows * V,) f32 penalised logits, one row per logits row
    _sample_rows: int = 0
    _sample_vocab: int = 0
    _step_done: Any = None            # the event download_step waits on

    def host_buffer(self, n: int) -> np.ndarray:
        mem = cp.cuda.alloc_pinned_memory(max(1, n) * 4)
        buf = np.frombuffer(mem, np.int32, n)                      # (n,) i32 pinned
        buf[:] = 0
        return buf

    @staticmethod
    def _check_words(host, device, what: str) -> int:
        _check(host, np.int32, f"{what} host")
        _check(device, np.int32, f"{what} device")
        if device.ndim != 1 or not device.flags.c_contiguous or not host.flags.c_contiguous:
            raise ValueError(f"{what}: buffers must be contiguous 1-D")
        return min(host.size, device.size)

    def upload_step(self, host, device) -> None:
        n = self._check_words(host, device, "upload_step")
        if n != host.size:
            raise ValueError(f"upload_step: {host.size} words into {device.size}")
        cp.cuda.runtime.memcpyAsync(device.data.ptr, host.ctypes.data, n * 4,
                                    cp.cuda.runtime.memcpyHostToDevice, self.stream.ptr)

    def download_step(self, device, host) -> None:
        n = self._check_words(host, device, "download_step")
        if n != device.size:
            raise ValueError(f"download_step: {device.size} words into {host.size}")
        if n:
            cp.cuda.runtime.memcpyAsync(host.ctypes.data, device.data.ptr, n * 4,
                                        cp.cuda.runtime.memcpyDeviceToHost, self.stream.ptr)
        if self._step_done is None:
            self._step_done = cp.cuda.Event(block=False, disable_timing=True)
        self._step_done.record(self.stream)
        self._step_done.synchronize()

    def prepare_sampling(self, rows: int, vocab: int) -> None:
        self._sample_work = self.zeros((max(1, rows) * vocab,), "float32")   # (rows * V,) f32
        self._sample_rows, self._sample_vocab = rows, vocab
        self._step_done = cp.cuda.Event(block=False, disable_timing=True)

    def record_tokens(self, ids, slots, positions, hist) -> None:
        T = ids.shape[0]
        for a, what in ((ids, "ids"), (slots, "slots"), (positions, "positions")):
            _check(a, np.int32, f"record_tokens {what}")
            if a.shape != (T,) or not a.flags.c_contiguous:
                raise ValueError(f"record_tokens {what}: shape {a.shape}, expected ({T},)")
        _check(hist, np.int32, "record_tokens hist")
        if hist.ndim != 2 or not hist.flags.c_contiguous:
            raise ValueError(f"record_tokens hist: {hist.shape} must be contiguous 2-D")
        self._launch("record_tokens", (_ceil(T, 128),), (128,),
                     [ids, slots, positions, _I32(T), _I32(hist.shape[0]), _I32(hist.shape[1]),
                      hist])

    def sample(self, logits, params, hist, out) -> None:
        L, _, ld, _, V = _rows(logits)
        if logits.ndim != 2:
            raise ValueError(f"sample logits: {logits.shape}, expected (L, V)")
        if logits.shape[0] == 0:
            return
        _check(logits, np.float32, "sample logits")
        for a, shape, what in ((params, (L, N_PARAMS), "params"), (out, (L, OUT_WORDS), "out")):
            _check(a, np.int32, f"sample {what}")
            if a.shape != shape or not a.flags.c_contiguous:
                raise ValueError(f"sample {what}: {a.shape}, expected contiguous {shape}")
        _check(hist, np.int32, "sample hist")
        if hist.ndim != 2 or not hist.flags.c_contiguous:
            raise ValueError(f"sample hist: {hist.shape} must be contiguous 2-D")
        if self._sample_work is None or L > self._sample_rows or V != self._sample_vocab:
            raise ValueError(f"sample: {L} rows of {V} exceed prepare_sampling's "
                             f"{self._sample_rows} of {self._sample_vocab}")
        self._launch("sample_rows", (L,), (SAMPLE_THREADS,),
                     [logits, _I32(ld), _I32(V), params, hist, _I32(hist.shape[1]),
                      self._sample_work, out])


# Kernel name prefix -> source file.
_KERNEL_SOURCE = {"gemv": "gemv.cu", "quantize": "quantize.cu", "kv": "quantize.cu",
                  "embed": "elementwise.cu", "rms": "elementwise.cu", "add": "elementwise.cu",
                  "glu": "elementwise.cu", "rope": "elementwise.cu", "moe": "elementwise.cu",
                  "attn": "attention.cu", "argmax": "sampling.cu", "record": "sampling.cu",
                  "sample": "sampling.cu"}
