"""Speculative sampling: verify drafts of a sampled request so the output follows the target's
distribution exactly. Pure numpy; every function works on any leading batch shape.

The engine's drafters are deterministic (point-mass proposals), for which the rule below
reduces to what the engine runs: accept the draft iff the row's own plain-sampling draw equals
it (service/engine/spec/chain.py gives the argument); that coupling also keeps the output
equal to plain seeded sampling token for token. The general rule here is for a drafter that
samples its proposals.

One draft token. The drafter proposed x drawn from its distribution q; the target's
distribution at that position is p. With uniforms u_a and u_d:

    accept x            if u_a * q(x) < p(x)        (i.e. with probability min(1, p(x) / q(x)))
    else emit y ~ r     r = normalize(max(0, p - q)), drawn by inverse CDF with u_d

Then P(emit y) = min(p(y), q(y)) + (1 - sum_z min(p(z), q(z))) * r(y) = p(y), since
sum_z max(0, p(z) - q(z)) = 1 - sum_z min(p(z), q(z)). A deterministic drafter (n-gram) has
q = one-hot(x): x is accepted with probability p(x), otherwise y is drawn from p without x.
If r is all zeros (p == q up to rounding, where a rejection cannot happen in exact arithmetic),
y is drawn from p.

A block. Drafts x_1..x_k with distributions q_1..q_k, target distributions p_1..p_{k+1} (row i
is the target after the seed and x_1..x_{i-1}; row k+1 follows all drafts). Drafts are tested
in order; the first rejection emits its resampled token and ends the block; when all k are
accepted, a bonus token is drawn from p_{k+1}. A step therefore emits n_accepted + 1 tokens,
the last of which is the next step's seed.

Random numbers. Every uniform comes from `counter_rng.counter_uniform(seed, index)`, keyed by
the request seed and the generated-token index t of the token it decides (0-based, the index
the plain sampler uses for that token), in three disjoint streams:

    u_draw(t)   = counter_uniform(seed, t)                 residual or bonus draw for token t
    u_accept(t) = counter_uniform(seed, ACCEPT_STREAM + t)  accept test of the draft at t
    u_propose(t)= counter_uniform(seed, PROPOSE_STREAM + t) a sampling drafter's draw at t

Each token index is decided by exactly one step, so no uniform is used twice, and the numbers
do not depend on how tokens were grouped into steps, on batching or on the backend: a seeded
request with the same drafts replays exactly. A block with no drafts draws its token from p
with u_draw(t), exactly what plain sampling with the same inverse CDF does. The streams must
differ: a drafter drawing x with u_draw(t) would correlate x with the residual draw and bias
the output (tests/unit/test_rejection.py shows the chi-square test catching it).
"""

from __future__ import annotations

import numpy as np

from service.backends.counter_rng import counter_uniforms

ACCEPT_STREAM = 1 << 62       # counter offset of the accept tests
PROPOSE_STREAM = 2 << 62      # counter offset a sampling drafter draws its tokens with


def sample_from(weights: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Inverse-CDF draw: the first i with cumsum(w)[i] > u * sum(w). weights (..., V) >= 0
    with a positive sum, u (...) in [0, 1) -> (...) int64. Zero-weight entries are never
    drawn (u * sum < sum, so the count of cdf entries <= u * sum stops at a positive one)."""
    w = np.asarray(weights, dtype=np.float64)
    cdf = np.cumsum(w, axis=-1)                                        # (..., V) f64
    x = np.asarray(u, dtype=np.float64)[..., None] * cdf[..., -1:]     # (..., 1)
    idx = np.count_nonzero(cdf <= x, axis=-1)                          # (...) int
    return np.minimum(idx, w.shape[-1] - 1).astype(np.int64)


def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """max(0, p - q), unnormalized (sample_from normalizes); p itself where that is all zeros.
    p, q (..., V) -> (..., V) f64."""
    p = np.asarray(p, dtype=np.float64)
    r = np.maximum(p - np.asarray(q, dtype=np.float64), 0.0)           # (..., V) f64
    empty = r.sum(axis=-1, keepdims=True) <= 0.0                       # (..., 1) bool
    return np.where(empty, p, r)


def accepts(p_x: np.ndarray, q_x: np.ndarray, u_accept: np.ndarray) -> np.ndarray:
    """u < min(1, p(x)/q(x)) without dividing: u * q(x) < p(x). (...) -> (...) bool."""
    return np.asarray(u_accept) * np.asarray(q_x) < np.asarray(p_x)


def verify_token(p: np.ndarray, q: np.ndarray, x: np.ndarray, u_accept: np.ndarray,
                 u_draw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One draft per row: p, q (..., V) distributions, x (...) draft ids drawn from q,
    uniforms (...). -> (token (...) int64, accepted (...) bool)."""
    x = np.asarray(x, dtype=np.int64)
    p_x = np.take_along_axis(np.asarray(p), x[..., None], axis=-1)[..., 0]     # (...)
    q_x = np.take_along_axis(np.asarray(q), x[..., None], axis=-1)[..., 0]     # (...)
    ok = accepts(p_x, q_x, u_accept)
    return np.where(ok, x, sample_from(residual(p, q), u_draw)), ok


def verify_chain(p: np.ndarray, q: np.ndarray, drafts: np.ndarray, u_accept: np.ndarray,
                 u_draw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A block of k drafts per row.

    p (..., k+1, V) target distributions, q (..., k, V) draft distributions, drafts (..., k)
    int, u_accept (..., k), u_draw (..., k+1). Returns n_accepted (...) int64 in 0..k and
    tokens (..., k+1) int64: drafts[:n] then the resampled (or bonus) token at n, -1 after."""
    p, q, drafts = np.asarray(p), np.asarray(q), np.asarray(drafts, dtype=np.int64)
    k = drafts.shape[-1]
    if p.shape[-2] != k + 1 or q.shape[-2] != k or p.shape[-1] != q.shape[-1]:
        raise ValueError(f"need p (..., {k + 1}, V) and q (..., {k}, V) for {k} drafts, got "
                         f"{p.shape} and {q.shape}")
    u_draw = np.asarray(u_draw)
    tok, ok = verify_token(p[..., :k, :], q, drafts, u_accept, u_draw[..., :k])  # (..., k)
    if k:   # n = index of the first rejection, k when none
        n = np.where(ok.all(axis=-1), k, np.argmin(ok, axis=-1))                 # (...)
    else:
        n = np.zeros(drafts.shape[:-1], np.int64)
    bonus = sample_from(p[..., k, :], u_draw[..., k])                             # (...)
    ends = np.concatenate([tok, bonus[..., None]], axis=-1)                      # (..., k+1)
    n_ = np.asarray(n, dtype=np.int64)[..., None]                                 # (..., 1)
    final = np.take_along_axis(ends, n_, axis=-1)                                 # (..., 1)
    pad = np.zeros((*drafts.shape[:-1], 1), np.int64)
    padded = np.concatenate([drafts, pad], axis=-1)                              # (..., k+1)
    slot = np.arange(k + 1)                                                       # (k+1,)
    out = np.where(slot < n_, padded, np.where(slot == n_, final, -1))           # (..., k+1)
    return n_[..., 0], out.astype(np.int64)


def chain_uniforms(seed: np.ndarray | int, t0: np.ndarray | int,
                   k: int) -> tuple[np.ndarray, np.ndarray]:
    """The uniforms of a block whose first draft is generated token t0: u_accept (..., k) for
    tokens t0..t0+k-1 and u_draw (..., k+1) for tokens t0..t0+k. seed, t0: ints or arrays of
    one shape (...)."""
    seed, t0 = np.broadcast_arrays(np.asarray(seed, dtype=np.uint64), np.asarray(t0))
    t = t0[..., None].astype(np.uint64) + np.arange(k + 1, dtype=np.uint64)      # (..., k+1)
    s = np.broadcast_to(seed[..., None], t.shape)
    u_draw = counter_uniforms(s.ravel(), t.ravel()).reshape(t.shape)
    ta = t[..., :k] + np.uint64(ACCEPT_STREAM)
    u_accept = counter_uniforms(s[..., :k].ravel(), ta.ravel()).reshape(ta.shape)
    return u_accept, u_draw


def propose_uniforms(seed: np.ndarray | int, t: np.ndarray) -> np.ndarray:
    """The uniforms a sampling drafter draws its token for generated index t with."""
    seed, t = np.broadcast_arrays(np.asarray(seed, dtype=np.uint64), np.asarray(t))
    idx = t.astype(np.uint64) + np.uint64(PROPOSE_STREAM)
    return counter_uniforms(seed.ravel(), idx.ravel()).reshape(idx.shape)
