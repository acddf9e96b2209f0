"""Structured output through the engine (CPU backend, SmolLM2): every generation satisfies
its constraint (JSON schemas validated with jsonschema, regexes and GBNF with re.fullmatch),
ends with FINISH_REASON_CONSTRAINT (or EOS where the text is complete), and the output does
not depend on speculation (n-gram drafter) or on the batch. A constraint that allows nothing
after some text ends its stream there (CONSTRAINT_DEAD_END), never with a token outside it."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from service.engine.types import (
    Constraint,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    StoppingCriteria,
)
from tests.support.batching import alone, same_output, together
from tests.support.engines import wait_idle

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = ["Give me a JSON object describing a person:", "Answer in JSON:",
           "The data, as JSON:", "Output:"]


def sampled(seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.0, seed=seed)


def obj(props: dict, required=None) -> dict:
    return {"type": "object", "properties": props, "additionalProperties": False,
            "required": list(props) if required is None else required}


INT9 = {"type": "integer", "minimum": 0, "maximum": 9}
SCHEMAS = [
    obj({"a": INT9}),
    obj({"ok": {"type": "boolean"}}),
    obj({"c": {"enum": ["red", "green", "blue"]}}),
    obj({"n": {"type": "integer", "minimum": 10, "maximum": 99}}),
    obj({"x": INT9, "y": INT9}),
    {"type": "array", "items": INT9, "minItems": 1, "maxItems": 3},
    {"enum": ["yes", "no", None]},
    obj({"p": obj({"q": INT9})}),
    obj({"s": {"type": "string", "maxLength": 6, "pattern": "^[a-z]+$"}}),
    obj({"t": {"type": "string", "enum": ["a", "b"]}, "u": {"type": "boolean"}}),
    obj({"a": INT9, "b": {"type": "boolean"}}, required=["a"]),
    {"$defs": {"d": {"type": "integer", "minimum": 1, "maximum": 5}},
     **obj({"d": {"$ref": "#/$defs/d"}})},
    {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 2, "maxItems": 2},
    obj({"v": {"type": "number", "minimum": 0, "maximum": 1}}),
    obj({"k": {"const": "fixed"}}),
    obj({"l": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}}),
    {"anyOf": [obj({"i": INT9}), obj({"j": {"type": "boolean"}})]},
    obj({"m": {"type": "null"}}),
    {"type": "integer", "minimum": -5, "maximum": 5},
    obj({"r": obj({"s": {"enum": [1, 2]}, "t": {"type": "boolean"}})}),
]
MAX_NEW = 64


def ids(engine, text: str) -> tuple[int, ...]:
    return tuple(engine.text_prompt_ids(text))


def request(engine, rid: str, prompt: str, c: Constraint, sampling=GREEDY, spec=False,
            max_new=MAX_NEW) -> GenerationRequest:
    return GenerationRequest(rid, ids(engine, prompt), sampling,
                             StoppingCriteria(max_new_tokens=max_new), speculative=spec,
                             constraint=c)


def finished_ok(r) -> bool:
    return r.finished.reason in (FinishReason.CONSTRAINT, FinishReason.EOS)


def test_json_schemas_batched_greedy_and_sampled(smol):
    reqs, schemas = [], []
    for i, schema in enumerate(SCHEMAS):
        c = Constraint("json_schema", json.dumps(schema))
        for j in range(10):
            p = GREEDY if j == 0 else sampled(1000 * i + j)
            reqs.append(request(smol, f"s{i}-{j}", PROMPTS[j % len(PROMPTS)], c, p))
            schemas.append(schema)
    results = []
    for k in range(0, len(reqs), 50):               # the engine queues at most 64
        results += together(smol, reqs[k:k + 50])[0]
    done = 0
    for req, r, schema in zip(reqs, results, schemas, strict=True):
        assert r.finished.error is None, r.finished.error
        if finished_ok(r):
            jsonschema.validate(json.loads(r.text), schema)
            done += 1
        else:
            assert r.finished.reason is FinishReason.LENGTH, (req.request_id, r.text)
    assert done >= 0.95 * len(reqs), done


@pytest.mark.parametrize("pat", [r"[0-9]{3}-[0-9]{4}", r"(yes|no)\.", r" ?[A-Z][a-z]{1,8}"])
def test_regex_fullmatch(smol, pat):
    for p in (GREEDY, sampled(7), sampled(8)):
        r = alone(smol, request(smol, "re", "Phone:", Constraint("regex", pat), p))
        assert finished_ok(r) and re.fullmatch(pat, r.text), (r.text, r.finished.reason)


def test_gbnf_and_choice(smol):
    g = 'root ::= "[" num ("," num)* "]"\nnum ::= [1-9] [0-9]?'
    for p in (GREEDY, sampled(3)):
        r = alone(smol, request(smol, "g", "A list:", Constraint("grammar", g), p, max_new=48))
        assert finished_ok(r) or r.finished.reason is FinishReason.LENGTH
        if finished_ok(r):
            assert re.fullmatch(r"\[[1-9][0-9]?(,[1-9][0-9]?)*\]", r.text), r.text
    c = Constraint("choice", options=("apple", "banana", "cherry"))
    r = alone(smol, request(smol, "c", "Pick a fruit:", c))
    assert r.finished.reason is FinishReason.CONSTRAINT and r.text in c.options


def mixed(engine, spec) -> list[GenerationRequest]:
    return [request(engine, f"m{i}", PROMPTS[i % 4],
                    Constraint("json_schema", json.dumps(SCHEMAS[i * 3])) if i % 3 else
                    Constraint("regex", r"[a-z ]{4,40}\."), GREEDY if i % 2 else sampled(i),
                    spec=spec)
            for i in range(6)] + [
        request(engine, f"la{i}", "Sing: la la la la la la", Constraint("regex", pat),
                sampled(i) if i else GREEDY, spec=spec)
        for i, pat in enumerate([r"(la ){3,12}\.", r"[a-z ]{4,40}\.", r"(la ?)+!"])] + [
        GenerationRequest(
                "plain", ids(engine, PROMPTS[0]), GREEDY, StoppingCriteria(max_new_tokens=16),
                speculative=spec)]


def test_exact_under_speculation_and_batching(smol, monkeypatch):
    # verification taken as free, so drafts are verified whatever the start-up cost
    # measurement found on this machine (tests.support.engines: draft_in_full)
    monkeypatch.setattr(smol, "verify_alpha", 0.0)
    off = [alone(smol, r) for r in mixed(smol, False)]
    on = [alone(smol, r) for r in mixed(smol, None)]
    for a, b in zip(on, off, strict=True):
        assert same_output(a, b), (a.text, b.text)
    assert sum(r.finished.usage.draft_tokens for r in on) > 0        # drafts were verified
    batched, _ = together(smol, mixed(smol, None))
    for a, b in zip(batched, off, strict=True):
        assert same_output(a, b), (a.text, b.text)


# nothing may follow "a", not even an end token (the first mask is not empty: it compiles)
DEAD_AFTER_A = Constraint("regex", r"a[^\x00-\U0010ffff]")


def test_a_constraint_that_dead_ends_ends_the_stream_with_its_own_reason(smol):
    """The draw after "a" has no allowed token: a sampled row failed the request (a draw from
    an empty set; INTERNAL over gRPC) and a greedy one committed token 0 (the argmax of all
    -inf, EOS here) against the constraint. Now "a" is delivered and the stream ends with
    CONSTRAINT_DEAD_END, the batch's other rows as they are alone, the KV blocks freed."""
    a = smol.text_prompt_ids("a")[-1]
    dead = [request(smol, f"dead{i}", "Say a:", DEAD_AFTER_A, p, spec=spec)
            for i, (p, spec) in enumerate([(GREEDY, False), (sampled(1), False),
                                           (GREEDY, None), (sampled(2), None)])]
    others = [request(smol, "re", "Phone:", Constraint("regex", r"[0-9]{3}-[0-9]{4}")),
              request(smol, "js", PROMPTS[0], Constraint("json_schema", json.dumps(SCHEMAS[0])),
                      sampled(3)),
              GenerationRequest("plain", ids(smol, PROMPTS[1]), sampled(4),
                                StoppingCriteria(max_new_tokens=12))]
    for r in [alone(smol, q) for q in dead] + together(smol, dead)[0]:
        assert (r.token_ids, r.text) == ([a], "a"), (r.token_ids, r.finished)
        assert r.finished.reason is FinishReason.CONSTRAINT_DEAD_END and r.finished.error is None
    ref = [alone(smol, q) for q in others]
    batched, _ = together(smol, [*dead[:2], *others, *dead[2:]])
    for r in batched[:2] + batched[-2:]:
        assert r.finished.reason is FinishReason.CONSTRAINT_DEAD_END and r.token_ids == [a]
    for got, want in zip(batched[2:-2], ref, strict=True):
        assert same_output(got, want), (got.text, want.text)
    wait_idle(smol)
    assert smol.pool.used_blocks == 0


def test_a_dead_end_after_a_draft_ends_the_stream_under_speculation(smol, monkeypatch):
    """A draft after which the constraint allows nothing is cut before verification: kept, its
    verify row drew from an empty mask (a sampled row failed the request). The output equals
    plain decoding's, drafts verified on the way."""
    monkeypatch.setattr(smol, "verify_alpha", 0.0)      # draft whenever the drafter can
    pat = r"( ?la){10}[^\x00-\U0010ffff]"
    for p in (GREEDY, sampled(3)):
        off, on = (alone(smol, request(smol, "la", "Sing: " + " ".join(["la"] * 12),
                                       Constraint("regex", pat), p, spec=spec))
                   for spec in (False, None))
        assert on.finished.reason is FinishReason.CONSTRAINT_DEAD_END, on.finished
        assert same_output(on, off) and re.fullmatch(r"( ?la){10}", on.text), (on.text, off.text)
        assert on.finished.usage.draft_tokens > 0


def test_an_end_token_taken_under_ignore_eos_ends_the_constraint(smol):
    """With ignore_eos, an end token is an ordinary committed token, and the constraint's
    matcher takes it as its stop token: the constraint is over (CONSTRAINT after that token).
    Filling the next mask of a matcher past its stop token raised in xgrammar, which failed
    the step: every request in the batch ended with an error. The end token made likely
    (logit_bias) where the regex allows it, greedy and sampled, alone and with others."""
    eos = smol.tokenizer.eos_id
    pull = (GREEDY, SamplingParams(temperature=0.0, logit_bias=((eos, 30.0),)),
            SamplingParams(temperature=0.8, seed=5, logit_bias=((eos, 30.0),)))
    reqs = [GenerationRequest(f"e{i}", ids(smol, "Phone:"), p,
                              StoppingCriteria(max_new_tokens=24, ignore_eos=True),
                              speculative=False, constraint=Constraint("regex", r"[0-9]{1,12}"))
            for i, p in enumerate(pull)]
    other = request(smol, "js", PROMPTS[0], Constraint("json_schema", json.dumps(SCHEMAS[0])),
                    sampled(3))
    ref = alone(smol, other)
    for r in [alone(smol, q) for q in reqs[1:]]:
        assert r.finished.error is None and r.finished.reason is FinishReason.CONSTRAINT, \
            r.finished
        digits = smol.tokenizer.decode(r.token_ids[:-1])    # the end token's text follows
        assert r.token_ids[-1] == eos and re.fullmatch(r"[0-9]{1,12}", digits), r.text
    batched, _ = together(smol, [*reqs, other])
    for r in batched[1:3]:
        assert r.finished.reason is FinishReason.CONSTRAINT and r.token_ids[-1] == eos, \
            r.finished
    assert same_output(batched[-1], ref), (batched[-1].text, ref.text)
    wait_idle(smol)
    assert smol.pool.used_blocks == 0
