"""Tree verify in the engine: drafting a tree, its step rows, accepting and compacting.

The math (building, masks, path following, compaction plans) is tree.py; this module turns it
into engine steps. A sequence with tree_budget > 0 gets, per decode step, a tree
of at most n nodes (n = the rows the plan gives it, <= its budget):

- drafting: a drafter with `candidates` (the model drafter) drafts the top-1 chain to depth
  tree_depth(n) and returns the top TREE_TOP_K tokens and log-probabilities at each depth;
  build_tree grows the best-first tree over them within n nodes (the chain first). Any other
  drafter (ngram) proposes one chain of n - 1 tokens: chain_tree.
- rows: node i of a sequence with `committed` KV rows is one step row with token tokens[i],
  RoPE position committed + depth[i], KV row committed + i, and attention to the committed rows
  plus its ancestors and itself: attn_lo = committed, attn_mask = those nodes' bits (n <= 16).
  Every node's row chooses its token as plain decoding would choose the token at its depth
  (greedy, or the request's seeded draw keyed by that token's index: spec/decode.choice).
- accepting: follow_path over the rows' choices; the accepted nodes' tokens and the bonus are
  emitted (exactly plain decoding's next tokens, tree.py says why), the committed count
  grows by the accepted node count, and when the path leaves the leading chain the accepted
  nodes' KV rows move to committed + depth (compaction_plan), every sequence's moves in ONE
  runner.move_kv after the step.

Sequences with chain drafts (lists) share the step as ordinary rows; `rows` gives them too.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from service.backends.step_format import TOP_MAX
from service.engine.runner.model_runner import ModelRunner
from service.engine.runner.step import StepOutput
from service.engine.scheduler.sequence import Sequence
from service.engine.spec.drafters import Drafter
from service.engine.spec.tree import (
    Tree,
    ancestor_mask,
    build_tree,
    chain_tree,
    compaction_plan,
    follow_path,
)

TREE_TOP_K = 4          # candidates per draft depth (siblings a node may get)


def tree_depth(n: int) -> int:
    """Draft depth for a tree of n nodes: half of the non-root nodes go to the top-1 chain, the
    rest to branches (a chain of all n - 1 would leave build_tree no room to branch)."""
    return max(1, n // 2)


def draft_tree(drafter: Drafter, seq: Sequence, n: int) -> Tree:
    """The tree of at most n >= 1 nodes to verify after seq's seed."""
    if n <= 1:
        return chain_tree([seq.seed])
    candidates = getattr(drafter, "candidates", None)
    if candidates is None:
        return chain_tree([seq.seed, *drafter.propose(seq, n - 1)])
    k = min(TREE_TOP_K, TOP_MAX, n - 1)
    chain, ids, logp = candidates(seq, tree_depth(n), k)
    if not chain:
        return chain_tree([seq.seed])
    return build_tree(seq.seed, ids, logp, n)


def n_rows(draft: list[int] | Tree) -> int:
    return draft.n if isinstance(draft, Tree) else len(draft)


class Rows(NamedTuple):
    """One sequence's rows of a step."""

    ids: list[int]
    positions: list[int]
    kv_positions: list[int]
    attn_lo: list[int]
    attn_mask: list[int]


def rows(draft: list[int] | Tree, committed: int) -> Rows:
    """The step rows of a chain draft [seed, d1, ..] or a single-path tree (ordinary rows:
    the same keys either way), or of a branching tree."""
    if isinstance(draft, Tree) and (draft.parents == np.arange(-1, draft.n - 1)).all():
        draft = [int(t) for t in draft.tokens]
    if not isinstance(draft, Tree):
        pos = list(range(committed, committed + len(draft)))
        return Rows(list(draft), pos, pos, [p + 1 for p in pos], [0] * len(draft))
    n = draft.n
    if n > 32:
        raise ValueError(f"a tree of {n} nodes does not fit a 32-bit attention mask")
    bits = ancestor_mask(draft.parents).astype(np.int64) @ (1 << np.arange(n, dtype=np.int64))
    return Rows([int(t) for t in draft.tokens], [committed + int(d) for d in draft.depths],
                list(range(committed, committed + n)), [committed] * n,
                [int(b) for b in bits])


def step_fields(segments: list[Rows]) -> dict[str, list[int]]:
    """StepInput's tree fields for the concatenated segments; {} when every row is ordinary
    (the step then goes through the runner exactly as before tree verify existed)."""
    if all(not any(s.attn_mask) for s in segments):
        return {}
    return {f: [v for s in segments for v in getattr(s, f)]
            for f in ("kv_positions", "attn_lo", "attn_mask")}


def commit(seq: Sequence, tree: Tree, out: StepOutput) -> tuple[int, np.ndarray, np.ndarray]:
    """Accept along the tree, emit, advance seq; returns (slot, src rows, dst rows) to move."""
    acc = follow_path(tree, np.asarray(out.token_ids))
    plan = compaction_plan(acc.nodes, seq.n_past)
    seq.n_past += len(acc.nodes)
    seq.count_step(len(acc.nodes))
    if tree.n > 1:
        seq.record_tree(tree.n - 1, len(acc.nodes) - 1)
    seq.emit(acc.emitted, [out.logprobs[i] for i in acc.nodes])
    return seq.slot, plan.src, plan.dst


def compact(runner: ModelRunner, moves: list[tuple[int, np.ndarray, np.ndarray]]) -> int:
    """Apply every sequence's KV moves in one runner.move_kv; returns the rows moved."""
    slots = [s for s, src, _ in moves for _ in range(len(src))]
    if not slots:
        return 0
    src = np.concatenate([m[1] for m in moves])
    dst = np.concatenate([m[2] for m in moves])
    runner.move_kv(slots, src, dst)
    return len(slots)
