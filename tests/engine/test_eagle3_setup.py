"""The eagle3 drafter's setup and failure paths on the CPU (tests/engine/test_eagle3_drafter.py
has its drafting and identities): configuration problems and startup refusals naming
draft_model (a missing file, a file of another architecture, a head made for another target, a
head the backend cannot run; `serve` exits 2), plain requests on an eagle3 server tap nothing, a
failing extend leaves the request exact, and a scored prompt is extended part by part."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.config import EngineConfig
from service.engine.spec.eagle3_drafter import Eagle3Drafter
from service.errors import ConfigError
from service.tools.synth_eagle3 import synthesize_eagle3
from tests.engine.test_eagle3_drafter import N_NEW, TARGET, eagle3_engine
from tests.engine.test_moe_speculation import PROMPTS
from tests.support.engines import GREEDY, Engine, engine_config, run
from tests.support.models import TINY, model_path


@pytest.fixture(scope="module")
def head(tmp_path_factory) -> Path:
    """A random head for tiny-qwen3 (`synth --eagle3`)."""
    return synthesize_eagle3(tmp_path_factory.mktemp("e3s") / "random.gguf", model_path(TARGET),
                             seed=6, layers=(1, 2, 3), quant="F32", weight_std=0.1).path


def test_config_problems_name_the_fields():
    problems = dict(EngineConfig(drafter="eagle3").problems())
    assert "EAGLE-3" in problems["draft_model"]
    assert EngineConfig(drafter="eagle3", draft_model="x.gguf", tree_budget=8).problems() == []


@pytest.mark.parametrize("case", ["missing", "not eagle3", "another target"])
def test_a_wrong_draft_model_is_refused_at_startup(head, tmp_path, case):
    target, draft = TARGET, str(head)
    if case == "missing":
        draft, why = str(tmp_path / "none.gguf"), "is not a file"
    elif case == "not eagle3":
        draft, why = str(model_path(TARGET)), "EAGLE-3 drafter ('eagle3') expected"
    else:
        target, why = "tiny-qwen3moe-s-q8", "target_hidden_size 256 but the target's"
    with pytest.raises(ConfigError) as ei:
        Engine.load(TINY / f"{target}.gguf", engine_config(drafter="eagle3", draft_model=draft))
    messages = [m for f, m in ei.value.problems if f == "draft_model"]
    assert messages and why in messages[0], ei.value.problems


def test_plain_requests_on_an_eagle3_server_tap_nothing(head):
    """A request with speculation off runs untapped steps and leaves the drafter no state."""
    with eagle3_engine(head) as eng:
        out = run(eng, PROMPTS[0], GREEDY, max_new_tokens=6, ignore_eos=True,
                  speculative=False)
        assert out.finished.usage.draft_tokens == 0
        assert eng.drafter.steps == 0


def test_serve_refuses_a_file_that_is_not_an_eagle3_drafter_with_exit_2():
    from tests.support.grpc_harness import run_serve

    r = run_serve([str(model_path(TARGET)), "--backend", "cpu", "--port", "0",
                   "--metrics-port", "-1", "--drafter", "eagle3", "--draft-model",
                   str(model_path(TARGET))], timeout=120)
    assert r.returncode == 2, r.stderr
    assert "draft_model" in r.stderr and "EAGLE-3 drafter ('eagle3') expected" in r.stderr


def test_a_failing_extend_leaves_requests_exact_and_undrafted(head, monkeypatch):
    """The drafter's failure after a step (its tokens committed) is logged, not the request's:
    the request ends normally with plain output, and the drafter, never caught up, proposes
    nothing."""
    def broken(*a, **k):
        raise RuntimeError("no room")

    with eagle3_engine(head, verify_width=4) as eng:
        plain = run(eng, PROMPTS[0], max_new_tokens=N_NEW, ignore_eos=True, speculative=False)
        monkeypatch.setattr(eng.drafter, "extend", broken)
        out = run(eng, PROMPTS[0], max_new_tokens=N_NEW, ignore_eos=True)
    assert out.finished.error is None and out.token_ids == plain.token_ids
    assert out.finished.usage.draft_tokens == 0


def test_a_head_the_backend_cannot_run_is_refused_at_startup(head, monkeypatch):
    def broken(self):
        raise ValueError("activations (1, 768) exceed the prepared buffers")

    monkeypatch.setattr(Eagle3Drafter, "check", broken)
    with pytest.raises(ConfigError) as ei:
        Engine.load(model_path(TARGET), engine_config(drafter="eagle3",
                                                      draft_model=str(head)))
    (field_, message), = ei.value.problems
    assert field_ == "draft_model" and "exceed the prepared buffers" in message


def test_a_scored_prompt_is_extended_part_by_part(head):
    """prompt_logprobs computes the prompt in parts of at most max_logits rows (each tapped
    and extended before the next overwrites the tap): output and prompt scores equal plain's,
    and the drafter is caught up after the prompt (it drafts at the first decode step)."""
    prompt = [(29 * i + 17) % 1000 + 1 for i in range(90)]
    with eagle3_engine(head, verify_width=4) as eng:
        assert eng.runner.model.max_logits < len(prompt)
        kw = dict(max_new_tokens=8, ignore_eos=True, prompt_logprobs=1)
        spec = run(eng, prompt, **kw)
        plain = run(eng, prompt, speculative=False, **kw)
        steps = eng.drafter.steps
    assert spec.token_ids == plain.token_ids
    assert len(spec.started.prompt_logprobs) == len(prompt) - 1
    assert spec.started.prompt_logprobs == plain.started.prompt_logprobs
    assert spec.finished.usage.draft_tokens > 0 and steps > 0
