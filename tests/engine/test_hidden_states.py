"""Target hidden states as step outputs (service/model/hidden.py) on the CPU backend.

The oracle is a second copy of the model cut to its first k layers (the GPU per-layer test's
way, tests/gpu/test_models.py): after a direct forward of the same rows, its residual ws_x is
the residual entering layer k of the whole model. The tap's rows must equal it bit for bit on
steps of up to 16 rows (the CPU backend computes each such row as a one-token step) and to
float32 summation noise on wider (sgemm) steps; taking them must not change a step's logits.
"""

from __future__ import annotations

import numpy as np
import pytest

from service.backends.cpu.backend import CpuBackend
from service.engine.runner import GREEDY, ModelRunner, StepInput
from service.model.hidden import HiddenRows, HiddenTap
from tests.support.models import build_model, forward_host

N_SLOTS, N_CTX, MAX_TOKENS, MAX_LOGITS = 2, 64, 24, 16
MODELS = ("tiny-qwen3", "tiny-qwen3moe")      # dense and MoE FFNs (3 layers each)


def model(name: str, **kw):
    return build_model(name, CpuBackend(threads=1, **kw), n_ctx=N_CTX, n_slots=N_SLOTS,
                       max_tokens=MAX_TOKENS, max_logits=MAX_LOGITS)


def step(ids, start: int, slot: int, n_logits: int, hidden: bool = True) -> StepInput:
    n = len(ids)
    return StepInput(ids, range(start, start + n), [slot] * n, range(n - n_logits, n),
                     [GREEDY] * n_logits, hidden=hidden)


def oracle_rows(name: str, k: int, steps: list[tuple[list[int], int]]) -> np.ndarray:
    """The residual entering layer k (after k layers) of the last of `steps` ((ids, start) in
    slot 0, run in order by direct forwards), from the model cut to its first k layers."""
    cut = model(name)
    cut.weights.layers = cut.weights.layers[:k]
    for ids, start in steps:
        forward_host(cut, ids, start, 1)
    return np.array(cut.ws_x[:len(steps[-1][0])])                       # (n, E) f32


def ids_of(n: int, salt: int, vocab: int) -> list[int]:
    return [(13 * i + salt) % vocab for i in range(n)]


@pytest.mark.parametrize("name", MODELS)
def test_tap_rows_equal_the_residual_entering_each_named_layer(name):
    """Points 0 (the embeddings), 2 and 3 (= n_layer, the final residual), out of order on
    purpose: buffer column block j holds point points[j]. A prefill of 19 rows (padded to 24,
    sgemm: to 1e-6 of its scale), then a verify step of 5 rows (padded to 8, exact)."""
    tr = model(name)
    V, E, n_layer = tr.spec.vocab_size, tr.spec.n_embd, tr.spec.n_layer
    points = (2, 0, n_layer)
    runner = ModelRunner(tr, N_SLOTS, N_CTX, hidden=HiddenTap(points))
    prefill, verify = ids_of(19, 3, V), ids_of(5, 7, V)
    runner.step(step(prefill, 0, 0, 1))
    got = np.array(runner.hidden_states(step(prefill, 0, 0, 1)))         # (19, 3E) f32
    assert got.shape == (19, 3 * E)
    for j, k in enumerate(points):
        want = oracle_rows(name, k, [(prefill, 0)])
        part = got[:, j * E:(j + 1) * E]
        scale = float(np.abs(want).max())
        assert np.abs(part - want).max() <= 1e-6 * scale, (k, np.abs(part - want).max())
    runner.step(step(verify, 19, 0, 5))
    got = np.array(runner.hidden_states(step(verify, 19, 0, 5)))         # (5, 3E) f32
    for j, k in enumerate(points):
        want = oracle_rows(name, k, [(prefill, 0), (verify, 19)])
        np.testing.assert_array_equal(got[:, j * E:(j + 1) * E], want, err_msg=f"point {k}")
    # the points differ from each other: a tap copying one layer everywhere would fail above
    assert not np.array_equal(got[:, :E], got[:, E:2 * E])


def test_logits_rows_are_the_last_rows_of_all_rows():
    tr = model("tiny-qwen3")
    every = ModelRunner(tr, N_SLOTS, N_CTX, hidden=HiddenTap((1, 3)))
    ids = ids_of(6, 5, tr.spec.vocab_size)
    every.step(step(ids, 0, 0, 3))
    want = np.array(every.hidden_states(step(ids, 0, 0, 3)))[-3:]         # (3, 2E)
    tr2 = model("tiny-qwen3")
    last = ModelRunner(tr2, N_SLOTS, N_CTX, hidden=HiddenTap((1, 3), HiddenRows.LOGITS))
    last.step(step(ids, 0, 0, 3))
    got = np.array(last.hidden_states(step(ids, 0, 0, 3)))
    assert got.shape == (3, 2 * tr.spec.n_embd)
    np.testing.assert_array_equal(got, want)


def test_a_tap_changes_no_logits_and_untapped_steps_copy_nothing(monkeypatch):
    """Logits with and without the tap are equal bit for bit; a runner with a tap runs no copy
    in steps that do not ask for hidden states, and one copy per point in steps that do."""
    a, b = model("tiny-qwen3"), model("tiny-qwen3")
    plain = ModelRunner(a, N_SLOTS, N_CTX)
    tapped = ModelRunner(b, N_SLOTS, N_CTX, hidden=HiddenTap((0, 1, 2)))
    copies = []
    be = b.backend
    real = be.copy_rows
    monkeypatch.setattr(be, "copy_rows", lambda s, o: (copies.append(s.shape), real(s, o)))
    ids = ids_of(9, 1, a.spec.vocab_size)
    for hidden in (True, False):
        plain.step(step(ids, 0, 1, 4, hidden=False))
        tapped.step(step(ids, 0, 1, 4, hidden=hidden))
        np.testing.assert_array_equal(np.array(b.ws_logits[:4]), np.array(a.ws_logits[:4]))
        assert len(copies) == (3 if hidden else 0)
        copies.clear()


def test_tapped_steps_obey_the_capture_rules():
    """The copies are ops on workspace views (CaptureRuleError otherwise): a captured CUDA
    graph can hold them. The same shapes with and without the tap are keyed apart."""
    tr = model("tiny-qwen3", capture_rules=True)
    runner = ModelRunner(tr, N_SLOTS, N_CTX, hidden=HiddenTap((1, 3)))
    for pos, hidden in ((0, True), (1, False), (2, True), (3, False), (4, True)):
        runner.step(step([5], pos, 0, 1, hidden=hidden))


@pytest.mark.parametrize("points, match", [((), "at least one"), ((0, 4), r"\[4\] outside"),
                                           ((-1,), "outside"), ((1, 1), "repeat")])
def test_bad_capture_points_are_refused(points, match):
    tr = model("tiny-qwen3")
    with pytest.raises(ValueError, match=match):
        ModelRunner(tr, N_SLOTS, N_CTX, hidden=HiddenTap(points))


def test_a_step_asking_a_runner_without_a_tap_is_refused():
    tr = model("tiny-qwen3")
    runner = ModelRunner(tr, N_SLOTS, N_CTX)
    with pytest.raises(ValueError, match="without a tap"):
        runner.step(step([1, 2], 0, 0, 1))
