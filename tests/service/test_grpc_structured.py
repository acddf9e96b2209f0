"""Structured output over gRPC: GenerateRequest.constraint's fields are served (the text
satisfies them, Finished says FINISH_REASON_CONSTRAINT), a constraint that does not compile is
INVALID_ARGUMENT naming its field before any token, one that allows nothing after some text
ends the stream there with FINISH_REASON_CONSTRAINT_DEAD_END, a request's constraint is
compiled once, and the vLLM protocol maps its own structured-output fields to the same
constraint."""

from __future__ import annotations

import json
import re
import time

import grpc
import pytest

from clients import Completion, error_details
from service.engine import constraint
from service.proto_build import stubs

pb = stubs().generation_pb2


def request(**kw):
    return pb.GenerateRequest(text="A short answer:", stopping=pb.StoppingCriteria(
        max_new_tokens=48), sampling=pb.SamplingParams(temperature=0.0), **kw)


def test_constraints_are_served_with_their_finish_reason(client):
    out = client.complete(request=request(regex=r"[0-9]{3}-[0-9]{4}"))
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", out.text)
    assert out.finish_reason == "CONSTRAINT"
    out = client.complete(request=request(choice=pb.Choice(options=["alpha", "beta"])))
    assert out.text in ("alpha", "beta") and out.finish_reason == "CONSTRAINT"
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    out = client.complete(request=request(json_schema=json.dumps(schema)))
    assert 0 <= json.loads(out.text)["n"] <= 9
    out = client.complete(request=request(grammar='root ::= "(" [a-c]+ ")"'))
    assert re.fullmatch(r"\([a-c]+\)", out.text) or out.finish_reason == "LENGTH"


@pytest.mark.parametrize("kw, field", [
    (dict(json_schema="{oops"), "constraint.json_schema"),
    (dict(regex="a("), "constraint.regex"),
    (dict(grammar="root ::= ("), "constraint.grammar"),
    (dict(choice=pb.Choice()), "constraint.choice.options"),
    (dict(json_object=False), "constraint.json_object"),
    # no text matches: every token (end tokens too) is masked from the first draw on
    (dict(regex=r"[^\x00-\U0010ffff]"), "constraint.regex"),
    (dict(grammar=r'root ::= [^\x00-\U0010ffff]'), "constraint.grammar"),
])
def test_a_bad_constraint_is_refused_by_field(client, kw, field):
    with pytest.raises(grpc.RpcError) as ei:
        client.complete(request=request(**kw))
    e = error_details(ei.value)
    assert (e.code, [f for f, _ in e.field_violations]) == ("INVALID_ARGUMENT", [field])


def test_a_constraint_no_text_satisfies_is_refused_for_a_sampled_request_too(client):
    # the draw over an empty set of tokens failed the request with INTERNAL
    req = request(regex=r"[^\x00-\U0010ffff]")
    req.sampling.temperature = 0.8
    with pytest.raises(grpc.RpcError) as ei:
        client.complete(request=req)
    e = error_details(ei.value)
    assert (e.code, [f for f, _ in e.field_violations]) == ("INVALID_ARGUMENT",
                                                            ["constraint.regex"])


def test_tree_speculation_with_a_constraint_is_refused(client):
    with pytest.raises(grpc.RpcError) as ei:
        client.complete(request=request(regex="a+", speculative=pb.SpeculativeOptions(
            mode=pb.SPECULATIVE_MODE_TREE)))
    assert [f for f, _ in error_details(ei.value).field_violations] == ["speculative.mode"]


def test_prompts_are_served_while_constraints_compile(server, client):
    """xgrammar compiles cannot be interrupted, and a grammar of a few hundred optional items
    takes seconds to minutes: two of them held both prompt workers, so every text prompt and
    Tokenize call waited for them (their callers gone or not). They compile on a pool of
    their own."""
    slow = [request(grammar="root ::= " + " ".join(['"a"?'] * k)) for k in (300, 301)]
    with grpc.insecure_channel(server.target) as channel:
        stub = stubs().generation_pb2_grpc.GenerationServiceStub(channel)
        calls = [stub.Generate(r, timeout=120) for r in slow]
        try:
            time.sleep(1.0)                               # both compiles are under way
            assert client.tokenize("Hello there", timeout=10).ids
            assert client.complete("Hello", max_new_tokens=2, timeout=10).token_ids
        finally:
            for call in calls:
                call.cancel()


def samples(client, req) -> list[Completion]:
    out = [Completion() for _ in range(max(1, req.n))]
    for r in client.generate(request=req):
        out[r.index].add(r)
    return out


@pytest.mark.parametrize("temperature, n", [(0.8, 1), (0.0, 1), (0.8, 2)])
def test_a_constraint_that_dead_ends_ends_the_stream_ok(client, temperature, n):
    """Nothing may follow "a" (the first draw is fine, so it compiles): a sampled request ended
    with INTERNAL, a greedy one with a token against the constraint (EOS). Every sample gets
    "a" and FINISH_REASON_CONSTRAINT_DEAD_END, status OK."""
    req = request(regex=r"a[^\x00-\U0010ffff]", n=n)
    req.sampling.temperature = temperature
    for out in samples(client, req):
        assert (out.text, out.finish_reason) == ("a", "CONSTRAINT_DEAD_END")
        assert len(out.token_ids) == out.usage.completion_tokens == 1


@pytest.mark.parametrize("n", [1, 3])
def test_a_constraint_is_compiled_once_per_request(client, n):
    """The server's check compiled it (a grammar lookup and a first-mask fill, ~0.5 ms for a
    loose regex), then the engine's submit again, once per sample."""
    before = constraint.compilations()
    req = request(regex=r"[A-Za-z ,.]{1,40}\.", n=n)
    req.stopping.max_new_tokens = 4
    assert all(out.finish_reason for out in samples(client, req))
    assert constraint.compilations() - before == 1
