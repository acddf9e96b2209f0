"""The exported HuggingFace tokenizer folder (service/model/hf_export.py) tokenizes as our own
tokenizer does, for both vocabulary kinds: SmolLM2 (byte-level BPE) and Gemma-3 (SentencePiece
style). A gateway loads these files with the `tokenizers` library and renders chat with
tokenizer_config.json's template, so the same is done here: ids of texts with and without
special tokens (HF's add_special_tokens and encode_special_tokens against our add_bos and
parse_special), decoded text, and chat renders encoded the HF way against our chat path."""

from __future__ import annotations

import io
import json
import zipfile
from functools import cache

import pytest
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from service.chat_templates import GEMMA_TURNS
from service.model.chat import chat_prompt_ids, template_for
from service.model.hf_export import (
    TOKENIZER_FILES,
    ModelFacts,
    exported_template,
    tokenizer_files,
    zip_files,
)
from service.model.tokenizer import Tokenizer
from tests.support.models import open_gguf

TEXTS = [
    "Hello world", " leading space and  two", "The capital of France is",
    "<|im_start|>user\nhi<|im_end|>\n", "<start_of_turn>user\nhi<end_of_turn>\n<bos>",
    "emoji 🤖, accents éàü and 中文 text\n\n\ttabs  end ", "numbers 1234567 and 3.14159",
    "don't I'LL we've", "   ", "a\u00a0b\u200bc", "<eos><|endoftext|></s>",
    "def f(x):\n    return x ** 2  # square\n",
]
CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "  Bye  "}],
]
MODELS = {"smollm2": None, "gemma3": GEMMA_TURNS}    # Gemma-3-270M has no template: a built-in


@cache
def exported(model: str) -> tuple[Tokenizer, str | None, dict[str, bytes], HFTokenizer]:
    md = open_gguf(model).metadata
    tok = Tokenizer.from_metadata(md)
    template = template_for(md, MODELS[model])
    files = tokenizer_files(tok, template, ModelFacts(model, "test", 512))
    return tok, template, files, HFTokenizer.from_str(files["tokenizer.json"].decode())


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("parse_special", [True, False])
@pytest.mark.parametrize("add_special", [True, False])
def test_ids_equal_ours(model, parse_special, add_special):
    tok, _, _, hf = exported(model)
    hf.encode_special_tokens = not parse_special
    try:
        for text in TEXTS:
            ours = tok.encode(text, add_bos=None if add_special else False,
                              parse_special=parse_special)
            assert hf.encode(text, add_special_tokens=add_special).ids == ours, text
    finally:
        hf.encode_special_tokens = False


@pytest.mark.parametrize("model", MODELS)
def test_special_token_texts_are_special_tokens_or_text(model):
    """Negative control of the above: the control tokens' texts give one id each when parsed
    and several when not, so the parity checks above cover both paths."""
    tok, _, _, hf = exported(model)
    text = "<|im_end|>" if model == "smollm2" else "<end_of_turn>"
    assert len(tok.encode(text, add_bos=False, parse_special=True)) == 1
    assert len(tok.encode(text, add_bos=False, parse_special=False)) > 1
    assert len(hf.encode(text, add_special_tokens=False).ids) == 1


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("skip_special", [False, True])
def test_decoded_text_equals_ours(model, skip_special):
    tok, _, _, hf = exported(model)
    for text in TEXTS:
        ids = tok.encode(text, parse_special=True)
        assert hf.decode(ids, skip_special_tokens=skip_special) == \
            tok.decode(ids, skip_special=skip_special), text


def hf_render(template: str, messages: list[dict], config: dict) -> str:
    """A chat render as HF-style consumers do it: the template of tokenizer_config.json with its
    bos/eos texts, add_generation_prompt."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    return env.from_string(template).render(
        messages=messages, bos_token=config.get("bos_token", ""),
        eos_token=config.get("eos_token", ""), add_generation_prompt=True)


@pytest.mark.parametrize("model", MODELS)
def test_chat_renders_encode_to_our_chat_ids(model):
    tok, template, files, hf = exported(model)
    config = json.loads(files["tokenizer_config.json"])
    for messages in CHATS:
        text = hf_render(config["chat_template"], messages, config)
        # HF convention: the template writes BOS, the render is encoded without adding it
        assert hf.encode(text, add_special_tokens=False).ids == \
            chat_prompt_ids(tok, template, messages)


def test_a_template_without_bos_gets_one_where_the_vocabulary_adds_it():
    gemma, _, _, _ = exported("gemma3")
    smol, _, _, _ = exported("smollm2")
    assert exported_template(gemma, GEMMA_TURNS) == "{{ bos_token }}" + GEMMA_TURNS
    assert exported_template(smol, GEMMA_TURNS) == GEMMA_TURNS      # SmolLM2 adds no BOS
    with_bos = "{{ bos_token }}" + GEMMA_TURNS
    assert exported_template(gemma, with_bos) == with_bos
    assert exported_template(gemma, None) is None


@pytest.mark.parametrize("model", MODELS)
def test_the_archive_holds_the_three_files_at_its_root(model):
    tok, template, files, _ = exported(model)
    data = zip_files(files)
    assert zip_files(files) == data              # same files, same bytes (a stable sha256)
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        assert sorted(zf.namelist()) == sorted(TOKENIZER_FILES)
        config = json.loads(zf.read("config.json"))
        tcfg = json.loads(zf.read("tokenizer_config.json"))
    assert config["vocab_size"] == tok.vocab_size
    eos = config["eos_token_id"]
    assert sorted(eos if isinstance(eos, list) else [eos]) == sorted(tok.eog_ids)
    assert tcfg["bos_token"] == tok.token_text(tok.bos_id)
    assert tcfg["add_bos_token"] is tok.add_bos
    assert ("chat_template" in tcfg) is (template is not None)
