"""Client library: `SpecstreamClient` (blocking) and `AsyncSpecstreamClient` (asyncio).

    with SpecstreamClient("localhost:50051") as c:
        for r in c.generate("Once upon a time", max_new_tokens=32, temperature=0):
            if r.HasField("delta"):
                print(r.delta.text, end="", flush=True)

`generate()` yields the raw `GenerateResponse` messages (Started, Deltas, Finished) as they
arrive; `complete()` folds them into a `Completion`. Leaving a `generate()` loop early cancels
the call, which frees the server's engine slot. Failures raise `grpc.RpcError`; `error_details()`
unpacks its google.rpc details (field violations, retry delay, reason).
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.proto_build import stubs

if TYPE_CHECKING:                # generated on first use (service.proto_build.stubs)
    from service.proto import config_pb2, generation_pb2

DEFAULT_TARGET = "localhost:50051"
TARGET_ENV = "SPECSTREAM_TARGET"
MIB = 1 << 20
CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", 32 * MIB),
    ("grpc.max_send_message_length", 32 * MIB),
    ("grpc.keepalive_time_ms", 30_000),     # >= the server's 10 s minimum ping interval
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
)
ChatInput = Sequence[tuple[str, str] | Mapping[str, str]]


def default_target() -> str:
    """$SPECSTREAM_TARGET, else DEFAULT_TARGET (read when a client is made, not on import)."""
    return os.environ.get(TARGET_ENV) or DEFAULT_TARGET


# ------------------------------------------------------------------------- requests
def _chat(messages: ChatInput) -> generation_pb2.ChatMessages:
    out = stubs().generation_pb2.ChatMessages()
    for m in messages:
        role, content = (m["role"], m["content"]) if isinstance(m, Mapping) else m
        out.messages.add(role=role, content=content)
    return out


def _set_optional(msg: Any, **values: Any) -> None:
    for name, value in values.items():
        if value is not None:
            setattr(msg, name, value)


def build_generate_request(
    prompt: str | None = None, *, tokens: Iterable[int] | None = None,
    chat: ChatInput | None = None, request_id: str = "",
    temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
    min_p: float | None = None, repetition_penalty: float | None = None,
    repeat_last_n: int | None = None, seed: int | None = None,
    max_new_tokens: int | None = None, stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (), ignore_eos: bool | None = None,
    top_logprobs: int | None = None, speculative: bool | None = None,
    speculative_mode: str | None = None, speculative_width: int | None = None,
    speculative_tree_budget: int | None = None,
    add_bos: bool | None = None, parse_special: bool | None = None,
    frequency_penalty: float | None = None, presence_penalty: float | None = None,
    logit_bias: Mapping[int, float] | None = None, min_tokens: int | None = None,
    n: int | None = None, prompt_logprobs: bool | None = None,
    prompt_top_logprobs: int | None = None,
    priority: int | None = None,
) -> generation_pb2.GenerateRequest:
    """A GenerateRequest from keyword arguments; None leaves a field unset (server default).
    speculative_mode: "chain", "tree" or "off"; logit_bias: {token id: bias}."""
    given = [x is not None for x in (prompt, tokens, chat)]
    if sum(given) != 1:
        raise ValueError("give exactly one of prompt, tokens or chat")
    req = stubs().generation_pb2.GenerateRequest(request_id=request_id)
    if prompt is not None:
        req.text = prompt
    elif tokens is not None:
        req.tokens.ids.extend(tokens)
    else:
        req.chat.CopyFrom(_chat(chat))
    _set_optional(req.sampling, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                  repetition_penalty=repetition_penalty, repeat_last_n=repeat_last_n, seed=seed,
                  frequency_penalty=frequency_penalty, presence_penalty=presence_penalty)
    for tok, bias in (logit_bias or {}).items():
        req.sampling.logit_bias[tok] = bias
    _set_optional(req.stopping, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos,
                  min_tokens=min_tokens)
    req.stopping.stop_sequences.extend(stop)
    req.stopping.stop_token_ids.extend(stop_token_ids)
    _set_optional(req.output, top_logprobs=top_logprobs, prompt_logprobs=prompt_logprobs,
                  prompt_top_logprobs=prompt_top_logprobs)
    _set_optional(req.speculative, enabled=speculative)
    if speculative_mode is not None:
        req.speculative.mode = stubs().generation_pb2.SpeculativeMode.Value(
            "SPECULATIVE_MODE_" + speculative_mode.upper())
    _set_optional(req.speculative, width=speculative_width,
                  tree_budget=speculative_tree_budget)
    _set_optional(req, add_bos=add_bos, parse_special=parse_special, n=n, priority=priority)
    return req


def _tokenize_request(text: str | None, chat: ChatInput | None, add_bos: bool | None,
                      parse_special: bool | None) -> generation_pb2.TokenizeRequest:
    if (text is None) == (chat is None):
        raise ValueError("give exactly one of text or chat")
    req = stubs().generation_pb2.TokenizeRequest()
    if text is not None:
        req.text = text
    else:
        req.chat.CopyFrom(_chat(chat))
    _set_optional(req, add_bos=add_bos, parse_special=parse_special)
    return req


def _detokenize_request(ids: Iterable[int], skip_special: bool | None
                        ) -> generation_pb2.DetokenizeRequest:
    req = stubs().generation_pb2.DetokenizeRequest(ids=list(ids))
    _set_optional(req, skip_special=skip_special)
    return req


def _config_request(settings: Mapping[str, Any]) -> config_pb2.ValidateConfigRequest:
    pb = stubs().config_pb2
    return pb.ValidateConfigRequest(config=pb.EngineConfig(
        **{k: v for k, v in settings.items() if v is not None}))


# ------------------------------------------------------------------------- results
@dataclass
class Completion:
    """All events of one Generate stream folded together."""

    request_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    deltas: int = 0
    prompt_tokens: int = 0
    seed: int = 0
    finish_reason: str = ""          # LENGTH, EOS, STOP_SEQUENCE, CONSTRAINT_DEAD_END, ...
    stop_sequence: str | None = None
    stop_token_id: int | None = None
    usage: generation_pb2.Usage | None = None
    timings: generation_pb2.Timings | None = None
    logprobs: list[generation_pb2.TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[generation_pb2.TokenLogprob] = field(default_factory=list)

    def add(self, r: generation_pb2.GenerateResponse) -> None:
        self.request_id = r.request_id
        kind = r.WhichOneof("event")
        if kind == "started":
            self.prompt_tokens, self.seed = r.started.prompt_tokens, r.started.seed
            self.prompt_logprobs = list(r.started.prompt_logprobs)
        elif kind == "delta":
            self.deltas += 1
            self.text += r.delta.text
            self.token_ids.extend(r.delta.token_ids)
            self.logprobs.extend(r.delta.logprobs)
        elif kind == "finished":
            f = r.finished
            self.finish_reason = stubs().generation_pb2.FinishReason.Name(f.reason).removeprefix(
                "FINISH_REASON_")
            self.usage, self.timings = f.usage, f.timings
            which = f.WhichOneof("matched_stop")
            if which == "stop_sequence":
                self.stop_sequence = f.stop_sequence
            elif which == "stop_token_id":
                self.stop_token_id = f.stop_token_id


@dataclass
class ErrorDetails:
    """What a failed call carries besides its code."""

    code: str
    message: str
    reason: str = ""
    field_violations: list[tuple[str, str]] = field(default_factory=list)
    retry_after_s: float | None = None
    metadata: dict[str, str] = field(default_factory=dict)


def error_details(err: grpc.RpcError) -> ErrorDetails:
    """Unpacks google.rpc details (BadRequest, RetryInfo, ErrorInfo) of a failed call."""
    code = err.code().name if callable(getattr(err, "code", None)) else "UNKNOWN"
    out = ErrorDetails(code=code, message=err.details() or "")
    for key, value in err.trailing_metadata() or ():
        if key != "grpc-status-details-bin":
            continue
        status = status_pb2.Status.FromString(value)
        for any_msg in status.details:
            for cls in (error_details_pb2.BadRequest, error_details_pb2.RetryInfo,
                        error_details_pb2.ErrorInfo):
                if any_msg.Is(cls.DESCRIPTOR):
                    d = cls()
                    any_msg.Unpack(d)
                    if isinstance(d, error_details_pb2.BadRequest):
                        out.field_violations += [(v.field, v.description)
                                                 for v in d.field_violations]
                    elif isinstance(d, error_details_pb2.RetryInfo):
                        out.retry_after_s = d.retry_delay.ToNanoseconds() / 1e9
                    else:
                        out.reason, out.metadata = d.reason, dict(d.metadata)
    return out


def _status_name(status: int) -> str:
    return health_pb2.HealthCheckResponse.ServingStatus.Name(status)


# ------------------------------------------------------------------------- TLS and tokens
def tls_credentials(ca_cert: str | None = None, client_cert: str | None = None,
                    client_key: str | None = None) -> grpc.ChannelCredentials:
    """Credentials of a TLS channel: the server verified against `ca_cert` (PEM file; None: the
    system's roots), and for mutual TLS this client's certificate and key (PEM files)."""
    def read(path: str | None) -> bytes | None:
        return Path(path).expanduser().read_bytes() if path else None

    return grpc.ssl_channel_credentials(read(ca_cert), read(client_key), read(client_cert))


def _with_token(metadata: Sequence[tuple[str, str]], token: str | None
                ) -> tuple[tuple[str, str], ...]:
    return (*metadata, ("authorization", f"Bearer {token}")) if token else tuple(metadata)


# ------------------------------------------------------------------------- blocking client
class SpecstreamClient:
    def __init__(self, target: str | None = None, *, timeout: float | None = None,
                 metadata: Sequence[tuple[str, str]] = (), channel: grpc.Channel | None = None,
                 options: Sequence[tuple[str, Any]] = CHANNEL_OPTIONS,
                 credentials: grpc.ChannelCredentials | None = None,
                 token: str | None = None) -> None:
        """target None: default_target(). `credentials` (tls_credentials()): a TLS channel;
        `token`: sent as `authorization: Bearer TOKEN` with every call. The first client
        generates the stubs if needed."""
        pb = stubs()
        target = target or default_target()
        self.channel = channel or (
            grpc.secure_channel(target, credentials, options=list(options)) if credentials
            else grpc.insecure_channel(target, options=list(options)))
        self.timeout, self.metadata = timeout, _with_token(metadata, token)
        self._gen = pb.generation_pb2_grpc.GenerationServiceStub(self.channel)
        self._cfg = pb.config_pb2_grpc.ConfigServiceStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    def _kw(self, timeout: float | None) -> dict[str, Any]:
        return {"timeout": self.timeout if timeout is None else timeout,
                "metadata": self.metadata or None}

    def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                 request: generation_pb2.GenerateRequest | None = None, **kw: Any
                 ) -> Iterator[generation_pb2.GenerateResponse]:
        """Streams responses; leaving the loop early cancels the call."""
        req = request if request is not None else build_generate_request(prompt, **kw)
        call = self._gen.Generate(req, **self._kw(timeout))
        try:
            yield from call
        finally:
            call.cancel()            # no-op once the stream has ended

    def complete(self, prompt: str | None = None, **kw: Any) -> Completion:
        out = Completion()
        for r in self.generate(prompt, **kw):
            out.add(r)
        return out

    def complete_samples(self, prompt: str | None = None, *, n: int, **kw: Any
                         ) -> list[Completion]:
        """The n samples of one request (GenerateRequest.n), by index."""
        out = [Completion() for _ in range(n)]
        for r in self.generate(prompt, n=n, **kw):
            out[r.index].add(r)
        return out

    def tokenize(self, text: str | None = None, *, chat: ChatInput | None = None,
                 add_bos: bool | None = None, parse_special: bool | None = None,
                 timeout: float | None = None) -> generation_pb2.TokenizeResponse:
        return self._gen.Tokenize(_tokenize_request(text, chat, add_bos, parse_special),
                                  **self._kw(timeout))

    def detokenize(self, ids: Iterable[int], *, skip_special: bool | None = None,
                   timeout: float | None = None) -> str:
        return self._gen.Detokenize(_detokenize_request(ids, skip_special),
                                    **self._kw(timeout)).text

    def model_info(self, timeout: float | None = None) -> config_pb2.ModelInfo:
        return self._cfg.GetModelInfo(stubs().config_pb2.GetModelInfoRequest(),
                                      **self._kw(timeout))

    def get_config(self, timeout: float | None = None) -> config_pb2.EngineConfig:
        return self._cfg.GetConfig(stubs().config_pb2.GetConfigRequest(),
                                   **self._kw(timeout)).config

    def validate_config(self, timeout: float | None = None, **settings: Any
                        ) -> config_pb2.ValidateConfigResponse:
        """Dry run of engine settings (EngineConfig field names); nothing changes."""
        return self._cfg.ValidateConfig(_config_request(settings), **self._kw(timeout))

    def health(self, service: str = "", timeout: float | None = None) -> str:
        """SERVING, NOT_SERVING, ... of a service ("" = the whole server)."""
        r = self._health.Check(health_pb2.HealthCheckRequest(service=service),
                               **self._kw(timeout))
        return _status_name(r.status)

    def wait_ready(self, timeout: float = 60.0, service: str = "") -> None:
        """Blocks until health reports SERVING; raises TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.health(service, timeout=2.0) == "SERVING":
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not SERVING after {timeout} s")
            time.sleep(0.1)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> SpecstreamClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------------- asyncio client
class AsyncSpecstreamClient:
    def __init__(self, target: str | None = None, *, timeout: float | None = None,
                 metadata: Sequence[tuple[str, str]] = (),
                 channel: grpc.aio.Channel | None = None,
                 options: Sequence[tuple[str, Any]] = CHANNEL_OPTIONS,
                 credentials: grpc.ChannelCredentials | None = None,
                 token: str | None = None) -> None:
        pb = stubs()
        target = target or default_target()
        self.channel = channel or (
            grpc.aio.secure_channel(target, credentials, options=list(options)) if credentials
            else grpc.aio.insecure_channel(target, options=list(options)))
        self.timeout, self.metadata = timeout, _with_token(metadata, token)
        self._gen = pb.generation_pb2_grpc.GenerationServiceStub(self.channel)
        self._cfg = pb.config_pb2_grpc.ConfigServiceStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    _kw = SpecstreamClient._kw

    async def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                       request: generation_pb2.GenerateRequest | None = None, **kw: Any
                       ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        req = request if request is not None else build_generate_request(prompt, **kw)
        call = self._gen.Generate(req, **self._kw(timeout))
        try:
            async for r in call:
                yield r
        finally:
            call.cancel()

    async def complete(self, prompt: str | None = None, **kw: Any) -> Completion:
        out = Completion()
        async for r in self.generate(prompt, **kw):
            out.add(r)
        return out

    async def complete_samples(self, prompt: str | None = None, *, n: int, **kw: Any
                               ) -> list[Completion]:
        """The n samples of one request (GenerateRequest.n), by index."""
        out = [Completion() for _ in range(n)]
        async for r in self.generate(prompt, n=n, **kw):
            out[r.index].add(r)
        return out

    async def tokenize(self, text: str | None = None, *, chat: ChatInput | None = None,
                       add_bos: bool | None = None, parse_special: bool | None = None,
                       timeout: float | None = None) -> generation_pb2.TokenizeResponse:
        return await self._gen.Tokenize(_tokenize_request(text, chat, add_bos, parse_special),
                                        **self._kw(timeout))

    async def detokenize(self, ids: Iterable[int], *, skip_special: bool | None = None,
                         timeout: float | None = None) -> str:
        r = await self._gen.Detokenize(_detokenize_request(ids, skip_special),
                                       **self._kw(timeout))
        return r.text

    async def model_info(self, timeout: float | None = None) -> config_pb2.ModelInfo:
        return await self._cfg.GetModelInfo(stubs().config_pb2.GetModelInfoRequest(),
                                            **self._kw(timeout))

    async def get_config(self, timeout: float | None = None) -> config_pb2.EngineConfig:
        r = await self._cfg.GetConfig(stubs().config_pb2.GetConfigRequest(), **self._kw(timeout))
        return r.config

    async def validate_config(self, timeout: float | None = None, **settings: Any
                              ) -> config_pb2.ValidateConfigResponse:
        return await self._cfg.ValidateConfig(_config_request(settings), **self._kw(timeout))

    async def health(self, service: str = "", timeout: float | None = None) -> str:
        r = await self._health.Check(health_pb2.HealthCheckRequest(service=service),
                                     **self._kw(timeout))
        return _status_name(r.status)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncSpecstreamClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
