"""train-drafter's hand-written backward passes (service/tools/eagle3_head.py, eagle3_ops.py)
against central finite differences of the loss, in float64 on tiny shapes: every trained tensor,
at unroll depths 1 and 3 (the training-time-test chain, whose steps read the previous step's
output and attend to its rows), with and without the pre-fc norm and the normed residual, a
reduced draft vocabulary and grouped heads; padding and unlabeled rows weighted 0."""

from __future__ import annotations

import numpy as np
import pytest

from service.model.eagle3 import Eagle3Spec
from service.tools.eagle3_head import Batch, Eagle3Head, trained_names
from service.tools.eagle3_ops import attention_forward

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


def tiny_batch(n_steps: int, seed: int) -> Batch:
    rng = np.random.default_rng(seed)
    labels = rng.integers(-1, VD, (B, T))
    weight = (rng.random((n_steps, B, T)) < 0.8) & (labels >= 0)
    weight[:, 1, T - 2:] = False                          # the second sequence is shorter
    return Batch(feats=3.0 * rng.standard_normal((B, T, 3 * ET)),
                 tokens=rng.integers(0, V, (B, T)), labels=labels,
                 weight=weight.astype(np.float64))


def total_loss(head: Eagle3Head, batch: Batch) -> float:
    losses, _, _ = head.loss_and_grads(batch)
    return float((losses / np.maximum(batch.weight.sum((1, 2)), 1.0)).sum())


@pytest.mark.parametrize("n_steps", [1, 3])
@pytest.mark.parametrize("flags", [{}, {"norm_before_fc": True, "norm_before_residual": True}],
                         ids=["plain", "normed"])
def test_gradients_match_finite_differences(n_steps, flags):
    head, batch = tiny_head(tiny_spec(**flags), seed=n_steps), tiny_batch(n_steps, seed=7)
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
