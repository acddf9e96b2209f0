"""service.engine.sampling: filters, seeded draws, temperature statistics, logprobs."""

from __future__ import annotations

import numpy as np
import pytest

from service.engine.sampling import Sampler, log_softmax, resolve_seed, top_logprobs
from service.engine.types import SamplingParams

OFF = dict(top_k=0, top_p=1.0, min_p=0.0)   # every filter disabled


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(np.asarray(x, np.float64) - np.max(x))
    return e / e.sum()


def random_logits(seed: int, n: int, vocab: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((n, vocab)) * 3).astype(np.float32)


# ---------------------------------------------------------------- determinism
def test_seeded_runs_repeat_and_seeds_differ():
    logits = random_logits(0, 50, 1000)

    def run(seed: int) -> list[int]:
        s = Sampler(SamplingParams(temperature=1.5, top_k=200, top_p=0.99, min_p=0.0),
                    1000, seed)
        return [s.sample(row, []) for row in logits]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_resolve_seed():
    assert resolve_seed(12345) == 12345
    assert resolve_seed(0) == 0
    fresh = {resolve_seed(None) for _ in range(8)}
    assert len(fresh) == 8 and all(0 <= s < 2**63 for s in fresh)


# ---------------------------------------------------------------- greedy equivalents
def test_greedy_is_argmax_lowest_id_on_ties():
    s = Sampler(SamplingParams(temperature=0.0), 1000, 0)
    for row in random_logits(1, 20, 1000):
        assert s.sample(row, []) == int(np.argmax(row))
    tied = np.zeros(1000, np.float32)
    tied[[17, 5, 900]] = 4.0
    assert s.sample(tied, []) == 5


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=1, top_p=1.0, min_p=0.0),
    SamplingParams(temperature=1.0, top_k=0, top_p=1e-6, min_p=0.0),
    SamplingParams(temperature=3.0, top_k=0, top_p=1.0, min_p=1.0),
], ids=["top_k=1", "top_p tiny", "min_p=1"])
def test_degenerate_filters_equal_greedy(params):
    s = Sampler(params, 5000, 3)
    for row in random_logits(2, 30, 5000):
        assert s.sample(row, []) == int(np.argmax(row))


# ---------------------------------------------------------------- filters
def test_top_k_keeps_exactly_the_k_largest():
    row = random_logits(3, 1, 10_000)[0]
    s = Sampler(SamplingParams(temperature=1.0, top_k=50, top_p=1.0, min_p=0.0), 10_000, 0)
    ids, probs = s.distribution(row, [])
    assert set(ids.tolist()) == set(np.argsort(-row)[:50].tolist())
    np.testing.assert_allclose(probs, softmax(row[ids]), rtol=1e-12)


def test_min_p_filters():
    # p relative to the max: 1, e^-1 = 0.37, e^-2 = 0.14, e^-3 = 0.05, e^-5 = 0.007
    row = np.array([0.0, -1.0, -2.0, -3.0, -5.0, -5.0], np.float32)
    s = Sampler(SamplingParams(temperature=1.0, min_p=0.1, top_k=0, top_p=1.0), 6, 11)
    ids, probs = s.distribution(row, [])
    assert sorted(ids.tolist()) == [0, 1, 2]
    np.testing.assert_allclose(probs[np.argsort(ids)], softmax(row[:3]), rtol=1e-12)
    drawn = {s.sample(row, []) for _ in range(2000)}
    assert drawn == {0, 1, 2}


def reference_nucleus(row: np.ndarray, top_p: float, min_p: float,
                      subset: np.ndarray | None = None) -> set[int]:
    """llama.cpp's order on fully sorted candidates (all ids, or `subset` after top-k):
    top-p, then min-p."""
    cand = np.arange(row.size) if subset is None else subset
    order = cand[np.argsort(-row[cand], kind="stable")]
    p = softmax(row[order])
    keep = int(np.searchsorted(np.cumsum(p), top_p)) + 1
    order, p = order[:keep], p[:keep]
    return set(order[p >= min_p * p[0]].tolist())


@pytest.mark.parametrize("top_p,min_p,scale", [
    (0.9, 0.0, 4.0),     # peaked: the first partition already holds the nucleus
    (0.9, 0.0, 0.3),     # flat: the nucleus search has to grow several times
    (0.5, 0.05, 2.0),    # min-p cuts first, nucleus found within its survivors
    (0.99, 0.2, 1.0),    # min-p is the binding filter
])
def test_top_p_and_min_p_match_sorted_reference(top_p, min_p, scale):
    vocab = 40_000
    row = (np.random.default_rng(4).standard_normal(vocab) * scale).astype(np.float32)
    s = Sampler(SamplingParams(temperature=0.7, top_k=0, top_p=top_p, min_p=min_p), vocab, 0)
    ids, probs = s.distribution(row, [])
    assert set(ids.tolist()) == reference_nucleus(row, top_p, min_p)
    assert len(ids) == len(set(ids.tolist()))
    t = np.float64(np.float32(0.7))           # parameters travel to the op as float32
    np.testing.assert_allclose(probs, softmax(row[ids].astype(np.float64) / t), rtol=1e-9)


def test_filters_compose_after_top_k():
    row = random_logits(5, 1, 3000)[0]
    s = Sampler(SamplingParams(temperature=1.0, top_k=100, top_p=0.8, min_p=0.02), 3000, 0)
    ids, probs = s.distribution(row, [])
    top100 = np.argsort(-row, kind="stable")[:100]
    assert set(ids.tolist()) == reference_nucleus(row, 0.8, 0.02, subset=top100)
    assert np.all(np.diff(ids) > 0)           # the draw's order: ascending ids


# ---------------------------------------------------------------- temperature statistics
def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_shapes_empirical_distribution(temperature):
    row = np.array([2.0, 1.0, 0.5, 0.0, -1.0], np.float32)
    s = Sampler(SamplingParams(temperature=temperature, **OFF), 5, 1234)
    n = 20_000
    counts = np.bincount([s.sample(row, []) for _ in range(n)], minlength=5)
    # df = 4: P(chi2 > 18.47) = 0.001 under the right distribution (the seed fixes the draw)
    assert chi_square(counts, softmax(row / temperature)) < 18.47
    # ...and the wrong temperatures are rejected by a wide margin
    for other in {0.5, 1.0, 2.0} - {temperature}:
        assert chi_square(counts, softmax(row / other)) > 200


# ---------------------------------------------------------------- repetition penalty
def test_repetition_penalty_math():
    row = np.array([2.0, -1.0, 0.5, 3.0, 1.0], np.float32)
    s = Sampler(SamplingParams(temperature=1.0, repetition_penalty=2.0, repeat_last_n=3, **OFF),
                5, 0)
    # window = last 3 ids = [0, 1, 1] -> distinct {0, 1}; id 3 is older and not penalised
    # 2.0 > 0 -> 2.0 / 2 = 1.0; -1.0 <= 0 -> -1.0 * 2 = -2.0
    ids, probs = s.distribution(row, [3, 0, 1, 1])
    want = np.array([1.0, -2.0, 0.5, 3.0, 1.0])
    np.testing.assert_allclose(probs[np.argsort(ids)], softmax(want), rtol=1e-12)
    assert row[0] == 2.0   # the caller's logits are untouched


def test_repetition_penalty_applies_to_greedy():
    row = np.array([3.0, 2.9, -4.0], np.float32)
    s = Sampler(SamplingParams(temperature=0.0, repetition_penalty=1.5), 3, 0)
    assert s.sample(row, []) == 0
    assert s.sample(row, [0]) == 1            # 3.0 / 1.5 = 2.0 < 2.9
    off = Sampler(SamplingParams(temperature=0.0, repeat_last_n=0, repetition_penalty=1.5), 3, 0)
    assert off.sample(row, [0]) == 0


# ---------------------------------------------------------------- logprobs
def test_log_softmax_normalised():
    row = random_logits(6, 1, 50_000)[0]
    lp = log_softmax(row)
    assert lp.dtype == np.float64
    assert abs(np.exp(lp).sum() - 1.0) < 1e-12
    np.testing.assert_allclose(lp, np.log(softmax(row)), rtol=1e-10)


def test_top_logprobs():
    row = np.array([0.5, 3.0, -1.0, 3.0, 2.0, 1.0], np.float32)
    lp = log_softmax(row)
    got = top_logprobs(row, chosen=4, k=3)
    assert got.token_id == 4 and got.logprob == pytest.approx(lp[4], abs=1e-12)
    assert [i for i, _ in got.top] == [1, 3, 4]          # tie between 1 and 3: lower id first
    values = [v for _, v in got.top]
    assert values == sorted(values, reverse=True)
    np.testing.assert_allclose(values, lp[[1, 3, 4]], atol=1e-12)
    assert top_logprobs(row, 2, 0).top == ()
    assert len(top_logprobs(row, 2, 100).top) == 6
    # the tie at the k-th place is resolved towards the lower id too
    assert [i for i, _ in top_logprobs(row, 0, 1).top] == [1]


def test_top_logprobs_ignore_sampling_filters():
    # logprobs describe the raw model distribution, whatever the sampler did
    row = random_logits(7, 1, 1000)[0]
    s = Sampler(SamplingParams(temperature=0.3, top_k=5, repetition_penalty=1.3), 1000, 9)
    tok = s.sample(row, [int(np.argmax(row))])
    assert top_logprobs(row, tok, 2).logprob == pytest.approx(log_softmax(row)[tok], abs=1e-12)


def test_logits_shape_checked():
    s = Sampler(SamplingParams(), 10, 0)
    with pytest.raises(ValueError):
        s.sample(np.zeros(9, np.float32), [])
    assert 0 <= s.sample(np.zeros(12, np.float32), []) < 10   # padded output rows are ignored
