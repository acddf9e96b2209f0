"""train-drafter's hand-written backward passes (service/tools/eagle3_head.py, eagle3_ops.py)
against central finite differences of the loss, in float64 on tiny shapes: every trained tensor,
at unroll depths 1 and 3 (the training-time-test chain, whose steps read the previous step's
output and attend to its rows), with and without the pre-fc norm and the normed residual, a
reduced draft vocabulary and grouped heads; padding and unlabeled rows weighted 0; with hard
labels and with soft ones (a distribution over a few draft ids per row)."""

from __future__ import annotations

import numpy as np
import pytest

from service.model.eagle3 import Eagle3Spec
from service.tools.eagle3_head import Batch, Eagle3Head, trained_names
from service.tools.eagle3_ops import attention_forward, cross_entropy, soft_cross_entropy

E, ET, H, HKV, HD, F, V, VD, B, T = 8, 6, 4, 2, 4, 12, 20, 10, 2, 7
EPS = 1e-6


def tiny_spec(**flags) -> Eagle3Spec:
    return Eagle3Spec(
        n_embd=E, n_embd_target=ET, target_layers=(0, 1, 2), n_head=H, n_head_kv=HKV,
        head_dim=HD, n_ff=F, vocab_size=V, draft_vocab=VD, n_ctx_train=64, rms_eps=1e-5,
        rope_base=100.0, rope_dims=HD, norm_before_fc=flags.get("norm_before_fc", False),
        norm_before_residual=flags.get("norm_before_residual", False), own_embedding=False,
        own_output=True, has_d2t=True, has_rope_freqs=False)


def tiny_head(spec: Eagle3Spec, seed: int) -> Eagle3Head:
    rng = np.random.default_rng(seed)
    params = {}
    for name in trained_names(spec):
        shape = spec.tensor_shapes()[name]
        if len(shape) == 1:
            params[name] = 1.0 + 0.3 * rng.standard_normal(shape)
        else:
            params[name] = rng.standard_normal(shape) / np.sqrt(shape[1])
    return Eagle3Head(spec, params, rng.standard_normal((V, E)), max_len=T)


def tiny_batch(n_steps: int, seed: int, soft: bool = False) -> Batch:
    rng = np.random.default_rng(seed)
    labels = rng.integers(-1, VD, (B, T))
    weight = (rng.random((n_steps, B, T)) < 0.8) & (labels >= 0)
    weight[:, 1, T - 2:] = False                          # the second sequence is shorter
    soft_ids = soft_p = None
    if soft:                                              # 4 ids a row, one of them unused
        soft_ids = rng.integers(0, VD, (B, T, 4))
        soft_p = rng.random((B, T, 4)) * (np.arange(4) < 3)
        soft_p /= soft_p.sum(-1, keepdims=True)
    return Batch(feats=3.0 * rng.standard_normal((B, T, 3 * ET)),
                 tokens=rng.integers(0, V, (B, T)), labels=labels,
                 weight=weight.astype(np.float64), soft_ids=soft_ids, soft_p=soft_p)


def total_loss(head: Eagle3Head, batch: Batch) -> float:
    losses, _, _ = head.loss_and_grads(batch)
    return float((losses / np.maximum(batch.weight.sum((1, 2)), 1.0)).sum())


@pytest.mark.parametrize("soft", [False, True], ids=["hard", "soft"])
@pytest.mark.parametrize("n_steps", [1, 3])
@pytest.mark.parametrize("flags", [{}, {"norm_before_fc": True, "norm_before_residual": True}],
                         ids=["plain", "normed"])
def test_gradients_match_finite_differences(n_steps, flags, soft):
    head = tiny_head(tiny_spec(**flags), seed=n_steps)
    batch = tiny_batch(n_steps, seed=7, soft=soft)
    _, _, grads = head.loss_and_grads(batch)
    rng = np.random.default_rng(3)
    assert set(grads) == set(trained_names(head.spec))
    for name, g in grads.items():
        w = head.p[name]
        assert np.abs(g).max() > 0, name                  # every tensor gets a gradient
        for idx in zip(*(rng.integers(0, n, 12) for n in w.shape), strict=True):
            old = w[idx]
            w[idx] = old + EPS
            up = total_loss(head, batch)
            w[idx] = old - EPS
            down = total_loss(head, batch)
            w[idx] = old
            num = (up - down) / (2 * EPS)
            assert abs(num - g[idx]) <= 1e-6 * max(1.0, abs(num)), (name, idx, num, g[idx])


def test_soft_cross_entropy():
    """Against a one-hot it is the hard cross-entropy; its logits gradient matches finite
    differences and is softmax - p on a row's ids (duplicate ids add up); a weight-0 row adds
    nothing whatever its probabilities."""
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((6, VD))
    labels = rng.integers(0, VD, 6)
    weight = np.array([1.0, 0.5, 0.0, 2.0, 1.0, 1.0])
    ids = np.stack([labels, rng.integers(0, VD, 6), labels], 1)          # (6, 3)
    one_hot = np.array([[1.0, 0.0, 0.0]] * 6)
    hard = cross_entropy(logits, labels, weight)
    soft = soft_cross_entropy(logits, ids, one_hot, weight)
    assert np.isclose(soft[0], hard[0]) and np.allclose(soft[1], hard[1])
    p = rng.random((6, 3))
    p /= p.sum(-1, keepdims=True)
    loss, d, _ = soft_cross_entropy(logits, ids, p, weight)
    assert not d[2].any()
    for r, c in ((0, int(labels[0])), (1, 3), (3, int(ids[3, 1])), (4, 7)):
        x = logits.copy()
        x[r, c] += EPS
        up = soft_cross_entropy(x, ids, p, weight)[0]
        x[r, c] -= 2 * EPS
        num = (up - soft_cross_entropy(x, ids, p, weight)[0]) / (2 * EPS)
        assert abs(num - d[r, c]) <= 1e-6, (r, c, num, d[r, c])
    sm = np.exp(logits[0]) / np.exp(logits[0]).sum()
    target = np.zeros(VD)
    np.add.at(target, ids[0], p[0])
    assert np.allclose(d[0], sm - target)


def test_the_chain_steps_read_earlier_steps():
    """A deeper step's loss depends on the earlier steps' keys (its attention reads the chain
    rows before it) and on step 0's output (its g): the unrolled gradient is not the one of k
    independent steps. Perturbing step 0's value projection moves step 2's loss."""
    head = tiny_head(tiny_spec(), seed=1)
    batch = tiny_batch(3, seed=2)
    only_last = Batch(batch.feats, batch.tokens, batch.labels,
                      batch.weight * np.array([0.0, 0.0, 1.0])[:, None, None])
    before = total_loss(head, only_last)
    head.p["fc.weight"][0, 0] += 0.1
    assert abs(total_loss(head, only_last) - before) > 1e-6


def test_attention_masks_what_a_chain_row_cannot_see():
    """Step k's row P: unchanged when step-0 keys past P - k or chain keys of other positions
    change; changed when the chain key at P - k + j does."""
    rng = np.random.default_rng(0)
    k, P = 3, 5                       # sees step 0 at <= 2, steps 1, 2, 3 at 3, 4, 5
    q = rng.standard_normal((1, T, H, HD))
    keys = [rng.standard_normal((1, T, HKV, HD)) for _ in range(k + 1)]
    vals = [rng.standard_normal((1, T, HKV, HD)) for _ in range(k + 1)]
    base = attention_forward(q, keys, vals)[0][0, P]
    for j, pos, seen in ((0, 3, False), (0, 2, True), (0, 0, True), (1, 4, False),
                         (1, 3, True), (2, 4, True), (2, 5, False), (3, 5, True),
                         (3, 4, False)):
        moved = [v.copy() for v in vals]
        moved[j][0, pos] += 1.0
        out = attention_forward(q, keys, moved)[0][0, P]
        assert (not np.allclose(out, base)) == seen, (j, pos)
