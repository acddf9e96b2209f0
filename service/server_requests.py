"""A GenerateRequest (or a TokenizeRequest's input) as the engine's domain types.

Its speculative options are resolved here, against the engine's configuration, once: a refused
request is never tokenized, and the engine gets them resolved (GenerationRequest.speculation).
Prompts are rendered and tokenized on the serving state's prompt pool, and a text that cannot
fit the context is refused before it is tokenized (`check_fits`), so one large request neither
delays other calls nor costs more than a context's worth of work.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from service.chat_templates import RenderWatch, watching
from service.engine.constraint import check as check_constraint
from service.engine.constraint import compile_constraint
from service.engine.spec.options import resolve as resolve_speculation
from service.engine.types import (
    MAX_LOGIT_BIAS,
    MAX_N,
    Constraint,
    GenerationRequest,
    SamplingParams,
    SpeculativeOptions,
    StoppingCriteria,
)
from service.errors import InvalidRequestError

if TYPE_CHECKING:                # generated on first use (service.proto_build.stubs)
    from service.proto import generation_pb2
    from service.server import ServingState


def optional(msg: Any, name: str, default: Any, conv=lambda v: v) -> Any:
    """conv(msg.name) when the optional field is set, else `default`."""
    return conv(getattr(msg, name)) if msg.HasField(name) else default


def sampling_from_proto(msg: generation_pb2.SamplingParams) -> SamplingParams:
    d = SamplingParams()
    if len(msg.logit_bias) > MAX_LOGIT_BIAS:        # refused before building anything of it
        raise InvalidRequestError("sampling.logit_bias", f"at most {MAX_LOGIT_BIAS} entries "
                                  f"allowed, got {len(msg.logit_bias)}")
    return SamplingParams(
        temperature=optional(msg, "temperature", d.temperature, float),
        top_k=optional(msg, "top_k", d.top_k, int), top_p=optional(msg, "top_p", d.top_p, float),
        min_p=optional(msg, "min_p", d.min_p, float),
        repetition_penalty=optional(msg, "repetition_penalty", d.repetition_penalty, float),
        repeat_last_n=optional(msg, "repeat_last_n", d.repeat_last_n, int),
        seed=optional(msg, "seed", d.seed, int),
        frequency_penalty=optional(msg, "frequency_penalty", d.frequency_penalty, float),
        presence_penalty=optional(msg, "presence_penalty", d.presence_penalty, float),
        logit_bias=tuple(sorted((int(k), float(v)) for k, v in msg.logit_bias.items())))


_SPECULATIVE_MODES = {0: None, 1: "chain", 2: "tree", 3: "off"}   # SpeculativeMode values


def speculative_from_proto(msg: generation_pb2.SpeculativeOptions
                           ) -> tuple[bool | None, SpeculativeOptions]:
    """(enabled, the other options); an unknown mode number is INVALID_ARGUMENT."""
    if msg.mode not in _SPECULATIVE_MODES:
        raise InvalidRequestError("speculative.mode", f"unknown SpeculativeMode {msg.mode}")
    return optional(msg, "enabled", None, bool), SpeculativeOptions(
        mode=_SPECULATIVE_MODES[msg.mode], width=optional(msg, "width", None, int),
        tree_budget=optional(msg, "tree_budget", None, int))


MAX_STOP_TOKEN_IDS = 1024        # each is checked against the vocabulary at every step's end


def stopping_from_proto(msg: generation_pb2.StoppingCriteria) -> StoppingCriteria:
    n = len(msg.stop_token_ids)
    if n > MAX_STOP_TOKEN_IDS:
        raise InvalidRequestError("stopping.stop_token_ids",
                                  f"{n} ids; at most {MAX_STOP_TOKEN_IDS}")
    d = StoppingCriteria()
    return StoppingCriteria(
        max_new_tokens=optional(msg, "max_new_tokens", d.max_new_tokens, int),
        stop_sequences=tuple(msg.stop_sequences), stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=optional(msg, "ignore_eos", d.ignore_eos, bool),
        min_tokens=optional(msg, "min_tokens", d.min_tokens, int))


# A prompt text is rejected before it is tokenized when even its fewest possible tokens
# overflow the context. The tokenizers of service/model/tokenizer.py run no normalizer, so each
# token stands for a contiguous run of the text: byte-level BPE writes every input byte as one
# character of the token's vocabulary text (1 or 2 bytes of UTF-8), SentencePiece writes a space
# as U+2581 (3 bytes) and a fallback byte as "<0xAB>" (6 bytes), a special token matches its own
# text, and an unknown character (at most 4 bytes) becomes one token. So one token covers at most
#     M = max(4, longest vocabulary text in UTF-8 bytes)
# bytes of the text, and a text of B bytes gives at least ceil(B / M) tokens (BOS/EOS add more).
@lru_cache(maxsize=8)
def max_token_bytes(tokenizer: Any) -> int:
    """M above: the most bytes of input text one token of `tokenizer` can cover."""
    longest = max((len(tokenizer.token_text(i).encode("utf-8", "surrogatepass"))
                   for i in range(tokenizer.vocab_size)), default=0)
    return max(4, longest)


def check_fits(tokenizer: Any, text: str, n_ctx: int, field: str) -> None:
    """PROMPT_TOO_LONG when `text` needs more than n_ctx tokens, decided without tokenizing."""
    if not tokenizer.can_encode:
        return                   # encode() itself answers FAILED_PRECONDITION, at once
    m = max_token_bytes(tokenizer)
    n_bytes = len(text.encode("utf-8", "surrogatepass"))
    fewest = -(-n_bytes // m)
    if fewest > n_ctx:
        raise InvalidRequestError(
            field, f"the text is {n_bytes} bytes and one token covers at most {m}, so it needs "
            f"at least {fewest} tokens; the context holds {n_ctx}", reason="PROMPT_TOO_LONG")


def encode_text(engine: Any, text: str, add_bos: bool | None, parse_special: bool) -> list[int]:
    """Plain text as prompt ids, refused unread when it cannot fit the context. Blocking."""
    check_fits(engine.tokenizer, text, engine.config.n_ctx, "input.text")
    if add_bos is None and parse_special:
        return engine.text_prompt_ids(text)      # exactly what `specstream generate` does
    return engine.tokenizer.encode(text, add_bos=add_bos, parse_special=parse_special)


def encode_chat(engine: Any, messages: list[dict[str, str]],
                watch: RenderWatch | None = None, content_special: bool = False) -> list[int]:
    """Role/content messages rendered with the model's template (or the built-in fallback),
    tokenized as Engine.chat_prompt_ids: the template's markers as control tokens, message
    content as text unless `content_special`; Generate and Tokenize both use this. The render
    runs under `watch` (its bounds, and a cancelled call stops it); the rendered text is
    checked against the context before tokenizing."""
    if not messages:
        raise InvalidRequestError("input.chat.messages", "the conversation is empty")
    with watching(watch or RenderWatch()):
        prompt = engine.chat_prompt(messages, content_special)
    check_fits(engine.tokenizer, prompt.plain, engine.config.n_ctx, "input.chat")
    return prompt.ids(engine.tokenizer)


def token_ids(engine: Any, ids: Sequence[int]) -> tuple[int, ...]:
    """Token-id input; a list longer than the context is refused before it is copied."""
    n_ctx = engine.config.n_ctx
    if len(ids) >= n_ctx:
        raise InvalidRequestError(
            "input.tokens.ids", f"the prompt has {len(ids)} tokens; the context holds {n_ctx}, "
            "leaving no room to generate", reason="PROMPT_TOO_LONG")
    return tuple(ids)


async def prompt_ids(state: ServingState, engine: Any, msg: Any) -> tuple[int, ...]:
    """The prompt token ids of a GenerateRequest or TokenizeRequest, built on the prompt pool."""
    which = msg.WhichOneof("input")
    if which == "text":
        ids = await state.off_loop(encode_text, engine, msg.text,
                                   optional(msg, "add_bos", None, bool),
                                   optional(msg, "parse_special", True, bool))
    elif which == "chat":
        messages = [{"role": m.role, "content": m.content} for m in msg.chat.messages]
        watch = RenderWatch()
        try:
            ids = await state.off_loop(encode_chat, engine, messages, watch,
                                       state.server_config.chat_special_tokens)
        except asyncio.CancelledError:   # the call ended: free the prompt worker now
            watch.interrupt("the call was cancelled")
            raise
    elif which == "tokens":
        return token_ids(engine, msg.tokens.ids)
    else:
        raise InvalidRequestError("input", "set exactly one of text, tokens or chat")
    return tuple(ids)


def n_from_proto(msg: generation_pb2.GenerateRequest) -> int:
    """GenerateRequest.n: unset 1, else in [1, MAX_N]."""
    n = optional(msg, "n", 1, int)
    if not 1 <= n <= MAX_N:
        raise InvalidRequestError("n", f"must be in [1, {MAX_N}], got {n}")
    return n


async def request_from_proto(state: ServingState, engine: Any,
                             msg: generation_pb2.GenerateRequest) -> GenerationRequest:
    speculative, options = speculative_from_proto(msg.speculative)
    sampling = sampling_from_proto(msg.sampling)
    speculation = resolve_speculation(speculative, options, engine.config,
                                      engine.config.drafter != "none",
                                      sampling.repetition_penalty, sampling.reads_history)
    constraint, compiled = constraint_from_proto(msg), None
    if constraint is not None:
        if speculation is not None and speculation.on and speculation.tree_budget > 0:
            raise InvalidRequestError("speculative.mode", "tree speculation cannot be used "
                                      "with a constraint; use chain or off")
        compiled = await state.compile_off_loop(compile_constraint, engine.tokenizer,
                                                constraint, engine.spec.vocab_size)
    return GenerationRequest(
        constraint=constraint, compiled_constraint=compiled,
        request_id=msg.request_id, prompt_ids=await prompt_ids(state, engine, msg),
        sampling=sampling, stopping=stopping_from_proto(msg.stopping),
        top_logprobs=optional(msg.output, "top_logprobs", 0, int), speculative=speculative,
        speculative_options=options, speculation=speculation,
        prompt_logprobs=prompt_logprobs_from_proto(msg.output),
        priority=optional(msg, "priority", 0, int))


def constraint_from_proto(msg: generation_pb2.GenerateRequest) -> Constraint | None:
    """GenerateRequest.constraint as a Constraint (checked, not compiled), None when unset."""
    kind = msg.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "choice":
        c = Constraint("choice", options=tuple(msg.choice.options))
    elif kind == "json_object":
        if not msg.json_object:
            raise InvalidRequestError("constraint.json_object", "must be true when set")
        c = Constraint("json_object")
    else:
        c = Constraint(kind, getattr(msg, kind))
    check_constraint(c)
    return c


def prompt_logprobs_from_proto(msg: generation_pb2.OutputOptions) -> int | None:
    """None unless prompt_logprobs is true; then prompt_top_logprobs (unset: 0)."""
    top = optional(msg, "prompt_top_logprobs", None, int)
    if not optional(msg, "prompt_logprobs", False, bool):
        if top is not None:
            raise InvalidRequestError("output.prompt_top_logprobs",
                                      "set without output.prompt_logprobs = true")
        return None
    return top or 0
