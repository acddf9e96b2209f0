"""Pure decode math: chain acceptance and the n-gram drafter."""

from __future__ import annotations

import random

import pytest

from service.engine.spec.chain import accept_chain
from service.engine.spec.drafters import NgramDrafter, create_drafter


def test_accept_chain_examples():
    # draft = [seed, d1, d2, d3]; target[i] = the model's choice after row i
    assert accept_chain([5, 6, 7, 8], [6, 7, 8, 9]) == (4, [6, 7, 8, 9])   # all accepted + bonus
    assert accept_chain([5, 6, 7, 8], [6, 1, 8, 9]) == (2, [6, 1])         # d2 rejected
    assert accept_chain([5, 6, 7, 8], [2, 7, 8, 9]) == (1, [2])            # nothing accepted
    assert accept_chain([5], [3]) == (1, [3])                              # plain decoding
    with pytest.raises(ValueError):
        accept_chain([1, 2], [3])


def test_accept_chain_equals_sequential_greedy():
    """Against a toy deterministic 'model' next(t) = f(prefix): chain verification emits exactly
    the tokens that one-at-a-time greedy decoding would, whatever the drafts are."""
    rng = random.Random(0)

    def next_token(prefix: tuple[int, ...]) -> int:
        return (sum(prefix) * 31 + len(prefix)) % 7

    for _ in range(300):
        prefix = (rng.randrange(7),)
        seq_greedy = list(prefix)
        while len(seq_greedy) < 30:
            seq_greedy.append(next_token(tuple(seq_greedy)))
        out = [prefix[0]]
        seed = next_token(prefix)
        out.append(seed)
        while len(out) < 30:
            w = rng.randrange(1, 6)
            draft = [seed] + [rng.randrange(7) if rng.random() < 0.5 else
                              seq_greedy[min(len(out) + i, 29)] for i in range(w - 1)]
            target = [next_token(tuple(out[:-1]) + tuple(draft[:i + 1])) for i in range(w)]
            n, emitted = accept_chain(draft, target)
            out.extend(emitted)
            seed = emitted[-1]
        assert out[:30] == seq_greedy


def test_ngram_drafter_proposes_the_continuation_of_the_last_match():
    d = NgramDrafter(ngram_size=3, min_match=1)
    hist = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3]
    assert d.lookup(hist, 3) == [4, 5, 9]
    assert d.lookup(hist, 1) == [4]
    # the most recent earlier occurrence wins
    assert d.lookup([7, 8, 1, 7, 8, 2, 7, 8], 1) == [2]
    # falls back to shorter n-grams, and proposes nothing without any match
    assert d.lookup([1, 2, 3, 9, 3], 2) == [9, 3]
    assert d.lookup([1, 2, 3, 4], 2) == []
    assert d.lookup([5], 3) == [] and d.lookup([1, 1], 0) == []


def test_ngram_drafter_min_match():
    assert NgramDrafter(3, min_match=2).lookup([1, 2, 3, 9, 3], 2) == []
    assert NgramDrafter(3, min_match=2).lookup([1, 2, 3, 9, 2, 3], 2) == [9, 2]


def test_ngram_drafter_never_proposes_past_the_history():
    d = NgramDrafter(ngram_size=2)
    assert d.lookup([4, 5, 4, 5], 10) == [4, 5]


def test_create_drafter():
    assert create_drafter("none", 3) is None
    assert isinstance(create_drafter("ngram", 2), NgramDrafter)


def test_draft_length_trades_acceptance_against_verify_cost():
    from service.engine.spec.width import best_draft_length, linear_costs

    def draft_length(p: float, alpha: float, max_k: int) -> int:   # one sequence, geometric
        return best_draft_length([p] * max_k, linear_costs(alpha, max_k), max_k)

    assert draft_length(0.0, 0.0, 7) == 0          # nothing is ever accepted
    assert draft_length(0.3, 0.0, 7) == 7          # verifying is free (a GPU): draft it all
    assert draft_length(0.95, 0.1, 7) == 7
    assert draft_length(0.5, 0.8, 3) == 0          # CPU-like cost, coin-flip drafts: plain
    assert draft_length(0.9, 0.5, 3) >= 2
    assert draft_length(0.99, 0.5, 0) == 0         # no room
    # the k it picks maximizes the modeled tokens per unit of cost over every allowed k
    # (p = 0.7, alpha = 0.3, 6 allowed has its best at k = 2: neither end of the range)
    def value(p: float, a: float, k: int) -> float:
        return sum(p ** i for i in range(k + 1)) / (1 + a * k)

    assert draft_length(0.7, 0.3, 6) == 2
    for p in (0.1, 0.4, 0.7, 0.9, 0.99):
        for a in (0.0, 0.3, 0.8):
            for room in (0, 1, 3, 6):
                k = draft_length(p, a, room)
                assert 0 <= k <= room
                best = max(value(p, a, j) for j in range(room + 1))
                assert value(p, a, k) == pytest.approx(best, rel=1e-12), (p, a, room, k)
