"""The width policy: per step, the draft length k (0 = plain decoding) that maximizes expected
committed tokens per unit of time. Pure decision math.

Acceptance per depth. p[i] is the running probability that draft i + 1 is accepted given that
drafts 1..i were (the chain stops at the first rejection, so deeper drafts are only tried when
the shallower ones passed). A verify of d drafts with a accepted tried depths 1..min(a + 1, d)
and passed depths 1..a. Each depth keeps exponentially decayed (passed, tried) counts over a
prior, so a request's own recent steps decide and an untried depth keeps the prior.

Expected tokens of k drafts: E(k) = 1 + sum_{i=1..k} prod_{j<=i} p[j-1]  (the bonus token plus
each accepted draft). With cost[k] the measured time of a step verifying k drafts (cost[0]: a
plain step), the policy picks

    k* = argmax_{0 <= k <= max_k} E(k) / cost[k]      (ties: the smaller k)

so k = 0 wins whenever no draft length pays for its verify rows: drafting never loses in
expectation. Without a measured table, cost[k] = 1 + alpha * k (spec/verify_cost.py).
"""

from __future__ import annotations

from collections.abc import Sequence

PRIOR_P = 0.6        # acceptance assumed at a depth not yet tried
PRIOR_WEIGHT = 2.0   # pseudo-trials behind the prior
DECAY = 0.8          # weight of the past at each verify of a depth


class DepthAcceptance:
    """Running acceptance per draft depth of one request."""

    __slots__ = ("passed", "tried")

    def __init__(self) -> None:
        self.passed: list[float] = []
        self.tried: list[float] = []

    def record(self, drafted: int, accepted: int) -> None:
        for i in range(min(accepted + 1, drafted)):
            if i == len(self.tried):
                self.passed.append(0.0)
                self.tried.append(0.0)
            self.passed[i] = DECAY * self.passed[i] + (1.0 if i < accepted else 0.0)
            self.tried[i] = DECAY * self.tried[i] + 1.0

    def rates(self, k: int) -> list[float]:
        """p[0..k-1]: the acceptance of depths 1..k given the shallower ones passed."""
        out = []
        for i in range(k):
            s, n = (self.passed[i], self.tried[i]) if i < len(self.tried) else (0.0, 0.0)
            out.append((s + PRIOR_P * PRIOR_WEIGHT) / (n + PRIOR_WEIGHT))
        return out


def linear_costs(alpha: float, max_k: int) -> list[float]:
    """cost[k] = 1 + alpha * k, in plain steps."""
    return [1.0 + alpha * k for k in range(max_k + 1)]


def expected_tokens(p: Sequence[float], k: int) -> float:
    """E(k): tokens a step of k drafts commits on average (the bonus token included)."""
    total, run = 1.0, 1.0
    for i in range(k):
        run *= p[i]
        total += run
    return total


def best_draft_length(p: Sequence[float], cost: Sequence[float], max_k: int) -> int:
    """argmax_k E(k) / cost[k] over 0..min(max_k, len(p), len(cost) - 1); ties: smaller k."""
    top = min(max_k, len(p), len(cost) - 1)
    best_k, best = 0, 1.0 / cost[0]
    for k in range(1, top + 1):
        value = expected_tokens(p, k) / cost[k]
        if value > best * (1.0 + 1e-9):
            best_k, best = k, value
    return best_k
