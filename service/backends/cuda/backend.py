"""The CUDA backend's facade: `CudaBackend` composes the parts and hands each call of the
Backend interface (base.py) to the part that owns it. Every op is a raw kernel (no CuPy
elementwise temporaries) launched on the backend's own stream into buffers allocated at load
time, so a step can be captured into a CUDA graph and replayed. The parts, each constructed
with what it uses, none reaching into another's attributes: launcher.py (Launcher: module
cache, registry lookup and argument check, eager and PDL launches; ActivationBlocks: whose
8-bit blocks the scratch holds), memory.py (allocation, host copies, step I/O), graphs.py (step
capture), weights.py (loading, through upload.py's staging ring), and the op families gemv.py,
gemm.py, moe.py, norm.py, elementwise.py, rope.py, kv.py, attention.py, sampling.py.
Shapes: T tokens in the step, K/N the input/output width of a matrix, E the model width.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import cupy as cp

from service.backends.base import Backend, segment_rows
from service.backends.cuda.attention import PREFILL_ATTENTION_MIN_TOKENS, AttentionOps
from service.backends.cuda.elementwise import ElementwiseOps
from service.backends.cuda.gemm import PREFILL_GEMM_MIN_TOKENS, GemmOps
from service.backends.cuda.gemv import GemvOps
from service.backends.cuda.graphs import GRAPH_MAX_TOKENS, StepGraphs, step_sizes
from service.backends.cuda.kernels import GEMV_PREFETCH_ROWS
from service.backends.cuda.kv import KVOps
from service.backends.cuda.launcher import ActivationBlocks, Launcher
from service.backends.cuda.memory import DeviceMemory
from service.backends.cuda.moe import MoeOps
from service.backends.cuda.norm import NORM_SLICES, NormOps
from service.backends.cuda.rope import RopeOps
from service.backends.cuda.sampling import SamplingOps
from service.backends.cuda.types import KV_TYPES, CudaKVCache, CudaMatrix
from service.backends.cuda.upload import PinnedUploader
from service.backends.cuda.weights import WeightLoader

__all__ = ["CudaBackend", "CudaKVCache", "CudaMatrix"]


class _Of:
    """An attribute of the backend that is an attribute of one of its parts (read and write)."""

    def __init__(self, part: str, name: str) -> None:
        self.part, self.name = part, name

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        return self if obj is None else getattr(getattr(obj, self.part), self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(getattr(obj, self.part), self.name, value)


class CudaBackend(Backend):
    name = "cuda"
    kv_types = KV_TYPES
    asynchronous = True
    kv_pool_share = 0.8     # device memory serves this process (the rest: scratch, graphs, drafts)

    def __init__(self, threads: int = 0, graphs: bool = True, device: int = 0,
                 invariant_tokens: int = 16, gemv_rows: int = 2, upload: str = "pinned",
                 prefill_gemm_min_tokens: int | None = PREFILL_GEMM_MIN_TOKENS,
                 staging_buffers: int = 3, staging_mib: int = 64,
                 prefill_scratch_mib: int = 128, pdl: bool = True, gemv_early: bool = False,
                 gemv_mma: bool = False, gemv_prefetch_rows: int = GEMV_PREFETCH_ROWS,
                 prefill_attention_min_tokens: int | None = PREFILL_ATTENTION_MIN_TOKENS,
                 fuse_norm: bool = False, moe_group_min_tokens: int | None = 2,
                 gemv_mma_one: str = "warp", norm_slices: int = NORM_SLICES):
        """graphs: capture each step shape once and replay it (graphs.py). upload: "pinned" (a
        ring of `staging_buffers` pinned buffers of `staging_mib` MiB, copies overlapped with
        reading the file) or "pageable" (one synchronous copy per plane). pdl: launch captured
        steps' kernels with programmatic dependent launch (launcher.py; off without
        cuda-bindings). gemv_*, fuse_norm: gemv.py. prefill_gemm_min_tokens (gemm.py, tiles in
        at most `prefill_scratch_mib` MiB), prefill_attention_min_tokens (attention.py):
        thresholds of wide steps, raised past `invariant_tokens`; None: never. Every choice
        but gemv_mma and the prefill thresholds gives the same bits.
        moe_group_min_tokens: MoE steps of at least this many tokens group the (token, expert)
        pairs by expert (moe.py); None: the gathered expert GEMVs always. norm_slices: blocks
        per row of the RMSNorm before a GEMV (norm.py; the same bits at any count)."""
        # CPU threads do not apply; every GEMV column and attention query is computed the same
        # way at any step size, so steps up to invariant_tokens are invariant here.
        del threads
        if upload not in ("pinned", "pageable"):
            raise ValueError(f"upload must be 'pinned' or 'pageable', not {upload!r}")
        cp.cuda.Device(device).use()
        uploader = (PinnedUploader(staging_buffers, staging_mib << 20,
                                   min(8, os.cpu_count() or 1))
                    if upload == "pinned" else None)
        self.stream = cp.cuda.Stream(non_blocking=True)
        blocks = self._act = ActivationBlocks()
        launcher = self._launcher = Launcher(self.stream, blocks, pdl)
        self._memory = DeviceMemory(self.stream, blocks)
        self._weights = WeightLoader(self.stream, upload, uploader)
        gemm_min = _past(prefill_gemm_min_tokens, invariant_tokens)
        # cuBLAS cannot be captured: a step wide enough for the GEMM path always runs eagerly
        self._steps = StepGraphs(self.stream, launcher, blocks, graphs,
                                 GRAPH_MAX_TOKENS if gemm_min is None
                                 else min(GRAPH_MAX_TOKENS, gemm_min - 1))
        self._gemm = GemmOps(self.stream, launcher, blocks, gemm_min, prefill_scratch_mib << 20)
        self._gemv = GemvOps(launcher, blocks, rows=gemv_rows, early=gemv_early,
                             prefetch_rows=gemv_prefetch_rows, mma=gemv_mma,
                             fuse_norm=fuse_norm, mma_one=gemv_mma_one)
        self._norm = NormOps(launcher, blocks, norm_slices)
        self._ew = ElementwiseOps(launcher, blocks)
        self._moe = MoeOps(launcher, self._gemv, self._ew,
                           group_min_tokens=moe_group_min_tokens)
        self._rope = RopeOps(launcher, self._weights.upload_vector)
        self._kv = KVOps(self.stream, launcher)
        self._attn = AttentionOps(launcher, blocks,
                                  _past(prefill_attention_min_tokens, invariant_tokens))
        self._sampling = SamplingOps(launcher)

    # Options and figures, kept by the parts that use them.
    graphs = _Of("_steps", "enabled")
    pdl = _Of("_launcher", "pdl")                 # read when a step is captured
    gemv_rows = _Of("_gemv", "rows")
    gemv_early = _Of("_gemv", "early")
    gemv_prefetch_rows = _Of("_gemv", "prefetch_rows")
    gemv_mma = _Of("_gemv", "mma")
    gemv_mma_one = _Of("_gemv", "mma_one")
    gemv_split_blocks = _Of("_gemv", "split_blocks")
    norm_slices = _Of("_norm", "slices")
    fuse_norm = _Of("_gemv", "fuse_norm")
    moe_group_min_tokens = _Of("_moe", "group_min_tokens")
    prefill_gemm_min_tokens = _Of("_gemm", "min_tokens")
    prefill_attention_min_tokens = _Of("_attn", "tiled_min_tokens")
    upload = _Of("_weights", "upload")
    tensor_bytes = _Of("_weights", "tensor_bytes")    # file bytes of the tensors loaded
    weight_bytes = _Of("_weights", "weight_bytes")
    load_seconds = _Of("_weights", "load_seconds")

    # ---------------------------------------------------------------- memory
    def zeros(self, shape, dtype="float32"): return self._memory.zeros(shape, dtype)
    def to_host(self, x): return self._memory.to_host(x)
    def upload_ints(self, host, out): self._memory.upload_ints(host, out)
    def synchronize(self) -> None: self._memory.synchronize()
    def memory_free(self) -> int: return self._memory.memory_free()

    # ---------------------------------------------------------------- weights
    def can_fuse(self, tensors): return self._weights.can_fuse(tensors)
    def load_matrix(self, tensors) -> CudaMatrix: return self._weights.load_matrix(tensors)
    def load_experts(self, tensor) -> CudaMatrix: return self._weights.load_experts(tensor)
    def upload_vector(self, host): return self._weights.upload_vector(host)
    def load_vector(self, tensor): return self._weights.load_vector(tensor)
    def load_embedding(self, tensor) -> CudaMatrix: return self._weights.load_matrix([tensor])
    def finish_load(self) -> None: self._weights.finish_load()

    def prepare(self, *, max_tokens: int, n_head: int, head_dim_v: int, n_ctx: int,
                n_embd: int, moe_experts: int = 0, moe_used: int = 0, moe_ff: int = 0) -> None:
        w, mem = self._weights, self._memory
        w.finish_load()
        self._gemm.prepare(max_tokens, w.max_k, w.max_elems, mem)
        rows = max_tokens * max(1, moe_used)
        self._act.allocate(mem.zeros((rows * w.max_k,), "int8"),
                           mem.zeros((rows * w.max_k // 32, 2), "float32"))
        self._attn.prepare(mem, max_tokens=max_tokens, n_head=n_head, head_dim_v=head_dim_v,
                           n_ctx=n_ctx)
        self._gemv.prepare(mem)
        if moe_used:
            self._moe.prepare(mem, max_tokens=max_tokens, n_embd=n_embd, n_expert=moe_experts,
                              n_used=moe_used, n_ff=moe_ff)

    # ---------------------------------------------------------------- step graphs
    def step_sizes(self, max_tokens: int) -> tuple[int, ...]: return step_sizes(max_tokens)
    def run_step(self, key, inputs, fn): return self._steps.run(key, inputs, fn)

    captures_steps = property(lambda self: self._steps.enabled)
    n_graphs = property(lambda self: len(self._steps.graphs))
    # one entry per captured graph: its step key followed by its inputs' device pointers
    graph_keys = property(lambda self: tuple(self._steps.graphs))
    # key -> how many times its captured graph was replayed (the capture's own launch not counted)
    graph_replays = property(lambda self: dict(self._steps.replays))

    # ---------------------------------------------------------------- KV cache
    def new_kv_cache(self, n_layer, n_slots, n_ctx, n_head_kv, head_dim, head_dim_v, type_k,
                     type_v, n_blocks=0, block_size=16) -> CudaKVCache:
        return self._kv.new_cache(n_layer, n_slots, n_ctx, n_head_kv, head_dim, head_dim_v,
                                  type_k, type_v, n_blocks, block_size)

    def set_block_table(self, cache, host) -> None: self._kv.set_block_table(cache, host)
    def kv_write(self, cache, layer, k, v, slots, positions):
        self._kv.write(cache, layer, k, v, slots, positions)
    def kv_move(self, cache, slots, src, dst): self._kv.move(cache, slots, src, dst)

    # ---------------------------------------------------------------- ops
    def embed(self, table, ids, scale, out): self._ew.embed(table, ids, scale, out)
    def add(self, a, b, out): self._ew.add(a, b, out)
    def copy_rows(self, src, out): self._ew.copy_rows(src, out)
    def glu(self, gate, up, activation, out): self._ew.glu(gate, up, activation, out)
    def softplus_gate(self, a, g): self._ew.softplus_gate(a, g)
    def glu_for_matmul(self, gate, up, activation, out):
        self._ew.glu_for_matmul(gate, up, activation, out)
    def rms_norm(self, x, w, eps, out): self._norm.rms_norm(x, w, eps, out)
    def rms_norm_for_matmul(self, x, w, eps, out): self._norm.rms_norm_for_matmul(x, w, eps, out)
    def rms_norm_add(self, o, w, eps, x): self._norm.rms_norm_add(o, w, eps, x)
    def rope_table(self, n_ctx, n_dims, base, scaling=None):
        return self._rope.table(n_ctx, n_dims, base, scaling)
    def rope(self, x, positions, table, neox): self._rope.rope(x, positions, table, neox)

    def rope_kv(self, q, k, v, q_norm, k_norm, eps, positions, slots, table, neox, cache,
                layer, kv_positions=None):
        self._rope.rope_kv(q, k, v, q_norm, k_norm, eps, positions, slots, table, neox, cache,
                           layer, kv_positions)

    def attention(self, q, cache, layer, slots, positions, kv_len, window, scale, out,
                  attn_lo=None, attn_mask=None):
        self._attn.attention(q, cache, layer, slots, positions, window, scale, out, False,
                             attn_lo, attn_mask)

    def attention_for_matmul(self, q, cache, layer, slots, positions, kv_len, window, scale,
                             out, attn_lo=None, attn_mask=None):
        self._attn.attention(q, cache, layer, slots, positions, window, scale, out, True,
                             attn_lo, attn_mask)

    def matmul(self, x, w: CudaMatrix, out, segments=None):
        self._matmul(x, w, out, False, segments)

    def matmul_add(self, x, w: CudaMatrix, out, tmp, segments=None):
        del tmp                               # the GEMV (or GEMM, beta = 1) adds into out
        self._matmul(x, w, out, True, segments)

    def _matmul(self, x, w: CudaMatrix, out, accumulate: bool, segments=None) -> None:
        """Each run of `segments` (base.py) on the path its own row count picks: the runs wide
        enough for the GEMM in one GemmOps.matmul (each dequantized tile once for all), the
        others on the GEMV, one call per run."""
        runs = segment_rows(segments, x.shape[0])
        wide = tuple(r for r in runs if self._gemm.wanted(x[r[0]:r[1]]))
        for a, b in runs:
            if (a, b) not in wide:
                self._gemv.matmul(x[a:b], w, out[a:b], accumulate=accumulate)
        if wide:
            self._gemm.matmul(x, w, out, accumulate, wide)

    def matmul_add_norm(self, x, w: CudaMatrix, out, tmp, norm_w, eps, h, segments=None):
        if segments is not None or not self._gemv.matmul_add_norm(
                x, w, out, norm_w, eps, h, self._gemm.wanted(x)):
            super().matmul_add_norm(x, w, out, tmp, norm_w, eps, h, segments)

    def moe(self, x, router, gate, up, down, n_used, normalize, activation, out, *,
            gating="softmax", bias=None, scale=1.0):
        self._moe.moe(x, router, gate, up, down, n_used, normalize, activation, out,
                      gating=gating, bias=bias, scale=scale)

    def round_f16(self, x, out) -> None: self._gemm.round_f16(x, out)
    def dequant_rows(self, w, r0, n_rows, out) -> None: self._gemm.dequant_rows(w, r0, n_rows, out)

    # ---------------------------------------------------------------- step I/O and sampling
    def host_buffer(self, n: int): return self._memory.host_buffer(n)
    def upload_step(self, host, device) -> None: self._memory.upload_step(host, device)
    def queue_download(self, device, host): return self._memory.queue_download(device, host)
    def wait_download(self, ticket) -> None: self._memory.wait_download(ticket)
    def prepare_sampling(self, rows, vocab): self._sampling.prepare(self._memory, rows, vocab)
    def argmax(self, logits, out): self._sampling.argmax(logits, out)
    def record_tokens(self, ids, slots, positions, hist):
        self._sampling.record_tokens(ids, slots, positions, hist)
    def chosen_ids(self, records, out): self._sampling.chosen_ids(records, out)
    def feed_ids(self, records, src, ids): self._sampling.feed_ids(records, src, ids)
    def sample(self, logits, params, hist, adj, out, masks=None):
        self._sampling.sample(logits, params, hist, adj, out, masks)

    # ---------------------------------------------------------------- parts' state by old names
    # Read by tests/gpu and bench (launch counting and timing, scratch poisoning, graph nodes);
    # `_launch` set to a callable takes every launch in its place (Launcher.intercept).
    _blocks = property(lambda self: self._act.view)
    _gs = property(lambda self: self._gemm.scratch)
    _uploader = property(lambda self: self._weights.uploader)
    _shared = property(lambda self: self._weights.shared)
    _graphs = property(lambda self: self._steps.graphs)
    _seen = property(lambda self: self._steps.seen)
    _kernels = property(lambda self: self._launcher.functions)

    _launch = property(lambda self: self._launcher.run,
                       lambda self, fn: setattr(self._launcher, "intercept", fn),
                       lambda self: setattr(self._launcher, "intercept", None))

    _s = property(lambda self: SimpleNamespace(
        qa=self._act.qa, ads=self._act.ads, gemv_done=self._gemv.done, part_ml=self._attn.part_ml,
        part_acc=self._attn.part_acc, counters=self._attn.counters, moe=self._moe.scratch))


def _past(min_tokens: int | None, invariant_tokens: int) -> int | None:
    """A threshold of wide steps, raised past the step-size-invariant widths."""
    return None if min_tokens is None else max(min_tokens, invariant_tokens + 1)
