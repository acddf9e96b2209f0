"""Generate over a real socket: stream shape, parity with `specstream generate`, stops, UTF-8."""

from __future__ import annotations

import asyncio
import json
import subprocess

import pytest

from clients import AsyncSpecstreamClient, Completion
from service.proto import generation_pb2
from tests.support.grpc_harness import N_CTX, ROOT, specstream_bin, specstream_env

PROMPT = "The capital of France is"
GREEDY = {"temperature": 0.0}


def kinds(responses) -> list[str]:
    return [r.WhichOneof("event") for r in responses]


def test_stream_order_started_deltas_finished(client):
    responses = list(client.generate(PROMPT, max_new_tokens=8, ignore_eos=True,
                                     request_id="order-1", **GREEDY))
    ks = kinds(responses)
    assert ks[0] == "started" and ks[-1] == "finished"
    assert set(ks[1:-1]) == {"delta"} and len(ks) >= 3
    assert {r.request_id for r in responses} == {"order-1"}
    done = Completion()
    for r in responses:
        done.add(r)
    assert done.finish_reason == "LENGTH"
    assert len(done.token_ids) == done.usage.completion_tokens == 8
    prompt_ids = client.tokenize(PROMPT).ids
    assert done.prompt_tokens == done.usage.prompt_tokens == len(prompt_ids)
    t = done.timings
    assert t.time_to_first_token_ms >= t.queue_ms >= 0


def test_request_id_minted_or_taken_from_metadata(client, server):
    minted = list(client.generate(PROMPT, max_new_tokens=1, **GREEDY))
    assert len({r.request_id for r in minted}) == 1 and minted[0].request_id
    from clients import SpecstreamClient

    with SpecstreamClient(server.target, metadata=[("x-request-id", "from-meta")]) as c:
        got = list(c.generate(PROMPT, max_new_tokens=1, **GREEDY))
    assert {r.request_id for r in got} == {"from-meta"}


def test_greedy_output_identical_to_cli(client, model_path):
    n = 12
    out = subprocess.run(
        [specstream_bin(), "generate", str(model_path), "--prompt", PROMPT, "--temperature", "0",
         "--max-new-tokens", str(n), "--json", "--backend", "cpu", "--n-ctx", str(N_CTX)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=specstream_env())
    assert out.returncode == 0, out.stderr
    cli = json.loads(out.stdout.strip().splitlines()[-1])
    done = client.complete(PROMPT, max_new_tokens=n, **GREEDY)
    assert done.token_ids == cli["token_ids"]
    assert done.text == cli["text"]
    assert done.finish_reason.lower() == cli["finish_reason"]


def test_token_input_equals_text_input(client):
    ids = list(client.tokenize(PROMPT).ids)
    a = client.complete(PROMPT, max_new_tokens=6, **GREEDY)
    b = client.complete(tokens=ids, max_new_tokens=6, **GREEDY)
    assert (a.token_ids, a.text, a.prompt_tokens) == (b.token_ids, b.text, b.prompt_tokens)


def test_speculation_is_lossless_over_grpc(client):
    plain = client.complete(PROMPT, max_new_tokens=10, speculative=False, **GREEDY)
    spec = client.complete(PROMPT, max_new_tokens=10, speculative=True, **GREEDY)
    assert plain.token_ids == spec.token_ids and plain.text == spec.text
    assert plain.usage.draft_tokens == 0


def test_stop_sequence_cut_and_never_leaked(client):
    base = client.complete(PROMPT, max_new_tokens=16, ignore_eos=True, **GREEDY)
    text = base.text
    # A stop that starts mid-text and spans a token boundary where possible.
    start = max(1, len(text) // 3)
    stop = text[start:start + 4]
    assert stop.strip(), f"degenerate completion {text!r}"
    responses = list(client.generate(PROMPT, max_new_tokens=16, ignore_eos=True, stop=[stop],
                                     **GREEDY))
    done = Completion()
    for r in responses:
        done.add(r)
    cut = text.index(stop)
    assert done.finish_reason == "STOP_SEQUENCE" and done.stop_sequence == stop
    assert done.text == text[:cut]
    for r in responses:               # no Delta carries any of the stop sequence
        if r.HasField("delta"):
            assert stop not in r.delta.text


def test_stop_token(client):
    base = client.complete(PROMPT, max_new_tokens=10, ignore_eos=True, **GREEDY)
    j = 3
    stop_id = base.token_ids[j]
    j = base.token_ids.index(stop_id)
    done = client.complete(PROMPT, max_new_tokens=10, ignore_eos=True,
                           stop_token_ids=[stop_id], **GREEDY)
    assert done.finish_reason == "STOP_TOKEN" and done.stop_token_id == stop_id
    assert done.token_ids == base.token_ids[:j + 1]   # the stop token is reported, not printed
    assert base.text.startswith(done.text)


def test_deltas_are_whole_utf8(client, engine):
    # The model answers an emoji list with emoji whose bytes span several tokens.
    prompt = "Emoji list: 😀 😃 😄 😁 😆 😅 😂 🤣"
    responses = list(client.generate(prompt, max_new_tokens=12, ignore_eos=True,
                                     speculative=False, **GREEDY))
    deltas = [r.delta for r in responses if r.HasField("delta")]
    split = 0
    for d in deltas:
        assert "\ufffd" not in d.text
        d.text.encode("utf-8")                        # whole characters, no lone surrogates
        raw = b"".join(engine.tokenizer.token_piece(t) for t in d.token_ids)
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            split += 1                                # these bytes alone are not valid UTF-8
    all_ids = [t for d in deltas for t in d.token_ids]
    assert "".join(d.text for d in deltas) == client.detokenize(all_ids)
    assert split > 0, "no character split across tokens was generated; pick another prompt"


def test_top_logprobs_aligned(client):
    done = client.complete(PROMPT, max_new_tokens=4, top_logprobs=3, ignore_eos=True, **GREEDY)
    assert [lp.token_id for lp in done.logprobs] == done.token_ids
    for lp in done.logprobs:
        assert len(lp.top) == 3 and lp.logprob <= 0.0
        assert lp.top[0].logprob >= lp.top[1].logprob >= lp.top[2].logprob
        assert lp.token_id == lp.top[0].token_id      # greedy picks the most likely


def test_chat_input(client, engine):
    chat = [("system", "You are terse."), ("user", "Say hi.")]
    ids = list(client.tokenize(chat=chat).ids)
    assert ids == engine.chat_prompt_ids([{"role": r, "content": c} for r, c in chat])
    done = client.complete(chat=chat, max_new_tokens=4, **GREEDY)
    assert done.prompt_tokens == len(ids) and done.finish_reason in ("LENGTH", "EOS")


@pytest.mark.parametrize("text", [
    "hello world", "  leading and trailing  ", "naïve café, 東京, 🤖🎉", "line1\nline2\ttab",
    "<|im_start|>user\nhi<|im_end|>",
])
def test_tokenize_detokenize_round_trip(client, text):
    r = client.tokenize(text, add_bos=False)
    assert len(r.ids) == len(r.pieces) and r.ids
    assert b"".join(r.pieces).decode("utf-8") == text
    assert client.detokenize(r.ids) == text


def test_tokenize_add_bos_and_special(client, engine):
    bos = engine.tokenizer.bos_id
    with_bos = client.tokenize("hi", add_bos=True).ids
    assert bos is None or with_bos[0] == bos
    special = client.tokenize("<|im_start|>", add_bos=False).ids
    literal = client.tokenize("<|im_start|>", add_bos=False, parse_special=False).ids
    assert len(special) == 1 and len(literal) > 1


def test_async_client_matches_sync(client, server):
    async def run() -> Completion:
        async with AsyncSpecstreamClient(server.target) as c:
            assert await c.health() == "SERVING"
            assert (await c.tokenize("hi")).ids
            return await c.complete(PROMPT, max_new_tokens=6, **GREEDY)

    a = asyncio.run(run())
    b = client.complete(PROMPT, max_new_tokens=6, **GREEDY)
    assert (a.token_ids, a.text) == (b.token_ids, b.text)


def test_finish_reason_enum_zero_is_unspecified():
    assert generation_pb2.FinishReason.Name(0) == "FINISH_REASON_UNSPECIFIED"
