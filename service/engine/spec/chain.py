"""Chain verification: which drafted tokens the target model agrees with. Pure math.

A verify step feeds the target [seed, d1, ..., d_{w-1}] at consecutive positions and gets the
target's choice tgt[i] after each row i. Row 0's input (the seed) is always valid. Draft d_{i+1}
is accepted while it equals tgt[i]; the first disagreement ends the chain, and the target's
choice there (the *bonus* token) is exact, because every input before it was accepted.

    accept_n = 1 + max{ a : d_{i+1} == tgt[i] for all i < a }
    emitted  = d_1 .. d_{accept_n - 1}, then tgt[accept_n - 1] (the next seed)

The KV rows of the seed and the accepted drafts (accept_n rows) are kept; the rows after them
are stale and get overwritten by later steps, so rollback is just not advancing the position.
The emitted sequence is exactly what plain decoding produces, one token at a time.

The target's choice is made by the request's own sampling, greedy or not. Row i of a sequence
whose next token has index t chooses tgt[i] as plain decoding chooses token t + i: its own
temperature / top-k / top-p / min-p, the draw keyed by (request seed, t + i), and the
repetition penalty over the token history up to its own position, which the same step records
(seed and d1..di) before it samples. Whenever row i matters (d1..di were all accepted) its
inputs, logits (the step-size-invariant path makes a verify row's logits bit-identical to a
single step's) and draw are those of plain decoding at index t + i, so it picks the same token.
Hence, by induction over the steps, a seeded sampled request emits the tokens plain seeded
sampling emits, token for token, whatever was drafted.

Why this is rejection sampling. The drafters are deterministic (the n-gram lookup; the model
drafter's greedy chain), so the proposal q at a row is a point mass on the draft x. Speculative
sampling accepts x with probability min(1, p(x) / q(x)) = p(x) and, on rejection, samples from
normalize(max(0, p - q)) = p restricted to tokens other than x. Here x is accepted iff the row's
draw y ~ p equals x, which happens with probability p(x); given y != x, y is distributed as p
restricted to tokens other than x. Both match, so the output follows the target's distribution
(rejection.py has the general rule for a sampling drafter, and the chi-square tests;
tests/engine/test_spec_sampling.py checks this rule through the engine's step).
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
