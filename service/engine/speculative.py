"""Greedy chain verification: which drafted tokens the target model agrees with. Pure math.

A verify step feeds the target [seed, d1, ..., d_{w-1}] at consecutive positions and gets the
target's choice tgt[i] after each row i. Row 0's input (the seed) is always valid. Draft d_{i+1}
is accepted while it equals tgt[i]; the first disagreement ends the chain, and the target's
choice there (the *bonus* token) is exact, because every input before it was accepted.

    accept_n = 1 + max{ a : d_{i+1} == tgt[i] for all i < a }
    emitted  = d_1 .. d_{accept_n - 1}, then tgt[accept_n - 1] (the next seed)

The KV rows of the seed and the accepted drafts (accept_n rows) are kept; the rows after them
are stale and get overwritten by later steps, so rollback is just not advancing the position.
The emitted sequence is exactly what plain greedy decoding produces, one token at a time.
"""

from __future__ import annotations

from collections.abc import Sequence


def accept_chain(draft: Sequence[int], target: Sequence[int]) -> tuple[int, list[int]]:
    """(accept_n, emitted) for draft = [seed, d1..], target = target choice after each row."""
    if len(draft) != len(target) or not draft:
        raise ValueError("draft and target must be non-empty and of equal length")
    n = 1
    while n < len(draft) and draft[n] == target[n - 1]:
        n += 1
    return n, [*draft[1:n], target[n - 1]]


def draft_length(p: float, alpha: float, max_k: int) -> int:
    """How many tokens to draft, given the acceptance rate p of recent drafts and the cost of
    a verify step relative to a plain step, 1 + alpha * k for k drafted tokens.

    Under a geometric model (each draft accepted with probability p, given the previous ones
    were), k drafts commit 1 + p + p^2 + ... + p^k tokens on average; we pick the k that
    maximizes tokens per unit of cost, 0 meaning plain decoding:

        k* = argmax_k (1 + sum_{i=1..k} p^i) / (1 + alpha * k),   0 <= k <= max_k
    """
    best_k, best, expected = 0, 1.0, 1.0
    for k in range(1, max_k + 1):
        expected += p ** k
        value = expected / (1.0 + alpha * k)
        if value > best:
            best_k, best = k, value
    return best_k
