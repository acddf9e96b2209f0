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

The metadata keys, token types and their checked readers are in vocab.py, the HuggingFace models
of both kinds in bpe.py, llama.cpp's rules as data in vocab_rules.py.
"""

from __future__ import annotations

import codecs
import functools
from collections.abc import Iterable, Mapping
from numbers import Integral
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from service.errors import InvalidRequestError, ModelFormatError
from service.model.bpe import build_bpe, build_spm
from service.model.vocab import (
    DEFAULT_IDS,
    KEY_ADD_BOS,
    KEY_ADD_EOS,
    KEY_ADD_SPACE_PREFIX,
    KEY_MODEL,
    KEY_PRE,
    KEY_TOKENS,
    KEY_TYPES,
    SPACE_MARK,
    VOCAB_KINDS,
    TokenAttr,
    TokenType,
    VocabKind,
    byte_level_chars,
    read_flag,
    read_list,
    read_token_id,
)
from service.model.vocab_rules import (
    ALWAYS_SHOWN,
    EOG_EXCEPTIONS,
    EOG_ROLES,
    EOG_TEXTS,
    PRE_TOKENIZERS,
    ROLES,
)

_ATTR_OF_TYPE = {int(t): int(TokenAttr[t.name]) for t in TokenType}
_NORMAL, _CONTROL, _USER, _BYTE = (int(TokenAttr[n]) for n in
                                   ("NORMAL", "CONTROL", "USER_DEFINED", "BYTE"))
_SPECIAL = int(TokenAttr.CONTROL | TokenAttr.UNKNOWN)  # hidden by skip_special, parsed on request
_LITERAL = _SPECIAL | _USER                            # decoded as their stored text
_CHAR_TO_BYTE = {c: b for b, c in enumerate(byte_level_chars())}


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
        kind = VOCAB_KINDS.get(name) if isinstance(name, str) else None
        if kind is None:
            raise ModelFormatError(f"{KEY_MODEL}: unsupported tokenizer {name!r}; supported: "
                                   + ", ".join(sorted(VOCAB_KINDS)))
        if kind is VocabKind.NONE:
            if KEY_TOKENS in md:
                return cls.ids_only(len(read_list(md, KEY_TOKENS, str, None)))
            size_key = f"{md.get('general.architecture')}.vocab_size"
            size = md.get(size_key)
            if isinstance(size, bool) or not isinstance(size, Integral):
                raise ModelFormatError(f"{size_key}: needed for a model without {KEY_TOKENS}")
            return cls.ids_only(int(size))
        return _cached(kind, _cache_key(md))

    def _load(self, md: Mapping[str, Any]) -> None:
        texts = read_list(md, KEY_TOKENS, str, None)
        n = len(texts)
        if n == 0:
            raise ModelFormatError(f"{KEY_TOKENS}: the vocabulary is empty")
        texts = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(texts)]
        vocab = {t: i for i, t in enumerate(texts)}
        if len(vocab) != n:
            raise ModelFormatError(f"{KEY_TOKENS}: {n - len(vocab)} duplicate token texts")
        raw_types = (read_list(md, KEY_TYPES, Integral, n) if KEY_TYPES in md
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
        bos, eos, unk = DEFAULT_IDS[self.kind]
        self.vocab_size = n
        self.bos_id = read_token_id(md, ("tokenizer.ggml.bos_token_id",), bos, n)
        self.eos_id = read_token_id(md, ("tokenizer.ggml.eos_token_id",), eos, n)
        self.unk_id = read_token_id(md, ("tokenizer.ggml.unknown_token_id",), unk, n)
        spm = self.kind is VocabKind.SPM
        self.add_bos = read_flag(md, KEY_ADD_BOS, spm or bool(spec and spec.add_bos))
        self.add_eos = read_flag(md, KEY_ADD_EOS, False)
        self.add_space_prefix = read_flag(md, KEY_ADD_SPACE_PREFIX, spm)
        self._texts, self._attrs = texts, attrs
        self._find_roles(md, vocab)
        self._specials = tuple(sorted(
            ((texts[i], i, bool(a & _SPECIAL)) for i, a in enumerate(attrs) if a & _LITERAL),
            key=lambda s: (-len(s[0].encode("utf-8", "surrogatepass")), s[1])))
        if spm:
            self._hf = build_spm(md, texts, vocab, self.unk_id)
        else:
            self._hf = build_bpe(md, vocab, spec)

    def _find_roles(self, md: Mapping[str, Any], vocab: dict[str, int]) -> None:
        """EOG set and attribute changes, in llama.cpp's order (a found role becomes CONTROL)."""
        attrs, eog = self._attrs, set()
        for role, (keys, texts) in ROLES.items():
            tid = read_token_id(md, keys, None, self.vocab_size)
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

    def literal_tokens(self) -> tuple[tuple[str, int, bool], ...]:
        """(text, id, special) of every token cut out of text before BPE: control and unknown
        tokens (special: parsed only on request, hidden by skip_special) and user-defined ones
        (always parsed, always shown). The HuggingFace export lists them as added tokens."""
        return self._specials

    def backend_json(self) -> str:
        """The HuggingFace `tokenizers` model this vocabulary runs on (the BPE model and its
        pre-tokenizer) as tokenizer.json text; '' without a vocabulary."""
        return self._hf.to_str() if self._hf is not None else ""

    def _check(self, tid: int) -> None:
        if not 0 <= tid < self.vocab_size:
            raise ValueError(f"token id {tid} outside the vocabulary [0, {self.vocab_size})")

    # ---- encode
    def control_texts(self) -> tuple[str, ...]:
        """The texts `parse_special` turns into control (or unknown) tokens, longest first."""
        return tuple(piece for piece, _, control_like in self._specials if control_like)

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = False,
               add_eos: bool | None = None, literals: Mapping[str, str] | None = None
               ) -> list[int]:
        """Token ids of `text`. add_bos/add_eos None: as the metadata says. `literals` maps
        stand-ins to the text they stand for, put back after special tokens were cut out:
        a stand-in's text is tokenized as text, never as a special token."""
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
            for stand_in, literal in (literals or {}).items():
                frag = frag.replace(stand_in, literal)
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
