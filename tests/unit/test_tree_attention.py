"""Tree verify rows in the CPU backend: masked attention against a dense numpy reference with
explicit masks, RoPE by position with K/V stored at another row, kv_move, ordinary rows
unchanged, and tree_verify's rows and compaction against hand cases."""

from __future__ import annotations

import numpy as np
import pytest

from service.backends.cpu.backend import CpuBackend
from service.engine.spec.tree import Tree, build_tree, chain_tree
from service.engine.spec.tree_verify import rows, step_fields

RNG = np.random.default_rng(11)


def dense_attention(q, k, v, visible, scale):
    """out[t, h] = softmax over the keys j with visible[t, j] (float64). q (T, H, D), k, v
    (n, Hkv, D), visible (T, n) bool."""
    T, H, _ = q.shape
    g = H // k.shape[1]
    out = np.zeros((T, H, v.shape[2]))
    for t in range(T):
        js = np.flatnonzero(visible[t])
        for h in range(H):
            s = k[js, h // g].astype(np.float64) @ q[t, h].astype(np.float64) * scale
            p = np.exp(s - s.max())
            out[t, h] = (p / p.sum()) @ v[js, h // g].astype(np.float64)
    return out


def visible_of(pos, lo, mask, window, n):
    """(T, n) bool: rows j < lo[t] inside the window by pos[t], and lo[t] + bit for mask bits."""
    vis = np.zeros((len(pos), n), bool)
    for t in range(len(pos)):
        for j in range(n):
            if j < lo[t]:
                vis[t, j] = not window or pos[t] - j < window
            elif j - lo[t] < 32:
                vis[t, j] = bool((int(mask[t]) >> (j - lo[t])) & 1)
    return vis


def filled_cache(be, n_ctx, n, hkv, D, slot=1):
    cache = be.new_kv_cache(1, 2, n_ctx, hkv, D, D, "f16", "f16")
    k = RNG.standard_normal((n, hkv, D)).astype(np.float32)
    v = RNG.standard_normal((n, hkv, D)).astype(np.float32)
    be.kv_write(cache, 0, k, v, np.full(n, slot, np.int32), np.arange(n, dtype=np.int32))
    return cache, k.astype(np.float16), v.astype(np.float16)


@pytest.mark.parametrize("window", [0, 4])
def test_masked_attention_equals_a_dense_reference(window):
    be = CpuBackend()
    H, hkv, D, committed = 4, 2, 8, 7
    parents = [-1, 0, 1, 0, 3, 1]                        # a root, two branches, depths 0..2
    n = committed + len(parents)
    cache, k, v = filled_cache(be, 24, n, hkv, D)
    depth = [0] * len(parents)
    bits = [0] * len(parents)
    for i, p in enumerate(parents):
        depth[i] = depth[p] + 1 if p >= 0 else 0
        bits[i] = (bits[p] if p >= 0 else 0) | 1 << i
    # tree rows, then one ordinary row of the same slot and one row whose lo is not 0 mid-prefix
    pos = np.array([committed + d for d in depth] + [n - 1, 5], np.int32)
    lo = np.array([committed] * len(parents) + [n, 3], np.int32)
    mask = np.array(bits + [0, 0b101], np.int32)
    T = len(pos)
    slots = np.ones(T, np.int32)
    q = RNG.standard_normal((T, H, D)).astype(np.float32)
    out = np.full((T, H, D), np.nan, np.float32)
    be.attention(q, cache, 0, slots, pos, n, window, 0.3, out, lo, mask)
    ref = dense_attention(q, k, v, visible_of(pos, lo, mask, window, n), 0.3)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)


def test_ordinary_rows_are_bit_identical_with_or_without_the_arrays():
    be = CpuBackend()
    n, H, hkv, D = 12, 4, 2, 8
    cache, _, _ = filled_cache(be, 16, n, hkv, D)
    for T in (3, 20):                                   # the per-query and the prefill paths
        pos = np.sort(RNG.integers(0, n, T)).astype(np.int32)
        slots = np.ones(T, np.int32)
        q = RNG.standard_normal((T, H, D)).astype(np.float32)
        plain = np.empty((T, H, D), np.float32)
        tree = np.empty((T, H, D), np.float32)
        be.attention(q, cache, 0, slots, pos, n, 5, 0.3, plain)
        be.attention(q, cache, 0, slots, pos, n, 5, 0.3, tree, pos + 1, np.zeros(T, np.int32))
        assert plain.tobytes() == tree.tobytes()


def test_a_tree_row_computes_what_plain_decoding_of_its_path_computes():
    """Node rows in DFS order (KV rows committed + i) and the same path decoded at consecutive
    rows give bit-identical attention outputs: the keys come in the same order."""
    be = CpuBackend()
    H, hkv, D, committed = 4, 2, 8, 5
    cache, k, v = filled_cache(be, 32, committed, hkv, D)
    kt = RNG.standard_normal((4, hkv, D)).astype(np.float32)     # nodes 0..3, parents -1,0,0,2
    vt = RNG.standard_normal((4, hkv, D)).astype(np.float32)
    be.kv_write(cache, 0, kt, vt, np.ones(4, np.int32), np.arange(5, 9, dtype=np.int32))
    q = RNG.standard_normal((1, H, D)).astype(np.float32)
    got = np.empty((1, H, D), np.float32)
    be.attention(q, cache, 0, np.ones(1, np.int32), np.array([7], np.int32), 9, 0, 0.3, got,
                 np.array([5], np.int32), np.array([0b1101], np.int32))     # node 3: 0, 2, 3
    path = [0, 2, 3]                                    # the same nodes at rows 5, 6, 7 of slot 0
    be.kv_write(cache, 0, k, v, np.zeros(committed, np.int32), np.arange(5, dtype=np.int32))
    be.kv_write(cache, 0, kt[path], vt[path], np.zeros(3, np.int32),
                np.arange(5, 8, dtype=np.int32))
    want = np.empty((1, H, D), np.float32)
    be.attention(q, cache, 0, np.zeros(1, np.int32), np.array([7], np.int32), 8, 0, 0.3, want)
    assert got.tobytes() == want.tobytes()


def test_rope_kv_rotates_by_position_and_stores_at_the_kv_row():
    be = CpuBackend()
    T, H, hkv, D = 3, 2, 1, 8
    table = be.rope_table(32, D, 10000.0)
    q = RNG.standard_normal((T, H, D)).astype(np.float32)
    k = RNG.standard_normal((T, hkv, D)).astype(np.float32)
    v = RNG.standard_normal((T, hkv, D)).astype(np.float32)
    pos, kv_rows, slots = (np.array(a, np.int32) for a in ([4, 5, 5], [4, 5, 6], [0, 0, 0]))
    c1 = be.new_kv_cache(1, 1, 16, hkv, D, D, "f16", "f16")
    q1, k1 = q.copy(), k.copy()
    be.rope_kv(q1, k1, v, None, None, 1e-6, pos, slots, table, False, c1, 0, kv_rows)
    c2 = be.new_kv_cache(1, 1, 16, hkv, D, D, "f16", "f16")
    q2, k2 = q.copy(), k.copy()
    be.rope(q2, pos, table, False)
    be.rope(k2, pos, table, False)
    be.kv_write(c2, 0, k2, v, slots, kv_rows)
    assert q1.tobytes() == q2.tobytes()
    assert c1.k[0].tobytes() == c2.k[0].tobytes() and c1.v[0].tobytes() == c2.v[0].tobytes()
    r6, r7 = c1.rows(0, [6, 7])
    assert c1.k[0][r6].any() and not c1.k[0][r7].any()


def test_kv_move_applies_the_moves_in_order():
    """Accepted nodes [0, 2, 3] at committed 10: rows 12 -> 11, then 13 -> 12 (row 12 is read
    by the first move before the second overwrites it). The cache is paged with a permuted
    block table: the moves are of logical rows."""
    be = CpuBackend()
    cache = be.new_kv_cache(2, 2, 16, 1, 4, 4, "f16", "f16", block_size=8)
    be.set_block_table(cache, np.array([[3, 0], [1, 2]], np.int32))
    rows = np.stack([cache.rows(s, np.arange(16)) for s in (0, 1)])     # (2, 16) pool rows
    for layer in range(2):
        for planes, off in ((cache.k, 0.0), (cache.v, 100.0)):
            planes[layer][rows] = (np.arange(32, dtype=np.float32).reshape(2, 16, 1, 1)
                                   + off + 1000 * layer)
    before = [a[rows] for a in (*cache.k, *cache.v)]                   # (2, 16, 1, 4) each
    be.kv_move(cache, np.array([1, 1], np.int32), np.array([12, 13], np.int32),
               np.array([11, 12], np.int32))
    for a, b in zip((c[rows] for c in (*cache.k, *cache.v)), before, strict=True):
        assert (a[1, 11] == b[1, 12]).all() and (a[1, 12] == b[1, 13]).all()
        assert (a[0] == b[0]).all() and (a[1, :11] == b[1, :11]).all()
        assert (a[1, 13:] == b[1, 13:]).all()


def test_tree_rows_hand_case():
    t = Tree(tokens=np.array([9, 5, 6, 7], np.int32), parents=np.array([-1, 0, 1, 0], np.int32),
             depths=np.array([0, 1, 2, 1], np.int32), columns=np.array([-1, 0, 0, 1], np.int32),
             scores=np.zeros(4))
    r = rows(t, 20)
    assert r.ids == [9, 5, 6, 7]
    assert r.positions == [20, 21, 22, 21]
    assert r.kv_positions == [20, 21, 22, 23]
    assert r.attn_lo == [20] * 4
    assert r.attn_mask == [0b1, 0b11, 0b111, 0b1001]
    chain = rows([9, 5, 6], 20)                          # ordinary rows
    assert chain == ([9, 5, 6], [20, 21, 22], [20, 21, 22], [21, 22, 23], [0, 0, 0])
    assert rows(chain_tree([9, 5, 6]), 20) == chain     # a single path stays ordinary
    assert step_fields([chain]) == {}
    f = step_fields([chain, r])
    assert f["attn_mask"] == [0, 0, 0, 1, 3, 7, 9] and f["attn_lo"][3:] == [20] * 4


def test_a_sixteen_node_tree_fits_the_mask():
    ids = np.arange(32, dtype=np.int64).reshape(8, 4)
    logp = np.log(np.tile([0.4, 0.3, 0.2, 0.1], (8, 1)))
    t = build_tree(1, ids, logp, 16)
    r = rows(t, 3)
    assert t.n == 16 and t.chain_length() == 8 and max(r.attn_mask) < 1 << 16
    assert all(m >> i & 1 for i, m in enumerate(r.attn_mask))
