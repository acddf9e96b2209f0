"""Chat templates: the model's own (SmolLM2), the built-in fallback (Gemma), the sandbox."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.errors import InvalidRequestError, ModelFormatError
from service.model.chat import CHATML, GEMMA_TURNS, render_chat, template_for

MODELS = Path(__file__).resolve().parents[2] / "models"
USER = [{"role": "user", "content": "What is 12 times 7?"}]


def read_metadata(path: Path) -> dict:
    if not path.is_file():
        pytest.skip(f"{path} is absent; fetch it with `specstream models fetch`")
    try:
        from service.gguf.reader import GGUFFile

        return GGUFFile(path).metadata
    except (ImportError, ModelFormatError):
        from gguf import GGUFReader

        reader = GGUFReader(path, "r")
        keys = ("general.architecture", "tokenizer.chat_template")
        return {k: reader.fields[k].contents() for k in keys if k in reader.fields}


def test_smollm2_template_from_metadata_renders_chatml():
    md = read_metadata(MODELS / "smollm2-135m.gguf")
    template = template_for(md)
    assert template == md["tokenizer.chat_template"]
    out = render_chat(template, USER, bos_token="<|im_start|>", eos_token="<|im_end|>")
    assert out == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                   "Hugging Face<|im_end|>\n"
                   "<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n")
    system = [{"role": "system", "content": "Be terse."}, *USER]
    out = render_chat(template, system, "<|im_start|>", "<|im_end|>", add_generation_prompt=False)
    assert out == ("<|im_start|>system\nBe terse.<|im_end|>\n"
                   "<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n")


def test_gemma_without_template_falls_back_to_turns():
    md = read_metadata(MODELS / "gemma3-270m.gguf")
    assert "tokenizer.chat_template" not in md
    assert template_for(md) is GEMMA_TURNS
    chat = [{"role": "system", "content": "Be terse."}, *USER,
            {"role": "assistant", "content": " 84 "}, {"role": "user", "content": "And 13?"}]
    assert render_chat(template_for(md), chat, "<bos>", "<eos>") == (
        "<start_of_turn>user\nBe terse.\n\nWhat is 12 times 7?<end_of_turn>\n"
        "<start_of_turn>model\n84<end_of_turn>\n"
        "<start_of_turn>user\nAnd 13?<end_of_turn>\n"
        "<start_of_turn>model\n")


def test_builtin_registry_by_architecture():
    assert template_for({"general.architecture": "gemma3"}) is GEMMA_TURNS
    assert template_for({"general.architecture": "qwen3"}) is CHATML
    assert template_for({"general.architecture": "llama", "tokenizer.chat_template": " "}) is CHATML
    assert render_chat(CHATML, USER, "", "") == (
        "<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n")


def test_hf_environment_helpers():
    template = ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                "{{ m | tojson }}{% endfor %}\n  {% if true %}\n[{{ bos_token }}]\n  {% endif %}")
    two = [{"role": "user", "content": "café"}, {"role": "user", "content": "x"}]
    # loop controls, non-ASCII JSON; trim_blocks eats the newline after a block tag and
    # lstrip_blocks the indentation before one
    assert render_chat(template, two, "<s>", "</s>") == '{"role": "user", "content": "café"}[<s>]\n'
    assert render_chat("{{ strftime_now('%Y') | length }}", USER, "", "") == "4"


@pytest.mark.parametrize("template", [
    "{{ messages.__class__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages[0].__init__.__globals__ }}",
    "{{ messages.append(1) }}",
    "{{ messages[0].update({'role': 'x'}) }}",
    "{{ cycler.__init__.__globals__.os }}",
])
def test_sandbox_refuses_unsafe_access(template):
    with pytest.raises(InvalidRequestError) as err:
        render_chat(template, USER, "", "")
    assert err.value.field == "input.chat"


@pytest.mark.parametrize("template, message", [
    ("{% for m in messages %}", "chat template failed"),
    ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
    ("{{ 1 + messages[0]['content'] }}", "chat template failed"),
])
def test_template_errors_are_request_errors(template, message):
    with pytest.raises(InvalidRequestError, match=message) as err:
        render_chat(template, USER, "", "")
    assert err.value.field == "input.chat"


@pytest.mark.parametrize("messages", [[], [{"role": "user"}], [{"role": "user", "content": 3}]])
def test_malformed_messages(messages):
    with pytest.raises(InvalidRequestError):
        render_chat(CHATML, messages, "", "")
