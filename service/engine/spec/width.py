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

A step of several sequences (allocate_drafts): the j-th draft of sequence i adds
g_ij = prod_{m<j} p_i[m] expected tokens (non-increasing in j), and the step's time is the
measured cost of its total rows, cost[R] (R = base rows + drafts). The drafts taken are the m
largest gains, m maximizing

    (T0 + sum of the m largest g) / cost[R0 + m]      (ties: the smaller m)

(T0: the tokens the step commits without drafts, one per sequence; R0: its rows), so a draft
is taken only where it pays for the rows it adds at this batch size: on a step whose cost
grows with every row (a compute-bound batch) drafting stops, on one where rows are nearly free
it drafts in full. One sequence: best_draft_length with cost[k] = cost[R0 + k].

Making a draft costs time too: a model drafter runs a forward per drafted token (the drafts of
a step's sequences one after another), the n-gram lookup a few microseconds. With d the
drafting time per drafted token in plain steps (the engine measures it as it drafts), m drafts
cost cost[R0 + m] + d * m: a drafter nearly as dear as the target stops drafting unless its
drafts are almost always accepted.
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


def best_draft_length(p: Sequence[float], cost: Sequence[float], max_k: int,
                      draft_cost: float = 0.0) -> int:
    """argmax_k E(k) / (cost[k] + draft_cost * k) over 0..min(max_k, len(p), len(cost) - 1);
    ties: smaller k."""
    top = min(max_k, len(p), len(cost) - 1)
    best_k, best = 0, 1.0 / cost[0]
    for k in range(1, top + 1):
        value = expected_tokens(p, k) / (cost[k] + draft_cost * k)
        if value > best * (1.0 + 1e-9):
            best_k, best = k, value
    return best_k


def draft_gains(p: Sequence[float], k: int) -> list[float]:
    """g_j for j = 1..k: the expected tokens the j-th draft adds (prod_{m<j} p[m])."""
    out, run = [], 1.0
    for i in range(k):
        run *= p[i]
        out.append(run)
    return out


def allocate_drafts(rates: Sequence[Sequence[float]], rooms: Sequence[int], base_rows: int,
                    base_tokens: float, cost: Sequence[float], draft_cost: float = 0.0
                    ) -> list[int]:
    """Draft lengths of a step's speculating sequences (rates[i]: sequence i's acceptance per
    depth, rooms[i]: its most drafts) on top of `base_rows` rows committing `base_tokens`
    tokens, cost[R] the time of a step of R rows and `draft_cost` the time of making one draft
    (both in plain steps): the m largest gains, m maximizing expected tokens per unit of time
    (ties: the smaller m); rows past the table are not taken."""
    items = sorted((-g, i, j) for i, (p, room) in enumerate(zip(rates, rooms, strict=True))
                   for j, g in enumerate(draft_gains(p, min(room, len(p)))))
    best_m, total = 0, base_tokens
    best = base_tokens / cost[min(base_rows, len(cost) - 1)]
    for m, (neg, _, _) in enumerate(items, 1):
        if base_rows + m >= len(cost):
            break
        total -= neg
        value = total / (cost[base_rows + m] + draft_cost * m)
        if value > best * (1.0 + 1e-9):
            best_m, best = m, value
    k = [0] * len(rooms)
    for _, i, _ in items[:best_m]:
        k[i] += 1
    return k


def shrink_drafts(want: Sequence[int], spare: int) -> list[int]:
    """Draft lengths cut to fit `spare` rows: one token at a time off the longest draft (the
    later index on a tie) until sum(want) <= spare. Computed by level: every draft is clipped
    to the lowest level L whose cut is within the excess (a binary search), then the drafts
    left at L give one more token each, the later ones first, for the rest of the excess."""
    out = list(want)
    excess = sum(out) - max(spare, 0)
    if excess <= 0:
        return out

    def cut(level: int) -> int:
        return sum(w - level for w in out if w > level)

    lo, hi = 0, max(out)                 # cut(hi) = 0 <= excess
    while lo < hi:
        mid = (lo + hi) // 2
        if cut(mid) <= excess:
            hi = mid
        else:
            lo = mid + 1
    rest = excess - cut(lo)              # < the drafts at lo (cut(lo - 1) > excess)
    for i in reversed(range(len(out))):
        out[i] = min(out[i], lo)
        if rest and out[i] == lo:
            out[i] -= 1
            rest -= 1
    return out
