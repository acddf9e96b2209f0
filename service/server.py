"""grpc.aio servicers: the only place that converts protobuf <-> domain types.

    client --Generate--> GenerationServicer --submit(GenerationRequest, sink)--> Engine thread
    client <--Started/Delta*/Finished-- EventBuffer <--call_soon_threadsafe(event)-- sink

The engine thread never waits on a client: its sink only schedules a callback on the event
loop. Each stream buffers at most `stream_buffer` events; past that, pending Deltas are merged
into one, so a slow reader costs memory proportional to its text, never an engine stall.
A cancelled or expired call raises CancelledError in the handler, whose `finally` cancels the
engine request (the engine frees the slot within one step).

Prompts are rendered and tokenized on a small thread pool (`PROMPT_WORKERS`), never on the event
loop, and a text that cannot fit the context is refused before it is tokenized (`check_fits`),
so one large request neither delays other calls nor costs more than a context's worth of work.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields, replace
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from service import __version__
from service.config import EngineConfig, ServerConfig
from service.engine.spec.options import resolve as resolve_speculation
from service.engine.types import (
    Delta,
    Event,
    Finished,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    SpeculativeOptions,
    Started,
    StoppingCriteria,
)
from service.errors import InvalidRequestError, UnavailableError
from service.interceptors import ServiceInterceptor
from service.metrics import Metrics
from service.proto_build import DocumentedPool, stubs

if TYPE_CHECKING:                # generated on first use (service.proto_build.stubs)
    from service.proto import config_pb2, generation_pb2

log = structlog.get_logger(__name__)
PROMPT_WORKERS = 2               # prompts rendered/tokenized at once; more wait their turn


def service_names() -> tuple[str, str]:
    """Full names of the GenerationService and the ConfigService."""
    pb = stubs()
    return (pb.generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name,
            pb.config_pb2.DESCRIPTOR.services_by_name["ConfigService"].full_name)


# ------------------------------------------------------------------------- serving state
@dataclass
class ServingState:
    """What the servicers share: the engine once loaded, the startup config, the drain flags."""

    engine_config: EngineConfig
    server_config: ServerConfig = field(default_factory=ServerConfig)
    metrics: Metrics = field(default_factory=Metrics)
    health: health.aio.HealthServicer = field(default_factory=health.aio.HealthServicer)
    engine: Any = None               # service.engine.scheduler.Engine once loaded and warmed up
    draining: bool = False
    cut_off: bool = False            # the grace period ran out: calls still open are cancelled
    prompt_pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        PROMPT_WORKERS, thread_name_prefix="prompt"))

    def require_engine(self, *, admitting: bool = False) -> Any:
        if admitting and self.draining:
            raise UnavailableError("the server is shutting down; send the request to another "
                                   "replica")
        if self.engine is None:
            raise UnavailableError("the model is still loading; retry shortly")
        if not getattr(self.engine, "healthy", True):
            raise UnavailableError("the engine has stopped; send the request to another replica")
        return self.engine

    async def set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", *service_names()):
            await self.health.set(name, status)

    async def off_loop(self, fn: Any, *args: Any) -> Any:
        """fn(*args) on the prompt pool: tokenizing and rendering never block the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.prompt_pool, fn, *args)


# ------------------------------------------------------------------------- engine -> stream
def merge_deltas(a: Delta, b: Delta) -> Delta:
    return Delta(token_ids=a.token_ids + b.token_ids, text=a.text + b.text,
                 logprobs=a.logprobs + b.logprobs)


class EventBuffer:
    """Bounded hand-off of one request's events from the engine thread to its stream."""

    def __init__(self, loop: asyncio.AbstractEventLoop, maxsize: int) -> None:
        self._loop = loop
        self._maxsize = max(1, maxsize)
        self._items: deque[Event] = deque()
        self._waiter: asyncio.Future | None = None
        self.merged = 0                  # Deltas folded into an earlier one

    def sink(self, event: Event) -> None:
        """Called on the engine thread; never blocks, never raises."""
        try:
            self._loop.call_soon_threadsafe(self._push, event)
        except RuntimeError:
            pass                         # the loop is closed: nobody is listening any more

    def _push(self, event: Event) -> None:
        items = self._items
        if (isinstance(event, Delta) and len(items) >= self._maxsize
                and isinstance(items[-1], Delta)):
            items[-1] = merge_deltas(items[-1], event)
            self.merged += 1
        else:
            items.append(event)          # Started/Finished are never merged: at most max + 2
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> Event:
        while not self._items:
            self._waiter = self._loop.create_future()
            await self._waiter
        return self._items.popleft()


# ------------------------------------------------------------------------- proto -> domain
def _opt(msg: Any, name: str, default: Any, conv=lambda v: v) -> Any:
    return conv(getattr(msg, name)) if msg.HasField(name) else default


def sampling_from_proto(msg: generation_pb2.SamplingParams) -> SamplingParams:
    d = SamplingParams()
    return SamplingParams(
        temperature=_opt(msg, "temperature", d.temperature, float),
        top_k=_opt(msg, "top_k", d.top_k, int), top_p=_opt(msg, "top_p", d.top_p, float),
        min_p=_opt(msg, "min_p", d.min_p, float),
        repetition_penalty=_opt(msg, "repetition_penalty", d.repetition_penalty, float),
        repeat_last_n=_opt(msg, "repeat_last_n", d.repeat_last_n, int),
        seed=_opt(msg, "seed", d.seed, int))


_SPECULATIVE_MODES = {0: None, 1: "chain", 2: "tree", 3: "off"}   # SpeculativeMode values


def speculative_from_proto(msg: generation_pb2.SpeculativeOptions
                           ) -> tuple[bool | None, SpeculativeOptions]:
    """(enabled, the other options); an unknown mode number is INVALID_ARGUMENT."""
    if msg.mode not in _SPECULATIVE_MODES:
        raise InvalidRequestError("speculative.mode", f"unknown SpeculativeMode {msg.mode}")
    return _opt(msg, "enabled", None, bool), SpeculativeOptions(
        mode=_SPECULATIVE_MODES[msg.mode], width=_opt(msg, "width", None, int),
        tree_budget=_opt(msg, "tree_budget", None, int))


def stopping_from_proto(msg: generation_pb2.StoppingCriteria) -> StoppingCriteria:
    d = StoppingCriteria()
    return StoppingCriteria(
        max_new_tokens=_opt(msg, "max_new_tokens", d.max_new_tokens, int),
        stop_sequences=tuple(msg.stop_sequences), stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=_opt(msg, "ignore_eos", d.ignore_eos, bool))


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


def encode_chat(engine: Any, messages: list[dict[str, str]]) -> list[int]:
    """Role/content messages rendered with the model's template (or the built-in fallback),
    tokenized with special tokens parsed, as Engine.chat_prompt_ids; Generate and Tokenize
    both use this. The rendered text is checked against the context before tokenizing."""
    if not messages:
        raise InvalidRequestError("input.chat.messages", "the conversation is empty")
    text = engine.chat_prompt_text(messages)
    check_fits(engine.tokenizer, text, engine.config.n_ctx, "input.chat")
    return engine.tokenizer.encode(text, parse_special=True)


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
        ids = await state.off_loop(encode_text, engine, msg.text, _opt(msg, "add_bos", None, bool),
                                   _opt(msg, "parse_special", True, bool))
    elif which == "chat":
        messages = [{"role": m.role, "content": m.content} for m in msg.chat.messages]
        ids = await state.off_loop(encode_chat, engine, messages)
    elif which == "tokens":
        return token_ids(engine, msg.tokens.ids)
    else:
        raise InvalidRequestError("input", "set exactly one of text, tokens or chat")
    return tuple(ids)


async def request_from_proto(state: ServingState, engine: Any,
                             msg: generation_pb2.GenerateRequest) -> GenerationRequest:
    speculative, options = speculative_from_proto(msg.speculative)
    sampling = sampling_from_proto(msg.sampling)
    # checked again by the engine; here so a refused request is never tokenized
    resolve_speculation(speculative, options, engine.config, engine.config.drafter != "none",
                        sampling.repetition_penalty)
    return GenerationRequest(
        request_id=msg.request_id, prompt_ids=await prompt_ids(state, engine, msg),
        sampling=sampling, stopping=stopping_from_proto(msg.stopping),
        top_logprobs=_opt(msg.output, "top_logprobs", 0, int), speculative=speculative,
        speculative_options=options)


def engine_config_from_proto(msg: config_pb2.EngineConfig, base: EngineConfig) -> EngineConfig:
    """The fields set in msg over base (ValidateConfig's dry run)."""
    return replace(base, **{f.name: getattr(msg, f.name) for f in fields(EngineConfig)
                            if msg.HasField(f.name)})


# ------------------------------------------------------------------------- domain -> proto
@lru_cache(maxsize=1)
def _finish_reasons() -> dict[FinishReason, int]:
    values = stubs().generation_pb2.FinishReason
    return {r: values.Value(f"FINISH_REASON_{r.name}")
            for r in FinishReason if r is not FinishReason.ERROR}


def response_from_event(request_id: str, event: Event) -> generation_pb2.GenerateResponse:
    pb = stubs().generation_pb2
    if isinstance(event, Started):
        return pb.GenerateResponse(request_id=request_id, started=pb.Started(
            prompt_tokens=event.prompt_tokens, seed=event.seed))
    if isinstance(event, Delta):
        return pb.GenerateResponse(request_id=request_id, delta=pb.Delta(
            token_ids=event.token_ids, text=event.text,
            logprobs=[pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                                      top=[pb.TopLogprob(token_id=t, logprob=p)
                                           for t, p in lp.top])
                      for lp in event.logprobs]))
    u, t = event.usage, event.timings
    fin = pb.Finished(
        reason=_finish_reasons()[event.reason],
        usage=pb.Usage(**vars(u)), timings=pb.Timings(**vars(t)))
    if isinstance(event.matched_stop, str):
        fin.stop_sequence = event.matched_stop
    elif isinstance(event.matched_stop, int):
        fin.stop_token_id = event.matched_stop
    return pb.GenerateResponse(request_id=request_id, finished=fin)


def engine_config_to_proto(cfg: EngineConfig) -> config_pb2.EngineConfig:
    return stubs().config_pb2.EngineConfig(**{f.name: getattr(cfg, f.name) for f in fields(cfg)})


def model_info_to_proto(info: Any, cfg: EngineConfig) -> config_pb2.ModelInfo:
    msg = stubs().config_pb2.ModelInfo(
        name=info.name, architecture=info.architecture, file_type=str(info.file_type),
        n_params=int(info.n_params), n_ctx_train=int(info.n_ctx_train), n_ctx=int(info.n_ctx),
        vocab_size=int(info.vocab_size), eog_ids=[int(i) for i in info.eog_ids],
        backend=str(info.backend), drafter=cfg.drafter,
        draft_model=str(getattr(info, "draft_model", "")),
        kv_cache_type_k=cfg.kv_cache_type_k, kv_cache_type_v=cfg.kv_cache_type_v,
        server_version=__version__)
    if info.bos_id is not None:
        msg.bos_id = int(info.bos_id)
    if info.eos_id is not None:
        msg.eos_id = int(info.eos_id)
    if info.chat_template:
        msg.chat_template = info.chat_template
    return msg


def tokenize_response(engine: Any, ids: tuple[int, ...]) -> generation_pb2.TokenizeResponse:
    pieces = [engine.tokenizer.token_piece(i) for i in ids]
    return stubs().generation_pb2.TokenizeResponse(ids=ids, pieces=pieces)


def detokenize_response(engine: Any, ids: Sequence[int], skip_special: bool
                        ) -> generation_pb2.DetokenizeResponse:
    vocab = engine.tokenizer.vocab_size
    for i, t in enumerate(ids):
        if t >= vocab:
            raise InvalidRequestError(f"ids[{i}]", f"token id {t} is outside the "
                                                   f"vocabulary [0, {vocab})")
    text = engine.tokenizer.decode(ids, skip_special=skip_special)
    return stubs().generation_pb2.DetokenizeResponse(text=text)


# ------------------------------------------------------------------------- servicers
class GenerationServicer:
    """specstream.v1.GenerationService (registered by build_server)."""

    def __init__(self, state: ServingState) -> None:
        self._state = state

    async def Generate(self, request: generation_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> None:
        state = self._state
        engine = state.require_engine(admitting=True)
        rid = request.request_id     # the interceptor filled it in when empty
        domain = await request_from_proto(state, engine, request)
        buffer = EventBuffer(asyncio.get_running_loop(), state.server_config.stream_buffer)
        handle = engine.submit(domain, buffer.sink)
        state.metrics.streams.inc()
        finished = False
        try:
            while not finished:
                event = await buffer.get()
                if isinstance(event, Finished):
                    finished = True
                    if event.reason is FinishReason.ERROR:
                        log.error("engine_request_failed", error=event.error)
                        raise RuntimeError("the engine failed on this request")
                    state.metrics.observe_finished(event, buffer.merged)
                    log.info("generate_finished", reason=event.reason.value,
                             prompt_tokens=event.usage.prompt_tokens,
                             completion_tokens=event.usage.completion_tokens,
                             ttft_ms=round(event.timings.time_to_first_token_ms, 3),
                             merged_deltas=buffer.merged)
                await context.write(response_from_event(rid, event))
        finally:
            state.metrics.streams.dec()
            if not finished:         # cancel, deadline, broken connection, shutdown
                handle.cancel()
                log.info("generate_cancelled")

    async def Tokenize(self, request: generation_pb2.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> generation_pb2.TokenizeResponse:
        state = self._state
        engine = state.require_engine()
        if request.WhichOneof("input") is None:
            raise InvalidRequestError("input", "set one of text or chat")
        ids = await prompt_ids(state, engine, request)
        return await state.off_loop(tokenize_response, engine, ids)

    async def Detokenize(self, request: generation_pb2.DetokenizeRequest,
                         context: grpc.aio.ServicerContext) -> generation_pb2.DetokenizeResponse:
        state = self._state
        engine = state.require_engine()
        return await state.off_loop(detokenize_response, engine, list(request.ids),
                                    _opt(request, "skip_special", False, bool))


class ConfigServicer:
    """specstream.v1.ConfigService (registered by build_server)."""

    def __init__(self, state: ServingState) -> None:
        self._state = state

    def _effective(self) -> EngineConfig:
        engine = self._state.engine
        return engine.config if engine is not None else self._state.engine_config

    async def GetModelInfo(self, request, context) -> config_pb2.ModelInfo:
        engine = self._state.require_engine()
        return model_info_to_proto(engine.info, engine.config)

    async def GetConfig(self, request, context) -> config_pb2.GetConfigResponse:
        return stubs().config_pb2.GetConfigResponse(
            config=engine_config_to_proto(self._effective()))

    async def ValidateConfig(self, request: config_pb2.ValidateConfigRequest,
                             context) -> config_pb2.ValidateConfigResponse:
        pb = stubs().config_pb2
        candidate = engine_config_from_proto(request.config, self._effective())
        problems = candidate.problems()
        return pb.ValidateConfigResponse(
            valid=not problems, config=engine_config_to_proto(candidate),
            problems=[pb.ConfigProblem(field=f, message=m) for f, m in problems])


# ------------------------------------------------------------------------- the server
def server_options(cfg: ServerConfig) -> list[tuple[str, int]]:
    """Channel arguments chosen on purpose (README.md, "Limits and keepalive")."""
    opts = [
        ("grpc.max_receive_message_length", cfg.max_receive_message_bytes),
        ("grpc.max_send_message_length", cfg.max_send_message_bytes),
        ("grpc.keepalive_time_ms", int(cfg.keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(cfg.keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms",
         int(cfg.min_ping_interval_s * 1000)),
        ("grpc.http2.max_ping_strikes", 2),
        ("grpc.so_reuseport", 0),    # a second server on the same port fails instead of sharing
    ]
    if cfg.max_connection_age_s > 0:
        opts += [("grpc.max_connection_age_ms", int(cfg.max_connection_age_s * 1000)),
                 ("grpc.max_connection_age_grace_ms", int(cfg.grace_period_s * 1000))]
    return opts


def build_server(state: ServingState) -> grpc.aio.Server:
    """A grpc.aio server with our services, health and reflection (not yet bound or started).
    The first call generates the stubs when they are missing or stale."""
    pb = stubs()
    interceptor = ServiceInterceptor(state.metrics, cut_off=lambda: state.cut_off)
    server = grpc.aio.server(interceptors=[interceptor],
                             options=server_options(state.server_config),
                             compression=grpc.Compression.NoCompression)
    pb.generation_pb2_grpc.add_GenerationServiceServicer_to_server(
        GenerationServicer(state), server)
    pb.config_pb2_grpc.add_ConfigServiceServicer_to_server(ConfigServicer(state), server)
    health_pb2_grpc.add_HealthServicer_to_server(state.health, server)
    reflection.enable_server_reflection(
        (*service_names(), health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME), server, pool=DocumentedPool())
    return server
