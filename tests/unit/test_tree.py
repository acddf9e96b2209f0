"""Tree verification (DDTree) as pure functions: building, masks, path following, compaction."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.engine.spec.chain import accept_chain
from service.engine.spec.tree import (
    ancestor_mask,
    attention_mask,
    build_tree,
    candidates_from_logits,
    chain_tree,
    compaction_plan,
    follow_path,
    positions,
)

# Hand case: seed 100, three draft positions, two candidates each.
#   chain (0), (0,0), (0,0,0) scores -0.1, -0.6, -3.6; then best-first over the frontier
#   (0,1) -1.1, (1) -2.5, then (1)'s children (1,0) -3.0, (1,1) -3.5, then (0,0,1) -3.8, ...
IDS = np.array([[10, 11], [20, 21], [30, 31]])
LOGP = np.array([[-0.1, -2.5], [-0.5, -1.0], [-3.0, -3.2]])


def hand_tree(budget: int = 6):
    return build_tree(100, IDS, LOGP, budget)


def test_hand_tree_dfs_order_parents_depths():
    t = hand_tree()
    # DFS preorder: root, 10, 20, 30 (the chain), then 21 under 10, then 11 under the root
    assert t.tokens.tolist() == [100, 10, 20, 30, 21, 11]
    assert t.parents.tolist() == [-1, 0, 1, 2, 1, 0]
    assert t.depths.tolist() == [0, 1, 2, 3, 2, 1]
    assert t.columns.tolist() == [-1, 0, 0, 0, 1, 1]
    np.testing.assert_allclose(t.scores, [0, -0.1, -0.6, -3.6, -1.1, -2.5])
    assert t.chain_length() == 3
    assert all(t.parents[i] < i for i in range(1, t.n))


def test_budget_grows_best_first_after_the_chain():
    assert hand_tree(1).tokens.tolist() == [100]
    assert hand_tree(2).tokens.tolist() == [100, 10]
    assert hand_tree(4).tokens.tolist() == [100, 10, 20, 30]     # the chain, though (0,1) beats
    assert hand_tree(5).tokens.tolist() == [100, 10, 20, 30, 21]  # (0,0,0) on score
    assert hand_tree(7).tokens.tolist() == [100, 10, 20, 30, 21, 11, 20]   # (1,0) -3.0
    assert hand_tree(8).tokens.tolist() == [100, 10, 20, 30, 21, 11, 20, 21]
    assert hand_tree(9).tokens.tolist() == [100, 10, 20, 30, 31, 21, 11, 20, 21]  # (0,0,1)
    full = hand_tree(100)
    assert full.n == 1 + 2 + 4 + 8
    # no draft positions: only the root whatever the budget
    assert build_tree(5, np.zeros((0, 3), int), np.zeros((0, 3)), 8).tokens.tolist() == [5]


def test_build_tree_refuses_bad_candidates():
    with pytest.raises(ValueError, match="at least 1"):
        build_tree(1, IDS, LOGP, 0)
    with pytest.raises(ValueError, match="sorted"):
        build_tree(1, IDS, LOGP[:, ::-1], 4)
    with pytest.raises(ValueError, match="repeats"):
        build_tree(1, np.array([[3, 3]]), np.array([[-1.0, -2.0]]), 4)
    with pytest.raises(ValueError, match="same|one shape"):
        build_tree(1, IDS, LOGP[:2], 4)


def test_candidates_from_logits():
    logits = np.array([[1.0, 3.0, 3.0, 0.0], [0.0, 0.0, 5.0, -1.0]])
    ids, logp = candidates_from_logits(logits, 3)
    assert ids.tolist() == [[1, 2, 0], [2, 0, 1]]            # ties: the lower id first
    lse = np.log(np.exp(logits).sum(axis=1, keepdims=True))
    np.testing.assert_allclose(logp, np.take_along_axis(logits, ids, axis=1) - lse)
    rng = np.random.default_rng(1)
    big = rng.integers(-3, 3, (4, 50)).astype(np.float32)   # many ties
    ids, logp = candidates_from_logits(big, 7)
    for row, r_ids in zip(big, ids, strict=True):
        assert r_ids.tolist() == sorted(range(50), key=lambda i: (-row[i], i))[:7]
    t = build_tree(0, ids, logp, 12)                        # they feed build_tree as is
    assert t.n == 12
    with pytest.raises(ValueError):
        candidates_from_logits(big, 51)


def test_mask_rows_and_positions():
    t = hand_tree()
    m = attention_mask(t, committed=3)
    assert m.shape == (6, 9)
    assert m[:, :3].all()                                # everyone sees the committed prefix
    rows = ["".join("1" if v else "0" for v in r) for r in m[:, 3:]]
    assert rows == ["100000",      # root
                    "110000",      # 10
                    "111000",      # 20
                    "111100",      # 30
                    "110010",      # 21: root, 10, itself (not its sibling 20 or 30)
                    "100001"]      # 11: root, itself
    assert positions(t, 3).tolist() == [3, 4, 5, 6, 5, 4]
    with pytest.raises(ValueError, match="precede"):
        ancestor_mask(np.array([-1, 2, 0]))


def test_follow_path_along_the_chain_needs_no_compaction():
    t = hand_tree()
    target = np.array([10, 20, 30, 9, 0, 0])          # argmax at each node row
    acc = follow_path(t, target)
    assert acc.nodes == [0, 1, 2, 3] and acc.emitted == [10, 20, 30, 9]
    plan = compaction_plan(acc.nodes, committed=3)
    assert plan.src.size == 0 and plan.dst.size == 0
    acc = follow_path(t, np.array([7, 20, 30, 9, 0, 0]))  # root's argmax is no child: plain step
    assert acc.nodes == [0] and acc.emitted == [7]


def test_path_leaving_the_chain_and_its_compaction():
    t = hand_tree()
    # root -> 10 (node 1) -> 21 (node 4, off the chain), whose argmax 7 is the bonus
    acc = follow_path(t, np.array([10, 21, 99, 99, 7, 99]))
    assert acc.nodes == [0, 1, 4] and acc.emitted == [10, 21, 7]
    plan = compaction_plan(acc.nodes, committed=3)
    assert plan.src.tolist() == [7] and plan.dst.tolist() == [5]   # row 3+4 -> row 3+2
    # root -> 11 (node 5)
    acc = follow_path(t, np.array([11, 0, 0, 0, 0, 42]))
    assert acc.nodes == [0, 5] and acc.emitted == [11, 42]
    assert compaction_plan(acc.nodes, committed=10) == ([15], [11])


def test_compaction_in_order_with_overlapping_rows():
    # nodes [0, 2, 3]: row 2 is the source of one move and the destination of the next
    plan = compaction_plan([0, 2, 3], committed=0)
    assert plan.src.tolist() == [2, 3] and plan.dst.tolist() == [1, 2]
    kv = ["a", "b", "c", "d"]
    for s, d in zip(plan.src, plan.dst, strict=True):
        kv[d] = kv[s]
    assert kv[:3] == ["a", "c", "d"]
    with pytest.raises(ValueError):
        compaction_plan([1, 2], committed=0)


def test_chain_tree_is_chain_verify():
    rng = np.random.default_rng(0)
    for _ in range(200):
        w = int(rng.integers(1, 7))
        draft = rng.integers(0, 3, w).tolist()
        target = rng.integers(0, 3, w).tolist()
        acc = follow_path(chain_tree(draft), np.array(target))
        assert (len(acc.nodes), acc.emitted) == accept_chain(draft, target)
        assert compaction_plan(acc.nodes, 5).src.size == 0


# ---------------------------------------------------------------- properties
@st.composite
def candidates(draw, vocab: int):
    depth = draw(st.integers(0, 5))
    k = draw(st.integers(1, vocab))
    ids = np.array([draw(st.permutations(range(vocab)))[:k] for _ in range(depth)],
                   dtype=np.int64).reshape(depth, k)
    logp = np.array([sorted(draw(st.lists(st.sampled_from([-0.0, -0.5, -1.0, -2.0, -7.5]),
                                          min_size=k, max_size=k)), reverse=True)
                     for _ in range(depth)]).reshape(depth, k)
    return ids, logp


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_tree_shape_properties(data):
    ids, logp = data.draw(candidates(vocab=5))
    budget = data.draw(st.integers(1, 40))
    t = build_tree(9, ids, logp, budget)
    depth, k = ids.shape
    assert t.n == min(budget, sum(k ** d for d in range(depth + 1)))       # budget respected
    assert t.chain_length() == min(depth, budget - 1)                       # chain always there
    assert all(0 <= t.parents[i] < i and t.depths[i] == t.depths[t.parents[i]] + 1
               for i in range(1, t.n))                                     # DFS: parents first
    kids = t.children()
    for i in range(t.n):                                                   # siblings: columns up
        assert [int(t.columns[c]) for c in kids[i]] == sorted(int(t.columns[c]) for c in kids[i])
    # best-first: each node beyond the chain scores >= every child left out
    chosen = {(int(t.parents[i]), int(t.columns[i])) for i in range(1, t.n)}
    left_out = [t.scores[i] + logp[t.depths[i], c] for i in range(t.n) if t.depths[i] < depth
                for c in range(k) if (i, c) not in chosen]
    extra = t.scores[t.chain_length() + 1:]
    if left_out and extra.size:
        assert extra.min() >= max(left_out) - 1e-12


def _argmax_fn(key: int, vocab: int):
    """A random but fixed function prefix -> next token, standing in for the target's argmax."""
    def f(prefix: tuple[int, ...]) -> int:
        h = hashlib.blake2b(repr((key, prefix)).encode(), digest_size=8).digest()
        return int.from_bytes(h, "little") % vocab
    return f


@settings(max_examples=120, deadline=None)
@given(st.data())
def test_tree_decoding_is_greedy_decoding(data):
    """Losslessness: whatever the trees, verify with the ancestor mask + path following +
    compaction emits exactly the tokens of greedy decoding with the same argmax function, and
    leaves the KV rows of the committed tokens in order at their positions."""
    vocab = data.draw(st.integers(2, 5))
    f = _argmax_fn(data.draw(st.integers(0, 2 ** 32)), vocab)
    prompt = tuple(data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=3)))
    length = len(prompt) + 24
    greedy = list(prompt)
    while len(greedy) < length:
        greedy.append(f(tuple(greedy)))

    out = list(prompt) + [f(prompt)]          # the last token is the seed (KV row not written)
    kv = [(tok, p) for p, tok in enumerate(prompt)]   # (token, position) per KV row
    while len(out) < length:
        committed = len(out) - 1
        ids, logp = data.draw(candidates(vocab))
        tree = build_tree(out[-1], ids, logp, data.draw(st.integers(1, 24)))
        mask, pos = attention_mask(tree, committed), positions(tree, committed)
        del kv[committed:]
        kv.extend(zip(tree.tokens.tolist(), pos.tolist(), strict=True))    # rows committed + i
        target = np.empty(tree.n, np.int64)
        for i in range(tree.n):               # what the target sees through the mask
            seen = sorted((kv[r][1], kv[r][0]) for r in np.flatnonzero(mask[i]))
            assert [p for p, _ in seen] == list(range(pos[i] + 1))
            target[i] = f(tuple(tok for _, tok in seen))
        acc = follow_path(tree, target)
        plan = compaction_plan(acc.nodes, committed)
        for s, d in zip(plan.src.tolist(), plan.dst.tolist(), strict=True):
            kv[d] = kv[s]
        out.extend(acc.emitted)
        n_kept = committed + len(acc.nodes)
        assert kv[:n_kept] == [(tok, p) for p, tok in enumerate(out[:n_kept])]
    assert out[:length] == greedy
