"""Chat messages -> prompt text through the model's Jinja chat template, sandboxed.

The environment is set up as HuggingFace's `apply_chat_template` sets it: trim_blocks and
lstrip_blocks, the loop-controls extension, `raise_exception`, `strftime_now` and a `tojson` filter
that keeps non-ASCII text. Templates come from model files, so they run in an immutable sandbox and
any attribute the sandbox deems unsafe (dunders, mutating methods) fails the render instead of
rendering as empty. Every failure becomes `InvalidRequestError("input.chat", ...)`.

The template is the one configured (`--chat-template NAME|FILE`: a `BUILTIN_TEMPLATES` name or a
Jinja file), else the model's own `tokenizer.chat_template`. A model with neither (a base model
such as Gemma-3-270M) refuses chat input with `ChatTemplateMissingError` instead of being given
a built-in silently. The built-ins never write `bos_token`: the tokenizer adds BOS itself where
the metadata asks. `chat_prompt_ids` turns a render into llama.cpp's ids for the same text
(tests/data/llamacpp_*_greedy*.json hold ChatML prompts for both models).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from service.errors import ChatTemplateMissingError, ConfigError, InvalidRequestError

if TYPE_CHECKING:
    from service.model.tokenizer import Tokenizer

FIELD = "input.chat"
KEY_TEMPLATE = "tokenizer.chat_template"

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Gemma turns: roles user/model, system text folded into the next turn, content trimmed.
GEMMA_TURNS = (
    "{% set state = namespace(prefix='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% set state.prefix = state.prefix + (message['content'] | trim) + '\\n\\n' %}"
    "{% else %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + state.prefix + (message['content'] | trim)"
    " + '<end_of_turn>\\n' }}"
    "{% set state.prefix = '' %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)

# --chat-template NAME -> template text
BUILTIN_TEMPLATES: dict[str, str] = {"chatml": CHATML, "gemma": GEMMA_TURNS}
SETTING = "chat_template"


def load_template(choice: str) -> str:
    """The template `choice` names: a built-in's name, else a Jinja file's path. The text is
    compiled here, so a bad choice is a ConfigError at startup, not a failed request."""
    if choice in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[choice]
    names = ", ".join(BUILTIN_TEMPLATES)
    path = Path(choice).expanduser()
    if not path.is_file():
        raise ConfigError([(SETTING, f"{choice!r} is neither a built-in template ({names}) "
                                     "nor a Jinja template file")])
    try:
        text = path.read_text("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([(SETTING, f"cannot read template file {choice!r}: {exc}")]) from exc
    try:
        _compile(text)
    except TemplateError as exc:
        raise ConfigError([(SETTING, f"{choice!r} is not a valid Jinja template: {exc}")]) from exc
    return text


def template_for(metadata: Mapping[str, Any], configured: str | None = None) -> str | None:
    """The configured template's text, else the model's own, else None (chat is refused)."""
    if configured:
        return configured
    own = metadata.get(KEY_TEMPLATE)
    return own if isinstance(own, str) and own.strip() else None


def missing_template(field: str = FIELD) -> ChatTemplateMissingError:
    """The error for chat input to a model without a template, naming the fix."""
    return ChatTemplateMissingError(field, (
        f"this model has no chat template ({KEY_TEMPLATE} is absent from its GGUF metadata) "
        "and none is configured; set one with --chat-template NAME|FILE (a built-in: "
        + ", ".join(BUILTIN_TEMPLATES) + "; or a Jinja file), or send text or token ids"))


class _Sandbox(ImmutableSandboxedEnvironment):
    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise SecurityError(f"access to attribute {attribute!r} of "
                            f"{type(obj).__name__!r} object is unsafe")


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    return env.from_string(template)


def render_chat(template: str, messages: Sequence[Mapping[str, str]], bos_token: str,
                eos_token: str, add_generation_prompt: bool = True) -> str:
    """Render `messages` ([{'role': ..., 'content': ...}, ...]) into one prompt string."""
    checked = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not all(
                isinstance(m.get(k), str) for k in ("role", "content")):
            raise InvalidRequestError(FIELD, f"message {i} needs string 'role' and 'content'")
        checked.append(dict(m))
    if not checked:
        raise InvalidRequestError(FIELD, "no messages")
    try:
        return _compile(template).render(
            messages=checked, bos_token=bos_token, eos_token=eos_token,
            add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # syntax, sandbox, raise_exception, type errors inside the template
        raise InvalidRequestError(FIELD, f"chat template failed: {exc}") from exc


def chat_prompt_ids(tokenizer: Tokenizer, template: str | None,
                    messages: Sequence[Mapping[str, str]]) -> list[int]:
    """Messages rendered with `template`, tokenized as prompt text is (special tokens parsed,
    BOS/EOS where the metadata adds them), with llama.cpp's ids for the same text.

    A BOS the template writes stays in the text unless the metadata adds one too: SmolLM2's BOS
    is `<|im_start|>` (add_bos_token false), which opens every turn, so its render keeps it and
    encodes it as token 1. Only where the tokenizer adds BOS itself (Gemma) is a leading
    `bos_token` text dropped, so the prompt gets one BOS; a trailing `eos_token` likewise.
    """
    return tokenizer.encode(chat_prompt_text(tokenizer, template, messages), parse_special=True)


def chat_prompt_text(tokenizer: Tokenizer, template: str | None,
                     messages: Sequence[Mapping[str, str]]) -> str:
    """The text chat_prompt_ids tokenizes (the server checks its length before tokenizing)."""
    if template is None:
        raise missing_template()
    tok = tokenizer
    bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
    eos = tok.token_text(tok.eos_id) if tok.eos_id is not None else ""
    text = render_chat(template, messages, bos, eos)
    if tok.add_bos and bos and text.startswith(bos):
        text = text[len(bos):]
    if tok.add_eos and eos and text.endswith(eos):
        text = text[:-len(eos)]
    return text
