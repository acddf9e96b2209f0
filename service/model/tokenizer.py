"""Text <-> token ids for GGUF vocabularies, reproducing llama.cpp's tokenizer.

Two vocabulary kinds are served, both run by a HuggingFace `tokenizers` BPE model built in memory
from the GGUF metadata (nothing is read from disk or the network):

- `gpt2` (byte-level BPE): the text is split by the pre-tokenizer regexes that
  `tokenizer.ggml.pre` selects (registry below, same regexes as llama.cpp), each piece is mapped
  byte -> printable char (GPT-2's table) and merged by `tokenizer.ggml.merges` rank.
- `llama` (SentencePiece-style): llama.cpp merges adjacent symbols greedily, always the pair whose
  concatenation is the vocabulary piece with the highest score. That is BPE whose merge list holds,
  for every piece p and every split p = a + b with a and b pieces, the pair (a, b) ranked by
  score(p) descending. Chars that are no piece become <0xNN> byte tokens; ' ' is written U+2581.

Special tokens are cut out of the text first, longest first (llama.cpp's partition): user-defined
tokens always, control and unknown tokens only when `parse_special` is true. As in llama.cpp,
tokens whose text marks a role (end of turn, FIM, ...) gain the CONTROL attribute, and the
end-of-generation set is eos plus those roles and texts (`ROLES`, `EOG_TEXTS`).
"""

from __future__ import annotations

import codecs
import functools
from collections.abc import Iterable, Mapping
from enum import Enum, IntEnum, IntFlag
from numbers import Integral, Real
from typing import Any

from tokenizers import Regex, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from service.errors import InvalidRequestError, ModelFormatError
from service.model.vocab_rules import (
    ALWAYS_SHOWN,
    EOG_EXCEPTIONS,
    EOG_ROLES,
    EOG_TEXTS,
    PRE_TOKENIZERS,
    ROLES,
    PreTokenizer,
)

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
_ATTR_OF_TYPE = {int(t): int(TokenAttr[t.name]) for t in TokenType}
_NORMAL, _CONTROL, _USER, _BYTE = (int(TokenAttr[n]) for n in
                                   ("NORMAL", "CONTROL", "USER_DEFINED", "BYTE"))
_SPECIAL = int(TokenAttr.CONTROL | TokenAttr.UNKNOWN)  # hidden by skip_special, parsed on request
_LITERAL = _SPECIAL | _USER                            # decoded as their stored text


class VocabKind(Enum):
    BPE = "gpt2"
    SPM = "llama"
    NONE = "none"


_VOCAB_KINDS = {"gpt2": VocabKind.BPE, "llama": VocabKind.SPM,
                "none": VocabKind.NONE, "no_vocab": VocabKind.NONE}


# llama.cpp's ids when the metadata names none: (bos, eos, unk)
_DEFAULT_IDS = {VocabKind.SPM: (1, 2, 0), VocabKind.BPE: (11, 11, None)}


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


_CHAR_TO_BYTE = {c: b for b, c in enumerate(byte_level_chars())}


# ---------------------------------------------------------------- metadata checks

def _list(md: Mapping[str, Any], key: str, item: type, n: int | None) -> list:
    value = md.get(key)
    # one check per distinct element type, not per element (a vocabulary has 262k entries)
    if not isinstance(value, list) or not all(issubclass(t, item) for t in set(map(type, value))):
        raise ModelFormatError(f"{key}: expected a list of {item.__name__}")
    if n is not None and len(value) != n:
        raise ModelFormatError(f"{key}: has {len(value)} entries, {KEY_TOKENS} has {n}")
    return value


def _flag(md: Mapping[str, Any], key: str, default: bool) -> bool:
    value = md.get(key, default)
    if not isinstance(value, bool):
        raise ModelFormatError(f"{key}: expected a bool, got {value!r}")
    return value


def _token_id(md: Mapping[str, Any], keys: tuple[str, ...], default: int | None,
              n: int) -> int | None:
    for key in keys:
        if key in md:
            value = md[key]
            if isinstance(value, bool) or not isinstance(value, Integral) or not 0 <= value < n:
                raise ModelFormatError(f"{key}: {value!r} is not a token id below {n}")
            return int(value)
    return default if default is not None and default < n else None


def _frozen(value: Any) -> Any:
    return tuple(_frozen(v) for v in value) if isinstance(value, list) else value


def _cache_key(md: Mapping[str, Any]) -> tuple:
    """The tokenizer's metadata (every tokenizer.ggml.* key) as a hashable value."""
    return tuple(sorted((k, _frozen(v)) for k, v in md.items()
                        if k.startswith("tokenizer.ggml.")))


@functools.lru_cache(maxsize=4)
def _cached(kind: VocabKind, key: tuple) -> Tokenizer:
    """Building a 262k-entry vocabulary takes seconds; a reloaded model reuses it."""
    tok = Tokenizer(kind, 0)
    tok._load({k: list(v) if isinstance(v, tuple) else v for k, v in key})
    return tok


# ---------------------------------------------------------------- the tokenizer

class Tokenizer:
    """A model's vocabulary: encode, decode, special ids. Immutable once built; thread-safe."""

    def __init__(self, kind: VocabKind, vocab_size: int):
        self.kind = kind
        self.vocab_size = vocab_size
        self.bos_id: int | None = None
        self.eos_id: int | None = None
        self.unk_id: int | None = None
        self.eog_ids: frozenset[int] = frozenset()
        self.add_bos = False
        self.add_eos = False
        self.add_space_prefix = False
        self._texts: list[str] = []
        self._attrs: list[int] = []  # TokenAttr bits per id
        self._specials: tuple[tuple[str, int, bool], ...] = ()  # (text, id, control-like)
        self._hf: HFTokenizer | None = None
        self._pieces: dict[int, bytes] = {}

    # ---- construction
    @classmethod
    def ids_only(cls, vocab_size: int) -> Tokenizer:
        """A model without a vocabulary: ids in, ids out; text cannot be encoded."""
        if vocab_size <= 0:
            raise ModelFormatError(f"vocabulary size must be positive, got {vocab_size}")
        return cls(VocabKind.NONE, vocab_size)

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any]) -> Tokenizer:
        """Build from GGUF metadata (plain python values). Same metadata -> cached instance."""
        name = md.get(KEY_MODEL, "none")
        kind = _VOCAB_KINDS.get(name) if isinstance(name, str) else None
        if kind is None:
            raise ModelFormatError(f"{KEY_MODEL}: unsupported tokenizer {name!r}; supported: "
                                   + ", ".join(sorted(_VOCAB_KINDS)))
        if kind is VocabKind.NONE:
            if KEY_TOKENS in md:
                return cls.ids_only(len(_list(md, KEY_TOKENS, str, None)))
            size_key = f"{md.get('general.architecture')}.vocab_size"
            size = md.get(size_key)
            if isinstance(size, bool) or not isinstance(size, Integral):
                raise ModelFormatError(f"{size_key}: needed for a model without {KEY_TOKENS}")
            return cls.ids_only(int(size))
        return _cached(kind, _cache_key(md))

    def _load(self, md: Mapping[str, Any]) -> None:
        texts = _list(md, KEY_TOKENS, str, None)
        n = len(texts)
        if n == 0:
            raise ModelFormatError(f"{KEY_TOKENS}: the vocabulary is empty")
        texts = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(texts)]
        vocab = {t: i for i, t in enumerate(texts)}
        if len(vocab) != n:
            raise ModelFormatError(f"{KEY_TOKENS}: {n - len(vocab)} duplicate token texts")
        raw_types = (_list(md, KEY_TYPES, Integral, n) if KEY_TYPES in md
                     else [int(TokenType.NORMAL)] * n)
        # llama.cpp reads an unknown type as UNDEFINED (such tokens decode to nothing)
        attrs = [_ATTR_OF_TYPE.get(int(t), 0) for t in raw_types]
        spec = None
        if self.kind is VocabKind.BPE:
            pre = md.get(KEY_PRE, "default")
            spec = PRE_TOKENIZERS.get(pre) if isinstance(pre, str) else None
            if spec is None:
                raise ModelFormatError(f"{KEY_PRE}: unsupported pre-tokenizer {pre!r}; supported: "
                                       + ", ".join(sorted(PRE_TOKENIZERS)))
        bos, eos, unk = _DEFAULT_IDS[self.kind]
        self.vocab_size = n
        self.bos_id = _token_id(md, ("tokenizer.ggml.bos_token_id",), bos, n)
        self.eos_id = _token_id(md, ("tokenizer.ggml.eos_token_id",), eos, n)
        self.unk_id = _token_id(md, ("tokenizer.ggml.unknown_token_id",), unk, n)
        spm = self.kind is VocabKind.SPM
        self.add_bos = _flag(md, KEY_ADD_BOS, spm or bool(spec and spec.add_bos))
        self.add_eos = _flag(md, KEY_ADD_EOS, False)
        self.add_space_prefix = _flag(md, KEY_ADD_SPACE_PREFIX, spm)
        self._texts, self._attrs = texts, attrs
        self._find_roles(md, vocab)
        self._specials = tuple(sorted(
            ((texts[i], i, bool(a & _SPECIAL)) for i, a in enumerate(attrs) if a & _LITERAL),
            key=lambda s: (-len(s[0].encode("utf-8", "surrogatepass")), s[1])))
        if spm:
            self._hf = _build_spm(md, texts, vocab, self.unk_id)
        else:
            self._hf = _build_bpe(md, vocab, spec)

    def _find_roles(self, md: Mapping[str, Any], vocab: dict[str, int]) -> None:
        """EOG set and attribute changes, in llama.cpp's order (a found role becomes CONTROL)."""
        attrs, eog = self._attrs, set()
        for role, (keys, texts) in ROLES.items():
            tid = _token_id(md, keys, None, self.vocab_size)
            if tid is None:
                tid = next((vocab[t] for t in texts if t in vocab), None)
                if tid is not None:
                    attrs[tid] |= _CONTROL
            if tid is not None and role in EOG_ROLES:
                eog.add(tid)
        for text in EOG_TEXTS & vocab.keys():
            eog.add(vocab[text])
            attrs[vocab[text]] |= _CONTROL
        for text in ALWAYS_SHOWN & vocab.keys():
            attrs[vocab[text]] = _USER
        if self.eos_id is not None:
            eog.add(self.eos_id)
        eog_texts = {self._texts[i] for i in eog}
        for text, attr, groups in EOG_EXCEPTIONS:
            if text in eog_texts and any(g <= eog_texts for g in groups):
                eog.discard(vocab[text])
                attrs[vocab[text]] = int(TokenAttr[attr])
        self.eog_ids = frozenset(eog)

    # ---- queries
    @property
    def can_encode(self) -> bool:
        return self.kind is not VocabKind.NONE

    def token_text(self, tid: int) -> str:
        """The vocabulary entry as stored (byte-level / U+2581 form); '' without a vocabulary."""
        self._check(tid)
        return self._texts[tid] if self._texts else ""

    def token_attr(self, tid: int) -> TokenAttr:
        self._check(tid)
        return TokenAttr(self._attrs[tid] if self._attrs else 0)

    def _check(self, tid: int) -> None:
        if not 0 <= tid < self.vocab_size:
            raise ValueError(f"token id {tid} outside the vocabulary [0, {self.vocab_size})")

    # ---- encode
    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = False,
               add_eos: bool | None = None) -> list[int]:
        """Token ids of `text`. add_bos/add_eos None: as the metadata says."""
        if self._hf is None:
            raise InvalidRequestError(
                "input.text", "this model has no vocabulary (tokenizer.ggml.model 'none'); "
                "it accepts token ids only", reason="FAILED_PRECONDITION")
        ids: list[int] = []
        if self.add_bos if add_bos is None else add_bos:
            if self.bos_id is None:
                raise ModelFormatError("tokenizer.ggml.bos_token_id: needed to add BOS")
            ids.append(self.bos_id)
        prev_special = True
        for frag in self._partition(text, parse_special):
            if isinstance(frag, int):
                ids.append(frag)
                prev_special = True
                continue
            if self.kind is VocabKind.SPM:
                if self.add_space_prefix and prev_special:
                    frag = " " + frag
                frag = frag.replace(" ", SPACE_MARK)
            ids.extend(self._hf.encode(frag, add_special_tokens=False).ids)
            prev_special = False
        if self.add_eos if add_eos is None else add_eos:
            if self.eos_id is None:
                raise ModelFormatError("tokenizer.ggml.eos_token_id: needed to add EOS")
            ids.append(self.eos_id)
        return ids

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Cut special-token texts out, longest (in bytes) first, as llama.cpp does; among
        equal lengths lower ids go first (llama.cpp leaves that order unspecified)."""
        frags: list[str | int] = [text] if text else []
        for piece, tid, control_like in self._specials:
            if (control_like and not parse_special) or piece not in text:
                continue
            out: list[str | int] = []
            for frag in frags:
                if isinstance(frag, int) or piece not in frag:
                    out.append(frag)
                    continue
                for j, part in enumerate(frag.split(piece)):
                    if j:
                        out.append(tid)
                    if part:
                        out.append(part)
            frags = out
        return frags

    # ---- decode
    def token_piece(self, tid: int, skip_special: bool = False) -> bytes:
        """The bytes token `tid` stands for (llama.cpp's token_to_piece).

        Control and unknown tokens give their text, or b'' when skip_special; user-defined
        tokens always give their text; unused tokens give b''; no vocabulary gives b''.
        """
        self._check(tid)
        if not self._texts:
            return b""
        attr = self._attrs[tid]
        if skip_special and attr & _SPECIAL:
            return b""
        piece = self._pieces.get(tid)
        if piece is None:
            piece = self._pieces[tid] = self._make_piece(tid, attr)
        return piece

    def _make_piece(self, tid: int, attr: int) -> bytes:
        text = self._texts[tid]
        if attr & _LITERAL:
            return text.encode("utf-8", "surrogatepass")
        if attr & _BYTE and not attr & _NORMAL:
            return bytes([int(text[3:5], 16)]) if self.kind is VocabKind.SPM else b""
        if not attr & _NORMAL:
            return b""
        if self.kind is VocabKind.SPM:
            return text.replace(SPACE_MARK, " ").encode("utf-8", "surrogatepass")
        # byte-level: each char stands for one byte; a char outside the table stays as UTF-8
        return b"".join(bytes([_CHAR_TO_BYTE[c]]) if c in _CHAR_TO_BYTE
                        else c.encode("utf-8", "surrogatepass") for c in text)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of `ids`: the concatenated pieces, invalid UTF-8 replaced by U+FFFD.

        As llama.cpp's detokenize: with add_space_prefix one leading space of the first piece is
        dropped, unless the sequence starts with BOS and skip_special removes it; skip_special
        also drops a BOS/EOS the metadata adds. No clean-up of spaces before punctuation: the
        text is what a stream of token pieces gives.
        """
        ids = list(ids)
        strip = self.add_space_prefix
        if skip_special and ids and self.add_bos and ids[0] == self.bos_id:
            ids, strip = ids[1:], False
        if skip_special and ids and self.add_eos and ids[-1] == self.eos_id:
            ids = ids[:-1]
        data = b"".join(self.token_piece(t, skip_special) for t in ids)
        if strip and ids and self.token_piece(ids[0], skip_special).startswith(b" "):
            data = data[1:]
        return data.decode("utf-8", "replace")

    def incremental_decoder(self, skip_special: bool = False) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special)


class IncrementalDecoder:
    """Per-request streaming decode: returns only complete UTF-8 text.

    Bytes of a multi-byte character split across tokens are held until the character is complete;
    bytes that can never form one become U+FFFD at once. No space is stripped: generated tokens
    continue a prompt.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, ids: Iterable[int]) -> str:
        data = b"".join(self.tokenizer.token_piece(t, self.skip_special) for t in ids)
        return self._utf8.decode(data)

    @property
    def pending_bytes(self) -> bytes:
        """Bytes held back, waiting for the rest of a character."""
        return self._utf8.getstate()[0]

    def flush(self) -> str:
        """End of stream: a dangling incomplete character becomes U+FFFD."""
        return self._utf8.decode(b"", final=True)


# ---------------------------------------------------------------- HuggingFace models

def _hf_bpe(vocab: dict[str, int], merges: list[tuple[str, str]], **kw: Any) -> HFTokenizer:
    return HFTokenizer(models.BPE(vocab=vocab, merges=merges, **kw))


def _build_bpe(md: Mapping[str, Any], vocab: dict[str, int], spec: PreTokenizer) -> HFTokenizer:
    merges: list[tuple[str, str]] = []
    seen = set()
    for i, line in enumerate(_list(md, KEY_MERGES, str, None)):
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


def _build_spm(md: Mapping[str, Any], texts: list[str], vocab: dict[str, int],
               unk_id: int | None) -> HFTokenizer:
    scores = [float(s) for s in _list(md, KEY_SCORES, Real, len(texts))]
    # Every split of every piece into two pieces, best resulting score first (ties: lower id).
    order = sorted(range(len(texts)), key=lambda i: (-scores[i], i))
    merges = [(a, b) for i in order if len(p := texts[i]) > 1 for k in range(1, len(p))
              if (a := p[:k]) in vocab and (b := p[k:]) in vocab]
    unk = texts[unk_id] if unk_id is not None else None
    return _hf_bpe(vocab, merges, byte_fallback=True, unk_token=unk)
