"""Speculative sampling keeps the target distribution: hand cases, then chi-square tests.

Each distribution test draws N = 200,000 outputs with fixed seeds and requires a chi-square
p-value >= P_PASS = 1e-3 against the target distribution (a correct sampler would fail one
check in a thousand for a random seed; the seeds are fixed, so the outcome is deterministic).
The negative controls (biased acceptance rules, a shared random stream) must give p-values
below P_FAIL = 1e-12 on the same draws, so the test has the power to see a wrong rule.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from service.backends.counter_rng import counter_uniform
from service.engine.spec.rejection import (
    ACCEPT_STREAM,
    accepts,
    chain_uniforms,
    propose_uniforms,
    residual,
    sample_from,
    verify_chain,
    verify_token,
)

N, V, SEED = 200_000, 8, 20261203
P_PASS, P_FAIL = 1e-3, 1e-12


def chi2_sf(x: float, dof: int) -> float:
    """P(chi2_dof >= x) in closed form for integer dof (Abramowitz & Stegun 26.4.4, 26.4.5):
    even dof 2m: exp(-x/2) sum_{i<m} (x/2)^i / i!;  odd dof 2m+1: erfc(sqrt(x/2)) +
    sqrt(2/pi) exp(-x/2) sum_{r=1..m} x^(r-1/2) / (2r-1)!!. Terms in logs (x may be huge)."""
    if x <= 0:
        return 1.0
    if dof % 2 == 0:
        return sum(math.exp(-x / 2 + i * math.log(x / 2) - math.lgamma(i + 1))
                   for i in range(dof // 2))
    total = math.erfc(math.sqrt(x / 2))
    for r in range(1, (dof - 1) // 2 + 1):
        log_dfact = math.lgamma(2 * r + 1) - r * math.log(2) - math.lgamma(r + 1)
        total += math.exp(0.5 * math.log(2 / math.pi) - x / 2 + (r - 0.5) * math.log(x)
                          - log_dfact)
    return total


def chi2_pvalue(samples: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's test of integer samples against probs (cells with probability 0 must be
    empty; they are left out of the statistic and the degrees of freedom)."""
    counts = np.bincount(samples, minlength=probs.size)
    assert counts.size == probs.size
    support = probs > 0
    assert counts[~support].sum() == 0, "drew a token of probability 0"
    expected = probs[support] * samples.size
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    return chi2_sf(stat, int(support.sum()) - 1)


def test_chi2_sf_matches_tables():
    for x, dof, p in [(3.841459, 1, 0.05), (5.991465, 2, 0.05), (14.067140, 7, 0.05),
                      (24.321886, 7, 0.001), (18.307038, 10, 0.05), (79.081944, 60, 0.05)]:
        assert chi2_sf(x, dof) == pytest.approx(p, rel=1e-5), (x, dof)
    assert chi2_sf(1e6, 63) == 0.0 and chi2_sf(0.0, 3) == 1.0


# ---------------------------------------------------------------- hand cases
def test_accept_rule_and_residual_by_hand():
    p = np.array([0.5, 0.5, 0.0, 0.0])
    q = np.array([0.25, 0.75, 0.0, 0.0])
    # x = 1: accepted with probability p/q = 2/3
    assert verify_token(p, q, 1, 0.6, 0.9) == (1, True)          # 0.6 * 0.75 = 0.45 < 0.5
    tok, ok = verify_token(p, q, 1, 0.7, 0.9)                    # 0.525 >= 0.5: rejected
    assert (tok, ok) == (0, False)                               # residual [0.25, 0, 0, 0]
    # x = 0: p/q = 2, accepted whatever the uniform
    assert verify_token(p, q, 0, 0.999, 0.0) == (0, True)
    # a one-hot draft (n-gram): accepted with probability p(x), else drawn from p without x
    onehot = np.eye(4)[1]
    assert verify_token(p, onehot, 1, 0.49, 0.3) == (1, True)
    assert verify_token(p, onehot, 1, 0.51, 0.3) == (0, False)
    np.testing.assert_array_equal(residual(p, p), p)             # nothing left: falls back to p
    assert sample_from(np.array([0.0, 0.2, 0.0, 0.8]), np.array([0.0, 0.2, 0.2001, 0.99])
                       ).tolist() == [1, 3, 3, 3]                # zero cells never drawn
    assert not accepts(0.0, 0.0, 0.0)                            # p(x) = q(x) = 0: rejected


def test_chain_by_hand():
    p = np.array([[0.5, 0.5, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])   # (k+1, V), k = 2
    q = np.array([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]])                    # (k, V)
    n, out = verify_chain(p, q, [0, 2], [0.3, 0.0], [0.5, 0.5, 0.5])
    # draft 0 accepted (p = q); draft 2 has p = 0: rejected, resampled from p - q -> token 1
    assert int(n) == 1 and out.tolist() == [0, 1, -1]
    n, out = verify_chain(p, q, [0, 1], [0.3, 0.0], [0.5, 0.5, 0.5])   # q(1) = 0: accepted
    assert int(n) == 2 and out.tolist() == [0, 1, 2]                   # bonus from p[2]
    n, out = verify_chain(p[:1], q[:0], np.zeros(0, int), np.zeros(0), [0.7])
    assert int(n) == 0 and out.tolist() == [1]                         # no drafts: p's draw
    with pytest.raises(ValueError):
        verify_chain(p, q[:1], [0, 1], [0.1, 0.1], [0.1, 0.1, 0.1])


def test_uniform_streams_and_replay():
    ua, ud = chain_uniforms(7, 40, 3)
    assert ud.tolist() == [counter_uniform(7, t) for t in (40, 41, 42, 43)]
    assert ua.tolist() == [counter_uniform(7, ACCEPT_STREAM + t) for t in (40, 41, 42)]
    assert len({*ua.tolist(), *ud.tolist(), *propose_uniforms(7, np.arange(40, 44)).tolist()}) == 11
    # batched over requests: row i is request i's own block
    ua_b, ud_b = chain_uniforms(np.array([7, 8]), np.array([40, 3]), 3)
    np.testing.assert_array_equal(ua_b[0], ua)
    np.testing.assert_array_equal(ud_b[1], chain_uniforms(8, 3, 3)[1])
    # a block without drafts is plain inverse-CDF sampling with u_draw(t)
    probs = np.random.default_rng(0).dirichlet(np.ones(V))
    n, out = verify_chain(probs[None], np.zeros((0, V)), np.zeros(0, int), *chain_uniforms(5, 9, 0))
    assert out.tolist() == [int(sample_from(probs, np.array(counter_uniform(5, 9))))]


# ---------------------------------------------------------------- one draft: output ~ p
def _pairs() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(11)
    p1, q1 = rng.dirichlet(np.ones(V)), rng.dirichlet(np.ones(V))
    p_zero = rng.dirichlet(np.ones(V)) * (np.arange(V) % 3 != 0)
    q_zero = rng.dirichlet(np.ones(V)) * (np.arange(V) < 4)
    peaked = np.full(V, 0.1 / (V - 1))
    peaked[5] = 0.9
    return {"dirichlet": (p1, q1), "p with zeros": (p_zero / p_zero.sum(), q1),
            "q with zeros": (p1, q_zero / q_zero.sum()), "one-hot draft": (p1, np.eye(V)[2]),
            "p equals q": (q1, q1), "peaked p, uniform q": (peaked, np.full(V, 1 / V))}


def _one_draft(p: np.ndarray, q: np.ndarray, rule: str = "min(1, p/q)") -> np.ndarray:
    t = np.arange(N)                                    # N tokens of one seeded request
    pp, qq = np.broadcast_to(p, (N, V)), np.broadcast_to(q, (N, V))
    u_accept, u_draw = chain_uniforms(SEED, t, 1)
    u_accept, u_draw = u_accept[:, 0], u_draw[:, 0]
    x = sample_from(qq, u_draw if rule == "shared stream" else propose_uniforms(SEED, t))
    if rule in ("min(1, p/q)", "shared stream"):
        return verify_token(pp, qq, x, u_accept, u_draw)[0]
    p_x, q_x = p[x], q[x]
    ok = {"always accept": q_x > 0, "min(1, q/p)": u_accept * p_x < q_x}[rule]
    return np.where(ok, x, sample_from(residual(pp, qq), u_draw))


@pytest.mark.parametrize("name", list(_pairs()))
def test_one_draft_output_follows_p(name):
    p, q = _pairs()[name]
    pv = chi2_pvalue(_one_draft(p, q), p)
    print(f"{name}: p-value {pv:.3g}")
    assert pv >= P_PASS


# (The shared stream needs a residual of two tokens or more to show: with a peaked p and a
# uniform q the residual is one token, whatever uniform draws from it.)
@pytest.mark.parametrize("name,rule", [
    ("dirichlet", "always accept"), ("dirichlet", "min(1, q/p)"), ("dirichlet", "shared stream"),
    ("peaked p, uniform q", "always accept"), ("peaked p, uniform q", "min(1, q/p)")])
def test_negative_controls_fail(name, rule):
    p, q = _pairs()[name]
    pv = chi2_pvalue(_one_draft(p, q, rule), p)
    print(f"{name}, {rule}: p-value {pv:.3g}")
    assert pv < P_FAIL


# ---------------------------------------------------------------- blocks: sequences ~ target
def _markov(rng: np.random.Generator, zeros: bool) -> np.ndarray:
    """(V, V) next-token distributions given the previous token."""
    m = rng.dirichlet(np.full(V, 0.7), size=V)
    if zeros:
        m *= (np.arange(V)[None, :] + np.arange(V)[:, None]) % 4 != 1
    return m / m.sum(axis=1, keepdims=True)


def _generate(target: np.ndarray, draft: np.ndarray, k: int, length: int) -> np.ndarray:
    """N independent seeded requests, each decoding `length` tokens after token 0 in blocks of
    k drafts sampled from the draft chain; returns (N, length) tokens."""
    seeds = SEED + np.arange(N, dtype=np.uint64)
    out = np.full((N, length + k + 1), -1, np.int64)
    pos, last = np.zeros(N, np.int64), np.zeros(N, np.int64)
    while (live := np.flatnonzero(pos < length)).size:
        s, t, m = seeds[live], pos[live], live.size
        drafts = np.empty((m, k), np.int64)
        prev = last[live]
        for i in range(k):                                  # the drafter samples from q
            drafts[:, i] = sample_from(draft[prev], propose_uniforms(s, t + i))
            prev = drafts[:, i]
        context = np.concatenate([last[live, None], drafts], axis=1)     # (m, k+1)
        n, toks = verify_chain(target[context], draft[context[:, :k]], drafts,
                               *chain_uniforms(s, t, k))
        rows = np.broadcast_to(live[:, None], toks.shape)
        cols = t[:, None] + np.arange(k + 1)
        keep = toks >= 0
        out[rows[keep], cols[keep]] = toks[keep]
        last[live] = toks[np.arange(m), n]
        pos[live] = t + n + 1
    return out[:, :length]


@pytest.mark.parametrize("k,zeros", [(3, False), (2, True)])
def test_block_sequences_follow_the_target_chain(k, zeros):
    rng = np.random.default_rng(100 + k)
    target, draft = _markov(rng, zeros), _markov(rng, zeros)
    draft = 0.5 * draft + 0.5 * target        # a drafter that is right part of the time
    seqs = _generate(target, draft, k, length=5)
    joint = (target[0][:, None] * target).ravel()            # P(t0 = a, t1 = b)
    pv_joint = chi2_pvalue(seqs[:, 0] * V + seqs[:, 1], joint)
    marg4 = target[0] @ np.linalg.matrix_power(target, 4)    # P(t4)
    pv_marg = chi2_pvalue(seqs[:, 4], marg4)
    print(f"k={k}: joint(t0, t1) p-value {pv_joint:.3g}, marginal(t4) p-value {pv_marg:.3g}")
    assert pv_joint >= P_PASS and pv_marg >= P_PASS
    # the draft chain alone (every draft accepted) is far from the target: the test has power
    assert chi2_pvalue(_generate(draft, draft, k, length=2)[:, 1], target[0] @ target) < P_FAIL
