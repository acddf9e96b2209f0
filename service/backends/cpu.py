"""CPU reference backend: numpy for the small ops, numba kernels for quantized matmuls.

It is the numerical oracle the CUDA kernels are checked against, so it favours exactness:
activations stay float32, quantized weights are repacked exactly (cpu_kernels.py), and the KV
cache holds exactly the values its element type represents (each row goes through a
quantize -> dequantize round trip when written, so attention sees what a q8_0/q4_0/f16 cache
would return; rows are kept as float32 here, the memory saving of a quantized cache is the GPU
backend's business).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

# numba's OpenMP workers spin up to 300,000 iterations waiting for the next parallel region.
# Next to the gRPC threads, or on a busy machine, that spinning steals the cores the next matmul
# needs (decoding several times slower on a loaded 2-core machine); not spinning at all
# (passive) costs a futex wake-up per matmul (about 2x slower decoding when idle, in our runs of
# bench/cpu_decode.py with OMP_WAIT_POLICY / GOMP_SPINCOUNT set by hand). A short spin keeps both
# cases fast.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

import threading  # noqa: E402
from collections.abc import Callable  # noqa: E402

import numpy as np  # noqa: E402

from service.backends import cpu_kernels as K  # noqa: E402
from service.backends import cpu_sampling  # noqa: E402
from service.backends.base import Backend  # noqa: E402
from service.backends.cpu_attention import CpuAttentionOps  # noqa: E402
from service.backends.cuda.layout import round_activations  # noqa: E402
from service.errors import ModelFormatError  # noqa: E402
from service.formats import BACKEND_KV_TYPES  # noqa: E402
from service.gguf import quants  # noqa: E402
from service.gguf.quants import QuantType  # noqa: E402
from service.gguf.reader import TensorInfo  # noqa: E402

TILE_ROWS = 512         # rows dequantized per sgemm in prefill steps (2.4 MB at K = 1152)
_EMPTY = np.zeros((0, 0), dtype=np.float32)


_NUMBA_SET = threading.local()   # .n: numba's pool size last set on this thread
_BLAS_SET = [0]                  # the BLAS pool size last set here (0: not yet); per process


def _blas_setters() -> list[Callable[[int], object]]:
    """One pool-size setter per loaded BLAS library. For OpenBLAS, openblas_set_num_threads
    called from a thread other than the main one has no effect once the main thread has
    called it (test_cpu_threads.py::test_budget_applies_after_main_thread_set shows it with
    numpy's OpenBLAS); openblas_set_num_threads_local takes effect from any thread."""
    from threadpoolctl import ThreadpoolController

    setters = []
    for lib in ThreadpoolController().select(user_api="blas").lib_controllers:
        local = None
        if lib.internal_api == "openblas":
            names = ("openblas_set_num_threads_local", "scipy_openblas_set_num_threads_local",
                     "openblas_set_num_threads_local64_")
            local = next((getattr(lib.dynlib, n) for n in names if hasattr(lib.dynlib, n)), None)
        setters.append(local or lib.set_num_threads)
    return setters


class _ThreadBudget:
    """The backend's `threads` given to one pool at a time, so the two never oversubscribe.

    Steps of up to `invariant_tokens` tokens run numba kernels on `threads` threads while BLAS
    (float32 weights' row products) runs on the calling thread alone; longer steps (prefill) run
    sgemm on `threads` BLAS threads while numba (tile dequantization) runs on the calling thread
    alone. Either way at most `threads` threads compute at once: pools sized to all cores each
    compete with each other and with any other busy process for the cores, and sgemm waits for
    its slowest thread (bench/prefill_contention.py times prefill beside a busy neighbour).
    numba's count is per calling thread and BLAS's per process, so the budget is applied by the
    thread that runs the step, whenever the size it needs differs from the last one set.
    """

    def __init__(self, threads: int, invariant_tokens: int):
        import numba

        self.threads = min(threads or numba.config.NUMBA_NUM_THREADS,
                           numba.config.NUMBA_NUM_THREADS)
        self.invariant_tokens = invariant_tokens
        self._set_numba = numba.set_num_threads
        self._set_blas = _blas_setters()

    def enter(self, n_tokens: int) -> None:
        """Size both pools for a step of `n_tokens` tokens on the calling thread."""
        sgemm = n_tokens > self.invariant_tokens
        n_numba, n_blas = (1, self.threads) if sgemm else (self.threads, 1)
        if getattr(_NUMBA_SET, "n", 0) != n_numba:
            self._set_numba(n_numba)
            _NUMBA_SET.n = n_numba
        if _BLAS_SET[0] != n_blas:
            for set_blas in self._set_blas:
                set_blas(n_blas)
            _BLAS_SET[0] = n_blas


@dataclass
class CpuMatrix:
    """A repacked weight matrix (N, K): format 'q8' (affine int8 groups) or 'f32'."""

    fmt: str
    n: int
    k: int
    data: np.ndarray                 # q8: (N, K) i8 | f32: (K, N) f32 (W^T)
    scale: np.ndarray = field(default_factory=lambda: _EMPTY)   # (N, K/group) f32
    offset: np.ndarray = field(default_factory=lambda: _EMPTY)  # (N, K/group) f32 | (0, 0)
    group: int = 32
    src: QuantType = QuantType.F32   # the file's type (selects llama.cpp's activation rounding)


@dataclass
class CpuEmbedding:
    raw: np.ndarray                  # (vocab, row_bytes) u8, the file's own rows
    qtype: QuantType
    n_embd: int


def _format_of(t: TensorInfo) -> tuple[str, int]:
    spec = quants.block_spec(t.qtype)
    if spec.bits == 32:
        return "f32", 0
    _, _, _, group = quants.affine_rows(t.raw[: spec.type_size], t.qtype, (1, spec.block_size))
    return "q8", group


def _rows(t: TensorInfo) -> tuple[int, int]:
    """A tensor viewed as a (rows, K) matrix."""
    return int(np.prod(t.shape[:-1])), t.shape[-1]


def _q8_k_round_trip(x: np.ndarray) -> np.ndarray:
    """ggml's Q8_K rounding of x (T, K): per 256 values d = max/-127 (max = the value of largest
    magnitude), q = min(127, round(x/d))."""
    t, k = x.shape
    b = x.reshape(t, k // 256, 256)
    mx = np.take_along_axis(b, np.abs(b).argmax(-1)[..., None], -1)            # (T, K/256, 1)
    safe = np.where(mx == 0, np.float32(1), mx)
    iscale = np.where(mx == 0, np.float32(0), np.float32(-127.0) / safe).astype(np.float32)
    q = np.minimum(np.rint(iscale * b), 127)
    d = np.where(iscale == 0, np.float32(0), np.float32(1.0) / np.where(iscale == 0, 1, iscale))
    return (q * d.astype(np.float32)).reshape(t, k).astype(np.float32)


_ACT_ROUNDING = {QuantType.F16: "f16", QuantType.BF16: "bf16", QuantType.Q4_K: "q8_k",
                 QuantType.Q5_K: "q8_k", QuantType.Q6_K: "q8_k", QuantType.F32: None}


def _act_round_trip(x: np.ndarray, src: QuantType) -> np.ndarray:
    kind = _ACT_ROUNDING.get(src, "q8_0")
    if kind is None:
        return x
    if kind == "q8_k" and x.shape[-1] % 256 == 0:
        return _q8_k_round_trip(x)
    qt = {"f16": QuantType.F16, "bf16": QuantType.BF16}.get(kind, QuantType.Q8_0)
    return quants.dequantize(quants.quantize(x, qt), qt, x.shape)


class CpuBackend(CpuAttentionOps, Backend):
    name = "cpu"
    kv_types = BACKEND_KV_TYPES["cpu"]

    def __init__(self, threads: int = 0, act_quant: bool | str = False, invariant_tokens: int = 16,
                 capture_rules: bool = False):
        """threads: compute threads of a step (0 = numba's default, all cores), see
        `_ThreadBudget`. invariant_tokens: steps of up to this many tokens (decode, speculative
        verify) compute every row exactly as a single-token step would; longer steps (prefill
        chunks) go through sgemm. The engine passes its largest verify width.

        act_quant: round activations as llama.cpp's CPU matmuls do before the dot product
        (8-bit blocks: Q8_K for K-quant weights, Q8_0 for the others; f16/bf16 for f16/bf16
        weights). Off by default: float32 activations are the reference. Tests turn it on to
        compare with llama.cpp's logits on random-weight models, where 8-bit noise is amplified.
        act_quant="gpu" rounds the inputs of quantized matrices exactly as the CUDA backend's
        8-bit blocks do (cuda_layout.round_activations), for tight GPU-vs-CPU comparisons.

        capture_rules: raise CaptureRuleError on anything inside `run_step` that a captured CUDA
        graph cannot contain (capture_rules.py), so CPU tests catch it before a GPU run.
        """
        self.act_quant = act_quant
        self.invariant_tokens = invariant_tokens
        self.threads = _ThreadBudget(threads, invariant_tokens)
        self._tile: np.ndarray | None = None      # scratch of _matmul_tiles, grown once
        self._keys: tuple = ((), None)           # (step key, key rows) of _query_rows
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
        fmts = {_format_of(t) for t in tensors}
        return len(fmts) == 1 and len({t.shape[-1] for t in tensors}) == 1

    def load_matrix(self, tensors: list[TensorInfo]) -> CpuMatrix:
        if not self.can_fuse(tensors):
            raise ModelFormatError("cannot fuse tensors of different formats: "
                                   + ", ".join(f"{t.name} {t.qtype.name}" for t in tensors))
        fmt, _ = _format_of(tensors[0])
        k = tensors[0].shape[-1]
        n = sum(int(np.prod(t.shape[:-1])) for t in tensors)
        if fmt == "f32":
            w = np.concatenate([quants.dequantize(t.raw, t.qtype, _rows(t)) for t in tensors])
            return CpuMatrix("f32", n, k, np.ascontiguousarray(w.T),  # (K, N) f32
                             src=tensors[0].qtype)
        parts = [quants.affine_rows(t.raw, t.qtype, _rows(t)) for t in tensors]
        codes = np.concatenate([p[0] for p in parts])                    # (N, K) i8
        scale = np.ascontiguousarray(np.concatenate([p[1] for p in parts]), np.float32)
        offset = np.ascontiguousarray(np.concatenate([p[2] for p in parts]), np.float32)
        group = parts[0][3]
        if not offset.any():
            offset = _EMPTY
        return CpuMatrix("q8", n, k, np.ascontiguousarray(codes, np.int8), scale, offset, group,
                         tensors[0].qtype)

    def load_experts(self, tensor: TensorInfo) -> list[CpuMatrix]:
        n_expert = tensor.shape[0]
        per = tensor.raw.reshape(n_expert, -1)
        return [self.load_matrix([TensorInfo(f"{tensor.name}[{e}]", tensor.qtype,
                                             tensor.shape[1:], per[e])])
                for e in range(n_expert)]

    def upload_vector(self, host) -> np.ndarray:
        return np.ascontiguousarray(host, dtype=np.float32)

    def load_embedding(self, tensor: TensorInfo) -> CpuEmbedding:
        vocab, e = tensor.shape
        return CpuEmbedding(tensor.raw.reshape(vocab, -1), tensor.qtype, e)

    # ---------------------------------------------------------------- ops
    def embed(self, table: CpuEmbedding, ids, scale, out):
        rows = table.raw[ids]                                          # (T, row_bytes) u8
        out[...] = quants.dequantize(rows, table.qtype, (len(ids), table.n_embd))
        if scale != 1.0:
            out *= np.float32(scale)

    def rms_norm(self, x, w, eps, out):
        ms = np.square(x).sum(axis=-1) / np.float32(x.shape[-1])               # (...,) f32
        np.multiply(x, (1.0 / np.sqrt(ms + np.float32(eps)))[..., None], out=out)
        out *= w

    def matmul(self, x, w: CpuMatrix, out):
        # Steps of up to invariant_tokens tokens (decode, speculative verify) compute every row
        # exactly as a single-token step would; longer steps (prefill chunks) go through sgemm.
        invariant = x.shape[0] <= self.invariant_tokens
        self.threads.enter(x.shape[0])
        if self.act_quant == "gpu":
            if w.fmt == "q8":
                q, d = round_activations(x)
                x = (q.reshape(len(q), -1, 32) * d[..., None]).reshape(q.shape)
        elif self.act_quant:
            x = _act_round_trip(np.ascontiguousarray(x, dtype=np.float32), w.src)
        if w.fmt == "f32":
            if invariant:
                for t in range(x.shape[0]):   # one row at a time: the same BLAS call for any T
                    np.matmul(x[t:t + 1], w.data, out=out[t:t + 1])
            else:
                np.matmul(x, w.data, out=out)
            return
        x = np.ascontiguousarray(x, dtype=np.float32)
        if not invariant:
            self._matmul_tiles(x, w, out)
            return
        xsum = np.empty((x.shape[0], w.k // w.group), np.float32)
        K.group_sums(x, w.group, xsum)
        K.matmul_q8(x, xsum, w.data, w.scale, w.offset, w.group, out)

    def _matmul_tiles(self, x, w: CpuMatrix, out):
        """out = x @ W^T, W dequantized TILE_ROWS rows at a time into a reused scratch buffer."""
        if self._tile is None or self._tile.shape[1] < w.k:
            self._tile = np.empty((TILE_ROWS, w.k), np.float32)
        for r0 in range(0, w.n, TILE_ROWS):
            r1 = min(w.n, r0 + TILE_ROWS)
            tile = self._tile[: r1 - r0, : w.k]                             # (rows, K) f32
            K.dequantize_rows(w.data, w.scale, w.offset, w.group, r0, tile)
            np.matmul(x, tile.T, out=out[:, r0:r1])

    def add(self, a, b, out):
        np.add(a, b, out=out)

    def rope_table(self, n_ctx, n_dims, base):
        inv = base ** (-np.arange(0, n_dims, 2, dtype=np.float64) / n_dims)    # (n_dims/2,)
        ang = np.arange(n_ctx, dtype=np.float64)[:, None] * inv[None, :]      # (n_ctx, n_dims/2)
        return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)

    def rope(self, x, positions, table, neox):
        cos, sin = table[0][positions][:, None, :], table[1][positions][:, None, :]  # (T,1,d/2)
        half = cos.shape[-1]
        if neox:
            a, b = x[..., :half], x[..., half:2 * half]
        else:
            a, b = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
        a0 = a.copy()
        a[...] = a0 * cos - b * sin
        b[...] = a0 * sin + b * cos

    def glu(self, gate, up, activation, out):
        # out must not alias gate or up.
        if activation == "silu":
            np.negative(gate, out=out)
            np.exp(out, out=out)
            out += 1.0
            np.divide(gate, out, out=out)
        else:  # gelu_tanh: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
            g = gate
            np.multiply(g, g, out=out)
            out *= np.float32(0.044715)
            out += 1.0
            out *= g
            out *= np.float32(np.sqrt(2.0 / np.pi))
            np.tanh(out, out=out)
            out += 1.0
            out *= g
            out *= np.float32(0.5)
        out *= up

    def moe(self, x, router: CpuMatrix, gate, up, down, n_used, normalize, activation, out):
        T = x.shape[0]
        logits = np.empty((T, router.n), np.float32)
        self.matmul(x, router, logits)
        logits -= logits.max(axis=-1, keepdims=True)
        probs = np.exp(logits)
        probs /= probs.sum(axis=-1, keepdims=True)                          # (T, n_expert)
        top = np.argsort(-probs, axis=-1, kind="stable")[:, :n_used]        # (T, n_used)
        w = np.take_along_axis(probs, top, axis=-1)
        if normalize:
            w /= w.sum(axis=-1, keepdims=True)
        out[...] = 0.0
        f = gate[0].n
        hg = np.empty((1, f), np.float32)
        hu = np.empty((1, f), np.float32)
        ha = np.empty((1, f), np.float32)
        y = np.empty((1, x.shape[1]), np.float32)
        for t in range(T):
            xt = x[t: t + 1]
            for e, we in zip(top[t], w[t], strict=True):
                self.matmul(xt, gate[e], hg)
                self.matmul(xt, up[e], hu)
                self.glu(hg, hu, activation, ha)
                self.matmul(ha, down[e], y)
                out[t] += we * y[0]

    def argmax(self, logits, out):
        K.argmax_rows(logits, out)

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

    def download_step(self, device, host) -> None:
        host[: device.size] = device

    def record_tokens(self, ids, slots, positions, hist) -> None:
        real = slots >= 0
        hist[slots[real], positions[real]] = ids[real]

    def chosen_ids(self, records, out) -> None:
        out[:] = records[:, 0]

    def sample(self, logits, params, hist, out) -> None:
        cpu_sampling.sample_rows(logits, params, hist, out)
