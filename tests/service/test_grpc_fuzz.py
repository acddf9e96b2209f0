"""Property-based fuzzing of GenerateRequest: every request gets INVALID_ARGUMENT or a normal
stream (Started, Deltas, Finished), never INTERNAL, and the server keeps serving."""

from __future__ import annotations

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clients import error_details
from service.proto import generation_pb2
from tests.support.grpc_harness import N_CTX

U32 = st.integers(0, 2**32 - 1)
SMALL_IDS = st.integers(0, 49151)
FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=32)
OUTCOMES = {"ok": 0, "invalid": 0}
FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])

# (in range, anything): a "valid" request draws only from the first, a "wild" one from both,
# so the fuzzer reaches the engine often and probes every bound as well.
FIELDS = {
    "temperature": (st.sampled_from([0.0, 0.7, 1.5]), FLOATS),
    "top_p": (st.floats(0.0625, 1.0, width=32), FLOATS),
    "min_p": (st.floats(0.0, 1.0, width=32), FLOATS),
    "repetition_penalty": (st.sampled_from([1.0, 1.1]), FLOATS),
    "top_k": (st.integers(0, 100), U32),
    "repeat_last_n": (st.integers(0, 64), U32),
    "seed": (st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)),
    # Valid lengths stay tiny so the CPU engine answers fast; wild ones probe the bounds.
    "max_new_tokens": (st.integers(1, 3), st.sampled_from([0, 1_000_001, 2**32 - 1])),
    "stop_sequences": (st.lists(st.text(min_size=1, max_size=6), max_size=3),
                       st.lists(st.text(max_size=6), max_size=18)),
    "stop_token_ids": (st.lists(SMALL_IDS, max_size=3), st.lists(U32, max_size=3)),
    "top_logprobs": (st.integers(0, 20), st.integers(0, 2**32 - 1)),
    "tokens": (st.lists(SMALL_IDS, min_size=1, max_size=24),
               st.lists(U32, max_size=4) | st.just([1] * (N_CTX + 1))),
    "text": (st.text(min_size=1, max_size=40), st.text(max_size=40)),
    "role": (st.sampled_from(["system", "user", "assistant"]), st.text(max_size=6)),
}


def optional(strategy):
    return st.none() | strategy


@st.composite
def generate_requests(draw) -> generation_pb2.GenerateRequest:
    wild = draw(st.sampled_from([False, False, True]))

    def value(name: str):
        valid, anything = FIELDS[name]
        return draw(valid | anything if wild else valid)

    req = generation_pb2.GenerateRequest(request_id=draw(st.text(max_size=8)))
    which = draw(st.sampled_from(["text", "tokens", "chat"] + ["none"] * wild))
    if which == "text":
        req.text = value("text")
    elif which == "tokens":
        req.tokens.SetInParent()
        req.tokens.ids.extend(value("tokens"))
    elif which == "chat":
        req.chat.SetInParent()
        for _ in range(draw(st.integers(0 if wild else 1, 3))):
            req.chat.messages.add(role=value("role"), content=draw(st.text(max_size=20)))
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "top_k",
                 "repeat_last_n", "seed"):
        if draw(st.booleans()):
            setattr(req.sampling, name, value(name))
    req.stopping.max_new_tokens = value("max_new_tokens")
    req.stopping.stop_sequences.extend(value("stop_sequences"))
    req.stopping.stop_token_ids.extend(value("stop_token_ids"))
    if draw(st.booleans()):
        req.stopping.ignore_eos = draw(st.booleans())
    if draw(st.booleans()):
        req.output.top_logprobs = value("top_logprobs")
    if draw(st.booleans()):
        req.speculative.enabled = draw(st.booleans())
    for name in ("add_bos", "parse_special"):
        if draw(st.booleans()):
            setattr(req, name, draw(st.booleans()))
    return req


@FUZZ
@given(req=generate_requests())
def test_fuzzed_generate_requests(client, req):
    try:
        responses = list(client.generate(request=req, timeout=120))
    except grpc.RpcError as err:
        e = error_details(err)
        assert e.code == "INVALID_ARGUMENT", (e, req)
        assert e.field_violations and e.field_violations[0][0], e
        OUTCOMES["invalid"] += 1
        return
    OUTCOMES["ok"] += 1
    kinds = [r.WhichOneof("event") for r in responses]
    assert kinds[0] == "started" and kinds[-1] == "finished", kinds
    assert set(kinds[1:-1]) <= {"delta"}
    assert responses[-1].finished.reason != generation_pb2.FINISH_REASON_UNSPECIFIED


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=st.binary(max_size=64))
def test_random_bytes_never_kill_the_server(server, client, payload):
    with grpc.insecure_channel(server.target) as ch:
        call = ch.unary_stream("/specstream.v1.GenerationService/Generate",
                               request_serializer=lambda b: b,
                               response_deserializer=lambda b: b)
        try:
            for _ in call(payload, timeout=3):
                pass
        except grpc.RpcError as err:
            # Undecodable bytes: INVALID_ARGUMENT (MALFORMED_REQUEST); decodable ones are
            # validated like any request, or run until the short deadline cancels them.
            assert err.code() in (grpc.StatusCode.INVALID_ARGUMENT,
                                  grpc.StatusCode.DEADLINE_EXCEEDED), err
    assert client.health() == "SERVING"


def test_server_still_answers_after_fuzzing(client):
    if sum(OUTCOMES.values()):          # the fuzzing above reached both kinds of answer
        assert OUTCOMES["ok"] >= 5 and OUTCOMES["invalid"] >= 5, OUTCOMES
    done = client.complete("Hello", max_new_tokens=2, temperature=0.0)
    assert done.finish_reason in ("LENGTH", "EOS") and client.health() == "SERVING"
