"""What the drafter files that read a target's hidden states (EAGLE-3: service/model/eagle3.py;
DFlash: service/model/dflash.py) have in common in llama.cpp's GGUF format: numbers under the
architecture's prefix with their ranges, the target layers they read, the attention geometry,
the target's vocabulary they carry, the `d2t` draft-to-target id map, the tensor set's types,
and the target layers and vocabulary a target must have. Each check raises
ModelFormatError naming the key or tensor at fault and the file.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from service.errors import ModelFormatError
from service.gguf.reader import INDEX_TYPES, GGUFFile
from service.model.spec import ModelSpec

D2T = "d2t"
MAX_LAYER = 4096


@dataclass(frozen=True)
class Attention:
    n_embd: int               # E
    n_head: int               # H
    n_head_kv: int            # Hkv, dividing H
    head_dim: int             # hd, keys and values alike
    rope_dims: int            # even, <= hd


class DrafterKeys:
    """The metadata of drafter file f under architecture `arch` ("eagle3", "dflash"); `kind`
    names the drafter in messages ("EAGLE-3", "DFlash")."""

    def __init__(self, f: GGUFFile, arch: str, kind: str):
        self.f, self.arch, self.kind = f, arch, kind
        got = f.get("general.architecture")
        if got != arch:
            raise ModelFormatError(f"{f.path}: architecture {got!r}, {_article(kind)} {kind} "
                                   f"drafter ({arch!r}) expected")

    def num(self, key: str, default=None, lo: float = 1, hi: float = 1 << 24):
        """`<arch>.<key>` within [lo, hi]; `default` where absent (None: required)."""
        full = f"{self.arch}.{key}"
        if full not in self.f.metadata and default is not None:
            return default
        v = self.f.require(full)
        if not lo <= v <= hi:
            raise ModelFormatError(f"{self.f.path}: metadata {full!r} = {v!r} is out of range "
                                   f"[{lo}, {hi}]")
        return v

    def flag(self, key: str) -> bool:
        """`<arch>.<key>` as a bool, False where absent."""
        full = f"{self.arch}.{key}"
        return bool(self.f.require(full, bool)) if full in self.f.metadata else False

    def target_layers(self, n_min: int, n_max: int) -> tuple[int, ...]:
        """`<arch>.target_layers`: n_min..n_max distinct layer indices in [0, MAX_LAYER]."""
        key, path = f"{self.arch}.target_layers", self.f.path
        layers = self.f.get(key)
        if layers is None:
            raise ModelFormatError(f"{path}: metadata {key!r} is missing (the target layers "
                                   "whose hidden states the drafter reads)")
        count = f"exactly {n_min}" if n_min == n_max else f"{n_min} to {n_max}"
        if (not isinstance(layers, list) or not n_min <= len(layers) <= n_max
                or not all(isinstance(k, int) and not isinstance(k, bool)
                           and 0 <= k <= MAX_LAYER for k in layers)):
            raise ModelFormatError(f"{path}: metadata {key!r} = {layers!r}: {count} layer "
                                   f"indices in [0, {MAX_LAYER}] expected")
        if len(set(layers)) != len(layers):
            raise ModelFormatError(f"{path}: metadata {key!r} = {layers!r} repeats a layer")
        return tuple(int(k) for k in layers)

    def attention(self) -> Attention:
        """Width, heads, head size (equal for keys and values) and RoPE dims."""
        path = self.f.path
        E = int(self.num("embedding_length"))
        H = int(self.num("attention.head_count", hi=4096))
        Hkv = int(self.num("attention.head_count_kv", H, hi=4096))
        if H % Hkv:
            raise ModelFormatError(f"{path}: head_count {H} is not a multiple of "
                                   f"head_count_kv {Hkv}")
        hd = int(self.num("attention.key_length", E // H, hi=4096))
        if int(self.num("attention.value_length", hd, hi=4096)) != hd:
            raise ModelFormatError(f"{path}: {self.kind} wants equal key and value head sizes")
        rope_dims = int(self.num("rope.dimension_count", hd, hi=4096))
        if rope_dims > hd or rope_dims % 2:
            raise ModelFormatError(f"{path}: rope.dimension_count {rope_dims} must be even "
                                   f"and <= head size {hd}")
        return Attention(E, H, Hkv, hd, rope_dims)

    def vocab_size(self) -> int:
        """The target's vocabulary the file carries: `<arch>.vocab_size`, else its tokens."""
        tokens = self.f.get("tokenizer.ggml.tokens")
        has_tokens = isinstance(tokens, list) and bool(tokens)
        if f"{self.arch}.vocab_size" not in self.f.metadata and not has_tokens:
            raise ModelFormatError(f"{self.f.path}: no vocabulary (tokenizer.ggml.tokens or "
                                   f"'{self.arch}.vocab_size'): {_article(self.kind)} "
                                   f"{self.kind} file carries its target's")
        return int(self.num("vocab_size", len(tokens) if has_tokens else None))


def check_d2t(f: GGUFFile, vocab_size: int, own_output_needed: bool) -> None:
    """The file's d2t: I64 absolute target ids in [0, vocab_size), no id twice; with
    own_output_needed, the drafter's own output.weight must be there (as many rows)."""
    info = f.tensor(D2T)
    if info.qtype.name != "I64":
        raise ModelFormatError(f"{f.path}: d2t must be I64 (llama.cpp's), not "
                               f"{info.qtype.name}")
    if own_output_needed and not f.has_tensor("output.weight"):
        raise ModelFormatError(f"{f.path}: a d2t of {info.shape[0]} rows needs the drafter's "
                               "own output.weight of as many rows")
    d2t = f.index_tensor(D2T)                                           # (Vd,) i64
    if d2t.min() < 0 or d2t.max() >= vocab_size:
        raise ModelFormatError(f"{f.path}: d2t holds ids {int(d2t.min())}..{int(d2t.max())}; "
                               f"target token ids in [0, {vocab_size}) expected (absolute "
                               "ids, not Hugging Face's offsets)")
    if np.unique(d2t).size != d2t.size:
        raise ModelFormatError(f"{f.path}: d2t maps two draft rows to one target id")


def check_tensor_types(f: GGUFFile, shapes: dict[str, tuple[int, ...]], kind: str,
                       f32_only: tuple[str, ...] = ()) -> None:
    """Every tensor of `shapes` (name -> shape) is in f with that shape, d2t alone an index
    type and those of f32_only F32; f has no others. kind names the drafter in messages
    ("EAGLE-3", "DFlash")."""
    for name, shape in shapes.items():
        info = f.tensor(name, shape)
        if (int(info.qtype) in INDEX_TYPES) != (name == D2T):
            raise ModelFormatError(f"{f.path}: tensor {name!r} has type {info.qtype.name}"
                                   + ("; d2t must be I64" if name == D2T else ""))
        if name in f32_only and info.qtype.name != "F32":
            raise ModelFormatError(f"{f.path}: tensor {name!r} has type "
                                   f"{info.qtype.name}; F32 expected")
    extra = sorted(set(f.tensors) - set(shapes))
    if extra:
        raise ModelFormatError(f"{f.path}: tensors {_article(kind)} {kind} drafter does not "
                               "have: " + ", ".join(extra[:8]))


def check_reads_target(target_layers: tuple[int, ...], vocab_size: int, target: ModelSpec,
                       where: str) -> None:
    """The target has the layers a drafter reads and the vocabulary it carries."""
    bad = [k for k in target_layers if k > target.n_layer]
    if bad:
        raise ModelFormatError(f"{where}: target_layers {list(target_layers)} name "
                               f"layers past the target's {target.n_layer}")
    if vocab_size != target.vocab_size:
        raise ModelFormatError(f"{where}: vocabulary of {vocab_size} tokens but the "
                               f"target's has {target.vocab_size}")


def _article(word: str) -> str:
    return "an" if word[:1] in "AEIOU" else "a"
