"""A vLLM engine protocol GenerateRequest (vllm.grpc.engine) as the engine's requests, and the
engine's events as the protocol's responses.

Every request field is mapped or refused with INVALID_ARGUMENT naming it; none is dropped:

    tokenized.input_ids | text       the prompt (text is tokenized as Generate's text input);
                                     ids get a leading BOS where the vocabulary adds one and
                                     they lack it (ServerConfig.vllm_add_bos, on by default)
    sampling_params.temperature      temperature (unset: ours, 0.8); 0 = greedy
    .top_p .top_k .min_p             as ours; proto3 zeros: top_p 0 = 1 (off), top_k 0 = off,
    .repetition_penalty              min_p 0 = off, repetition_penalty 0 = 1 (off)
    .max_tokens                      max_new_tokens (unset: up to the end of the context)
    .stop .stop_token_ids            stop sequences and stop ids (the gateway also matches
                                     stop strings in its own text; both stop at the same token)
    .ignore_eos .seed                as ours (seed >= 0)
    .min_tokens .frequency_penalty   as ours (0 = off); logit_bias ids checked against the
    .presence_penalty .logit_bias    vocabulary, values in [-100, 100], at most 300
    .n                               n samples (0 = 1), as GenerateRequest.n
                                     (service/server_samples.py); responses carry `index`
    .logprobs                        N alternatives per token (0: the chosen token's only)
    .truncate_prompt_tokens          keep the last N prompt tokens (-1: as many as fit), before
                                     the BOS above
    .skip_special_tokens .spaces_between_special_tokens .include_stop_str_in_output
                                     text options: this protocol returns token ids only, and
                                     the gateway detokenizes with them, so there is no text
                                     here for them to change
    .json_schema .regex .grammar .choice .json_object
                                     structured output (GenerateRequest.constraint's fields;
                                     a compile error is INVALID_ARGUMENT on the field)
    .grammar_from_first_token        ignored: constraints apply from the first token
    .prompt_logprobs                 N in [0, 20]: each prompt token's log-probability and N
                                     alternatives (input_logprobs of the first chunk, or of
                                     the complete message)
    refused when set: prompt_logprobs -1, logprobs -1, structural_tag, mm_inputs,
    extra_mm_inputs, media_refs, kv_transfer_params(_json), data_parallel_rank other than 0.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from service.engine.constraint import compile_constraint
from service.engine.spec.options import resolve as resolve_speculation
from service.engine.types import (
    MAX_LOGIT_BIAS,
    MAX_TOP_LOGPROBS,
    Constraint,
    Delta,
    Finished,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    SpeculativeOptions,
    StoppingCriteria,
    TokenLogprob,
)
from service.errors import InvalidRequestError
from service.server_requests import encode_text
from service.server_samples import check_samples_fit, sample_requests

if TYPE_CHECKING:
    from service.server import ServingState

MAX_N = 16                       # samples per request
SP = "sampling_params"
DEFAULTS = SamplingParams()
# advertised in GetModelInfo.default_sampling_params_json, so a gateway fills what its client
# left unset with these instead of its own
DEFAULT_SAMPLING = {"temperature": DEFAULTS.temperature, "top_p": DEFAULTS.top_p,
                    "top_k": DEFAULTS.top_k, "min_p": DEFAULTS.min_p,
                    "repetition_penalty": DEFAULTS.repetition_penalty}
# our validators' field names -> the protocol's
_FIELD_NAMES = (("stopping.max_new_tokens", f"{SP}.max_tokens"),
                ("stopping.stop_sequences", f"{SP}.stop"),
                ("stopping.stop_token_ids", f"{SP}.stop_token_ids"),
                ("stopping.min_tokens", f"{SP}.min_tokens"),
                ("output.top_logprobs", f"{SP}.logprobs"),
                ("output.prompt_top_logprobs", f"{SP}.prompt_logprobs"),
                ("input.tokens.ids", "tokenized.input_ids"), ("input.text", "text"),
                ("input", "tokenized.input_ids"), ("sampling.", f"{SP}."))
_CONSTRAINTS = ("json_schema", "regex", "grammar", "structural_tag", "json_object", "choice")


def protocol_field(field: str) -> str:
    for ours, theirs in _FIELD_NAMES:
        if field.startswith(ours):
            return theirs + field[len(ours):]
    return field


def _refuse(field: str, why: str) -> InvalidRequestError:
    return InvalidRequestError(field, why + "; this server does not support it")


def check_request_fields(msg: Any) -> None:
    """INVALID_ARGUMENT for the first field set that the engine cannot honour."""
    for name in ("mm_inputs", "media_refs", "kv_transfer_params", "kv_transfer_params_json"):
        if msg.HasField(name):
            raise _refuse(name, "multimodal input and KV transfer are not served")
    if len(msg.extra_mm_inputs):
        raise _refuse("extra_mm_inputs", "multimodal input is not served")
    if msg.HasField("data_parallel_rank") and msg.data_parallel_rank != 0:
        raise _refuse("data_parallel_rank", "this server has one rank, 0")
    sp = msg.sampling_params
    if len(sp.logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidRequestError(f"{SP}.logit_bias", f"at most {MAX_LOGIT_BIAS} entries "
                                  f"allowed, got {len(sp.logit_bias)}")
    if sp.HasField("prompt_logprobs") and sp.prompt_logprobs < 0:
        raise _refuse(f"{SP}.prompt_logprobs", "prompt log-probabilities of the whole "
                      "vocabulary (-1)")
    which = sp.WhichOneof("constraint")
    if which == "structural_tag":
        raise _refuse(f"{SP}.{which}", "structural tags are not served (json_schema, regex, "
                      "grammar, choice and json_object are)")
    if sp.HasField("logprobs") and sp.logprobs < 0:
        raise _refuse(f"{SP}.logprobs", "log-probabilities of the whole vocabulary (-1)")
    if sp.HasField("seed") and sp.seed < 0:
        raise InvalidRequestError(f"{SP}.seed", f"must be >= 0, got {sp.seed}")
    if sp.n > MAX_N:
        raise InvalidRequestError(f"{SP}.n", f"at most {MAX_N} samples, got {sp.n}")


def constraint_of(sp: Any) -> Constraint | None:
    """The structured-output constraint of vLLM's SamplingParams (None when unset)."""
    which = sp.WhichOneof("constraint")
    if which is None:
        return None
    if which == "choice":
        return Constraint("choice", options=tuple(sp.choice.choices))
    if which == "json_object":
        return Constraint("json_object")
    return Constraint(which, getattr(sp, which))


def sampling_of(sp: Any) -> SamplingParams:
    return SamplingParams(
        temperature=sp.temperature if sp.HasField("temperature") else DEFAULTS.temperature,
        top_p=sp.top_p or 1.0, top_k=sp.top_k, min_p=sp.min_p,
        repetition_penalty=sp.repetition_penalty or 1.0,
        seed=sp.seed if sp.HasField("seed") else None,
        frequency_penalty=sp.frequency_penalty, presence_penalty=sp.presence_penalty,
        logit_bias=tuple(sorted((int(k), float(v)) for k, v in sp.logit_bias.items())))


def _truncate(ids: tuple[int, ...], sp: Any, room: int) -> tuple[int, ...]:
    """The last truncate_prompt_tokens ids (-1: `room`, as many as leave a token to generate)."""
    if not sp.HasField("truncate_prompt_tokens"):
        return ids
    keep = sp.truncate_prompt_tokens
    if keep == -1:
        keep = room
    if keep < 1:
        raise InvalidRequestError(f"{SP}.truncate_prompt_tokens",
                                  f"must be -1 or >= 1, got {sp.truncate_prompt_tokens}")
    return ids[-keep:]


async def prompt_of(state: ServingState, engine: Any, msg: Any) -> tuple[int, ...]:
    which = msg.WhichOneof("input")
    if which == "tokenized":
        ids = tuple(msg.tokenized.input_ids)
    elif which == "text":
        try:
            ids = tuple(await state.off_loop(encode_text, engine, msg.text, None, True))
        except InvalidRequestError as exc:
            raise InvalidRequestError(protocol_field(exc.field), str(exc).split(": ", 1)[-1],
                                      exc.reason) from exc
    else:
        raise InvalidRequestError("input", "set tokenized.input_ids or text")
    tok = engine.tokenizer
    bos = (which == "tokenized" and state.server_config.vllm_add_bos and tok.add_bos
           and tok.bos_id is not None and ids[:1] != (tok.bos_id,))
    ids = _truncate(ids, msg.sampling_params, engine.config.n_ctx - 1 - bos)
    # what the own text path and llama.cpp give this model
    return (tok.bos_id, *ids) if bos and ids[:1] != (tok.bos_id,) else ids


async def requests_from_proto(state: ServingState, engine: Any, msg: Any
                              ) -> list[GenerationRequest]:
    """The request's samples as engine requests (one unless n > 1), each checked as the
    engine will check it, field names given as the protocol's."""
    check_request_fields(msg)
    sp = msg.sampling_params
    prompt = await prompt_of(state, engine, msg)
    sampling = sampling_of(sp)
    n_ctx = engine.config.n_ctx
    max_new = sp.max_tokens if sp.HasField("max_tokens") else max(1, n_ctx - len(prompt))
    top = 0 if not sp.HasField("logprobs") else min(max(sp.logprobs, 1), MAX_TOP_LOGPROBS + 1)
    base = GenerationRequest(
        request_id=msg.request_id, prompt_ids=prompt, sampling=sampling,
        stopping=StoppingCriteria(max_new_tokens=max_new, stop_sequences=tuple(sp.stop),
                                  stop_token_ids=tuple(sp.stop_token_ids),
                                  ignore_eos=sp.ignore_eos, min_tokens=sp.min_tokens),
        top_logprobs=top,
        prompt_logprobs=sp.prompt_logprobs if sp.HasField("prompt_logprobs") else None,
        speculation=resolve_speculation(None, SpeculativeOptions(), engine.config,
                                        engine.config.drafter != "none",
                                        sampling.repetition_penalty, sampling.reads_history))
    constraint = constraint_of(sp)
    if constraint is not None:
        if base.speculation is not None and base.speculation.on and base.speculation.tree_budget:
            raise _refuse(f"{SP}.{sp.WhichOneof('constraint')}", "a constraint with the "
                          "server's tree speculation")
        try:
            compiled = await state.compile_off_loop(compile_constraint, engine.tokenizer,
                                                    constraint, engine.spec.vocab_size)
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"{SP}.{constraint.kind}", str(exc).split(": ", 1)[-1],
                                      exc.reason) from exc
        base = replace(base, constraint=constraint, compiled_constraint=compiled)
    try:
        base.validate(engine.spec.vocab_size, n_ctx)
    except InvalidRequestError as exc:
        field = exc.field
        if msg.WhichOneof("input") == "text" and field.startswith("input"):
            field = "input.text"        # the prompt the client gave: text, not input_ids
        raise InvalidRequestError(protocol_field(field), str(exc).split(": ", 1)[-1],
                                  exc.reason) from exc
    check_samples_fit(max(1, sp.n), engine.config, f"{SP}.n")
    return sample_requests(base, max(1, sp.n))


# ------------------------------------------------------------------------- events -> proto
def finish_reason(reason: FinishReason) -> str:
    """vLLM's finish reasons: stop (an end token, stop id or stop string, a completed
    constraint), length, abort (cancelled, or a constraint that allows nothing after the text:
    the text is a valid prefix, not a complete sentence, and not a request error)."""
    if reason in (FinishReason.LENGTH, FinishReason.CONTEXT_LIMIT):
        return "length"
    if reason in (FinishReason.CANCELLED, FinishReason.CONSTRAINT_DEAD_END):
        return "abort"
    return "stop"


def output_logprobs(pb: Any, delta: Delta, chosen_only: bool) -> Any:
    """The protocol's OutputLogProbs of a Delta (logprobs 0: no alternatives)."""
    lps = delta.logprobs
    return pb.OutputLogProbs(
        token_logprobs=[lp.logprob for lp in lps], token_ids=[lp.token_id for lp in lps],
        top_logprobs=[pb.TopLogProbs(values=[] if chosen_only else [p for _, p in lp.top],
                                     token_ids=[] if chosen_only else [t for t, _ in lp.top])
                      for lp in lps])


def input_logprobs(pb: Any, prompt: tuple[int, ...], lps: tuple[TokenLogprob, ...]) -> Any:
    """The protocol's InputLogProbs of a prompt: no value for its first token, then each
    token's log-probability (Started.prompt_logprobs) with its alternatives."""
    return pb.InputLogProbs(
        token_logprobs=[pb.InputTokenLogProb()] + [pb.InputTokenLogProb(value=lp.logprob)
                                                   for lp in lps],
        token_ids=prompt,
        top_logprobs=[pb.TopLogProbs()] + [pb.TopLogProbs(values=[p for _, p in lp.top],
                                                          token_ids=[t for t, _ in lp.top])
                                           for lp in lps])


def complete_of(pb: Any, event: Finished, ids: list[int], index: int) -> Any:
    msg = pb.GenerateComplete(
        output_ids=ids, finish_reason=finish_reason(event.reason),
        prompt_tokens=event.usage.prompt_tokens, completion_tokens=event.usage.completion_tokens,
        cached_tokens=event.usage.cached_prompt_tokens, index=index,
        spec_accepted_tokens=event.usage.accepted_draft_tokens,
        spec_draft_tokens=event.usage.draft_tokens)
    if isinstance(event.matched_stop, str):
        msg.matched_stop_str = event.matched_stop
    elif isinstance(event.matched_stop, int):
        msg.matched_token_id = event.matched_stop
    return msg
