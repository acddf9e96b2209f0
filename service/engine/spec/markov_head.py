"""The DSpark Markov head: a low-rank previous-token correction of a drafter's logits
(docs/design.md#dspark-markov-head).

    logits_i += W2 @ W1[prev_i]        prev_i = the input id of logits row i

W1 (V, R) holds one R-vector per previous token, W2 (V, R) maps it back to the vocabulary. In a
draft GGUF they are the tensors `dflash.dspark.markov.w1` and `dflash.dspark.markov.w2`, ggml
shape [rank, vocab] each (row-major (V, R)), F16, F32 or Q8_0, with metadata
`<arch>.dflash.dspark.{enabled, markov_rank, vocab_size}`. In a draft chain the input id of the
row that picks d_{i+1} is d_i, so the correction is sequential over the block; it runs on the
backend inside the drafter's step, right before the argmax, with two existing ops (captured with
the step on a graph-capturing backend, no host round trip):

    embed(W1, ids[T-1:T], 1, r)          r (1, R) = W1[prev]             (a row gather)
    matmul_add(r, W2, logits, tmp)       logits (1, V) += r @ W2^T       (= W2 @ W1[prev])

A file without the tensors has no head; one with a head of another vocabulary size than the
target's loads without it (a warning names both sizes); any other inconsistency (one tensor of
the two, shapes that disagree with each other or with the metadata, an unsupported type) is a
ModelFormatError.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import structlog

from service.backends.base import Array, Backend
from service.errors import ModelFormatError
from service.gguf.quants import QuantType
from service.gguf.reader import GGUFFile

log = structlog.get_logger("specstream.engine")

W1_NAME = "dflash.dspark.markov.w1"
W2_NAME = "dflash.dspark.markov.w2"
# F16/F32 as fit-markov writes them; Q8_0 as `specstream quantize` re-encodes a head whose rank
# is a multiple of 32 (its near-tie corrections need 8 bits or more; 4-bit is refused:
# docs/design.md#dspark-markov-head)
HEAD_TYPES = (QuantType.F16, QuantType.F32, QuantType.Q8_0)


def meta_key(arch: str, what: str) -> str:
    """`<arch>.dflash.dspark.<what>` (what: enabled, markov_rank, vocab_size)."""
    return f"{arch}.dflash.dspark.{what}"


@dataclass(frozen=True)
class HeadShape:
    vocab: int
    rank: int


def read_head_shape(f: GGUFFile, target_vocab: int) -> HeadShape | None:
    """The head of draft file `f` when it has a usable one for a target of `target_vocab`
    tokens; None when it has none, when its metadata disables it, or (with a warning) when its
    vocabulary size differs from the target's."""
    have = [n for n in (W1_NAME, W2_NAME) if n in f.tensors]
    if not have:
        return None
    where = f"{f.path}: DSpark Markov head"
    if len(have) == 1:
        missing = W2_NAME if have == [W1_NAME] else W1_NAME
        raise ModelFormatError(f"{where}: {have[0]} is present but {missing} is missing")
    arch = f.get("general.architecture", "")
    if f.get(meta_key(arch, "enabled"), True) is False:
        log.info("markov_head_off", path=str(f.path), reason=f"{meta_key(arch, 'enabled')} "
                                                             "is false")
        return None
    w1, w2 = f.tensors[W1_NAME], f.tensors[W2_NAME]
    for t in (w1, w2):
        if len(t.shape) != 2:
            raise ModelFormatError(f"{where}: {t.name} has shape {t.shape}; expected "
                                   "(vocab, rank) (ggml [rank, vocab])")
        if t.qtype not in HEAD_TYPES:
            raise ModelFormatError(f"{where}: {t.name} is {t.qtype.name}; the head is stored "
                                   "as " + " or ".join(q.name for q in HEAD_TYPES))
    if w1.shape != w2.shape:
        raise ModelFormatError(f"{where}: {W1_NAME} {w1.shape} and {W2_NAME} {w2.shape} "
                               "differ; both are (vocab, rank)")
    vocab, rank = w1.shape
    for what, want in (("markov_rank", rank), ("vocab_size", vocab)):
        got = f.get(meta_key(arch, what))
        if got is not None and int(got) != want:
            raise ModelFormatError(f"{where}: {meta_key(arch, what)} = {got} but the tensors "
                                   f"are (vocab {vocab}, rank {rank})")
    if vocab != target_vocab:
        log.warning("markov_head_disabled", path=str(f.path), head_vocab_size=vocab,
                    target_vocab_size=target_vocab,
                    reason=f"the head's vocabulary size {vocab} differs from the target's "
                           f"{target_vocab}")
        return None
    return HeadShape(vocab, rank)


class MarkovHead:
    """The head on a backend: W1 as an embedding table, W2 as a matrix, and a (1, R) and a
    (1, V) scratch row allocated at load time."""

    def __init__(self, f: GGUFFile, shape: HeadShape, backend: Backend):
        self.shape, self.backend = shape, backend
        self.w1: Any = backend.load_embedding(f.tensors[W1_NAME])      # (V, R) rows by id
        self.w2: Any = backend.load_matrix([f.tensors[W2_NAME]])       # (V, R)
        self.dtype = f.tensors[W1_NAME].qtype.name
        self._r = backend.zeros((1, shape.rank))                        # (1, R) f32
        self._tmp = backend.zeros((1, shape.vocab))                     # (1, V) f32

    @property
    def rank(self) -> int:
        return self.shape.rank

    def apply(self, ids: Array, logits: Array) -> None:
        """logits (1, V) += W2 @ W1[ids[-1]]: the correction of the step's last row, whose input
        id is `ids[-1]` (ids (T,) int32 on the backend; never read on the host)."""
        if logits.shape != (1, self.shape.vocab):
            raise ValueError(f"Markov head: logits {logits.shape}, expected "
                             f"(1, {self.shape.vocab})")
        T = ids.shape[0]
        self.backend.embed(self.w1, ids[T - 1:T], 1.0, self._r)        # (1, R) f32
        self.backend.matmul_add(self._r, self.w2, logits, self._tmp)   # (1, V) f32


def load_markov_head(f: GGUFFile, target_vocab: int, backend: Backend) -> MarkovHead | None:
    """The head of draft file `f` on `backend` (None: the file has no usable head), with a log
    line saying it is on."""
    shape = read_head_shape(f, target_vocab)
    if shape is None:
        return None
    head = MarkovHead(f, shape, backend)
    log.info("markov_head_on", path=str(f.path), rank=shape.rank, vocab_size=shape.vocab,
             dtype=head.dtype)
    return head
