"""The backend interface: the ops the transformer is written against, once.

Design rules (they are what lets the CUDA backend capture one step as one CUDA graph):
- Every op writes into a caller-provided `out` buffer; buffers come from `zeros()` at load time
  (the transformer's workspace), so nothing is allocated inside a step.
- A step processes T tokens, 1 <= T <= max_tokens. Per-step values (token ids, positions, KV
  slots) arrive as int32 views of one device buffer that the model runner uploads with one copy
  (`upload_step`, service/engine/runner.py). T is padded up to a few capture sizes with padding
  rows (slot -1, id 0, position 0): kv_write stores nothing for them, attention outputs 0 for
  them, and no real row ever reads them. `kv_len` is a host-side int >= every real position + 1,
  there for the CPU backend only: no launch geometry may depend on it.
- Tree verify rows (service/engine/tree.py) separate a row's RoPE position from where its K/V
  is written and what it sees. Three optional (T,) int32 arrays, read by rope_kv and attention:
  `kv_positions` (the KV row written; default: the position), `attn_lo` and `attn_mask` (the
  keys seen: rows [0, attn_lo) and rows attn_lo + j for each set bit j of the 32-bit mask;
  default: attn_lo = position + 1, mask 0, which is plain causal attention). Sliding-window
  layers judge the rows below attn_lo by the query's RoPE position (row c kept when
  c > position - window); rows picked by the mask are always kept. `kv_move` copies KV rows
  inside a slot (tree compaction). An ordinary row gives the same bits with or without them.
- The KV cache is paged: each layer stores n_blocks * block_size rows (a pool of blocks of
  block_size positions, x Hkv x D in the cache type's planes), and `block_table` (n_slots,
  max_blocks) int32 on the backend maps a slot's logical block to a pool block. Ops keep the
  logical interface, (slot, position) per row; the physical row of (slot, pos) is
  block_table[slot, pos // block_size] * block_size + pos % block_size, for the KV rows
  written (kv_write, rope_kv), read (attention: keys and values) and moved (kv_move).
  `set_block_table` replaces the table between steps; the buffer itself never moves, so a
  captured step reads the table of the step it replays. Any valid table gives the same bits.
- A step may hold several prompts' chunks, each a run of rows padded alone (the runner's
  segmented steps): the matmuls then take `segments`, the row ranges [a, b) of those runs, and
  compute each run's rows exactly as a matmul over those rows alone would (the same algorithm,
  order of additions and bits), while sharing what does not depend on the rows (a quantized
  weight tile dequantized once for every run). None: the step's rows are one run.
- Token choice happens on the backend (`sample`), so only int32 ids (and log-probabilities when
  asked) come back, with one copy (`download_step`).
- Arrays are the backend's own (numpy for CPU, CuPy for CUDA); the model layer only slices,
  reshapes and passes them along.

Weight handles (`Matrix`, `Experts`, `Embedding`) are opaque to the model layer.
"""

from __future__ import annotations

import abc
import os
from typing import Any

import numpy as np

from service.gguf.reader import TensorInfo

Array = Any   # numpy.ndarray or cupy.ndarray, by backend
# the row ranges [a, b) of a segmented step's runs, in order, covering its rows; None: one run
Segments = tuple[tuple[int, int], ...] | None
SMALL_STEPS = (1, 2, 4, 8, 16)   # decode and verify step sizes


def segment_rows(segments: Segments, T: int) -> tuple[tuple[int, int], ...]:
    """`segments` checked against a step of T rows (consecutive, non-empty, covering [0, T));
    None reads as the one run [0, T)."""
    if segments is None:
        return ((0, T),)
    at = 0
    for a, b in segments:
        if a != at or b <= a:
            break
        at = b
    else:
        if at == T:
            return tuple(segments)
    raise ValueError(f"segments {list(segments)} do not cover the step's {T} rows in order")


def capture_sizes(max_tokens: int) -> tuple[int, ...]:
    """Step sizes a step is padded up to: 1, 2, 4, 8, 16, then max_tokens (the prefill chunk)."""
    return tuple(sorted({s for s in SMALL_STEPS if s < max_tokens} | {max_tokens}))


class KVCache(abc.ABC):
    """Per-layer K and V rows for `n_slots` sequences of up to `n_ctx` positions, in a pool of
    `n_blocks` blocks of `block_size` rows addressed through `block_table` (n_slots,
    max_blocks) int32 (the module docstring's paging rule)."""

    type_k: str
    type_v: str
    n_slots: int
    n_ctx: int
    block_size: int
    n_blocks: int
    max_blocks: int
    block_table: Array


def kv_pool_geometry(n_slots: int, n_ctx: int, n_blocks: int, block_size: int) -> tuple[int, int]:
    """(max_blocks, n_blocks) of a paged cache: max_blocks = ceil(n_ctx / block_size) blocks per
    slot; n_blocks 0 means n_slots * max_blocks (every slot can hold a full context).
    block_size is a power of two in 8..256."""
    if block_size < 8 or block_size > 256 or block_size & (block_size - 1):
        raise ValueError(f"KV block size {block_size}: a power of two in 8..256 wanted")
    if n_blocks < 0:
        raise ValueError(f"KV pool of {n_blocks} blocks")
    max_blocks = -(-n_ctx // block_size)
    n_blocks = n_blocks or n_slots * max_blocks
    if n_blocks * block_size >= 1 << 31:
        raise ValueError(f"KV pool of {n_blocks} blocks of {block_size}: at most 2^31 - 1 "
                         "positions (row indices are int32)")
    return max_blocks, n_blocks


def initial_block_table(n_slots: int, max_blocks: int, n_blocks: int) -> np.ndarray:
    """(n_slots, max_blocks) int32: the identity (slot s, block b -> s * max_blocks + b) when the
    pool holds every slot's full context, else all 0 (a valid id; real ones are set before
    use)."""
    if n_blocks >= n_slots * max_blocks:
        return np.arange(n_slots * max_blocks, dtype=np.int32).reshape(n_slots, max_blocks)
    return np.zeros((n_slots, max_blocks), np.int32)


def checked_block_table(cache: KVCache, host: Any) -> np.ndarray:
    """`host` as a contiguous (n_slots, max_blocks) int32 array after checking its shape, dtype
    and that every entry is a block id in [0, n_blocks)."""
    a = np.asarray(host)
    if a.shape != (cache.n_slots, cache.max_blocks) or a.dtype != np.int32:
        raise ValueError(f"block table {a.shape} {a.dtype}: ({cache.n_slots}, "
                         f"{cache.max_blocks}) int32 wanted")
    if a.size and (int(a.min()) < 0 or int(a.max()) >= cache.n_blocks):
        raise ValueError(f"block table entries {int(a.min())}..{int(a.max())}: block ids in "
                         f"[0, {cache.n_blocks}) wanted")
    return np.ascontiguousarray(a)


class Backend(abc.ABC):
    name: str
    # steps run asynchronously to the host (queued on a device): the engine's overlapped loop
    # hides its host work behind them (config overlap "auto")
    asynchronous: bool = False
    # steps are captured once per shape and replayed (CUDA graphs): the engine runs every
    # decode / verify shape at startup so that no request pays a first use or a capture
    captures_steps: bool = False
    # The share of memory_free() the default KV pool may take (kv_cache_memory ''): host memory
    # is shared with everything else on the machine, and the prefix cache fills whatever pool
    # it is given over time, so a quarter of it.
    kv_pool_share: float = 0.25

    # ---------------------------------------------------------------- memory
    @abc.abstractmethod
    def zeros(self, shape: tuple[int, ...], dtype: str = "float32") -> Array: ...

    @abc.abstractmethod
    def to_host(self, x: Array) -> Any:
        """A numpy copy of `x` (synchronizes)."""

    @abc.abstractmethod
    def upload_ints(self, host: Any, out: Array) -> None:
        """Copy a small host int32 array into the device buffer `out` (async where possible)."""

    def synchronize(self) -> None:  # noqa: B027 - a no-op default on synchronous backends
        """Wait for queued work."""

    def memory_free(self) -> int:
        """Bytes of memory free for the KV cache pool now (device memory on a GPU)."""
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

    def kv_position_bytes(self, n_layer: int, n_head_kv: int, head_dim: int, head_dim_v: int,
                          type_k: str, type_v: str) -> int:
        """Bytes one position of the KV cache takes over all layers (K and V), as stored: each
        row of d values in the blocks of the type's GGML format (`quants.kv_qtype`): f16 2 bytes
        an element; q8_0 1 byte + a 2-byte scale per 32; q4_0 half a byte + a 2-byte scale
        per 32."""
        from service.gguf.quants import block_spec, kv_qtype

        def row(t: str, d: int) -> int:
            spec = block_spec(kv_qtype(t))
            return d // spec.block_size * spec.type_size
        return n_layer * n_head_kv * (row(type_k, head_dim) + row(type_v, head_dim_v))

    # ---------------------------------------------------------------- weights (load time)
    @abc.abstractmethod
    def load_matrix(self, tensors: list[TensorInfo]) -> Any:
        """A (sum of rows, K) matrix from one or more tensors stacked by rows (q|k|v fusion).

        All tensors must share K; the backend may refuse to fuse mixed formats, in which case
        `can_fuse` returns False and the caller loads them one by one.
        """

    @abc.abstractmethod
    def can_fuse(self, tensors: list[TensorInfo]) -> bool: ...

    @abc.abstractmethod
    def load_experts(self, tensor: TensorInfo) -> Any:
        """(n_expert, N, K) expert matrices."""

    @abc.abstractmethod
    def upload_vector(self, host: Any) -> Array:
        """A device copy of a host float32 vector."""

    def load_vector(self, tensor: TensorInfo) -> Array:
        """A 1-D float32 tensor (norm weights, biases)."""
        from service.gguf.quants import dequantize

        return self.upload_vector(dequantize(tensor.raw, tensor.qtype, tensor.shape))

    @abc.abstractmethod
    def load_embedding(self, tensor: TensorInfo) -> Any:
        """A (vocab, n_embd) table read by row."""

    def prepare(self, *, max_tokens: int, n_head: int, head_dim_v: int, n_ctx: int,  # noqa: B027
                n_embd: int, moe_experts: int = 0, moe_used: int = 0, moe_ff: int = 0) -> None:
        """Size every scratch buffer a step needs, once, after the weights are loaded (so no
        step allocates: a CUDA graph cannot). A no-op where ops allocate nothing."""

    def step_sizes(self, max_tokens: int) -> tuple[int, ...]:
        """The sizes the model runner pads a step of up to max_tokens tokens to (ascending, the
        last = max_tokens): one captured graph per size and logits count."""
        return capture_sizes(max_tokens)

    def run_step(self, key: tuple, inputs: tuple, fn):
        """Run one step `fn()` of shape `key` (token count first) reading the device arrays
        `inputs`; a backend may capture it once and replay it. Returns fn's result."""
        del key, inputs
        return fn()

    @abc.abstractmethod
    def new_kv_cache(self, n_layer: int, n_slots: int, n_ctx: int, n_head_kv: int,
                     head_dim: int, head_dim_v: int, type_k: str, type_v: str,
                     n_blocks: int = 0, block_size: int = 16) -> KVCache:
        """A paged cache (module docstring): per layer n_blocks * block_size rows of K (Hkv, D)
        and V (Hkv, Dv); block_size a power of two in 8..256 (ValueError otherwise); n_blocks 0
        = n_slots * ceil(n_ctx / block_size). Its block_table starts as initial_block_table."""

    @abc.abstractmethod
    def set_block_table(self, cache: KVCache, host: Any) -> None:
        """Copy host (n_slots, max_blocks) int32 into cache.block_table, ordered before the next
        step; `host` may change as soon as this returns. ValueError on a wrong shape or dtype
        or an entry outside [0, n_blocks)."""

    # ---------------------------------------------------------------- ops (write into out)
    @abc.abstractmethod
    def embed(self, table: Any, ids: Array, scale: float, out: Array) -> None:
        """out[t] = table[ids[t]] * scale.  out (T, E) f32."""

    @abc.abstractmethod
    def rms_norm(self, x: Array, w: Array, eps: float, out: Array) -> None:
        """out = x / sqrt(mean(x^2, -1) + eps) * w over the last axis."""

    @abc.abstractmethod
    def matmul(self, x: Array, w: Any, out: Array, segments: Segments = None) -> None:
        """out (T, N) = x (T, K) @ W^T; with `segments` (module docstring) each range of rows
        as a matmul of its own."""

    @abc.abstractmethod
    def add(self, a: Array, b: Array, out: Array) -> None:
        """out = a + b (b may broadcast, e.g. a bias)."""

    @abc.abstractmethod
    def copy_rows(self, src: Array, out: Array) -> None:
        """out (T, N) = src (T, N) f32; both may be row-strided views (a hidden-state tap copies
        residual rows into columns of its buffer, service/model/hidden.py)."""

    @abc.abstractmethod
    def rope_table(self, n_ctx: int, n_dims: int, base: float, scaling=None) -> Any:
        """cos/sin of pos * base^(-2i/n_dims) for pos < n_ctx, i < n_dims/2 (load time); with
        `scaling` (a spec.RopeScaling), YaRN's angles and magnitude (rope_angles.py)."""

    @abc.abstractmethod
    def rope(self, x: Array, positions: Array, table: Any, neox: bool) -> None:
        """Rotate the first n_dims of each head of x (T, H, D) in place by position.

        NORMAL mode rotates pairs (x[2i], x[2i+1]); NEOX rotates (x[i], x[i + n_dims/2]).
        """

    @abc.abstractmethod
    def glu(self, gate: Array, up: Array, activation: str, out: Array) -> None:
        """out = act(gate) * up; activation 'silu' or 'gelu_tanh'."""

    @abc.abstractmethod
    def kv_write(self, cache: KVCache, layer: int, k: Array, v: Array, slots: Array,
                 positions: Array) -> None:
        """Store k (T, Hkv, D), v (T, Hkv, Dv) at logical rows positions[t] of slots[t]."""

    @abc.abstractmethod
    def attention(self, q: Array, cache: KVCache, layer: int, slots: Array, positions: Array,
                  kv_len: int, window: int, scale: float, out: Array, attn_lo: Array = None,
                  attn_mask: Array = None) -> None:
        """Causal (optionally sliding-window) GQA attention of q (T, H, D) over the cache.

        Query t sees cache rows j of its slot with j <= positions[t] (and positions[t] - j <
        window when window > 0). out (T, H, Dv). With attn_lo / attn_mask (T,) int32 (see the
        module docstring) it sees rows j < attn_lo[t] (inside the window) and the rows
        attn_lo[t] + b for the set bits b of attn_mask[t].
        """

    @abc.abstractmethod
    def kv_move(self, cache: KVCache, slots: Array, src: Array, dst: Array) -> None:
        """For m = 0, 1, .. in order: the K and V rows (every layer, every head) at logical row
        src[m] of slot slots[m] are copied to logical row dst[m] of the same slot (both through
        the block table). slots, src, dst (n,) int32
        on the backend. Used after a tree verify step (tree.compaction_plan)."""

    @abc.abstractmethod
    def moe(self, x: Array, router: Any, gate: Any, up: Any, down: Any, n_used: int,
            normalize: bool, activation: str, out: Array, *, gating: str = "softmax",
            bias: Array | None = None, scale: float = 1.0) -> None:
        """Top-n_used routed mixture of GLU experts. x, out (T, E).

        probs = softmax or sigmoid (`gating`) of x @ router^T; the experts with the largest
        probs (+ bias (n_expert,) f32, for the choice only; the lowest index first on ties) are
        used with weights = their probs, divided by their sum (at least 2^-14) when `normalize`,
        times `scale`; out[t] = sum of weight * down(act(gate(x)) * up(x))."""

    def softplus_gate(self, a: Array, g: Array) -> None:
        """a (T, H, Dv) *= softplus(g) in place, g (T, H, 1) (one value per head, broadcast) or
        (T, H, Dv); softplus(v) = log(1 + exp(v)), v where v > 20 (ggml's). g's rows may be
        strided (columns of the q|k|v|g matmul output)."""
        raise NotImplementedError(f"the {self.name} backend has no attention output gate")

    @abc.abstractmethod
    def argmax(self, logits: Array, out: Array) -> None:
        """out[t] = argmax(logits[t]) as int32 (the lowest index on exact ties)."""

    # ---------------------------------------------------------------- fused ops
    # Each has a default that composes the ops above, so a backend computes exactly what the
    # separate ops compute unless it overrides them with one pass. A backend may override any
    # subset; the CPU reference overrides none.

    def rms_norm_for_matmul(self, x: Array, w: Array, eps: float, out: Array) -> None:
        """rms_norm(x, w, eps, out) where `out` (T, K) is the input of the next matmul: the
        backend may prepare that matmul's input (e.g. 8-bit blocks) in the same pass. It stays
        prepared for matmuls on exactly `out` until the next other op; writing `out` by other
        means in between is not allowed."""
        self.rms_norm(x, w, eps, out)

    def glu_for_matmul(self, gate: Array, up: Array, activation: str, out: Array) -> None:
        """glu(gate, up, activation, out) where `out` (T, F) feeds the next matmul (as above)."""
        self.glu(gate, up, activation, out)

    def attention_for_matmul(self, q: Array, cache: KVCache, layer: int, slots: Array,
                             positions: Array, kv_len: int, window: int, scale: float,
                             out: Array, attn_lo: Array = None, attn_mask: Array = None) -> None:
        """attention(...) where `out` (T, H, Dv), read as (T, H*Dv), feeds the next matmul."""
        self.attention(q, cache, layer, slots, positions, kv_len, window, scale, out, attn_lo,
                       attn_mask)

    def rope_kv(self, q: Array, k: Array, v: Array, q_norm: Array | None,
                k_norm: Array | None, eps: float, positions: Array, slots: Array, table: Any,
                neox: bool, cache: KVCache, layer: int, kv_positions: Array = None) -> None:
        """The attention inputs of one layer: q, k (T, H | Hkv, D) get their per-head RMSNorm
        (when q_norm / k_norm are given) and RoPE by positions[t]; q is updated in place, k
        (rotated) and v (T, Hkv, Dv) are stored in the cache at rows kv_positions[t] (default
        positions[t]) of slots[t]. k's contents are unspecified afterwards."""
        if q_norm is not None:
            self.rms_norm(q, q_norm, eps, q)
        if k_norm is not None:
            self.rms_norm(k, k_norm, eps, k)
        self.rope(q, positions, table, neox)
        self.rope(k, positions, table, neox)
        self.kv_write(cache, layer, k, v, slots,
                      positions if kv_positions is None else kv_positions)

    def matmul_add(self, x: Array, w: Any, out: Array, tmp: Array,
                   segments: Segments = None) -> None:
        """out (T, N) += x (T, K) @ W^T, rounded as matmul into tmp then add(out, tmp, out).
        tmp (T, N) is scratch the backend may use; its contents are unspecified afterwards."""
        self.matmul(x, w, tmp, segments)
        self.add(out, tmp, out)

    def matmul_add_norm(self, x: Array, w: Any, out: Array, tmp: Array, norm_w: Array,
                        eps: float, h: Array, segments: Segments = None) -> None:
        """matmul_add(x, w, out, tmp), then rms_norm_for_matmul(out, norm_w, eps, h): a residual
        add and the next layer's input norm, rounded as the two ops (a backend may run them as
        one launch)."""
        self.matmul_add(x, w, out, tmp, segments)
        self.rms_norm_for_matmul(out, norm_w, eps, h)

    def rms_norm_add(self, o: Array, w: Array, eps: float, x: Array) -> None:
        """x (T, E) += rms_norm(o, w, eps), rounded as rms_norm in place then add(x, o, x) (a
        post-norm and the residual add). o's contents are unspecified afterwards."""
        self.rms_norm(o, w, eps, o)
        self.add(x, o, x)

    # ---------------------------------------------------------------- step I/O and sampling
    @abc.abstractmethod
    def host_buffer(self, n: int) -> Any:
        """A host int32 buffer (n,) for step inputs/outputs (pinned where that exists)."""

    @abc.abstractmethod
    def upload_step(self, host: Any, device: Array) -> None:
        """Copy host (n,) int32 into device[:n] with one (asynchronous) copy. The host buffer
        must stay untouched until the step's `download_step` has returned."""

    def download_step(self, device: Array, host: Any) -> None:
        """Copy device (n,) int32 into host[:n] with one copy queued after the step's work, and
        wait for it (n may be 0: then it only waits)."""
        self.wait_download(self.queue_download(device, host))

    @abc.abstractmethod
    def queue_download(self, device: Array, host: Any) -> Any:
        """Queue the copy of device (n,) int32 into host[:n] after the work queued so far and
        return a ticket for `wait_download`; work queued later runs on (the overlapped loop
        reads step k back while step k + 1 runs). host[:n] is unspecified until the wait."""

    def wait_download(self, ticket: Any) -> None:  # noqa: B027 - a no-op on synchronous backends
        """Wait for the copy `queue_download` returned `ticket` for (and the work before it)."""

    def prepare_sampling(self, rows: int, vocab: int) -> None:  # noqa: B027 - no-op default
        """Size the sample op's per-row scratch for up to `rows` logits rows of `vocab`."""

    @abc.abstractmethod
    def record_tokens(self, ids: Array, slots: Array, positions: Array, hist: Array) -> None:
        """hist[slots[t], positions[t]] = ids[t] for the real rows (the repetition penalty's
        token history). ids, slots, positions (T,) int32; hist (n_slots, n_ctx) int32."""

    @abc.abstractmethod
    def chosen_ids(self, records: Array, out: Array) -> None:
        """out[r] = records[r, 0]: the chosen ids of `sample`'s output records (L, OUT_WORDS)
        int32 into out (L,) int32, on the backend (how a draft chain feeds each step's choice to
        the next step's input without a host round trip)."""

    @abc.abstractmethod
    def feed_ids(self, records: Array, src: Array, ids: Array) -> None:
        """ids[t] = records[src[t], 0] where src[t] >= 0, else ids[t] unchanged: a step's input
        ids taken from the previous step's output records (L, OUT_WORDS) int32 on the backend,
        before that step is read back (the overlapped loop). src, ids (T,) int32."""

    @abc.abstractmethod
    def sample(self, logits: Array, params: Array, hist: Array, adj: Array, out: Array,
               masks: Array | None = None) -> None:
        """Choose one token per logits row (service/backends/cpu/sampling.py defines the
        parameter record, the chain of filters, the draw and the output record).
        logits (L, V) f32, params (L, N_PARAMS) int32, hist (n_slots, n_ctx) int32,
        adj (K, 2) int32 the step's logit adjustments (step_format.py), out (L, OUT_WORDS)
        int32, masks (R, MASK_WORDS) int32 the step's token masks (rows whose record says
        MASK >= 0 read theirs; None: no row reads any)."""
