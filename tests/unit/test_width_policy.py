"""The width policy (spec/width.py): the draft length maximizing tokens per unit time."""

from __future__ import annotations

import itertools
import random

from service.engine.spec.width import (
    PRIOR_P,
    DepthAcceptance,
    allocate_drafts,
    best_draft_length,
    expected_tokens,
    linear_costs,
    shrink_drafts,
)


def test_expected_tokens():
    assert expected_tokens([0.5, 0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.5, 0.5, 0.5], 3) == 1 + 0.5 + 0.25 + 0.125
    assert expected_tokens([1.0, 0.0, 1.0], 3) == 2.0     # nothing past a sure rejection


def test_picks_the_argmax_by_brute_force():
    grid = [0.0, 0.2, 0.5, 0.8, 0.95]
    for p in itertools.product(grid, repeat=3):
        for cost in ([1.0, 1.1, 1.5, 3.0], [1.0, 1.3, 1.6, 1.9], [1.0, 1.0, 1.0, 1.0],
                     [1.0, 2.5, 2.6, 2.7]):
            values = [expected_tokens(p, k) / cost[k] for k in range(4)]
            k = best_draft_length(p, cost, 3)
            assert values[k] >= max(values) * (1 - 1e-9)
            assert all(values[j] < values[k] * (1 + 1e-9) for j in range(k))  # smallest argmax


def test_low_acceptance_gives_zero_and_high_gives_full_width():
    costs = linear_costs(0.2, 7)
    assert best_draft_length([0.1] * 7, costs, 7) == 0
    assert best_draft_length([0.95] * 7, costs, 7) == 7
    assert best_draft_length([0.9, 0.9, 0.0, 0.9], linear_costs(0.1, 4), 4) == 2
    assert best_draft_length([0.9] * 7, costs, 3) == 3              # capped by room
    assert best_draft_length([0.9] * 7, costs, 0) == 0
    # a verify that costs two plain steps needs more than one token from its drafts
    assert best_draft_length([0.9] * 3, [1.0, 2.0, 2.0, 2.0], 3) == 3
    assert best_draft_length([0.4] * 3, [1.0, 2.0, 2.0, 2.0], 3) == 0


def test_depth_acceptance_tracks_where_chains_break():
    d = DepthAcceptance()
    assert d.rates(3) == [PRIOR_P] * 3
    for _ in range(20):
        d.record(4, 1)           # depth 1 always passes, depth 2 always fails, 3-4 untried
    p = d.rates(4)
    assert p[0] > 0.85 and p[1] < 0.2 and p[2] == p[3] == PRIOR_P
    assert best_draft_length(p, linear_costs(0.1, 4), 4) == 1
    for _ in range(20):
        d.record(2, 0)
    assert d.rates(1)[0] < 0.2
    assert best_draft_length(d.rates(4), linear_costs(0.3, 4), 4) == 0


def brute_force(rates, rooms, base_rows, base_tokens, cost):
    """The best tokens per unit of time over every draft-length vector (each within its room
    and the table): value and the smallest total drafts reaching it."""
    best, best_m = -1.0, None
    for ks in itertools.product(*(range(r + 1) for r in rooms)):
        rows = base_rows + sum(ks)
        if rows >= len(cost):
            continue
        gained = sum(expected_tokens(p, k) - 1 for p, k in zip(rates, ks, strict=True))
        value = (base_tokens + gained) / cost[rows]
        if value > best * (1 + 1e-9) or (abs(value - best) <= best * 1e-9 and sum(ks) < best_m):
            best, best_m = max(best, value), sum(ks)
    return best, best_m


def test_allocation_is_the_best_split_of_the_step_by_brute_force():
    """allocate_drafts reaches the best expected tokens per unit of time of any choice of
    draft lengths, with the fewest drafts among the best, on flat, concave, linear and steep
    step-cost tables at several base sizes."""
    grid = (0.1, 0.5, 0.8, 0.95)
    tables = ([1.0] * 12, [1.0 + 0.05 * r for r in range(12)], [float(r) for r in range(12)],
              [1.0, 1.0, 1.0, 1.0, 1.0, 2.5, 2.6, 2.7, 2.8, 4.0, 4.1, 4.2],
              [1.0 + 0.3 * max(0, r - 1) for r in range(12)])
    for p0, p1 in itertools.product(grid, repeat=2):
        rates = [[p0, p0 * 0.9, p0 * 0.8], [p1, p1, p1]]
        for cost in tables:
            for base in (2, 4, 6):
                k = allocate_drafts(rates, [3, 3], base, 2.0, cost)
                rows = base + sum(k)
                gained = sum(expected_tokens(p, n) - 1 for p, n in zip(rates, k, strict=True))
                got = (2.0 + gained) / cost[rows]
                best, best_m = brute_force(rates, [3, 3], base, 2.0, cost)
                assert got >= best * (1 - 1e-9), (p0, p1, cost, base, k)
                assert sum(k) == best_m, (p0, p1, cost, base, k)


def test_one_sequence_allocation_is_best_draft_length():
    grid = [0.0, 0.2, 0.5, 0.8, 0.95]
    for p in itertools.product(grid, repeat=3):
        for cost in ([1.0, 1.0, 1.1, 1.5, 3.0], [1.0, 1.0, 1.3, 1.6, 1.9], [1.0] * 5):
            got = allocate_drafts([list(p)], [3], 1, 1.0, cost)
            assert got == [best_draft_length(p, cost[1:], 3)], (p, cost)


def test_drafting_stops_where_the_batch_makes_rows_dear():
    """The same acceptance drafts in full while a step's rows are nearly free (a small batch
    on a GPU) and not at all once each row costs its share (a compute-bound batch)."""
    gpu = [1.0] * 17 + [1.0 + (r - 16) / 16 for r in range(17, 129)]   # flat to 16, then linear
    rates = [[0.7] * 3] * 4
    assert allocate_drafts(rates, [3] * 4, 4, 4.0, gpu) == [3, 3, 3, 3]
    wide = [[0.7] * 3] * 64
    assert allocate_drafts(wide, [3] * 64, 64, 64.0, gpu) == [0] * 64
    # rows past the table are never taken; the largest gains first (every first draft)
    assert allocate_drafts(rates, [3] * 4, 4, 4.0, [1.0] * 10) == [2, 1, 1, 1]   # 5 rows left
    assert allocate_drafts([], [], 3, 3.0, gpu) == []


def test_shrink_drafts_is_the_one_token_at_a_time_rule():
    """shrink_drafts (by level) equals taking one token at a time off the longest draft, the
    later on a tie, over every draft vector of up to 4 sequences of 0..4 drafts and every
    room, and on random 64-sequence steps."""
    def one_at_a_time(want, spare):
        want = list(want)
        while sum(want) > spare:
            i = max(range(len(want)), key=lambda j: (want[j], j))
            want[i] -= 1
        return want

    cases = [(w, s) for k in range(5) for w in itertools.product(range(5), repeat=k)
             for s in range(18)]
    rng = random.Random(0)
    cases += [([rng.randrange(8) for _ in range(64)], rng.randrange(200)) for _ in range(300)]
    for want, spare in cases:
        got = shrink_drafts(want, spare)
        assert got == one_at_a_time(want, spare), (want, spare)
        assert sum(got) == min(sum(want), spare)


def test_a_dear_drafter_drafts_only_where_its_drafts_pay_for_themselves():
    """Making drafts costs draft_cost plain steps each: drafts that pay for their verify rows
    alone stop paying once the drafter's own time counts, and a drafter as dear as the target
    never drafts, even when every draft is accepted (k + 1 tokens for 1 + alpha k + k steps)."""
    cost = linear_costs(0.15, 8)
    half = [0.5] * 4
    assert allocate_drafts([half], [4], 1, 1, cost) == [2]
    assert allocate_drafts([half], [4], 1, 1, cost, draft_cost=0.0) == [2]
    assert allocate_drafts([half], [4], 1, 1, cost, draft_cost=0.3) == [1]
    assert allocate_drafts([half], [4], 1, 1, cost, draft_cost=1.0) == [0]
    assert allocate_drafts([[1.0] * 4], [4], 1, 1, cost) == [4]
    assert allocate_drafts([[1.0] * 4], [4], 1, 1, cost, draft_cost=1.0) == [0]
    assert allocate_drafts([[0.99] * 4, [0.2] * 4], [4, 4], 2, 2, linear_costs(0.05, 12),
                           draft_cost=0.1) == [4, 0]


def test_draft_cost_is_priced_per_draft_by_brute_force():
    """allocate_drafts with a drafting cost is the best split when each draft adds draft_cost
    to the step's time (brute force over every draft-length vector), and one sequence's
    allocation is best_draft_length's with the same cost."""
    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(1, 3)
        rates = [[rng.choice([0.1, 0.4, 0.7, 0.9, 1.0]) for _ in range(3)] for _ in range(n)]
        rooms = [rng.randint(0, 3) for _ in range(n)]
        table = linear_costs(rng.choice([0.0, 0.1, 0.3]), 12)
        dc = rng.choice([0.0, 0.05, 0.3, 1.0])
        priced = [c + dc * max(0, r - n) for r, c in enumerate(table)]
        best, best_m = brute_force(rates, rooms, n, n, priced)
        k = allocate_drafts(rates, rooms, n, n, table, dc)
        gained = sum(expected_tokens(p, ki) - 1 for p, ki in zip(rates, k, strict=True))
        assert abs((n + gained) / priced[n + sum(k)] - best) <= best * 1e-9
        assert sum(k) == best_m
        if n == 1:
            per = [table[1 + j] for j in range(4)]
            assert k[0] == best_draft_length(rates[0][:rooms[0]], per, rooms[0], dc)
