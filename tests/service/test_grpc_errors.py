"""Errors become status codes with google.rpc details; nothing reaches the client as a trace."""

from __future__ import annotations

import math
import threading

import grpc
import pytest
from google.rpc import code_pb2, error_details_pb2

from clients import SpecstreamClient, error_details
from service.config import EngineConfig
from service.engine.types import FinishReason, Started
from service.errors import (
    CapacityError,
    ConfigError,
    FetchError,
    InvalidRequestError,
    ModelFormatError,
    UnavailableError,
)
from service.interceptors import status_for
from tests.support.fake_engine import VOCAB, FakeEngine, finished
from tests.support.grpc_harness import N_CTX, serving

BAD_REQUESTS = [
    ({"temperature": -1.0}, "sampling.temperature"),
    ({"temperature": math.nan}, "sampling.temperature"),
    ({"top_p": 0.0}, "sampling.top_p"),
    ({"top_p": math.inf}, "sampling.top_p"),
    ({"min_p": 2.0}, "sampling.min_p"),
    ({"repetition_penalty": 0.0}, "sampling.repetition_penalty"),
    ({"max_new_tokens": 0}, "stopping.max_new_tokens"),
    ({"max_new_tokens": 2_000_000}, "stopping.max_new_tokens"),
    ({"stop": [""]}, "stopping.stop_sequences[0]"),
    ({"stop": ["x"] * 17}, "stopping.stop_sequences"),
    ({"stop_token_ids": [10**9]}, "stopping.stop_token_ids[0]"),
    ({"top_logprobs": 21}, "output.top_logprobs"),
]


def _code(err: grpc.RpcError) -> grpc.StatusCode:
    return err.code()


# ------------------------------------------------------------------ fields, checked by the server
@pytest.mark.parametrize(("kw", "field"), BAD_REQUESTS)
def test_bad_sampling_and_stopping_name_the_field(fake_client, kw, field):
    with pytest.raises(grpc.RpcError) as ei:
        list(fake_client.generate(tokens=[1, 2], **kw))
    e = error_details(ei.value)
    assert e.code == "INVALID_ARGUMENT", e
    assert [f for f, _ in e.field_violations] == [field]
    assert e.message.startswith(field)


@pytest.mark.parametrize(("kw", "field", "reason"), [
    ({"tokens": [10**9]}, "input.tokens.ids[0]", "INVALID_ARGUMENT"),
    ({"tokens": [1, 2, VOCAB]}, "input.tokens.ids[2]", "INVALID_ARGUMENT"),
    ({"tokens": [1] * N_CTX}, "input", "PROMPT_TOO_LONG"),
    ({"tokens": []}, "input", "INVALID_ARGUMENT"),
    ({"chat": []}, "input", "INVALID_ARGUMENT"),
])
def test_bad_prompts(fake_client, kw, field, reason):
    with pytest.raises(grpc.RpcError) as ei:
        list(fake_client.generate(**kw))
    e = error_details(ei.value)
    assert e.code == "INVALID_ARGUMENT" and e.reason == reason
    assert e.field_violations[0][0].startswith(field)


# ------------------------------------------------------------------ text: the model's tokenizer
def test_prompt_too_long_text(client):
    with pytest.raises(grpc.RpcError) as ei:
        list(client.generate("word " * (N_CTX + 10)))
    assert error_details(ei.value).reason == "PROMPT_TOO_LONG"


def test_detokenize_and_tokenize_bad_input(client):
    with pytest.raises(grpc.RpcError) as ei:
        client.detokenize([5, 10**6])
    e = error_details(ei.value)
    assert e.code == "INVALID_ARGUMENT" and e.field_violations[0][0] == "ids[1]"
    from service.proto import generation_pb2

    with pytest.raises(grpc.RpcError) as ei:
        client._gen.Tokenize(generation_pb2.TokenizeRequest())
    assert error_details(ei.value).field_violations[0][0] == "input"


# ------------------------------------------------------------------ status mapping, unit level
@pytest.mark.parametrize(("exc", "code"), [
    (InvalidRequestError("a.b", "bad"), code_pb2.INVALID_ARGUMENT),
    (InvalidRequestError("input.text", "no vocab", reason="FAILED_PRECONDITION"),
     code_pb2.FAILED_PRECONDITION),
    (CapacityError("full", retry_after_s=2.5), code_pb2.RESOURCE_EXHAUSTED),
    (UnavailableError("loading"), code_pb2.UNAVAILABLE),
    (FetchError("no net"), code_pb2.UNAVAILABLE),
    (ConfigError([("speculative.enabled", "no drafter")]), code_pb2.FAILED_PRECONDITION),
    (ModelFormatError("bad tensor"), code_pb2.FAILED_PRECONDITION),
    (KeyError("secret internals"), code_pb2.INTERNAL),
])
def test_status_for(exc, code):
    st = status_for(exc, "rid-1")
    assert st.code == code
    if code == code_pb2.INTERNAL:
        assert "secret" not in st.message and "rid-1" in st.message
    if code == code_pb2.RESOURCE_EXHAUSTED:
        retry = error_details_pb2.RetryInfo()
        assert any(d.Unpack(retry) for d in st.details)
        assert retry.retry_delay.ToNanoseconds() == 2_500_000_000


# ------------------------------------------------------------------ mechanics, scripted engine
def test_resource_exhausted_carries_retry_info():
    with serving(FakeEngine(raises=CapacityError("64 requests are waiting", 1.5))) as (_, c):
        with pytest.raises(grpc.RpcError) as ei:
            list(c.generate(tokens=[1, 2]))
    e = error_details(ei.value)
    assert e.code == "RESOURCE_EXHAUSTED" and e.retry_after_s == 1.5 and e.reason == "QUEUE_FULL"


def test_internal_errors_hide_details_and_server_survives():
    def fail_midway(request, sink, handle):
        sink(Started(1, 1))
        sink(finished(FinishReason.ERROR, error="ZeroDivisionError: secret internals"))

    crash = FakeEngine(raises=ZeroDivisionError("secret internals at line 42"))
    for engine in (crash, FakeEngine(script=fail_midway)):
        with serving(engine) as (_, c):
            with pytest.raises(grpc.RpcError) as ei:
                list(c.generate(tokens=[1, 2], request_id="boom"))
            e = error_details(ei.value)
            assert e.code == "INTERNAL" and e.reason == "INTERNAL"
            assert "secret" not in e.message and "Traceback" not in e.message
            assert "boom" in e.message
            assert c.health() == "SERVING"


def test_loading_server_is_not_serving_and_unavailable():
    with serving(None) as (_, c):
        for service in ("", "specstream.v1.GenerationService", "specstream.v1.ConfigService"):
            assert c.health(service) == "NOT_SERVING"
        for call in (lambda: list(c.generate("hi")), lambda: c.tokenize("hi"), c.model_info):
            with pytest.raises(grpc.RpcError) as ei:
                call()
            assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        assert c.get_config().n_ctx == EngineConfig().n_ctx       # config answers meanwhile
        assert not c.validate_config(verify_width=0).valid


def test_draining_refuses_generate():
    with serving(FakeEngine(script=lambda *a: None)) as (srv, c):
        srv.service.state.draining = True
        with pytest.raises(grpc.RpcError) as ei:
            list(c.generate(tokens=[1]))
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE


def test_speculation_requested_without_drafter_is_failed_precondition():
    with serving(FakeEngine(script=lambda *a: None)) as (_, c):
        with pytest.raises(grpc.RpcError) as ei:
            list(c.generate(tokens=[1], speculative=True))
    assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_unknown_method_is_unimplemented(server):
    with grpc.insecure_channel(server.target) as ch:
        call = ch.unary_unary("/specstream.v1.GenerationService/Nope",
                              request_serializer=lambda b: b, response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as ei:
            call(b"")
    assert ei.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_cancel_reaches_scripted_engine():
    release = threading.Event()

    def hold(request, sink, handle):
        sink(Started(1, 1))
        handle.cancelled.wait(30)
        release.set()

    engine = FakeEngine(script=hold)
    with serving(engine) as (_, c):
        stream = c.generate(tokens=[1])
        assert next(stream).HasField("started")
        stream.close()                                   # leaves the loop: cancels the call
        assert release.wait(10), "the server did not cancel the engine request"


def test_message_size_limit_is_deliberate(server):
    """32 MiB requests are refused by the server (not unlimited), and it keeps serving."""
    from service.proto import generation_pb2

    big = generation_pb2.GenerateRequest(text="a" * (33 << 20)).SerializeToString()
    opts = [("grpc.max_send_message_length", 64 << 20)]
    with grpc.insecure_channel(server.target, options=opts) as ch:
        call = ch.unary_stream("/specstream.v1.GenerationService/Generate",
                               request_serializer=lambda b: b,
                               response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as ei:
            list(call(big, timeout=60))
    assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with SpecstreamClient(server.target) as c:
        assert c.health() == "SERVING"
