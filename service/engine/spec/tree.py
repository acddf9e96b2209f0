"""Tree verification (DDTree): many draft continuations checked in one target forward. Pure math.

Candidates. For each of the next D positions the drafter gives its top-K tokens with their
log-probabilities, best first: cand_ids[d, c] and cand_logp[d, c] (row d is depth d + 1). A
node at depth d >= 1 is a path of candidate columns (c_1, .., c_d); its token is
cand_ids[d - 1, c_d] and its score the cumulative log-probability

    score(c_1, .., c_d) = sum_{j=1..d} cand_logp[j - 1, c_j]          (the root, depth 0: 0)

The root is the seed (the last target choice, its KV row not yet written).

Building (`build_tree`). The tree holds at most `budget` nodes, the root included (`budget` is
the number of rows the verify forward processes, like a chain's width). It first takes the top-1
chain (column 0 at every depth, as deep as the budget allows), then grows best-first: the
highest-scoring child of any node already in the tree joins next (ties: the lexicographically
smallest column path). Log-probabilities are <= 0, so a child never outscores its parent and
the nodes join in non-increasing score order: every node beyond the chain scores at least as
high as any child left out.

Flattening. Nodes are numbered in DFS preorder, children in column order, so every parent
precedes its children and the top-1 chain occupies rows 0..L: a path accepted along the chain
needs no KV compaction, exactly like chain verify. Node i's KV row is committed + i; its RoPE
position is committed + depth[i].

Masking (`attention_mask`). Row i may attend to the committed prefix, its ancestors and itself:
the target then computes, at node i, exactly what plain decoding computes after the path
root..i (same tokens at the same positions; no sibling is visible).

Following (`follow_path`). With target[i] the target's argmax at node i, walk from the root to
the child whose token equals target[parent]; siblings have distinct tokens, so the walk is
unique. The accepted nodes' tokens after the root are emitted, then target[last] (the bonus),
which is the next seed. Losslessness: each accepted child's token is what greedy decoding picks
after its ancestors' path, and the bonus is the target's argmax after the whole accepted path,
so the emitted tokens are exactly greedy decoding's next len(accepted) tokens.

Compaction (`compaction_plan`). The k-th accepted node (depth k) must end up in KV row
committed + k, the position its RoPE was computed for; it was written at committed + node.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


@dataclass(frozen=True)
class Tree:
    """A flattened draft tree, nodes in DFS preorder; node 0 is the root (the seed)."""

    tokens: np.ndarray    # (n,) int32 token of each node
    parents: np.ndarray   # (n,) int32 parent node index, -1 for the root; parents[i] < i
    depths: np.ndarray    # (n,) int32 0 for the root
    columns: np.ndarray   # (n,) int32 candidate column of each node in its row, -1 for the root
    scores: np.ndarray    # (n,) float64 cumulative log-probability, 0 for the root

    @property
    def n(self) -> int:
        return int(self.tokens.size)

    def children(self) -> list[list[int]]:
        """Child node indices of every node, in column order."""
        kids: list[list[int]] = [[] for _ in range(self.n)]
        for i in range(1, self.n):
            kids[int(self.parents[i])].append(i)
        return kids

    def chain_length(self) -> int:
        """Nodes of the top-1 chain after the root (rows 1..L, consecutive in DFS order)."""
        n = 1
        while n < self.n and self.parents[n] == n - 1 and self.columns[n] == 0:
            n += 1
        return n - 1


class Accepted(NamedTuple):
    """Result of path following: `nodes` starts with the root (0); accept_n = len(nodes)."""

    nodes: list[int]      # accepted node indices, increasing, nodes[k] at depth k
    emitted: list[int]    # tokens of nodes[1:], then the bonus token (the next seed)


class Compaction(NamedTuple):
    """KV row moves, absolute row indices, to apply in order (or gather all, then scatter)."""

    src: np.ndarray       # (m,) int32 rows written by the verify forward
    dst: np.ndarray       # (m,) int32 rows they belong in; dst < src, both increasing


# ---------------------------------------------------------------- building
def check_n_top(n_top: int, most: int) -> None:
    """A drafter's candidates() refuses a candidate count outside 1..most."""
    if not 1 <= n_top <= most:
        raise ValueError(f"n_top must be in 1..{most}, got {n_top}")


def no_candidates(n_top: int) -> tuple[list[int], np.ndarray, np.ndarray]:
    """candidates()' answer when nothing can be drafted: an empty chain, (0, n_top) ids and
    log-probabilities."""
    return [], np.zeros((0, n_top), np.int64), np.zeros((0, n_top), np.float64)


def candidates_from_logits(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k tokens per draft position with their log-probabilities, best first (equal
    logits: the lower id first, like the argmax kernels). logits (D, V) -> ids (D, k) int64,
    logp (D, k) f64 (log-softmax over the whole row)."""
    x = np.asarray(logits, dtype=np.float64)
    if x.ndim != 2 or not 1 <= k <= x.shape[1]:
        raise ValueError(f"need (D, V) logits and 1 <= k <= V, got {x.shape} and k={k}")
    lse = np.logaddexp.reduce(x, axis=1, keepdims=True)                  # (D, 1) f64
    kth = np.partition(x, x.shape[1] - k, axis=1)[:, x.shape[1] - k]      # (D,) k-th largest
    ids = np.empty((x.shape[0], k), np.int64)                             # (D, k) int64
    for d in range(x.shape[0]):   # sort only the entries >= the k-th largest (ties included)
        near = np.flatnonzero(x[d] >= kth[d])
        ids[d] = near[np.lexsort((near, -x[d, near]))[:k]]
    return ids, np.take_along_axis(x, ids, axis=1) - lse


def _check_candidates(cand_ids: np.ndarray, cand_logp: np.ndarray) -> None:
    if cand_ids.ndim != 2 or cand_ids.shape != cand_logp.shape:
        raise ValueError(f"candidates must be (D, K) ids and log-probs of one shape, got "
                         f"{cand_ids.shape} and {cand_logp.shape}")
    if cand_ids.shape[0] and cand_ids.shape[1] == 0:
        raise ValueError("each draft position needs at least one candidate (K >= 1)")
    if np.isnan(cand_logp).any():
        raise ValueError("candidate log-probabilities contain NaN")
    if (np.diff(cand_logp, axis=1) > 0).any():
        raise ValueError("candidate log-probabilities must be sorted best first in each row")
    for d, row in enumerate(cand_ids):
        if np.unique(row).size != row.size:
            raise ValueError(f"draft position {d} repeats a candidate token: {row.tolist()}")


def build_tree(seed: int, cand_ids: np.ndarray, cand_logp: np.ndarray, budget: int) -> Tree:
    """The best-first tree of at most `budget` nodes (root included) over candidates
    cand_ids (D, K) int and cand_logp (D, K) float, rows sorted best first."""
    cand_ids = np.asarray(cand_ids)
    cand_logp = np.asarray(cand_logp, dtype=np.float64)
    _check_candidates(cand_ids, cand_logp)
    if budget < 1:
        raise ValueError(f"tree budget must be at least 1 (the root), got {budget}")
    depth_max, k = cand_ids.shape

    score: dict[tuple[int, ...], float] = {(): 0.0}
    for d in range(min(depth_max, budget - 1)):                 # the top-1 chain first
        score[(0,) * (d + 1)] = score[(0,) * d] + float(cand_logp[d, 0])
    frontier: list[tuple[float, tuple[int, ...]]] = []

    def push_children(path: tuple[int, ...]) -> None:
        d = len(path)
        if d < depth_max:
            for c in range(k):
                child = (*path, c)
                if child not in score:
                    heapq.heappush(frontier, (-(score[path] + float(cand_logp[d, c])), child))

    for path in list(score):
        push_children(path)
    while len(score) < budget and frontier:
        neg, path = heapq.heappop(frontier)
        if path in score:
            continue
        score[path] = -neg
        push_children(path)
    return _flatten(seed, cand_ids, score)


def _flatten(seed: int, cand_ids: np.ndarray, score: dict[tuple[int, ...], float]) -> Tree:
    """DFS preorder of the chosen paths, children in column order."""
    order: list[tuple[int, ...]] = []
    index: dict[tuple[int, ...], int] = {}
    stack = [()]
    kids: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for path in score:
        if path:
            kids.setdefault(path[:-1], []).append(path)
    while stack:
        path = stack.pop()
        index[path] = len(order)
        order.append(path)
        stack.extend(sorted(kids.get(path, ()), reverse=True))    # lowest column on top
    n = len(order)
    tokens = np.empty(n, np.int32)                                # (n,) int32
    tokens[0] = seed
    for i, path in enumerate(order[1:], 1):
        tokens[i] = cand_ids[len(path) - 1, path[-1]]
    return Tree(
        tokens=tokens,
        parents=np.array([index[p[:-1]] if p else -1 for p in order], np.int32),   # (n,)
        depths=np.array([len(p) for p in order], np.int32),                        # (n,)
        columns=np.array([p[-1] if p else -1 for p in order], np.int32),           # (n,)
        scores=np.array([score[p] for p in order], np.float64))                    # (n,)


def chain_tree(tokens: list[int]) -> Tree:
    """A single-path tree [seed, d1, d2, ..]: chain verify as a special case of tree verify."""
    n = len(tokens)
    if n == 0:
        raise ValueError("a tree needs at least the seed")
    return Tree(tokens=np.asarray(tokens, np.int32), parents=np.arange(-1, n - 1, dtype=np.int32),
                depths=np.arange(n, dtype=np.int32),
                columns=np.array([-1] + [0] * (n - 1), np.int32), scores=np.zeros(n))


# ---------------------------------------------------------------- verify inputs
def ancestor_mask(parents: np.ndarray) -> np.ndarray:
    """(n, n) bool: [i, j] is True when node j is node i or one of its ancestors."""
    parents = np.asarray(parents)
    n = parents.size
    mask = np.zeros((n, n), dtype=bool)                           # (n, n) bool
    for i in range(n):
        p = int(parents[i])
        if i == 0 and p != -1 or i > 0 and not 0 <= p < i:
            raise ValueError(f"node {i} has parent {p}; parents must precede their children")
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    return mask


def attention_mask(tree: Tree, committed: int) -> np.ndarray:
    """(n, committed + n) bool over KV rows 0..committed+n-1: the prefix, then the tree rows
    (node j at row committed + j)."""
    prefix = np.ones((tree.n, committed), dtype=bool)             # (n, committed) bool
    return np.concatenate([prefix, ancestor_mask(tree.parents)], axis=1)


def positions(tree: Tree, committed: int) -> np.ndarray:
    """(n,) int32 RoPE positions: committed + depth."""
    return (committed + tree.depths).astype(np.int32)


# ---------------------------------------------------------------- accepting
def follow_path(tree: Tree, target: np.ndarray) -> Accepted:
    """Walk from the root along children whose token equals the target's argmax at their
    parent. target: (n,) int, the target's argmax at each node row."""
    target = np.asarray(target)
    if target.shape != (tree.n,):
        raise ValueError(f"target must be ({tree.n},), got {target.shape}")
    kids = tree.children()
    nodes = [0]
    while True:
        want = int(target[nodes[-1]])
        nxt = next((c for c in kids[nodes[-1]] if int(tree.tokens[c]) == want), None)
        if nxt is None:
            break
        nodes.append(nxt)
    emitted = [int(tree.tokens[i]) for i in nodes[1:]] + [int(target[nodes[-1]])]
    return Accepted(nodes, emitted)


def compaction_plan(nodes: list[int], committed: int) -> Compaction:
    """Moves that put accepted node nodes[k] (written at row committed + nodes[k]) into row
    committed + k. Empty when the path is a prefix of the top-1 chain (nodes[k] == k).

    In-place safety: nodes increase and nodes[k] >= k, so a move's destination is never the
    source of a later move; applying them in order is correct, and so is reading every source
    before writing any destination. Copying all at once in place is not (with nodes [0, 2, 3]
    row 2 is read by one move and written by the other)."""
    k = np.arange(len(nodes), dtype=np.int32)
    src = np.asarray(nodes, np.int32)
    if src.size == 0 or src[0] != 0 or (np.diff(src) <= 0).any():
        raise ValueError(f"accepted nodes must start at the root and increase, got {nodes}")
    moved = src != k
    return Compaction(src=(committed + src[moved]).astype(np.int32),
                      dst=(committed + k[moved]).astype(np.int32))
