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

Message content is text: a user who writes `<|im_end|>` gets the characters, not the control
token, or a message could close its own turn and open a system turn. Before rendering, every
control-token text inside a content is swapped for a stand-in character (from Unicode's private
use planes, one the conversation does not use); the render is tokenized with special tokens
parsed, which turns the template's own markers into control tokens, and the stand-ins are put
back as text (`ChatPrompt`). A conversation without such text renders and tokenizes exactly as
before. `content_special=True` (a server option) parses content as the template's text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
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


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered conversation: its text with stand-ins for the control-token texts written in
    message content, and what each stand-in stands for."""

    text: str
    literals: dict[str, str] = field(default_factory=dict)

    @property
    def plain(self) -> str:
        """The text as rendered, stand-ins put back."""
        out = self.text
        for stand_in, literal in self.literals.items():
            out = out.replace(stand_in, literal)
        return out

    def ids(self, tokenizer: Tokenizer) -> list[int]:
        return tokenizer.encode(self.text, parse_special=True, literals=self.literals)


_STAND_INS = range(0xF0000, 0x10FFFE)   # planes 15 and 16: private use, never in a vocabulary


def _stand_ins(tokenizer: Tokenizer, template: str,
               messages: Sequence[Mapping[str, str]]) -> dict[str, str]:
    """control text -> a stand-in character, for the control texts written in any content."""
    contents = [m.get("content") for m in messages if isinstance(m, Mapping)]
    contents = [c for c in contents if isinstance(c, str)]
    found = [t for t in tokenizer.control_texts() if any(t in c for c in contents)]
    if not found:
        return {}
    used = set(template).union(*map(set, contents))
    free = (chr(c) for c in _STAND_INS if chr(c) not in used)
    return {text: next(free) for text in found}


def chat_prompt(tokenizer: Tokenizer, template: str | None,
                messages: Sequence[Mapping[str, str]], content_special: bool = False
                ) -> ChatPrompt:
    """`messages` rendered with `template`; content tokenizes as text unless content_special."""
    if template is None:
        raise missing_template()
    swap = {} if content_special else _stand_ins(tokenizer, template, messages)
    if swap:
        shown = []
        for m in messages:
            m = dict(m)
            if isinstance(m.get("content"), str):
                for text, stand_in in swap.items():       # longest first
                    m["content"] = m["content"].replace(text, stand_in)
            shown.append(m)
        messages = shown
    text = chat_prompt_text(tokenizer, template, messages)
    return ChatPrompt(text, {stand_in: text for text, stand_in in swap.items()})


def chat_prompt_ids(tokenizer: Tokenizer, template: str | None,
                    messages: Sequence[Mapping[str, str]], content_special: bool = False
                    ) -> list[int]:
    """Messages rendered with `template`, tokenized as prompt text is (special tokens parsed,
    BOS/EOS where the metadata adds them), with llama.cpp's ids for the same text.

    A BOS the template writes stays in the text unless the metadata adds one too: SmolLM2's BOS
    is `<|im_start|>` (add_bos_token false), which opens every turn, so its render keeps it and
    encodes it as token 1. Only where the tokenizer adds BOS itself (Gemma) is a leading
    `bos_token` text dropped, so the prompt gets one BOS; a trailing `eos_token` likewise.
    Control-token text inside message content stays text unless `content_special`.
    """
    return chat_prompt(tokenizer, template, messages, content_special).ids(tokenizer)


def chat_prompt_text(tokenizer: Tokenizer, template: str | None,
                     messages: Sequence[Mapping[str, str]]) -> str:
    """The rendered text (content as given), after the BOS/EOS the tokenizer adds itself."""
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
