"""Chat messages -> prompt text through the model's Jinja chat template, sandboxed.

Templates compile in service/chat_templates.py's sandbox (HuggingFace's `apply_chat_template`
environment), which also holds the built-ins and `load_template`. Every failure of a render
becomes `InvalidRequestError("input.chat", ...)`.

The template is the one configured (`--chat-template NAME|FILE`: a `BUILTIN_TEMPLATES` name or a
Jinja file), else the model's own `tokenizer.chat_template`. A model with neither (a base model
such as Gemma-3-270M) refuses chat input with `ChatTemplateMissingError` instead of being given
a built-in silently. The built-ins never write `bos_token`: the tokenizer adds BOS itself where
the metadata asks. `chat_prompt_ids` turns a render into llama.cpp's ids for the same text
(tests/data/llamacpp_*_greedy*.json hold ChatML prompts for both models).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from service.chat_templates import BUILTIN_TEMPLATES, RenderStopped, render_bounded
from service.chat_templates import CHATML as CHATML
from service.chat_templates import GEMMA_TURNS as GEMMA_TURNS
from service.chat_templates import load_template as load_template
from service.errors import ChatTemplateMissingError, InvalidRequestError

if TYPE_CHECKING:
    from service.model.tokenizer import Tokenizer

FIELD = "input.chat"
KEY_TEMPLATE = "tokenizer.chat_template"


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
        return render_bounded(template, messages=checked, bos_token=bos_token,
                              eos_token=eos_token, add_generation_prompt=add_generation_prompt)
    except RenderStopped as exc:  # its work bound, its deadline, or the call was cancelled
        raise InvalidRequestError(FIELD, f"chat template stopped: {exc}") from None
    except RecursionError:
        raise InvalidRequestError(FIELD, "chat template failed: recursion too deep") from None
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
