"""GGUF vocabularies as data: the tokenizer.ggml.* keys, token types and llama.cpp's token
attributes, the vocabulary kinds, GPT-2's byte table, and checked readers of the metadata
(a malformed value is a ModelFormatError naming its key). Used by tokenizer.py and bpe.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum, IntEnum, IntFlag
from numbers import Integral
from typing import Any

from service.errors import ModelFormatError

KEY_MODEL = "tokenizer.ggml.model"
KEY_PRE = "tokenizer.ggml.pre"
KEY_TOKENS = "tokenizer.ggml.tokens"
KEY_TYPES = "tokenizer.ggml.token_type"
KEY_SCORES = "tokenizer.ggml.scores"
KEY_MERGES = "tokenizer.ggml.merges"
KEY_ADD_BOS = "tokenizer.ggml.add_bos_token"
KEY_ADD_EOS = "tokenizer.ggml.add_eos_token"
KEY_ADD_SPACE_PREFIX = "tokenizer.ggml.add_space_prefix"
SPACE_MARK = "\u2581"  # SentencePiece's visible space


class TokenType(IntEnum):
    """Values of `tokenizer.ggml.token_type`."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


class TokenAttr(IntFlag):
    """llama.cpp's token attributes: the GGUF type, plus CONTROL where a role is found by text."""

    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5


# Per-token attributes are kept as plain ints (262k IntFlag objects would slow loading).


class VocabKind(Enum):
    BPE = "gpt2"
    SPM = "llama"
    NONE = "none"


VOCAB_KINDS = {"gpt2": VocabKind.BPE, "llama": VocabKind.SPM,
                "none": VocabKind.NONE, "no_vocab": VocabKind.NONE}


# llama.cpp's ids when the metadata names none: (bos, eos, unk)
DEFAULT_IDS = {VocabKind.SPM: (1, 2, 0), VocabKind.BPE: (11, 11, None)}


def byte_level_chars() -> list[str]:
    """GPT-2's reversible byte -> printable char table used by byte-level BPE vocabularies."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in kept:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


# ---------------------------------------------------------------- metadata readers
def read_list(md: Mapping[str, Any], key: str, item: type, n: int | None) -> list:
    """md[key] as a list of `item` values (of n entries when n is given)."""
    value = md.get(key)
    # one check per distinct element type, not per element (a vocabulary has 262k entries)
    if not isinstance(value, list) or not all(issubclass(t, item) for t in set(map(type, value))):
        raise ModelFormatError(f"{key}: expected a list of {item.__name__}")
    if n is not None and len(value) != n:
        raise ModelFormatError(f"{key}: has {len(value)} entries, {KEY_TOKENS} has {n}")
    return value


def read_flag(md: Mapping[str, Any], key: str, default: bool) -> bool:
    """md[key] as a bool, `default` when absent."""
    value = md.get(key, default)
    if not isinstance(value, bool):
        raise ModelFormatError(f"{key}: expected a bool, got {value!r}")
    return value


def read_token_id(md: Mapping[str, Any], keys: tuple[str, ...], default: int | None,
                  n: int) -> int | None:
    """The first of `keys` present, as a token id below n; else `default` (None when it is
    not below n)."""
    for key in keys:
        if key in md:
            value = md[key]
            if isinstance(value, bool) or not isinstance(value, Integral) or not 0 <= value < n:
                raise ModelFormatError(f"{key}: {value!r} is not a token id below {n}")
            return int(value)
    return default if default is not None and default < n else None
