"""CPU reference backend: numpy for the small ops, numba kernels for quantized matmuls.

It is the numerical oracle the CUDA kernels are checked against, so it favours exactness:
activations stay float32, quantized weights are repacked exactly (kernels.py), and the KV
cache holds exactly the values its element type represents (attention.py).

`CpuBackend` is a facade over parts that each own their state: `ThreadBudget` (the pools'
sizes), `CpuMatmul` (weights and their products, the prefill tile scratch), `CpuAttention` (KV
caches, attention, the decode step's key rows); the small ops (ops.py) and the sample op
(sampling.py) are stateless.
"""

from __future__ import annotations

import numpy as np

from service.backends.base import Backend
from service.backends.cpu import ops, sampling
from service.backends.cpu.attention import KV_TYPES, CpuAttention, CpuKVCache
from service.backends.cpu.matmul import CpuMatmul, CpuMatrix
from service.backends.cpu.ops import CpuEmbedding
from service.backends.cpu.threads import ThreadBudget
from service.gguf.reader import TensorInfo


class CpuBackend(Backend):
    name = "cpu"
    kv_types = KV_TYPES

    def __init__(self, threads: int = 0, act_quant: bool | str = False, invariant_tokens: int = 16,
                 capture_rules: bool = False):
        """threads: compute threads of a step (0 = numba's default, all cores), see
        `ThreadBudget`. invariant_tokens: steps of up to this many tokens (decode, speculative
        verify) compute every row exactly as a single-token step would; longer steps (prefill
        chunks) go through sgemm. The engine passes its largest verify width.

        act_quant: round activations as llama.cpp's CPU matmuls do before the dot product
        (8-bit blocks: Q8_K for K-quant weights, Q8_0 for the others; f16/bf16 for f16/bf16
        weights). Off by default: float32 activations are the reference. Tests turn it on to
        compare with llama.cpp's logits on random-weight models, where 8-bit noise is amplified.
        act_quant="gpu" rounds the inputs of quantized matrices exactly as the CUDA backend's
        8-bit blocks do (act_quant.round_activations), for tight GPU-vs-CPU comparisons.

        capture_rules: raise CaptureRuleError on anything inside `run_step` that a captured CUDA
        graph cannot contain (capture_rules.py), so CPU tests catch it before a GPU run.
        """
        self.act_quant = act_quant
        self.invariant_tokens = invariant_tokens
        self.threads = ThreadBudget(threads, invariant_tokens)
        self.matmuls = CpuMatmul(self.threads, act_quant, invariant_tokens)
        self.attn = CpuAttention(self.threads, invariant_tokens)
        if capture_rules:
            from service.backends.capture_rules import install

            install(self)

    # ---------------------------------------------------------------- memory
    def zeros(self, shape, dtype="float32"):
        return np.zeros(shape, dtype=dtype)

    def to_host(self, x):
        return np.array(x)

    def upload_ints(self, host, out):
        out[: len(host)] = host

    # ---------------------------------------------------------------- weights
    def can_fuse(self, tensors: list[TensorInfo]) -> bool:
        return self.matmuls.can_fuse(tensors)

    def load_matrix(self, tensors: list[TensorInfo]) -> CpuMatrix:
        return self.matmuls.load_matrix(tensors)

    def load_experts(self, tensor: TensorInfo) -> list[CpuMatrix]:
        return self.matmuls.load_experts(tensor)

    def upload_vector(self, host) -> np.ndarray:
        return np.ascontiguousarray(host, dtype=np.float32)

    def load_embedding(self, tensor: TensorInfo) -> CpuEmbedding:
        return ops.load_embedding(tensor)

    # ---------------------------------------------------------------- KV cache
    def new_kv_cache(self, n_layer, n_slots, n_ctx, n_head_kv, head_dim, head_dim_v,
                     type_k, type_v, n_blocks=0, block_size=16) -> CpuKVCache:
        return self.attn.new_kv_cache(n_layer, n_slots, n_ctx, n_head_kv, head_dim, head_dim_v,
                                      type_k, type_v, n_blocks, block_size)

    def set_block_table(self, cache: CpuKVCache, host) -> None:
        self.attn.set_block_table(cache, host)

    def kv_position_bytes(self, n_layer, n_head_kv, head_dim, head_dim_v, type_k, type_v) -> int:
        return self.attn.kv_position_bytes(n_layer, n_head_kv, head_dim, head_dim_v, type_k,
                                           type_v)

    # ---------------------------------------------------------------- ops
    def embed(self, table: CpuEmbedding, ids, scale, out):
        ops.embed(table, ids, scale, out)

    def rms_norm(self, x, w, eps, out):
        ops.rms_norm(x, w, eps, out)

    def matmul(self, x, w: CpuMatrix, out, segments=None):
        self.matmuls.matmul(x, w, out, segments)

    def add(self, a, b, out):
        np.add(a, b, out=out)

    def copy_rows(self, src, out):
        np.copyto(out, src)

    def rope_table(self, n_ctx, n_dims, base, scaling=None):
        return ops.rope_table(n_ctx, n_dims, base, scaling)

    def rope(self, x, positions, table, neox):
        ops.rope(x, positions, table, neox)

    def glu(self, gate, up, activation, out):
        ops.glu(gate, up, activation, out)

    def kv_write(self, cache: CpuKVCache, layer, k, v, slots, positions):
        self.attn.kv_write(cache, layer, k, v, slots, positions)

    def attention(self, q, cache: CpuKVCache, layer, slots, positions, kv_len, window, scale,
                  out, attn_lo=None, attn_mask=None):
        self.attn.attention(q, cache, layer, slots, positions, kv_len, window, scale, out,
                            attn_lo, attn_mask)

    def kv_move(self, cache: CpuKVCache, slots, src, dst):
        self.attn.kv_move(cache, slots, src, dst)

    def moe(self, x, router: CpuMatrix, gate, up, down, n_used, normalize, activation, out, *,
            gating="softmax", bias=None, scale=1.0):
        self.matmuls.moe(x, router, gate, up, down, n_used, normalize, activation, out,
                         gating=gating, bias=bias, scale=scale)

    def softplus_gate(self, a, g):
        ops.softplus_gate(a, g)

    def argmax(self, logits, out):
        ops.argmax(logits, out)

    # ---------------------------------------------------------------- step I/O and sampling
    def step_sizes(self, max_tokens: int) -> tuple[int, ...]:
        """The capture sizes up to 16, then multiples of 16: nothing is captured here, and
        padding a 20-token prompt to a 256-token chunk would cost 4x its prefill time
        (smollm2-135m, 2 threads), while steps past 16 tokens still carry padding rows."""
        big = range(32, max_tokens, 16)
        return tuple(sorted({*super().step_sizes(max_tokens), *big}))

    def host_buffer(self, n: int) -> np.ndarray:
        return np.zeros(n, np.int32)

    def upload_step(self, host, device) -> None:
        device[: host.size] = host

    def queue_download(self, device, host) -> None:
        host[: device.size] = device        # the step already ran: nothing is left to wait for

    def record_tokens(self, ids, slots, positions, hist) -> None:
        real = slots >= 0
        hist[slots[real], positions[real]] = ids[real]

    def chosen_ids(self, records, out) -> None:
        out[:] = records[:, 0]

    def feed_ids(self, records, src, ids) -> None:
        fed = src >= 0
        ids[fed] = records[src[fed], 0]

    def sample(self, logits, params, hist, adj, out, masks=None) -> None:
        sampling.sample_rows(logits, params, hist, adj, out, masks)
