"""TextStream: complete UTF-8 only, stop sequences never leaked, chunking does not matter."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.engine.textstream import TextStream
from service.model.tokenizer import Tokenizer, byte_level_chars

END = 256  # the control token "<|end|>"


@pytest.fixture(scope="module")
def bytes_tok() -> Tokenizer:
    return _bytes_tokenizer()


def _bytes_tokenizer() -> Tokenizer:
    """Byte-level vocabulary where token id == byte value, plus one control token."""
    return Tokenizer.from_metadata({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": [*byte_level_chars(), "<|end|>"],
        "tokenizer.ggml.token_type": [1] * 256 + [3], "tokenizer.ggml.merges": [],
        "tokenizer.ggml.eos_token_id": END, "tokenizer.ggml.bos_token_id": END})


def ids(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def run(stream: TextStream, chunks: list[list[int]]) -> tuple[str, str | None]:
    out = ""
    for chunk in chunks:
        text, stop = stream.push(chunk)
        out += text
        if stop is not None:
            return out, stop
    return out + stream.finish(), None


def test_stop_across_token_boundaries(bytes_tok):
    stream = TextStream(bytes_tok, stop=["<stop>"])
    emitted = []
    for i in ids("Hello<stop>world"):
        text, stop = stream.push([i])
        emitted.append(text)
        if stop:
            break
    assert "".join(emitted) == "Hello" and stop == "<stop>"
    assert emitted[-6:-1] == [""] * 5  # '<', 's', 't', 'o', 'p' were held, never sent
    assert stream.push(ids("more")) == ("", "<stop>") and stream.finish() == ""


def test_held_prefix_released_when_ruled_out_or_at_the_end(bytes_tok):
    stream = TextStream(bytes_tok, stop=["<stop>"])
    assert stream.push(ids("abc<st")) == ("abc", None)
    assert stream.pending == "<st"
    assert stream.push(ids("x")) == ("<stx", None)
    assert stream.push(ids("<s")) == ("", None)
    assert stream.finish() == "<s"


def test_multibyte_characters_and_stops(bytes_tok):
    stream = TextStream(bytes_tok, stop=["本"])
    out = [stream.push([b]) for b in ids("日本語")]
    assert [t for t, _ in out if t] == ["日"] and out[-1] == ("", "本")
    dangling = TextStream(bytes_tok)
    assert dangling.push(ids("a\u00e9")[:-1]) == ("a", None)
    assert dangling.finish() == "\ufffd"


def test_first_completed_stop_wins_whatever_the_chunking(bytes_tok):
    for chunks in ([ids("xabcd")], [[b] for b in ids("xabcd")]):
        assert run(TextStream(bytes_tok, stop=["abcd", "bc"]), chunks) == ("xa", "bc")
        assert run(TextStream(bytes_tok, stop=["abc", "ab"]), chunks) == ("x", "ab")


def test_special_tokens_text_or_skipped(bytes_tok):
    assert run(TextStream(bytes_tok), [ids("hi"), [END]]) == ("hi<|end|>", None)
    assert run(TextStream(bytes_tok, skip_special=True), [ids("hi"), [END]]) == ("hi", None)
    assert run(TextStream(bytes_tok, stop=["<|end|>"]), [ids("hi"), [END]]) == ("hi", "<|end|>")


def _expected(full: str, stops: list[str]) -> tuple[str, str | None]:
    """Whole-text answer: the stop whose first occurrence ends first (longer on a tie)."""
    found = [(full.find(s) + len(s), -len(s), s) for s in stops if s and s in full]
    if not found:
        return full, None
    end, neg_len, stop = min(found)
    return full[:end + neg_len], stop


@st.composite
def streams(draw):
    text = draw(st.text(alphabet=st.sampled_from(list("ab<>/ \né日😀")), max_size=30))
    data = ids(text)
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=10)))
    chunks = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    pieces = st.text(alphabet=st.sampled_from(list("ab<>/ é日")), min_size=1, max_size=4)
    from_text = st.builds(lambda i, n: text[i:i + n], st.integers(0, 30), st.integers(1, 4))
    stops = draw(st.lists(st.one_of(pieces, from_text), max_size=3))
    return text, chunks, stops


@settings(max_examples=400, deadline=None)
@given(streams())
def test_emitted_plus_held_is_the_decoded_text(case):
    text, chunks, stops = case
    tok = _bytes_tokenizer()
    stream = TextStream(tok, stop=stops)
    decoder = tok.incremental_decoder()
    emitted, decoded, stop = "", "", None
    for chunk in chunks:
        decoded += decoder.push(chunk)
        out, stop = stream.push(chunk)
        emitted += out
        if stop is not None:
            break
        assert emitted + stream.pending == decoded
        assert not any(s and s in emitted for s in stops)
    if stop is None:
        emitted += stream.finish()
    assert (emitted, stop) == _expected(text, stops)
