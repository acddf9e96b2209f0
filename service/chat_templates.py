"""Chat templates as a configuration names them: the built-ins, a Jinja file's text checked at
startup, and the sandbox every template compiles in.

A leaf (it imports nothing of the service but errors), so `service.config` can check a
`--chat-template NAME|FILE` choice with the other settings, all problems at once, and the model
layer renders with the same environment (service/model/chat.py).

The environment is set up as HuggingFace's `apply_chat_template` sets it: trim_blocks and
lstrip_blocks, the loop-controls extension, `raise_exception`, `strftime_now` and a `tojson`
filter that keeps non-ASCII text. Templates come from model files, so they run in an immutable
sandbox and any attribute the sandbox deems unsafe (dunders, mutating methods) fails the render
instead of rendering as empty.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from service.errors import ConfigError

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
        compile_template(text)
    except TemplateError as exc:
        raise ConfigError([(SETTING, f"{choice!r} is not a valid Jinja template: {exc}")]) from exc
    return text


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
def compile_template(template: str) -> Any:
    """`template` compiled in the sandbox (cached by its text)."""
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    return env.from_string(template)
