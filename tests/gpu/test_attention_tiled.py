"""The query-tiled attention kernel of long steps (cuda/attention_tiled.cu) against the CPU
reference and the split kernel (attention.cu), on a paged cache with a permuted block table:
chunks after a prefix, several slots and padding rows in one step, sliding windows, GQA group
sizes 1, 3 and 4, head sizes 64 / 128 / 256, every KV type. And the property the scheduler
relies on: a row's bits do not depend on which other rows share its step or block."""

from __future__ import annotations

import numpy as np
import pytest

from service.backends.cpu.backend import CpuBackend

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

N_CTX, N_SLOTS, BLOCK = 600, 2, 16


def _backends():
    from service.backends.cuda.backend import CudaBackend

    tiled = CudaBackend(graphs=False, prefill_gemm_min_tokens=None)
    split = CudaBackend(graphs=False, prefill_gemm_min_tokens=None,
                        prefill_attention_min_tokens=None)
    assert tiled.prefill_attention_min_tokens == 32 and split.prefill_attention_min_tokens is None
    return tiled, split


def _caches(type_k, type_v, hkv, d, seed):
    """The same keys and values (positions 0..N_CTX-1 of both slots) in a CPU cache and two
    CUDA caches (tiled and split backends), all behind one permuted block table."""
    rng = np.random.default_rng(seed)
    cpu, (tiled, split) = CpuBackend(), _backends()
    caches = [be.new_kv_cache(1, N_SLOTS, N_CTX, hkv, d, d, type_k, type_v, block_size=BLOCK)
              for be in (cpu, tiled, split)]
    mb, nb = caches[0].max_blocks, caches[0].n_blocks
    table = rng.permutation(nb).astype(np.int32)[:N_SLOTS * mb].reshape(N_SLOTS, mb)
    for be, c in zip((cpu, tiled, split), caches, strict=True):
        be.set_block_table(c, table)
    for slot in range(N_SLOTS):
        for start in range(0, N_CTX, 200):
            n = min(200, N_CTX - start)
            k = rng.normal(0, 1, (n, hkv, d)).astype(np.float32)           # (n, Hkv, D)
            v = rng.normal(0, 1, (n, hkv, d)).astype(np.float32)
            pos = np.arange(start, start + n, dtype=np.int32)
            slots = np.full(n, slot, np.int32)
            cpu.kv_write(caches[0], 0, k, v, slots, pos)
            for be, c in zip((tiled, split), caches[1:], strict=True):
                with be.stream:              # the copies ordered before the kernels that read them
                    args = [cp.asarray(a) for a in (k, v, slots, pos)]
                be.kv_write(c, 0, *args)
    for be in (tiled, split):
        be.prepare(max_tokens=256, n_head=32, head_dim_v=d, n_ctx=N_CTX, n_embd=64)
    return (cpu, tiled, split), caches


def _run(be, cache, q, slots, pos, window, scale):
    """attention of the rows (q, slots, pos) on backend `be`; host (T, H, Dv) f32."""
    T, H, D = q.shape                                  # these tests use Dv = D
    if isinstance(be, CpuBackend):
        out = np.empty((T, H, D), np.float32)
        be.attention(q, cache, 0, slots, pos, N_CTX, window, scale, out)
        return out
    # Inputs and the poison go on the backend's stream (non-blocking: the null stream's copies
    # are not ordered before its kernels).
    out = be.zeros((T, H, D))
    with be.stream:
        out.fill(np.nan)                               # every row must be written
        qd, sd, pd = cp.asarray(q), cp.asarray(slots), cp.asarray(pos)
    be.attention(qd, cache, 0, sd, pd, N_CTX, window, scale, out)
    return be.to_host(out)


def _mixed_rows():
    """(slots, positions) of one step: 70 rows of slot 1 at 0..69, 30 rows of slot 0 at
    400..429 interleaved with them, 5 padding rows (slot -1)."""
    s = [1] * 70 + [0] * 30 + [-1] * 5
    p = list(range(70)) + list(range(400, 430)) + [0] * 5
    order = np.random.default_rng(3).permutation(len(s))
    return np.array(s, np.int32)[order], np.array(p, np.int32)[order]


SHAPES = [(8, 2, 64), (9, 3, 64), (32, 8, 128), (4, 1, 256)]      # (H, Hkv, D)
PAIRS = [("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "q4_0"), ("f16", "q4_0"),
         ("q8_0", "f16"), ("bf16", "bf16"), ("q5_1", "q5_0"), ("q5_0", "q4_1"), ("q4_1", "q5_1"),
         ("bf16", "q5_0")]
CASES = [(shape, ("f16", "f16")) for shape in SHAPES] + [(SHAPES[0], p) for p in PAIRS[1:]]


@pytest.mark.parametrize("shape,types", CASES)
def test_tiled_attention_against_cpu_and_the_split_kernel(shape, types):
    """Softmax sums in float32 in other orders on the three: 1e-5 of the output's scale (the
    split kernel's own bound against the CPU in test_kernels.py); a wrong key, mask, slot or
    tile is off by O(1)."""
    H, hkv, d = shape
    (cpu, tiled, split), caches = _caches(*types, hkv, d, seed=H + d)
    rng = np.random.default_rng(7)
    scale = 1.0 / np.sqrt(d)
    chunk = (np.zeros(150, np.int32), np.arange(100, 250, dtype=np.int32))   # after a prefix
    for slots, pos in (chunk, _mixed_rows()):
        q = rng.normal(0, 1, (len(pos), H, d)).astype(np.float32)             # (T, H, D)
        for window in (0, 100):
            ref = _run(cpu, caches[0], q, slots, pos, window, scale)
            got = _run(tiled, caches[1], q, slots, pos, window, scale)
            other = _run(split, caches[2], q, slots, pos, window, scale)
            bound = 1e-5 * np.abs(ref).max()
            assert np.abs(got - ref).max() <= bound, (window, "cpu")
            assert np.abs(got - other).max() <= bound, (window, "split kernel")
            assert np.all(got[slots < 0] == 0.0)


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[1], SHAPES[2]])
def test_a_rows_bits_do_not_depend_on_its_step(shape):
    """The same (query, slot, position) rows inside steps of other lengths, offsets, orders and
    neighbours give the same bits (the scheduler's chunks and the prefix cache rely on it)."""
    H, hkv, d = shape
    (_, tiled, _), caches = _caches("f16", "q8_0", hkv, d, seed=5)
    rng = np.random.default_rng(11)
    q_all = rng.normal(0, 1, (N_CTX, H, d)).astype(np.float32)             # one per position
    scale = 0.125
    for window in (0, 77):
        def rows(slots, pos, window=window):
            return _run(tiled, caches[1], q_all[pos], np.asarray(slots, np.int32),
                        np.asarray(pos, np.int32), window, scale)
        pos = np.arange(100, 250, dtype=np.int32)
        base = rows(np.zeros(150, np.int32), pos)
        longer = rows(np.zeros(190, np.int32), np.arange(60, 250, dtype=np.int32))[40:]
        assert np.array_equal(base.view(np.uint32), longer.view(np.uint32)), window
        perm = rng.permutation(150)
        shuffled = rows(np.zeros(150, np.int32), pos[perm])
        assert np.array_equal(shuffled.view(np.uint32), base[perm].view(np.uint32)), window
        # beside rows of the other slot and padding rows
        mixed_s = np.concatenate([np.ones(40, np.int32), np.zeros(150, np.int32),
                                  np.full(3, -1, np.int32)])
        mixed_p = np.concatenate([np.arange(500, 540, dtype=np.int32), pos,
                                  np.zeros(3, np.int32)])
        mixed = rows(mixed_s, mixed_p)
        assert np.array_equal(mixed[40:190].view(np.uint32), base.view(np.uint32)), window
