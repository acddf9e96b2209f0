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
