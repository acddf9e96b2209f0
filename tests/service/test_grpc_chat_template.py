"""Chat input over a real socket: the ids are llama.cpp's for the same prompt text (SmolLM2's own
template), and a model without a chat template refuses chat input until one is configured."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from clients import SpecstreamClient, error_details
from service.config import load_config
from service.errors import ConfigError
from service.model.chat import BUILTIN_TEMPLATES, CHATML
from service.serve import BackgroundServer
from tests.conftest import load_json, real_model_path
from tests.engine.test_engine import assert_matches_llamacpp, greedy_with_gaps

from .grpc_harness import SERVE_FLAGS, TEST_ENGINE, run_serve

SYSTEM_CASE = next(c for c in load_json("llamacpp_smollm2_greedy_extra.json")["cases"]
                   if c["prompt"].startswith("<|im_start|>system\n"))
SYSTEM_CHAT = [("system", "You are a helpful assistant."), ("user", "Name three primary colors.")]
USER_CASE = next(c for c in load_json("llamacpp_smollm2_greedy.json")["cases"]
                 if c["prompt"].startswith("<|im_start|>user\n"))
USER_CHAT = [("user", "What is 12 times 7?")]      # USER_CASE's prompt in ChatML


def test_smollm2_chat_ids_and_answer_are_llamacpps(client, engine):
    # SYSTEM_CHAT in SmolLM2's template is the fixture's prompt text
    assert engine.tokenizer.decode(SYSTEM_CASE["prompt_ids"]) == SYSTEM_CASE["prompt"]
    ids = list(client.tokenize(chat=SYSTEM_CHAT).ids)
    assert ids == SYSTEM_CASE["prompt_ids"]
    # no system message: the template writes its own, and the prompt still opens with BOS
    hi = list(client.tokenize(chat=[("user", "hi")]).ids)
    assert hi[:2] == [engine.tokenizer.bos_id, 9690]
    assert hi == client.tokenize(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n").ids
    done = client.complete(chat=SYSTEM_CHAT, max_new_tokens=len(SYSTEM_CASE["greedy_ids"]),
                           temperature=0.0)
    assert done.prompt_tokens == len(SYSTEM_CASE["prompt_ids"])
    got, gaps = greedy_with_gaps(engine, SYSTEM_CASE["prompt_ids"], len(SYSTEM_CASE["greedy_ids"]))
    assert done.token_ids == got           # the server's ids are the engine's, whose gaps we know
    assert_matches_llamacpp("smollm2", SYSTEM_CASE, got, gaps)


# ------------------------------------------------------------------ a model without a template
@pytest.fixture(scope="module")
def gemma_client() -> Iterator[SpecstreamClient]:
    """Gemma-3-270M (a base model: no tokenizer.chat_template), served without --chat-template.
    Tokenize and a refused Generate never reach the engine thread, so it is not started."""
    from service.engine.engine import Engine

    engine = Engine.load(real_model_path("gemma3-270m"), TEST_ENGINE)
    with BackgroundServer(engine) as srv, SpecstreamClient(srv.target, timeout=60) as c:
        yield c


def _refusal(call) -> None:
    with pytest.raises(grpc.RpcError) as ei:
        call()
    e = error_details(ei.value)
    assert e.code == "FAILED_PRECONDITION", e
    assert [f for f, _ in e.field_violations] == ["input.chat"]
    assert e.reason == "CHAT_TEMPLATE_MISSING" and e.metadata["field"] == "input.chat"
    assert e.message.startswith("input.chat: this model has no chat template")
    assert "--chat-template NAME|FILE" in e.message
    assert all(name in e.message for name in BUILTIN_TEMPLATES)


def test_chat_to_a_model_without_template_is_failed_precondition(gemma_client):
    assert not gemma_client.model_info().HasField("chat_template")
    _refusal(lambda: gemma_client.tokenize(chat=USER_CHAT))
    _refusal(lambda: list(gemma_client.generate(chat=USER_CHAT, max_new_tokens=2)))
    gemma = load_json("llamacpp_gemma3_greedy.json")["cases"][0]
    assert list(gemma_client.tokenize(gemma["prompt"]).ids) == gemma["prompt_ids"]   # text works


# ------------------------------------------------------------------ the setting
def test_chat_template_from_env_replaces_the_models_own(serve_subprocess, model_path):
    """SPECSTREAM_CHAT_TEMPLATE=chatml: SmolLM2 chat input without its own template's system
    turn, so the ids are llama.cpp's for the plain ChatML prompt."""
    srv = serve_subprocess([str(model_path), *SERVE_FLAGS],
                           env={"SPECSTREAM_CHAT_TEMPLATE": "chatml"})
    srv.wait_listening()
    with SpecstreamClient(srv.target, timeout=120) as c:
        c.wait_ready(120)
        assert c.model_info().chat_template == CHATML
        assert list(c.tokenize(chat=USER_CHAT).ids) == USER_CASE["prompt_ids"]


def test_unknown_chat_template_fails_startup_listing_the_names(model_path):
    done = run_serve([str(model_path), *SERVE_FLAGS, "--chat-template", "no-such-template"])
    assert done.returncode == 2
    assert "chat_template: 'no-such-template' is neither a built-in template (" in done.stderr
    assert all(name in done.stderr for name in BUILTIN_TEMPLATES)


def test_chat_template_setting_sources(tmp_path):
    template = tmp_path / "turns.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    config = tmp_path / "specstream.toml"
    config.write_text(f'[server]\nchat_template = "{template}"\n')
    server, _ = load_config([], env={}, config_file=config)
    assert server.chat_template == str(template)
    server, _ = load_config([], env={"SPECSTREAM_CHAT_TEMPLATE": "gemma"}, config_file=config)
    assert server.chat_template == "gemma"
    server, _ = load_config(["--chat-template", "chatml"], env={"SPECSTREAM_CHAT_TEMPLATE": "x"})
    assert server.chat_template == "chatml"
    with pytest.raises(ConfigError) as err:
        load_config(["--chat-template", str(tmp_path / "absent.jinja")], env={})
    assert [f for f, _ in err.value.problems] == ["chat_template"]
