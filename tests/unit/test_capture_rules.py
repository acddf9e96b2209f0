"""The CPU backend's capture rules: what a CUDA graph cannot contain raises on the CPU.

Positive runs: the tiny models through Transformer.forward and through the engine (prefill
chunks, decode steps, speculative verify steps) give the same logits and ids as without the
rules while every step is checked (SmolLM2 and a draft model run under the rules in the engine
tier: tests/engine/test_model_drafter.py::test_draft_steps_obey_the_capture_rules). Negative
controls: a step that allocates, copies or waits, one that passes an array made during the step
to an op (directly, or from a model layer that allocates a temporary), and one whose op sequence
changes under the same key.
"""

from __future__ import annotations

import numpy as np
import pytest

from service.backends import backend_options, create_backend
from service.backends.capture_rules import FORBIDDEN, CaptureRuleError
from service.backends.cpu.backend import CpuBackend
from service.engine.types import FinishReason
from service.gguf.quants import QuantType
from service.gguf.reader import TensorInfo
from service.model.transformer import Transformer
from tests.support.engines import run, running_engine
from tests.support.models import TINY_MODELS, build_model, load_json


# ---------------------------------------------------------------- a step harness
@pytest.fixture
def be():
    return CpuBackend(threads=1, capture_rules=True)


def _f32_tensor(rows: int, k: int) -> TensorInfo:
    w = np.ones((rows, k), np.float32)
    return TensorInfo("w", QuantType.F32, (rows, k), w.view(np.uint8).reshape(-1))


_PAGED = CpuBackend(threads=1).new_kv_cache(1, 2, 32, 1, 32, 32, "f16", "f16")

FORBIDDEN_CALLS = {
    "zeros": lambda b, x: b.zeros((4,)),
    "upload_vector": lambda b, x: b.upload_vector(np.ones(4, np.float32)),
    "upload_ints": lambda b, x: b.upload_ints(np.ones(8, np.float32), x[0]),
    "to_host": lambda b, x: b.to_host(x),
    "synchronize": lambda b, x: b.synchronize(),
    "new_kv_cache": lambda b, x: b.new_kv_cache(1, 1, 8, 1, 32, 32, "f16", "f16"),
    "load_matrix": lambda b, x: b.load_matrix([_f32_tensor(4, 8)]),
    "load_vector": lambda b, x: b.load_vector(_f32_tensor(1, 8)),
    "rope_table": lambda b, x: b.rope_table(8, 4, 10000.0),
    "set_block_table": lambda b, x: b.set_block_table(_PAGED, _PAGED.block_table[::-1].copy()),
}


@pytest.mark.parametrize("name", sorted(FORBIDDEN_CALLS))
def test_forbidden_call_inside_a_step_raises_naming_it(be, name):
    assert name in FORBIDDEN
    x = be.zeros((2, 8))                                                # (2, 8) f32
    FORBIDDEN_CALLS[name](be, x)                     # outside a step: allowed
    with pytest.raises(CaptureRuleError, match=rf"^{name}\(\) called inside a step"):
        be.run_step((2,), (), lambda: FORBIDDEN_CALLS[name](be, x))
    assert be.run_step((2,), (), lambda: be.add(x, x, x)) is None   # the backend still works


def test_op_on_workspace_views_passes_and_fresh_arrays_fail(be):
    x, out = be.zeros((4, 8)), be.zeros((4, 8))                         # (4, 8) f32
    w = be.upload_vector(np.full(8, 2.0, np.float32))                   # (8,) f32
    x[...] = 1.0
    be.run_step((2,), (), lambda: be.rms_norm(x[:2].reshape(2, 2, 4)[:, 1], w[:4], 1e-6,
                                              out[2:].reshape(2, 2, 4)[:, 0]))
    assert np.allclose(out[2:, :4], 2.0)
    fresh_b = np.ones(8, np.float32)
    with pytest.raises(CaptureRuleError, match=r"^add: argument 'b' \(8,\) float32"):
        be.run_step((2,), (), lambda: be.add(x[:2], fresh_b, out[:2]))
    with pytest.raises(CaptureRuleError, match=r"^glu: argument 'out'"):
        be.run_step((2,), (), lambda: be.glu(x[:2], x[:2], "silu", np.empty_like(x[:2])))
    with pytest.raises(CaptureRuleError, match=r"^add: argument 'a'"):   # a copy, not a view
        be.run_step((2,), (), lambda: be.add(x[:2] * 1, x[:2], out[:2]))
    with pytest.raises(CaptureRuleError, match=r"inputs\[0\]"):
        be.run_step((2,), (np.zeros(2, np.int32),), lambda: be.add(x, x, out))


def test_key_must_determine_the_op_sequence(be):
    x, out = be.zeros((4, 8)), be.zeros((4, 8))                         # (4, 8) f32
    n_ops = [1]

    def step_count():
        for _ in range(n_ops[0]):
            be.add(x[:2], x[:2], out[:2])

    be.run_step((2, 1), (), step_count)
    be.run_step((2, 1), (), step_count)              # the same sequence again: fine
    n_ops[0] = 2
    be.run_step((2, 2), (), step_count)              # another key records its own sequence
    with pytest.raises(CaptureRuleError, match=r"step key \(2, 1\): op #1 .* the end of the step"):
        be.run_step((2, 1), (), step_count)
    n_ops[0] = 1
    with pytest.raises(CaptureRuleError, match=r"step key \(2, 2\): 1 ops, the first run .* 2"):
        be.run_step((2, 2), (), step_count)
    rows = be.zeros((1,), "int32")                  # a shape read from data: T varies per run

    def step_shape():
        t = 1 + int(rows[0])
        be.add(x[:t], x[:t], out[:t])

    be.run_step((3,), (rows,), step_shape)
    rows[0] = 2
    with pytest.raises(CaptureRuleError, match=r"step key \(3,\): op #0 .*\(3, 8\)"):
        be.run_step((3,), (rows,), step_shape)


def test_backend_options_reach_create_backend_only_inside_the_block():
    with backend_options("cpu", capture_rules=True):
        inside = create_backend("cpu", threads=1)
    assert hasattr(inside, "capture_state")
    assert not hasattr(create_backend("cpu", threads=1), "capture_state")


# ---------------------------------------------------------------- models through forward
def _inputs(be, ids: list[int], start: int):
    """Device (ids, positions, slots) buffers made before any step, filled by upload_ints."""
    n = len(ids)
    bufs = [be.zeros((n,), "int32") for _ in range(3)]
    be.upload_ints(np.array(ids, np.int32), bufs[0])
    be.upload_ints(np.arange(start, start + n, dtype=np.int32), bufs[1])
    be.upload_ints(np.zeros(n, np.int32), bufs[2])
    return bufs


def _run_model(name: str, prompt: list[int], n_decode: int, rules: bool,
               model_cls=Transformer) -> np.ndarray:
    """Prefill the prompt, then n_decode single-token steps (key (1, 1) repeats); the logits of
    every step, (len(prompt) + n_decode, V)."""
    be = CpuBackend(threads=1, act_quant=True, capture_rules=rules)
    tr = build_model(name, be, cls=model_cls)
    t = len(prompt)
    rows = [np.array(tr.forward(*_inputs(be, prompt, 0), t, t))]
    step_in = _inputs(be, [0], t)
    for i in range(n_decode):
        be.upload_ints(np.array([prompt[i % t]], np.int32), step_in[0])
        be.upload_ints(np.array([t + i], np.int32), step_in[1])
        rows.append(be.to_host(tr.forward(*step_in, t + i + 1, 1)))
    if rules:
        state = be.capture_state
        assert state.steps == 1 + n_decode and set(state.sequences) == {(t, t), (1, 1)}
        assert len(state.sequences[(1, 1)]) > 4 * tr.spec.n_layer   # ops were checked
    return np.concatenate(rows)


@pytest.mark.parametrize("name", TINY_MODELS)
def test_tiny_models_obey_the_rules(name):
    prompt = list(load_json("tiny/llamacpp_tiny_logits.json")["prompt_ids"][:8])
    ruled = _run_model(name, prompt, 3, rules=True)
    np.testing.assert_array_equal(ruled, _run_model(name, prompt, 3, rules=False))


class TemporaryInLayer(Transformer):
    """A model layer that computes each matmul into a numpy temporary and copies it out."""

    def _matmuls(self, x, parts, out, segments=None) -> None:
        for w, c0, c1 in parts:
            tmp = np.empty((x.shape[0], c1 - c0), np.float32)                 # (T, c) f32
            self.backend.matmul(x, w, tmp, segments)
            out[:, c0:c1] = tmp


def test_model_layer_allocating_a_temporary_fails():
    prompt = [1, 2, 3]
    np.testing.assert_array_equal(_run_model("tiny-qwen3", prompt, 0, False, TemporaryInLayer),
                                  _run_model("tiny-qwen3", prompt, 0, False))   # right numbers
    with pytest.raises(CaptureRuleError, match=r"^matmul: argument 'out'"):   # wrong memory
        _run_model("tiny-qwen3", prompt, 0, True, TemporaryInLayer)
    tr = build_model("tiny-qwen3", CpuBackend(threads=1, capture_rules=True), max_tokens=8)
    host = [np.array(prompt, np.int32), np.arange(3, dtype=np.int32), np.zeros(3, np.int32)]
    with pytest.raises(CaptureRuleError, match=r"inputs\[0\]"):       # host arrays as inputs
        tr.forward(*host, 3, 1)


# ---------------------------------------------------------------- the engine
def _generate(name: str, rules: bool) -> tuple[list[int], int]:
    # a repetitive prompt longer than one prefill chunk: the n-gram drafter proposes, so
    # prefill chunks, single decode steps and verify steps all run
    with backend_options("cpu", capture_rules=rules), \
            running_engine(name, n_slots=2, threads=1, prefill_chunk=16) as eng:
        vocab = eng.spec.vocab_size
        prompt = [1] + [t % vocab for t in (504, 3458, 282, 4649, 314, 7042, 30)] * 4
        out = run(eng, prompt, max_new_tokens=12, ignore_eos=True)
    assert eng.failure is None
    assert out.finished.reason is FinishReason.LENGTH, out.finished.error   # no step failed
    state = getattr(eng.model.backend, "capture_state", None)
    assert (state is not None) == rules
    return out.token_ids, (len(state.sequences) if rules else 0)


@pytest.mark.parametrize("name", TINY_MODELS)
def test_engine_steps_obey_the_rules(name):
    ruled, n_keys = _generate(name, rules=True)
    assert len(ruled) == 12 and n_keys >= 4     # prefill chunks, decode and verify widths
    assert ruled == _generate(name, rules=False)[0]
