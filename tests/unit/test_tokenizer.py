"""Tokenizer against llama.cpp's own ids (tests/data/llamacpp_tokenizer.json) and metadata rules."""

from __future__ import annotations

import functools
import heapq

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.errors import InvalidRequestError, ModelFormatError
from service.model.tokenizer import (
    SPACE_MARK,
    IncrementalDecoder,
    TokenAttr,
    Tokenizer,
    VocabKind,
    byte_level_chars,
)
from tests.support.models import load_json, open_gguf

GOLDEN = load_json("llamacpp_tokenizer.json")
MODELS = GOLDEN["models"]


def model_metadata(name: str) -> dict:
    """The metadata of a real model, when it is present (the unit tier never fetches)."""
    return open_gguf(name, fetch=False).metadata


@pytest.fixture(scope="module", params=sorted(MODELS))
def named_tokenizer(request) -> tuple[str, Tokenizer]:
    return request.param, Tokenizer.from_metadata(model_metadata(request.param))


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    return Tokenizer.from_metadata(model_metadata("smollm2"))


@pytest.fixture(scope="module")
def gemma() -> Tokenizer:
    return Tokenizer.from_metadata(model_metadata("gemma3"))


# ---------------------------------------------------------------- golden ids from llama.cpp

def test_tokenize_cases_match_llamacpp(named_tokenizer):
    name, tok = named_tokenizer
    for case in MODELS[name]["tokenize"]:
        assert tok.encode(case["text"], add_bos=False) == case["ids"], case["text"]
        assert tok.decode(case["ids"]) == case["roundtrip"]
        dec = tok.incremental_decoder()
        streamed = "".join(dec.push([i]) for i in case["ids"]) + dec.flush()
        assert streamed == case["roundtrip"]


def test_greedy_prompt_ids_match_llamacpp(named_tokenizer):
    name, tok = named_tokenizer
    for case in MODELS[name]["greedy"]:
        assert tok.encode(case["prompt"], parse_special=True) == case["prompt_ids"], case["name"]
        assert tok.decode(case["greedy_ids"], skip_special=True) == case["greedy_text"]


def test_special_text_parsed_only_on_request(smol, gemma):
    assert smol.encode("<|im_start|>user", parse_special=True) == [1, 4093]
    assert 1 not in smol.encode("<|im_start|>user")
    turn = "<start_of_turn>user\nHi<end_of_turn>\n"
    assert gemma.encode(turn, parse_special=True) == [2, 105, 2364, 107, 10979, 106, 107]
    plain = gemma.encode(turn)
    assert 105 not in plain and 106 not in plain
    # user-defined tokens (Gemma's "<b>", "\n") are cut out even without parse_special
    assert gemma.encode("<b>x</b>", add_bos=False)[0] == gemma.encode("<b>", add_bos=False)[0]
    assert gemma.token_attr(gemma.encode("<b>", add_bos=False)[0]) == TokenAttr.USER_DEFINED


def test_bos_rules_follow_metadata(smol, gemma):
    assert not smol.add_bos and smol.bos_id == 1
    assert smol.encode("Hi")[0] != smol.bos_id
    assert smol.encode("Hi", add_bos=True)[0] == smol.bos_id
    assert gemma.add_bos and gemma.bos_id == 2
    assert gemma.encode("Hi")[0] == 2
    assert gemma.encode("Hi", add_bos=False)[0] != 2
    assert gemma.encode("", add_bos=True) == [2] and gemma.encode("", add_bos=False) == []


def test_end_of_generation_ids(smol, gemma):
    # Expected sets are llama_vocab_is_eog over every id, same llama.cpp as the fixtures.
    assert smol.eos_id == 2 and smol.token_text(2) == "<|im_end|>"
    assert smol.eog_ids == {0, 2, 4}  # <|endoftext|>, <|im_end|>, <reponame> (FIM repo)
    assert smol.token_text(1) == "<|im_start|>" and 1 not in smol.eog_ids
    assert gemma.eos_id == 1 and gemma.token_text(106) == "<end_of_turn>"
    assert gemma.eog_ids == {1, 106, 212}  # <eos>, <end_of_turn>, </s>
    assert 105 not in gemma.eog_ids  # <start_of_turn>
    # "</s>" is user-defined in the file; as an end-of-generation text it is made CONTROL, so it
    # is no longer cut out of plain text and is hidden by skip_special
    assert TokenAttr.CONTROL in gemma.token_attr(212)
    assert gemma.encode("</s>", add_bos=False) != [212]
    assert gemma.encode("</s>", add_bos=False, parse_special=True) == [212]
    assert gemma.decode([212], skip_special=True) == ""


def test_token_pieces(smol, gemma):
    space_t = smol.encode(" the")[0]
    assert smol.token_piece(space_t) == b" the"
    assert gemma.token_piece(gemma.encode(" the", add_bos=False)[0]) == b" the"
    byte_a = gemma.encode("\U0001fae8", add_bos=False)[0]
    assert gemma.token_attr(byte_a) == TokenAttr.BYTE and gemma.token_piece(byte_a) == b"\xf0"
    assert gemma.token_piece(106) == b"<end_of_turn>"
    assert gemma.token_piece(106, skip_special=True) == b""
    assert gemma.decode([2, 9259], skip_special=True) == "Hello"
    with pytest.raises(ValueError):
        gemma.token_piece(gemma.vocab_size)


# ---------------------------------------------------------------- incremental decoding

def test_incremental_decoder_holds_split_characters(smol):
    ids = smol.encode("emoji 🎉🚀 test")  # the emoji are split over byte tokens
    dec = IncrementalDecoder(smol)
    outs = []
    for i in ids:
        outs.append(dec.push([i]))
        assert "\ufffd" not in outs[-1]
    assert "".join(outs) + dec.flush() == "emoji 🎉🚀 test"
    assert "" in outs  # some tokens ended inside a character and were held


def test_incremental_decoder_cjk_and_byte_fallback(smol, gemma):
    for tok, text in ((smol, "日本語のテキスト"), (gemma, "x\U0001fae8\U000f0000y")):
        ids = tok.encode(text, add_bos=False)
        dec = tok.incremental_decoder()
        seen = ""
        for i in ids:
            seen += dec.push([i])
            assert text.startswith(seen)
        assert seen + dec.flush() == text


def test_incremental_decoder_flush_replaces_dangling(gemma):
    first_byte = gemma.encode("\U0001fae8", add_bos=False)[0]
    dec = gemma.incremental_decoder()
    assert dec.push([first_byte]) == "" and dec.pending_bytes == b"\xf0"
    assert dec.flush() == "\ufffd"


# ---------------------------------------------------------------- SPM rule, checked by a port

def _spm_greedy(text: str, vocab: dict[str, int], scores: list[float], byte_ids: list[int]):
    """llama.cpp's SPM loop written out: merge the adjacent pair whose concatenation is the
    best-scoring piece (ties: leftmost) until none is a piece; leftover chars -> byte tokens."""
    sym = list(text)
    nxt = list(range(1, len(sym))) + [-1]
    prv = list(range(-1, len(sym) - 1))
    heap: list[tuple[float, int, int, int]] = []

    def push(left: int, right: int) -> None:
        if left >= 0 and right >= 0 and (tid := vocab.get(sym[left] + sym[right])) is not None:
            heapq.heappush(heap, (-scores[tid], left, right, len(sym[left]) + len(sym[right])))

    for i in range(1, len(sym)):
        push(i - 1, i)
    while heap:
        _, left, right, size = heapq.heappop(heap)
        if not sym[left] or not sym[right] or len(sym[left]) + len(sym[right]) != size:
            continue
        sym[left], sym[right] = sym[left] + sym[right], ""
        nxt[left] = nxt[right]
        if nxt[left] >= 0:
            prv[nxt[left]] = left
        push(prv[left], left)
        push(left, nxt[left])
    out, i = [], 0 if sym else -1
    while i != -1:
        tid = vocab.get(sym[i])
        out.extend([tid] if tid is not None else [byte_ids[b] for b in sym[i].encode()])
        i = nxt[i]
    return out


@functools.lru_cache(maxsize=1)
def _gemma_reference() -> tuple[Tokenizer, dict[str, int], list[float], list[int]]:
    md = model_metadata("gemma3")
    vocab = {t: i for i, t in enumerate(md["tokenizer.ggml.tokens"])}
    byte_ids = [vocab[f"<0x{b:02X}>"] for b in range(256)]
    return Tokenizer.from_metadata(md), vocab, md["tokenizer.ggml.scores"], byte_ids


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(alphabet=st.sampled_from(list("aeilnorst -_.=,!0123456789é日本ä😀\U0001fae8")),
               max_size=40))
def test_gemma_matches_greedy_score_rule(text):
    tok, vocab, scores, byte_ids = _gemma_reference()
    text = " ".join(text.split())  # runs of spaces are Gemma user-defined tokens: cut out first
    expected = _spm_greedy(text.replace(" ", SPACE_MARK), vocab, scores, byte_ids)
    assert tok.encode(text, add_bos=False) == expected


# ---------------------------------------------------------------- metadata without a model file

def _tiny_bpe(**extra) -> dict:
    tokens = [*byte_level_chars(), "ab", "<|end|>"]
    md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt2",
          "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.token_type": [1] * 257 + [3],
          "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.eos_token_id": 257,
          "tokenizer.ggml.bos_token_id": 257}
    md.update(extra)
    return md


def _tiny_spm(**extra) -> dict:
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)),
              SPACE_MARK, "a", "b", "c", "ab", "bc", f"{SPACE_MARK}a"]
    scores = [0.0] * 259 + [-1.0, -2.0, -3.0, -4.0, -6.0, -5.0, -0.5]
    types = [2, 3, 3] + [6] * 256 + [1] * 7
    md = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types,
          "tokenizer.ggml.add_space_prefix": True}
    md.update(extra)
    return md


def test_tiny_bpe_from_metadata():
    tok = Tokenizer.from_metadata(_tiny_bpe())
    assert tok.kind is VocabKind.BPE and tok.vocab_size == 258
    ab = tok.encode("abc")
    assert ab == [256, ord("c")]
    assert tok.decode(ab) == "abc"
    assert tok.eog_ids == {257}  # "<|end|>" text and the EOS id
    assert tok.encode("x<|end|>", parse_special=True) == [ord("x"), 257]


def test_tiny_spm_greedy_by_score_and_space_prefix():
    tok = Tokenizer.from_metadata(_tiny_spm())
    ids = {t: i for i, t in enumerate(_tiny_spm()["tokenizer.ggml.tokens"])}
    # "abc": 'bc' (-5) beats 'ab' (-6); a space is prefixed and '▁a' (-0.5) wins first
    assert tok.encode("abc", add_bos=False) == [ids[f"{SPACE_MARK}a"], ids["bc"]]
    assert tok.encode("abc") == [1, ids[f"{SPACE_MARK}a"], ids["bc"]]  # SPM: BOS by default
    assert tok.encode("z", add_bos=False) == [ids[SPACE_MARK], ids["<0x7A>"]]
    assert tok.decode(tok.encode("abc", add_bos=False)) == "abc"  # the prefix space is dropped


def test_ids_only_tokenizer():
    tok = Tokenizer.ids_only(1024)
    assert tok.vocab_size == 1024 and not tok.can_encode
    with pytest.raises(InvalidRequestError):
        tok.encode("hello")
    assert tok.decode([1, 2, 3]) == "" and tok.eog_ids == frozenset()
    tiny = {"general.architecture": "qwen3", "qwen3.vocab_size": 1024,
            "tokenizer.ggml.model": "none"}
    assert Tokenizer.from_metadata(tiny).vocab_size == 1024
    assert Tokenizer.from_metadata({"tokenizer.ggml.tokens": ["a", "b"]}).vocab_size == 2


@pytest.mark.parametrize("md, key", [
    ({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]}, "tokenizer.ggml.model"),
    ({"tokenizer.ggml.model": "gpt2"}, "tokenizer.ggml.tokens"),
    (_tiny_bpe(**{"tokenizer.ggml.token_type": [1, 1]}), "tokenizer.ggml.token_type"),
    (_tiny_bpe(**{"tokenizer.ggml.pre": "nonesuch"}), "tokenizer.ggml.pre"),
    ({k: v for k, v in _tiny_bpe().items() if k != "tokenizer.ggml.merges"},
     "tokenizer.ggml.merges"),
    (_tiny_bpe(**{"tokenizer.ggml.bos_token_id": 9999}), "tokenizer.ggml.bos_token_id"),
    ({k: v for k, v in _tiny_spm().items() if k != "tokenizer.ggml.scores"},
     "tokenizer.ggml.scores"),
    (_tiny_spm(**{"tokenizer.ggml.tokens": ["a", "a"] + _tiny_spm()["tokenizer.ggml.tokens"][2:]}),
     "tokenizer.ggml.tokens"),
    ({"general.architecture": "llama", "tokenizer.ggml.model": "none"}, "llama.vocab_size"),
])
def test_bad_metadata_names_the_key(md, key):
    with pytest.raises(ModelFormatError, match=key.replace(".", r"\.")):
        Tokenizer.from_metadata(md)
