"""The `model` drafter on the CPU: layer-truncated and full q8_0 copies of SmolLM2 made with
service.tools.quantize draft for it; greedy output stays identical to plain greedy output, a
drafter of another vocabulary is refused at load, and a cancelled request frees its draft slot.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from service.config import EngineConfig
from service.engine.spec.draft_model import ModelDrafter
from service.engine.types import FinishReason, GenerationRequest, StoppingCriteria
from service.errors import ConfigError
from tests.support.batching import Streams
from tests.support.cli import run_cli
from tests.support.engines import GREEDY, Engine, engine_config, run, running_engine, wait_idle
from tests.support.models import load_json, model_path, open_gguf
from tests.support.speculation import greedy_equals_plain_at_widths

N_NEW = 24                       # tokens per fixture prompt: a few steps even at width 16
WIDTHS = (2, 6, 16)


@pytest.fixture(scope="module")
def drafts(requantized) -> dict[str, str]:
    """name -> path of SmolLM2 draft files: its first 4 blocks, and all of it, at q8_0."""
    return {"4 layers q8_0": str(requantized("smollm2", "q8_0", 4)),
            "full q8_0": str(requantized("smollm2", "q8_0"))}


def model_engine(draft: str, **options):
    """SmolLM2 drafted for by the model `draft`, verify width 16, drafting in full at every
    width (the measured verify cost, which follows the machine's load, must not decide how much
    is drafted). options: running_engine's."""
    return running_engine("smollm2", **{"drafter": "model", "draft_model": draft,
                                        "verify_width": 16, **options}, draft_in_full=True)


@pytest.fixture(scope="module")
def plain_ids() -> list[list[int]]:
    """Plain greedy ids (no speculation) for every fixture prompt."""
    with running_engine("smollm2") as eng:
        return [run(eng, c["prompt_ids"], max_new_tokens=N_NEW, ignore_eos=True,
                    speculative=False).token_ids
                for c in load_json("llamacpp_smollm2_greedy.json")["cases"]]


@pytest.mark.parametrize("which", ["4 layers q8_0", "full q8_0"])
def test_model_drafter_output_equals_plain_greedy(drafts, plain_ids, which):
    """The identity gate at verify widths 2, 6 and 16, with acceptance printed per width."""
    cases = load_json("llamacpp_smollm2_greedy.json")["cases"]
    with model_engine(drafts[which]) as eng:
        assert isinstance(eng.drafter, ModelDrafter)
        assert eng.info.drafter == "model" and "smollm2-135m-q8_0" in eng.info.draft_model
        for got in greedy_equals_plain_at_widths(
                eng, [c["prompt_ids"] for c in cases], plain_ids, widths=WIDTHS,
                max_new_tokens=N_NEW, label=which, names=[c["name"] for c in cases]):
            if which == "full q8_0":
                assert got.rate > 0.5


@dataclass
class _State:                    # what a drafter reads of a sequence (DraftState)
    slot: int
    history: list[int] = field(default_factory=list)


def test_rollback_keeps_the_draft_cache_consistent(drafts):
    """After a partial acceptance, drafting from the kept rows gives the same tokens as drafting
    from scratch on the same history (steps of <= 16 rows compute every row exactly as a
    single-token step, so the two caches hold the same values)."""
    prompt = load_json("llamacpp_smollm2_greedy.json")["cases"][0]["prompt_ids"]
    with model_engine(drafts["4 layers q8_0"], start=False, n_slots=2) as eng:
        d = eng.drafter                           # driven here: the engine is not started
        kept = _State(0, list(prompt))
        d.start(kept)
        first = d.propose(kept, 4)
        assert len(first) == 4
        # the target accepted 2 drafts and chose another token as the third
        kept.history += [*first[:2], (first[2] + 1) % eng.spec.vocab_size]
        again = d.propose(kept, 4)
        fresh = _State(1, list(kept.history))
        d.start(fresh)
        assert d.propose(fresh, 4) == again
        assert d.slots_in_use == {0, 1}
        d.release(kept)
        d.release(fresh)
        assert d.slots_in_use == frozenset()


def _first_difference(a: str, b: str) -> tuple[int, str, str]:
    ta = open_gguf(a).get("tokenizer.ggml.tokens") or []
    tb = open_gguf(b).get("tokenizer.ggml.tokens") or []
    i = next(i for i in range(max(len(ta), len(tb)))
             if i >= len(ta) or i >= len(tb) or ta[i] != tb[i])
    return i, repr(ta[i]) if i < len(ta) else "(none)", repr(tb[i]) if i < len(tb) else "(none)"


@pytest.mark.parametrize("other", ["gemma3", "tiny-qwen3"])
def test_a_drafter_of_another_vocabulary_is_refused(other):
    target, draft = str(model_path("smollm2")), str(model_path(other))
    with pytest.raises(ConfigError) as ei:
        Engine.load(target, engine_config(drafter="model", draft_model=draft))
    messages = [m for f, m in ei.value.problems if f == "draft_model"]
    i, ours, theirs = _first_difference(target, draft)
    assert any(f"token id {i}: {ours} in the target, {theirs} in the draft model" in m
               for m in messages), messages


def test_serve_refuses_a_drafter_of_another_vocabulary_with_exit_2():
    from tests.support.grpc_harness import run_serve

    gemma = str(model_path("gemma3"))
    r = run_serve([str(model_path("smollm2")), "--backend", "cpu",
                   "--port", "0", "--metrics-port", "-1", "--drafter", "model",
                   "--draft-model", gemma], timeout=120)
    assert r.returncode == 2, r.stderr
    assert "draft_model" in r.stderr and "vocabularies differ first at token id" in r.stderr


def test_the_model_drafter_needs_a_draft_model(tmp_path):
    problems = dict(EngineConfig(drafter="model").problems())
    assert "draft model" in problems["draft_model"]
    # set by flag, env or config file like every engine setting
    from service.config import load_config

    flag = load_config(["--drafter", "model", "--draft-model", "a.gguf"], {})[1]
    env = load_config([], {"SPECSTREAM_DRAFTER": "model", "SPECSTREAM_DRAFT_MODEL": "b.gguf"})[1]
    cfg = tmp_path / "s.toml"
    cfg.write_text('[engine]\ndrafter = "model"\ndraft_model = "c.gguf"\n')
    file = load_config([], {}, cfg)[1]
    assert [c.draft_model for c in (flag, env, file)] == ["a.gguf", "b.gguf", "c.gguf"]


def test_cancelling_releases_the_drafter_slot(drafts):
    with model_engine(drafts["4 layers q8_0"], verify_width=4) as eng:
        drafter = eng.drafter
        streams = Streams(eng)
        long = streams.submit(GenerationRequest(
            "long", (1, 2, 3, 4), GREEDY, StoppingCriteria(max_new_tokens=10_000,
                                                           ignore_eos=True)))
        assert streams.wait_until(lambda: long.deltas and drafter.steps > 0, 120)
        assert drafter.slots_in_use == {0}
        streams.handles[0].cancel()
        streams.wait(60)
        wait_idle(eng)
        assert long.finished.reason is FinishReason.CANCELLED
        assert drafter.slots_in_use == frozenset()
        out = run(eng, [1, 2, 3], max_new_tokens=3)       # the slot serves the next request
        assert out.finished.reason is FinishReason.LENGTH
        assert drafter.slots_in_use == frozenset()


def test_draft_steps_obey_the_capture_rules(drafts):
    """The draft chain runs through run_step like the target's steps: with the CPU backend's
    capture rules on (what a captured CUDA graph cannot contain raises), a generation whose
    catch-up spans several chunks still drafts, verifies and matches plain decoding."""
    spec = captured_drafting_run(drafts["full q8_0"])
    assert spec.finished.usage.accepted_draft_tokens > 0


def captured_drafting_run(draft: str):
    """12 tokens of an 18-id prompt (catch-up over several 8-token chunks) drafted by `draft`
    with the CPU backend's capture rules on; asserts it ran cleanly and matched plain decoding,
    and returns the speculative run."""
    from service.backends import backend_options

    prompt = load_json("llamacpp_smollm2_greedy.json")["cases"][1]["prompt_ids"]   # 18 ids
    with backend_options("cpu", capture_rules=True), \
            model_engine(draft, verify_width=4, prefill_chunk=8) as eng:
        for backend in (eng.model.backend, eng.drafter.model.backend):   # target and drafter
            assert hasattr(backend, "capture_state")
        spec = run(eng, prompt, max_new_tokens=12)
        plain = run(eng, prompt, max_new_tokens=12, speculative=False)
    assert eng.failure is None and spec.finished.error is None, spec.finished.error
    assert spec.token_ids == plain.token_ids
    return spec


def test_generate_cli_drafts_with_a_model(capsys, drafts):
    ids = ",".join(map(str, load_json("llamacpp_smollm2_greedy.json")["cases"][2]["prompt_ids"]))
    common = ["generate", "smollm2-135m", "--prompt-ids", ids, "--max-new-tokens", "12",
              "--temperature", "0", "--json", "--backend", "cpu", "--n-ctx", "128"]
    outs = []
    for extra in (["--drafter", "model", "--draft-model", drafts["full q8_0"]],
                  ["--no-speculative"]):
        code, out, _ = run_cli(capsys, *common, *extra)
        assert code == 0
        outs.append(json.loads(out))
    assert outs[0]["token_ids"] == outs[1]["token_ids"]
    assert outs[0]["usage"]["accepted_draft_tokens"] > 0


def test_the_engine_learns_what_a_draft_costs_and_stops_a_drafter_as_dear_as_the_target():
    """A model drafting for itself (the same file) runs a target-sized forward per draft: the
    engine learns a drafting cost of about a plain step per draft from its steady drafting
    steps (a sequence's first drafting step, which runs the prompt through the draft model,
    does not count), after which the width policy stops drafting (k + 1 tokens would cost
    1 + alpha k + k steps), probing rarely; the output is plain decoding's. A cost that is set
    stays (draft_in_full, verify_alpha)."""
    target = model_path("tiny-qwen3")
    ids = list(range(5, 21))
    with running_engine(target, verify_width=4) as eng:
        plain = run(eng, ids, max_new_tokens=64, ignore_eos=True, speculative=False).token_ids
    with running_engine(target, drafter="model", draft_model=str(target),
                        verify_width=4) as eng:
        out = run(eng, ids, max_new_tokens=64, ignore_eos=True)
        assert out.token_ids == plain
        assert eng.draft_cost > 0.5, eng.draft_cost
        assert eng.scheduler.probe_every() >= 25
        # drafting in full would draft 3 per step (every draft accepted: 48 drafts)
        assert out.finished.usage.draft_tokens <= 12, out.finished.usage
    with running_engine(target, drafter="model", draft_model=str(target), verify_width=4,
                        draft_in_full=True) as eng:
        out = run(eng, ids, max_new_tokens=64, ignore_eos=True)
        assert out.token_ids == plain
        assert eng.draft_cost == 0.0
        assert out.finished.usage.draft_tokens >= 40, out.finished.usage
