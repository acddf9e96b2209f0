"""One large request cannot hold up the server: prompts are tokenized off the event loop, and a
text that cannot fit the context is refused before it is tokenized."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import grpc
import pytest

from clients import error_details
from tests.support.grpc_harness import N_CTX

HUGE = "word " * 1_920_000                      # 9.6 MB: ceil(B / M) tokens exceed any context
MARK = "<wait-for-health>"                      # the text whose tokenizing is held up


@pytest.fixture()
def encode_calls(engine, monkeypatch):
    """Lengths of the texts the engine's tokenizer encodes; a text holding MARK waits in the
    tokenizer until `release` is set (at most 20 s), a text over 1 MB is refused at once."""
    tok = engine.tokenizer
    real = tok.encode
    calls: list[int] = []
    entered, release = threading.Event(), threading.Event()

    def encode(text: str, *args, **kw):
        calls.append(len(text))
        if len(text) > 1_000_000:
            raise AssertionError("the whole huge text reached the tokenizer")
        if MARK in text:
            entered.set()
            release.wait(20)
        return real(text, *args, **kw)

    monkeypatch.setattr(tok, "encode", encode)
    return SimpleNamespace(lengths=calls, entered=entered, release=release)


@pytest.mark.parametrize(("call", "field"), [
    ("generate_text", "input.text"),
    ("tokenize_text", "input.text"),
    ("generate_chat", "input.chat"),
    ("tokenize_chat", "input.chat"),
])
def test_huge_text_refused_before_tokenizing(client, encode_calls, call, field):
    run = {
        "generate_text": lambda: list(client.generate(HUGE, max_new_tokens=1)),
        "tokenize_text": lambda: client.tokenize(HUGE),
        "generate_chat": lambda: list(client.generate(chat=[("user", HUGE)], max_new_tokens=1)),
        "tokenize_chat": lambda: client.tokenize(chat=[("user", HUGE)]),
    }[call]
    with pytest.raises(grpc.RpcError) as ei:
        run()
    e = error_details(ei.value)
    assert (e.code, e.reason) == ("INVALID_ARGUMENT", "PROMPT_TOO_LONG"), e
    assert [f for f, _ in e.field_violations] == [field]
    assert f"the context holds {N_CTX}" in e.message
    assert encode_calls.lengths == []                 # refused without tokenizing anything


def test_text_that_may_fit_is_still_tokenized(client):
    """The bound refuses only what cannot fit: a text of many more bytes than the context has
    tokens, but few tokens (long runs of spaces), is tokenized and served."""
    text = " " * (40 * N_CTX) + "x"
    ids = client.tokenize(text).ids
    assert 0 < len(ids) < N_CTX


@pytest.mark.parametrize("call", ["generate_text", "generate_chat", "tokenize_text",
                                  "tokenize_chat"])
def test_health_answers_while_a_prompt_is_tokenized(server, client, encode_calls, call):
    """While one request sits in the tokenizer, health and other calls are answered."""
    text = f"{MARK} a prompt"
    run = {
        "generate_text": lambda: client.complete(text, max_new_tokens=1),
        "tokenize_text": lambda: client.tokenize(text),
        "generate_chat": lambda: client.complete(chat=[("user", text)], max_new_tokens=1),
        "tokenize_chat": lambda: client.tokenize(chat=[("user", text)]),
    }[call]
    with ThreadPoolExecutor(1) as pool:
        big = pool.submit(run)
        assert encode_calls.entered.wait(30), "the request never reached the tokenizer"
        try:
            assert client.health(timeout=5) == "SERVING"
            assert client.detokenize([], timeout=5) == ""
            assert not big.done()                  # health was answered first
        finally:
            encode_calls.release.set()
        big.result(timeout=60)
