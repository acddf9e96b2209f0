"""The HuggingFace `tokenizers` models of both vocabulary kinds, built in memory from GGUF
metadata: byte-level BPE behind the pre-tokenizer regexes `tokenizer.ggml.pre` selects
(vocab_rules.py), and SentencePiece-style vocabularies as BPE whose merges are every split of
every piece, ranked by the piece's score (tokenizer.py's docstring gives the equivalence).
"""

from __future__ import annotations

from collections.abc import Mapping
from numbers import Real
from typing import Any

from tokenizers import Regex, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from service.errors import ModelFormatError
from service.model.vocab import KEY_MERGES, KEY_SCORES, read_list
from service.model.vocab_rules import PreTokenizer


def _hf_bpe(vocab: dict[str, int], merges: list[tuple[str, str]], **kw: Any) -> HFTokenizer:
    return HFTokenizer(models.BPE(vocab=vocab, merges=merges, **kw))


def build_bpe(md: Mapping[str, Any], vocab: dict[str, int], spec: PreTokenizer) -> HFTokenizer:
    merges: list[tuple[str, str]] = []
    seen = set()
    for i, line in enumerate(read_list(md, KEY_MERGES, str, None)):
        cut = line.find(" ", 1)
        if cut < 0:
            raise ModelFormatError(f"{KEY_MERGES}[{i}]: {line!r} is not 'left right'")
        pair = (line[:cut], line[cut + 1:])
        # llama.cpp keeps the first rank of a repeated pair; a pair whose parts or result are
        # not tokens can never yield a token, so it is left out.
        if pair not in seen and pair[0] in vocab and pair[1] in vocab and "".join(pair) in vocab:
            seen.add(pair)
            merges.append(pair)
    hf = _hf_bpe(vocab, merges, ignore_merges=spec.ignore_merges)
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in spec.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return hf


def build_spm(md: Mapping[str, Any], texts: list[str], vocab: dict[str, int],
               unk_id: int | None) -> HFTokenizer:
    scores = [float(s) for s in read_list(md, KEY_SCORES, Real, len(texts))]
    # Every split of every piece into two pieces, best resulting score first (ties: lower id).
    order = sorted(range(len(texts)), key=lambda i: (-scores[i], i))
    merges = [(a, b) for i in order if len(p := texts[i]) > 1 for k in range(1, len(p))
              if (a := p[:k]) in vocab and (b := p[k:]) in vocab]
    unk = texts[unk_id] if unk_id is not None else None
    return _hf_bpe(vocab, merges, byte_fallback=True, unk_token=unk)
