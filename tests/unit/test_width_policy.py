"""The width policy (spec/width.py): the draft length maximizing tokens per unit time."""

from __future__ import annotations

import itertools

from service.engine.spec.width import (
    PRIOR_P,
    DepthAcceptance,
    best_draft_length,
    expected_tokens,
    linear_costs,
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
