"""CUDA backend: CuPy launchers for the raw kernels in cuda/, weights quantized on the GPU,
and one captured CUDA graph per step shape.

With its mixins attention.py (the attention family), gemv.py (the GEMVs; no CuPy
import of its own), gemm.py (the prefill GEMM and the end of loading) and
sampling.py (step I/O and token choice), and upload.py (the pinned staging ring the
weights go through), the only modules that import CuPy; types.py holds the shapes and
helpers they share. Every op is a raw kernel (no CuPy elementwise temporaries),
launched on the backend's own stream into buffers allocated at load time, so a step can be
captured into a CUDA graph and replayed: the first step of a shape runs eagerly (it loads the
kernels), the second is captured, later ones replay. Kernels read token ids, positions and KV
slots from device buffers and never take a KV length from the host, so one graph per
(tokens, logits) shape serves every position. Steps wider than the decode/verify widths
(prefill chunks, run eagerly) take their matmuls through dequantize + cuBLAS GEMM.

Shapes below: T tokens in the step, K/N the input/output width of a matrix, E the model width.
"""

from __future__ import annotations

import os
from typing import Any

import cupy as cp
import numpy as np

from service.backends.base import Backend
from service.backends.cuda import kernels
from service.backends.cuda import sources as cuda_sources
from service.backends.cuda.attention import AttentionOps
from service.backends.cuda.gemm import PREFILL_GEMM_MIN_TOKENS, GemmOps, GemmScratch
from service.backends.cuda.gemv import GemvOps
from service.backends.cuda.launcher import PdlLauncher, pdl_available
from service.backends.cuda.layout import LAYOUTS, PlaneLayout, layout_of, split_planes
from service.backends.cuda.sampling import SamplingOps
from service.backends.cuda.types import (
    ATT_CHUNK,
    F32,
    GEMV_PREFETCH_ROWS,
    GRAPH_MAX_TOKENS,
    I32,
    KV_TYPES,
    PREFILL_ATTENTION_MIN_TOKENS,
    CudaKVCache,
    CudaMatrix,
    Scratch,
    ViewKey,
    ceil_div,
    check_dtype,
    matrix_key,
    norm_block,
    view_rows,
)
from service.backends.cuda.upload import PinnedUploader
from service.gguf.quants import dequantize
from service.gguf.reader import TensorInfo

__all__ = ["CudaBackend", "CudaKVCache", "CudaMatrix"]


class CudaBackend(AttentionOps, GemvOps, GemmOps, SamplingOps, Backend):
    name = "cuda"
    kv_types = KV_TYPES

    def __init__(self, threads: int = 0, graphs: bool = True, device: int = 0,
                 invariant_tokens: int = 16, gemv_rows: int = 2, upload: str = "pinned",
                 prefill_gemm_min_tokens: int | None = PREFILL_GEMM_MIN_TOKENS,
                 staging_buffers: int = 3, staging_mib: int = 64,
                 prefill_scratch_mib: int = 128, pdl: bool = True, gemv_early: bool = False,
                 gemv_mma: bool = False, gemv_prefetch_rows: int = GEMV_PREFETCH_ROWS,
                 prefill_attention_min_tokens: int | None = PREFILL_ATTENTION_MIN_TOKENS,
                 fuse_norm: bool = False):
        """gemv_rows: 2 (the default) picks the GEMV variant by the step's width
        (cuda_types.gemv_choice); 1 runs the one-column one-row kernel at every width (the
        earlier kernel, kept for benchmarks). Both give the same bits.
        upload: "pinned" (a ring of `staging_buffers` pinned buffers of `staging_mib` MiB,
        copies overlapped with reading the file) or "pageable" (one synchronous copy per plane).
        prefill_gemm_min_tokens: matmuls of steps with at least this many tokens, and more than
        `invariant_tokens` (decode and verify steps stay on the step-size-invariant GEMV), go
        through dequantize + cuBLAS GEMM; None keeps every matmul on the GEMV. Weight tiles of
        the GEMM are dequantized into a scratch of at most `prefill_scratch_mib` MiB.
        pdl: kernels of captured steps are launched with programmatic dependent launch
        (launcher.py; each kernel's launch overlaps its predecessor's run); False launches
        them through CuPy with full serialization (the earlier behaviour, for benchmarks).
        Without cuda-bindings it is off. Both give the same bits.
        gemv_early: one-column quantized GEMVs use the c1r1e kernel, which reads each lane's
        first weight group before the programmatic-launch wait (same bits, more registers).
        gemv_prefetch_rows: one-column Q4_K / Q6_K GEMVs of matrices with at most this many
        rows use the c1r1p kernel (the next weight group loaded before each dot; same bits),
        where one warp per row leaves too few loads in flight; 0 never (docs/PERFORMANCE.md
        section 11: faster at 4096 rows on the H200, not at 6144 and more, nor on Q8_0 / Q4_0).
        gemv_mma: every GEMV over Q4_K / Q6_K weights (plain mode, any width, one column
        included) runs on the int8 tensor cores (cuda/gemv_mma.cu, 8 columns per block up to 8,
        16 above): a column's result depends on neither the step's width nor its neighbours, so
        batching and verify stay exact within the mode. Off by default: its sums are rounded in
        another order than the dp4a kernels' (other last bits), and one column costs ~1.2-1.4x
        the dp4a kernel's time while 8 / 16 cost ~1.3-1.5x / 1.5-2.6x of it (H200).
        prefill_attention_min_tokens: steps with at least this many tokens, and more than
        `invariant_tokens`, run attention on the query-tiled kernel (attention_tiled.cu: keys
        read once per 32 query rows instead of once per query); None keeps every step on the
        split kernel (attention.cu). A row's result does not depend on its step's other rows
        on either kernel; the two differ in the last bits.
        fuse_norm: a one-column residual GEMV followed by an RMSNorm (matmul_add_norm) runs as
        one launch whose last block normalizes the row; False (the default) launches the two
        kernels. Both give the same bits. Off by default: measured slower on the H200 (0.89x /
        0.94x of the default decode on the 8B / 1B shapes, `make bench-gpu`'s versions table;
        docs/PERFORMANCE.md section 13)."""
        # CPU threads do not apply; every GEMV column and attention query is computed the same
        # way at any step size, so steps up to invariant_tokens are invariant here.
        del threads
        if gemv_rows not in (1, 2):
            raise ValueError(f"gemv_rows must be 1 or 2, not {gemv_rows}")
        if upload not in ("pinned", "pageable"):
            raise ValueError(f"upload must be 'pinned' or 'pageable', not {upload!r}")
        cp.cuda.Device(device).use()
        self.upload = upload
        self._uploader = (PinnedUploader(staging_buffers, staging_mib << 20,
                                         min(8, os.cpu_count() or 1))
                          if upload == "pinned" else None)
        self.prefill_gemm_min_tokens = (None if prefill_gemm_min_tokens is None
                                        else max(prefill_gemm_min_tokens, invariant_tokens + 1))
        self.prefill_attention_min_tokens = (
            None if prefill_attention_min_tokens is None
            else max(prefill_attention_min_tokens, invariant_tokens + 1))
        self._gs = GemmScratch(limit=prefill_scratch_mib << 20)
        self.tensor_bytes = 0             # file bytes of the tensors loaded
        self.load_seconds = 0.0
        self._load_t0: float | None = None
        self.graphs = graphs
        self.pdl = bool(pdl and pdl_available())       # read when a step is captured
        self._pdl = PdlLauncher() if self.pdl else None
        self._capturing = False           # kernels launched now are recorded into a graph
        self.gemv_rows = gemv_rows
        self.gemv_early = gemv_early
        self.gemv_prefetch_rows = gemv_prefetch_rows
        self.fuse_norm = fuse_norm
        self.gemv_mma = gemv_mma
        self.stream = cp.cuda.Stream(non_blocking=True)
        self._modules: dict[str, Any] = {}
        self._kernels: dict[str, Any] = {}
        self._smem_opt_in: dict[str, int] = {}        # dynamic shared memory allowed per kernel
        self._staging: dict[int, np.ndarray] = {}     # pinned upload buffers per destination
        self._shared: dict[str, CudaMatrix] = {}      # tensors loaded once (tied embeddings)
        self._graphs: dict[tuple, tuple[Any, Any]] = {}
        self._seen: set[tuple] = set()
        self._s = Scratch()
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
            src = kernels.kernel(name).source
            mod = self._modules.get(src)
            if mod is None:
                mod = cp.RawModule(code=cuda_sources.source_text(src),
                                   options=cuda_sources.OPTIONS)
                self._modules[src] = mod
            fn = self._kernels[name] = mod.get_function(name)
        return fn

    def _launch(self, name: str, grid, block, args, shared_mem: int = 0) -> None:
        spec = kernels.kernel(name)
        spec.check(args)
        if not spec.keeps_blocks:
            self._blocks = None
        fn = self._fn(name)
        if shared_mem > self._smem_opt_in.get(name, 48 << 10):   # past 48 KiB: opt in
            fn.max_dynamic_shared_size_bytes = shared_mem
            self._smem_opt_in[name] = shared_mem
        if self._capturing and self.pdl and self._pdl is not None:
            self._pdl.launch(fn.kernel.ptr, grid, block, tuple(args), self.stream.ptr,
                             shared_mem)
            return
        with self.stream:
            fn(grid, block, tuple(args), shared_mem=shared_mem)

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

    def memory_free(self) -> int:
        """Free device memory, counting what CuPy's pool holds unused as free."""
        pool = cp.get_default_memory_pool()
        return int(cp.cuda.runtime.memGetInfo()[0]) + pool.free_bytes()

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

    def prepare(self, *, max_tokens: int, n_head: int, head_dim_v: int, n_ctx: int,
                n_embd: int, moe_experts: int = 0, moe_used: int = 0, moe_ff: int = 0) -> None:
        self.finish_load()
        self._prepare_gemm(max_tokens)
        s, z = self._s, self.zeros
        rows = max_tokens * max(1, moe_used)
        s.qa = z((rows * self._max_k,), "int8")
        s.ads = z((rows * self._max_k // 32, 2), "float32")
        n_split = ceil_div(n_ctx, ATT_CHUNK)
        s.part_ml = z((max_tokens * n_head * n_split, 2), "float32")
        s.part_acc = z((max_tokens * n_head * n_split * head_dim_v,), "float32")
        s.counters = z((max_tokens * n_head,), "int32")       # the kernel leaves them at 0
        s.gemv_done = z((1,), "int32")                         # the kernel leaves it at 0
        if moe_used:
            f = moe_ff
            s.moe = {"logits": z((max_tokens, moe_experts)), "ids": z((rows,), "int32"),
                     "w": z((rows,)), "g": z((rows, f)), "u": z((rows, f)),
                     "a": z((rows, f)), "y": z((rows, n_embd))}

    # ---------------------------------------------------------------- step graphs
    def step_sizes(self, max_tokens: int) -> tuple[int, ...]:
        """1, 2, 4, 8, 16 (captured: decode and verify), then powers of two up to max_tokens
        (prefill chunks run eagerly, so their sizes cost no graph; a short prompt is padded to
        at most twice its length instead of to a whole chunk)."""
        sizes, n = set(super().step_sizes(max_tokens)), 32
        while n < max_tokens:
            sizes.add(n)
            n *= 2
        return tuple(sorted(sizes))

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
        self._capturing = True
        try:
            result = fn()
        finally:
            self._capturing = False
            graph = self.stream.end_capture()
        self._graphs[full] = (graph, result)
        graph.launch(stream=self.stream)
        return result

    @property
    def n_graphs(self) -> int:
        return len(self._graphs)

    @property
    def graph_keys(self) -> tuple[tuple, ...]:
        """One entry per captured graph: its step key followed by its inputs' device pointers."""
        return tuple(self._graphs)

    # ---------------------------------------------------------------- ops
    def embed(self, table: CudaMatrix, ids, scale, out):
        T, E = out.shape
        check_dtype(ids, np.int32, "embed ids")
        if not out.flags.c_contiguous or E != table.k:
            raise ValueError(f"embed: out {out.shape} must be contiguous (T, {table.k})")
        self._launch(f"embed_{table.layout.kernel}", (T, ceil_div(E, 256)), (256,),
                     [*table.args(), I32(E), ids, F32(scale), out])

    def rms_norm(self, x, w, eps, out):
        n0, n1, s0, s1, D = view_rows(x)
        o0, o1, p0, p1, Do = view_rows(out)
        if (n0, n1, D) != (o0, o1, Do) or w.shape != (D,):
            raise ValueError(f"rms_norm: x {x.shape}, out {out.shape}, w {w.shape}")
        self._launch("rms_norm", (n0 * n1,), (norm_block(D),),
                     [x, I32(n1), I32(s0), I32(s1), I32(D), w, F32(eps), out, I32(p0),
                      I32(p1)])

    def _block_room(self, rows: int, k: int) -> bool:
        """Whether rows x k activations fit the 8-bit block scratch as whole 32-groups."""
        return self._s.qa is not None and k % 32 == 0 and rows * k <= self._s.qa.size

    def _block_args(self, rows: int, k: int) -> list[Any]:
        return [self._s.qa[: rows * k], self._s.ads[: rows * k // 32]]

    def rms_norm_for_matmul(self, x, w, eps, out):
        if x.ndim != 2 or out.ndim != 2 or not self._block_room(*out.shape):
            self.rms_norm(x, w, eps, out)
            return
        T, _, ldx, _, D = view_rows(x)
        _, _, ldo, _, _ = view_rows(out)
        if out.shape != (T, D) or w.shape != (D,):
            raise ValueError(f"rms_norm_for_matmul: x {x.shape}, out {out.shape}, w {w.shape}")
        for a, what in ((x, "x"), (w, "w"), (out, "out")):
            check_dtype(a, np.float32, f"rms_norm_for_matmul {what}")
        self._launch("rms_norm_quant", (T,), (norm_block(D),),
                     [x, I32(ldx), I32(D), w, F32(eps), out, I32(ldo),
                      *self._block_args(T, D)])
        self._blocks = matrix_key(out)

    def rms_norm_add(self, o, w, eps, x):
        T, _, ldo, _, D = view_rows(o)
        _, _, ldx, _, _ = view_rows(x)
        if o.ndim != 2 or x.shape != o.shape or w.shape != (D,):
            raise ValueError(f"rms_norm_add: o {o.shape}, x {x.shape}, w {w.shape}")
        for a, what in ((o, "o"), (w, "w"), (x, "x")):
            check_dtype(a, np.float32, f"rms_norm_add {what}")
        self._launch("rms_norm_add", (T,), (norm_block(D),),
                     [o, I32(ldo), I32(D), w, F32(eps), x, I32(ldx)])

    def add(self, a, b, out):
        T, _, lda, _, N = view_rows(a)
        To, _, ldo, _, No = view_rows(out)
        if b.ndim == 1:
            ldb = 0
            if b.shape[0] != N:
                raise ValueError(f"add: bias {b.shape} vs rows of {N}")
        else:
            _, _, ldb, _, _ = view_rows(b)
            if b.shape != a.shape:
                raise ValueError(f"add: {a.shape} + {b.shape}")
        if (T, N) != (To, No):
            raise ValueError(f"add: out {out.shape} vs {a.shape}")
        self._launch("add_rows", (ceil_div(N, 256), T), (256,),
                     [a, I32(lda), b, I32(ldb), I32(N), out, I32(ldo)])

    def glu(self, gate, up, activation, out):
        self._glu("glu", gate, up, activation, out, [])

    def glu_for_matmul(self, gate, up, activation, out):
        if out.ndim != 2 or not self._block_room(*out.shape):
            self.glu(gate, up, activation, out)
            return
        self._glu("glu_quant", gate, up, activation, out, self._block_args(*out.shape))
        self._blocks = matrix_key(out)

    def _glu(self, kernel: str, gate, up, activation, out, blocks: list[Any]):
        T, _, ldg, _, F = view_rows(gate)
        _, _, ldu, _, _ = view_rows(up)
        _, _, ldo, _, _ = view_rows(out)
        if gate.ndim != 2 or up.shape != gate.shape or out.shape != gate.shape:
            raise ValueError(f"{kernel}: gate {gate.shape}, up {up.shape}, out {out.shape}")
        act = {"silu": 0, "gelu_tanh": 1}[activation]
        self._launch(kernel, (ceil_div(F, 256), T), (256,),
                     [gate, I32(ldg), up, I32(ldu), I32(F), I32(act), out, I32(ldo),
                      *blocks])

    def moe(self, x, router: CudaMatrix, gate: CudaMatrix, up: CudaMatrix, down: CudaMatrix,
            n_used, normalize, activation, out):
        T = x.shape[0]
        m, P = self._s.moe, T * n_used
        logits, ids, w = m["logits"][:T], m["ids"][:P], m["w"][:P]
        self._gemv(x, router, logits)                                  # (T, n_expert)
        self._launch("moe_route", (ceil_div(T, 64),), (64,),
                     [logits, I32(logits.shape[1]), I32(T), I32(router.n), I32(n_used),
                      I32(1 if normalize else 0), ids, w])
        g, u, a, y = m["g"][:P], m["u"][:P], m["a"][:P], m["y"][:P]
        self._gemv(x, gate, g, ids, P, n_used)                         # (P, F)
        self._gemv(x, up, u, ids, P, n_used)
        self.glu(g, u, activation, a)
        self._gemv(a, down, y, ids, P, 1)                              # (P, E)
        _, _, ldo, _, E = view_rows(out)
        self._launch("moe_combine", (ceil_div(E, 256), T), (256,),
                     [y, w, I32(n_used), I32(E), out, I32(ldo)])

    def argmax(self, logits, out):
        T, _, ld, _, V = view_rows(logits)
        check_dtype(out, np.int32, "argmax out")
        self._launch("argmax_rows", (T,), (1024,), [logits, I32(ld), I32(V), out])

