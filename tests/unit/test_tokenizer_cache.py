"""Tokenizer.from_metadata reuses a built vocabulary for the same tokenizer metadata only."""

from __future__ import annotations

import pytest

from service.errors import ModelFormatError
from service.model.tokenizer import Tokenizer
from tests.unit.test_tokenizer import _tiny_bpe, _tiny_spm


def test_same_metadata_same_instance():
    a = Tokenizer.from_metadata(_tiny_spm())
    assert Tokenizer.from_metadata(_tiny_spm(**{"general.name": "other file"})) is a


def test_changed_tokenizer_metadata_builds_anew():
    a = Tokenizer.from_metadata(_tiny_bpe())
    b = Tokenizer.from_metadata(_tiny_bpe(**{"tokenizer.ggml.merges": []}))
    assert b is not a
    assert a.encode("ab", add_bos=False) == [256]
    assert [b.token_text(t) for t in b.encode("ab", add_bos=False)] == ["a", "b"]


def test_nested_arrays_are_refused_not_unhashable():
    md = _tiny_bpe(**{"tokenizer.ggml.merges": [["a", "b"]]})
    with pytest.raises(ModelFormatError, match="merges"):
        Tokenizer.from_metadata(md)
