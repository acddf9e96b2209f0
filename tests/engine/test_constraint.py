"""Structured output (service/engine/constraint.py): xgrammar over the GGUF vocabulary's exact
bytes, for byte-level BPE (SmolLM2) and SentencePiece (Gemma-3); masked greedy walks whose text
must satisfy the constraint; compile errors named by field."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from service.engine import constraint as C
from service.engine.types import Constraint, FinishReason, GenerationRequest, StoppingCriteria
from service.errors import InvalidRequestError
from service.gguf.reader import GGUFFile
from service.model.tokenizer import Tokenizer
from tests.support.engines import GREEDY

MODELS = {"bpe": Path("models/smollm2-135m.gguf"), "spm": Path("models/gemma3-270m.gguf")}


@pytest.fixture(scope="module", params=sorted(MODELS))
def tok(request):
    path = MODELS[request.param]
    if not path.exists():
        pytest.skip(f"{path} missing")
    return Tokenizer.from_metadata(GGUFFile(path).metadata)


def walk(tok, c: Constraint, seed: int, max_tokens: int = 64) -> tuple[str, bool]:
    """Random logits, masked: the text of the tokens drawn, and whether the constraint ended it
    (complete, nothing else allowed) or an end-of-generation token was drawn where allowed."""
    m = C.Matcher(C.compile_constraint(tok, c), tok.vocab_size)
    rng = np.random.default_rng(seed)
    ids = []
    for _ in range(max_tokens):
        mask = m.mask()
        if m.done(mask):
            return tok.decode(ids), True
        lg = rng.standard_normal(tok.vocab_size).astype(np.float32)
        lg[sorted(tok.eog_ids)] -= 3.0              # end late, when the text allows it
        C.mask_logits(lg, mask)
        t = int(np.argmax(lg))
        assert C.allowed(mask, t)
        if t in tok.eog_ids:
            assert m.accept(t) and m.terminated
            return tok.decode(ids), True
        assert m.accept(t)
        ids.append(t)
    return tok.decode(ids), False


def test_a_token_outside_the_mask_is_refused_and_changes_nothing(tok):
    m = C.Matcher(C.compile_constraint(tok, Constraint("regex", r"[0-9]+")), tok.vocab_size)
    letter = tok.encode("x", add_bos=False)[0]
    digit = tok.encode("7", add_bos=False)[0]
    assert not C.allowed(m.mask(), letter) and C.allowed(m.mask(), digit)
    assert not m.accept(letter)
    assert m.accept(digit)


def test_the_first_mask_is_filled_once_and_a_dead_end_is_an_empty_mask(tok):
    """A Matcher starts from its Compiled's first mask (read-only, shared by the request's
    sequences: no second fill); after "a", `a[^\\x00-\\U0010ffff]` allows no token at all,
    not even an end token: a dead end, not a completed constraint."""
    compiled = C.compile_constraint(tok, Constraint("regex", r"a[^\x00-\U0010ffff]"))
    m = C.Matcher(compiled, tok.vocab_size)
    assert m.first_mask() is compiled.first_mask and not m.first_mask().flags.writeable
    assert np.array_equal(m.first_mask(), m.mask()) and not C.dead_end(m.first_mask())
    assert m.accept(tok.encode("a", add_bos=False)[0])
    mask = m.mask()
    assert C.dead_end(mask) and not m.done(mask) and not m.terminated


def test_the_vocabulary_is_exact_bytes(tok):
    # every token the walk takes decodes to the text the matcher accepted: a multi-byte / space
    # / byte-fallback piece would break re.fullmatch if the bytes given to xgrammar were wrong
    pat = r"( [a-zà-ü]{1,6}){1,4}\."
    for seed in range(4):
        text, ended = walk(tok, Constraint("regex", pat), seed)
        assert ended and re.fullmatch(pat, text), text


@pytest.mark.parametrize("pat", [r"[0-9]{3}-[0-9]{4}", r"(yes|no|maybe)!", r"[A-Z][a-z]{2,5}"])
def test_regex_walks_fullmatch(tok, pat):
    for seed in range(3):
        text, ended = walk(tok, Constraint("regex", pat), seed)
        assert ended and re.fullmatch(pat, text), text


def test_gbnf_and_choice(tok):
    g = 'root ::= "(" num ("," num)* ")"\nnum ::= [1-9] [0-9]?'
    for seed in range(3):
        text, ended = walk(tok, Constraint("grammar", g), seed)
        assert ended and re.fullmatch(r"\([1-9][0-9]?(,[1-9][0-9]?)*\)", text), text
    text, ended = walk(tok, Constraint("choice", options=("red", "green", "blue")), 0)
    assert ended and text in ("red", "green", "blue")


SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
     "required": ["a"], "additionalProperties": False},
    {"type": "object", "properties": {"c": {"enum": ["x", "y"]}, "d": {"type": "boolean"}},
     "required": ["c", "d"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 5},
     "minItems": 1, "maxItems": 3},
    {"$defs": {"p": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0,
                                                             "maximum": 99}},
                     "required": ["x"], "additionalProperties": False}},
     "type": "object", "properties": {"p": {"$ref": "#/$defs/p"}}, "required": ["p"],
     "additionalProperties": False},
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=range(len(SCHEMAS)))
def test_json_schema_walks_validate(tok, schema):
    for seed in range(3):
        text, ended = walk(tok, Constraint("json_schema", json.dumps(schema)), seed, 96)
        assert ended, text
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("c, field", [
    (Constraint("grammar", "root ::= ("), "constraint.grammar"),
    (Constraint("json_schema", "{not json"), "constraint.json_schema"),
    (Constraint("regex", "a(b"), "constraint.regex"),
    (Constraint("regex", ""), "constraint.regex"),
    (Constraint("choice", options=()), "constraint.choice.options"),
])
def test_bad_constraints_name_their_field(tok, c, field):
    with pytest.raises(InvalidRequestError) as ei:
        C.compile_constraint(tok, c)
    assert ei.value.field == field
    assert "grammar_parser.cc" not in str(ei.value)


def test_proto_conversion():
    from service.proto_build import stubs
    from service.server_requests import constraint_from_proto
    pb = stubs().generation_pb2
    assert constraint_from_proto(pb.GenerateRequest()) is None
    msg = pb.GenerateRequest(choice=pb.Choice(options=["a", "b"]))
    assert constraint_from_proto(msg) == Constraint("choice", options=("a", "b"))
    assert constraint_from_proto(pb.GenerateRequest(regex="a+")) == Constraint("regex", "a+")
    with pytest.raises(InvalidRequestError) as ei:
        constraint_from_proto(pb.GenerateRequest(json_object=False))
    assert ei.value.field == "constraint.json_object"
    assert pb.FinishReason.Value("FINISH_REASON_CONSTRAINT") == 7


def _done_reference(m: C.Matcher, mask: np.ndarray) -> bool:
    """done() written out: complete, and the mask with the stop tokens cleared is empty."""
    if not m.completed:
        return False
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
    bits[[t for t in m._stops if t < m.vocab_size]] = 0
    return not bits.any()


@pytest.mark.parametrize("threaded_rows", [1, 100])
def test_batch_advance_equals_one_row_at_a_time(tok, threaded_rows, monkeypatch):
    """advance_rows (batch accept, batch fill, threaded or not) gives each matcher the state and
    the next mask that accept + mask() give it alone, rows of different constraints mixed; a
    refused token leaves its matcher as it was."""
    monkeypatch.setattr(C, "THREADED_ROWS", threaded_rows)
    monkeypatch.setattr(C, "THREAD_MIN_MS", 0.0)        # threaded whenever THREADED_ROWS says
    monkeypatch.setattr(C, "FILL_THREADS", 2)
    monkeypatch.setattr(C, "fill_threads", C.FillThreads())
    cs = [Constraint("regex", r"[a-z ]{1,40}"), Constraint("regex", r"[0-9]+(\.[0-9]+)?"),
          Constraint("json_schema", json.dumps({"type": "object", "properties": {
              "n": {"type": "integer"}, "s": {"type": "string"}}, "required": ["n", "s"]})),
          Constraint("choice", options=("yes", "no", "maybe"))]
    V = tok.vocab_size
    batch = [C.Matcher(C.compile_constraint(tok, c), V) for c in cs]
    alone = [C.Matcher(C.compile_constraint(tok, c), V) for c in cs]
    rng = np.random.default_rng(5)
    live = list(range(len(cs)))
    for step in range(24):
        toks = []
        for i in live:
            mask = alone[i].mask()
            lg = rng.standard_normal(V).astype(np.float32)
            lg[sorted(tok.eog_ids)] = -np.inf
            if step % 5 == 4:                        # now and then a token the mask refuses
                lg[np.unpackbits(mask.view(np.uint8), bitorder="little")[:V] == 1] = -np.inf
            else:
                C.mask_logits(lg, mask)
            toks.append(int(np.argmax(lg)) if np.isfinite(lg).any() else 0)
        masks, filled = C.advance_rows([batch[i] for i in live], toks)
        for r, (i, t) in enumerate(zip(live, toks, strict=True)):
            ok = alone[i].accept(t)
            assert (batch[i].ahead == t) if ok else batch[i].ahead is None
            assert filled[r] == ok
            ref = alone[i].mask()
            assert np.array_equal(batch[i].mask(), ref)
            if ok:
                assert np.array_equal(masks[r], ref)
                assert batch[i].done(masks[r]) == _done_reference(alone[i], ref)
            batch[i].ahead = None
        live = [i for i in live if not alone[i].done(alone[i].mask())]
        if not live:
            break
    assert step >= 3


def test_advance_rows_skips_fills_and_accepts_a_token_once(tok):
    """fill False: the token is accepted, the row not filled (mask() then gives the same mask
    as a filled row); a matcher whose `ahead` is already its token is not advanced again."""
    c = Constraint("regex", r"[a-z]{1,8}")
    V = tok.vocab_size
    a, b, ref = (C.Matcher(C.compile_constraint(tok, c), V) for _ in range(3))
    t = int(np.flatnonzero(np.unpackbits(a.mask().view(np.uint8), bitorder="little")[:V])[0])
    assert b.accept(t)                      # accepted before (overlap.py's check) ...
    b.ahead = t
    masks, filled = C.advance_rows([a, b], [t, t], [False, True])
    assert filled == [False, True] and a.ahead == t and b.ahead == t
    assert ref.accept(t)
    assert np.array_equal(masks[1], ref.mask())            # ... and not accepted twice
    assert np.array_equal(a.mask(), ref.mask()) and np.array_equal(b.mask(), ref.mask())


def test_a_skipped_fill_leaves_the_ends_to_the_next_tokens_check(tok):
    """overlap._check_unmasked on a sequence whose last commit skipped its mask fill
    (row_masks [None]): a token the matcher takes is kept without a fill; a dead end or a
    complete constraint that allows only end tokens comes out as the finish the eager commit
    would have given (CONSTRAINT_DEAD_END / CONSTRAINT), whatever the next token is."""
    from service.engine.overlap import _check_unmasked
    from service.engine.scheduler.sequence import Sequence, advance_constrained

    V = tok.vocab_size

    def seq(c: Constraint, tokens: list[int]) -> Sequence:
        req = GenerationRequest("r", (1, 2), GREEDY, StoppingCriteria(max_new_tokens=99),
                                constraint=c)
        s = Sequence(request=req, sink=lambda ev: None, seed_value=0, text=None,
                     eog_ids=frozenset(tok.eog_ids), n_ctx=512, speculative=False,
                     matcher=C.Matcher(C.compile_constraint(tok, c), V))
        for t in tokens:                    # committed with the fill skipped
            advance_constrained([(s, t)], {id(s)})
            assert s.row_masks == [None] and s._advance(t) is None
        return s

    def first(mask):            # the first token the mask allows that is no end token
        ok = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:V])
        return int(next(t for t in ok if t not in tok.eog_ids))

    a = tok.encode("a", add_bos=False)[-1]
    any_tok = first(C.Matcher(C.compile_constraint(tok, Constraint("regex", "b")), V).mask())
    s = seq(Constraint("regex", r"a[^\x00-\U0010ffff]"), [a])
    assert _check_unmasked(s, any_tok) == (False, FinishReason.CONSTRAINT_DEAD_END)
    yes = tok.encode("yes", add_bos=False)
    for nxt in (any_tok, min(tok.eog_ids)):
        s = seq(Constraint("choice", options=("yes", "no")), yes)
        assert _check_unmasked(s, nxt) == (False, FinishReason.CONSTRAINT)
    s = seq(Constraint("regex", r"[a-z]{1,8}"), [a])
    nxt = first(s.row_mask(0))
    s.row_masks = [None]
    assert _check_unmasked(s, nxt) == (True, None) and s.matcher.ahead == nxt


def test_a_batch_fill_goes_to_threads_only_where_one_thread_would_take_long(monkeypatch):
    """FillThreads: the first fill runs on one thread (nothing measured yet); a batch goes
    threaded when that fill's cost per row times its rows reaches THREAD_MIN_MS (and it has
    THREADED_ROWS rows); while it goes threaded, one batch in REMEASURE runs on one thread
    again to measure the cost anew, so a workload turned cheap comes back to one thread."""
    monkeypatch.setattr(C, "THREADED_ROWS", 4)
    monkeypatch.setattr(C, "THREAD_MIN_MS", 1.0)
    monkeypatch.setattr(C, "REMEASURE", 3)
    monkeypatch.setattr(C, "FILL_THREADS", 16)
    f = C.FillThreads()
    assert not f.threaded(16)                   # nothing measured
    f.record(16, False, 0.32)                   # 0.02 ms a row (a JSON schema)
    assert not f.threaded(16) and not f.threaded(49)
    assert f.threaded(50)                       # 50 rows of 0.02 ms: 1 ms on one thread
    f.record(16, False, 8.0)                    # 0.5 ms a row (a costly regex)
    assert f.threaded(4) and not f.threaded(3)  # 2 ms, but under THREADED_ROWS
    for _ in range(3):
        assert f.threaded(16)
        f.record(16, True, 1.5)
    assert not f.threaded(16)                   # measured again on one thread
    f.record(16, False, 0.4)
    assert not f.threaded(16) and f.threaded_since == 0
    monkeypatch.setattr(C, "FILL_THREADS", 1)
    f.record(16, False, 80.0)
    assert not f.threaded(16)                   # one core: never
