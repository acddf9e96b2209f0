"""`specstream synth --dflash TARGET OUT.gguf`: a seeded random-weight DFlash drafter in
llama.cpp's format (service/model/dflash.py) for a given target: the target's width (llama.cpp's
DFlash encoder requires it), heads, head size, RoPE base and tokenizer; `n_layer` decoder layers
of FFN width `n_ff` (default: the target's); target layers by default DFlash's spread (HF ids
round(1 + i (n - 4) / (P - 1)), i < P, written + 1 as the converter does), or [1, n - 1] for a
shallow target; block size 16 and the mask token V - 1 unless given. Options: a reduced draft
vocabulary (d2t, own output of as many rows), the drafter's own token embeddings, causal
attention within the block, partial RoPE (rope_dims < head size); a DSpark drafter (llama.cpp's
draft-dspark): a Markov head of rank `markov_rank` (markov_w1 / markov_w2, optionally the
markov_w2.scale `markov_scale`; its weights' std `markov_std`, default weight_std: a random
head's correction is std^2 sqrt(rank), weak next to the block logits unless made larger), a
confidence head (conf_proj with its bias), the anchor-first
block layout unless `bonus_anchor`.

Weights as service/tools/drafter_weights.py makes them (seeded by (seed, name); F32, F16 or
Q8_0). The written file is re-read by DflashSpec.from_gguf and checked against the target
before this returns.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from service.errors import ConfigError
from service.gguf.reader import GGUFFile
from service.model.dflash import (
    ARCH,
    DEFAULT_BLOCK,
    MARKOV_SCALE,
    MARKOV_W1,
    MARKOV_W2,
    MASK_KEY,
    DflashSpec,
)
from service.model.spec import ModelSpec
from service.tools.drafter_weights import QUANTS, geometry, random_weights, write_drafter

DEFAULT_POINTS = 5            # z-lab's DFlash drafters read five target layers


@dataclass(frozen=True)
class DflashSynthResult:
    path: Path
    spec: DflashSpec
    n_tensors: int
    n_bytes: int


def default_layers(n_layer: int, n_points: int = DEFAULT_POINTS) -> tuple[int, ...]:
    """DFlash's spread of target layers in llama.cpp's convention (HF ids + 1); [1, n - 1] for
    a target too shallow for it."""
    lo, hi = 1, n_layer - 3
    if hi - lo + 1 >= n_points > 1:
        return tuple(round(lo + i * (hi - lo) / (n_points - 1)) + 1 for i in range(n_points))
    return tuple(sorted({1, n_layer - 1})) if n_layer >= 2 else (0,)


@dataclass(frozen=True)
class DflashOptions:
    seed: int = 0
    layers: tuple[int, ...] | None = None   # target layers; None: default_layers
    n_layer: int = 1                        # decoder layers
    n_ff: int = 0                           # 0: the target's
    block_size: int = DEFAULT_BLOCK
    mask_token: int = -1                    # -1: V - 1
    draft_vocab: int = 0                    # 0: the target's (no d2t)
    own_embedding: bool = False
    causal: bool = False
    rope_dims: int = 0                      # 0: the target's
    quant: str = "F16"
    weight_std: float = 0.02
    markov_rank: int = 0                    # > 0: a DSpark drafter with a Markov head
    markov_scale: float = 0.0               # > 0: markov_w2.scale holding it
    markov_std: float = 0.0                 # the Markov weights' std; 0: weight_std
    confidence_head: bool = False           # DSpark: conf_proj.weight and .bias
    bonus_anchor: bool = False              # DSpark: dflash.sample_from_anchor false


def _problems(t: ModelSpec, o: DflashOptions, out: Path) -> list[tuple[str, str]]:
    p = []
    if o.quant not in QUANTS:
        p.append(("quant", f"{o.quant!r} is not one of " + ", ".join(QUANTS)))
    if o.layers is not None and (not o.layers or len(set(o.layers)) != len(o.layers)
                                 or not all(0 <= k <= t.n_layer for k in o.layers)):
        p.append(("target-layers", f"{list(o.layers)}: distinct layers in [0, {t.n_layer}] "
                                   "wanted"))
    for field, v, lo, hi in (("draft-layers", o.n_layer, 1, 64), ("ff", o.n_ff, 0, 1 << 20),
                             ("block-size", o.block_size, 2, 1024),
                             ("mask-token", o.mask_token, -1, t.vocab_size - 1),
                             ("draft-vocab", o.draft_vocab, 0, t.vocab_size),
                             ("rope-dims", o.rope_dims, 0, t.head_dim)):
        if not lo <= v <= hi:
            p.append((field, f"{v} is out of range [{lo}, {hi}]"))
    if not 0 <= o.markov_rank <= 4096:
        p.append(("markov-rank", f"{o.markov_rank} is out of range [0, 4096]"))
    elif o.quant == "Q8_0" and o.markov_rank % 32:
        p.append(("markov-rank", f"{o.markov_rank}: Q8_0 rows of markov_w2 need a multiple of "
                                 "32"))
    if not o.markov_rank and (o.confidence_head or o.bonus_anchor or o.markov_scale):
        p.append(("markov-rank", "the confidence head, the bonus anchor and the scale are "
                                 "DSpark's: they need a Markov head (markov-rank > 0)"))
    if o.markov_std < 0:
        p.append(("markov-std", f"{o.markov_std} must be positive (0: weight-std)"))
    if o.markov_scale < 0:
        p.append(("markov-scale", f"{o.markov_scale} must be positive (0: none)"))
    if o.rope_dims % 2:
        p.append(("rope-dims", f"{o.rope_dims} must be even"))
    if not o.weight_std > 0:
        p.append(("weight-std", f"{o.weight_std} must be positive"))
    if t.head_dim != t.head_dim_v:
        p.append(("dflash", "the target has unequal key/value head sizes"))
    if not out.parent.is_dir():
        p.append(("out", f"{out.parent} is not a directory"))
    return p


def synthesize_dflash(out: str | os.PathLike, target: str | os.PathLike,
                      options: DflashOptions = DflashOptions()) -> DflashSynthResult:
    """Write a random DFlash drafter for `target` (a GGUF path) to `out`; ConfigError listing
    every bad option."""
    out, tf, o = Path(out), GGUFFile(target), options
    t = ModelSpec.from_gguf(tf)
    if problems := _problems(t, o, out):
        raise ConfigError(problems)
    spec = DflashSpec(
        n_embd=t.n_embd, target_layers=tuple(o.layers or default_layers(t.n_layer)),
        n_layer=o.n_layer, n_head=t.n_head, n_head_kv=t.n_head_kv, head_dim=t.head_dim,
        n_ff=o.n_ff or t.n_ff, vocab_size=t.vocab_size,
        draft_vocab=o.draft_vocab or t.vocab_size, n_ctx_train=t.n_ctx_train,
        rms_eps=t.rms_eps, rope_base=t.layers[0].rope_base, rope_dims=o.rope_dims or t.rope_dims,
        block_size=o.block_size,
        mask_token=o.mask_token if o.mask_token >= 0 else t.vocab_size - 1, causal=o.causal,
        own_embedding=o.own_embedding, own_output=bool(o.draft_vocab),
        has_d2t=bool(o.draft_vocab), markov_rank=o.markov_rank,
        markov_scale=o.markov_scale > 0, confidence=o.confidence_head,
        confidence_bias=o.confidence_head, sample_from_anchor=not o.bonus_anchor)
    tensors = random_weights(spec.tensor_shapes(), o.seed, o.weight_std, spec.vocab_size)
    for name in (MARKOV_W1, MARKOV_W2) if spec.dspark and o.markov_std else ():
        tensors[name] *= np.float32(o.markov_std / o.weight_std)
    if spec.markov_scale:
        tensors[MARKOV_SCALE] = np.array([o.markov_scale], np.float32)
    return write_dflash(out, tf, spec, tensors, o.quant)


def write_dflash(out: Path, target: GGUFFile, spec: DflashSpec,
                 tensors: dict[str, np.ndarray], quant: str = "F32") -> DflashSynthResult:
    """Write the drafter `spec` with the given weights (spec.tensor_shapes()'s names and
    shapes, f32; d2t i64) for `target`, re-read and checked against it."""
    def rest(w) -> None:
        w.add_bool(f"{ARCH}.attention.causal", spec.causal)
        w.add_uint32(MASK_KEY, spec.mask_token)
        if spec.dspark:
            w.add_bool(f"{ARCH}.sample_from_anchor", spec.sample_from_anchor)
            w.add_bool(f"{ARCH}.has_confidence_head", spec.confidence)

    u32 = [*geometry(spec, spec.n_layer), ("block_size", spec.block_size)]
    write_drafter(out, target, ARCH, spec, u32, tensors, quant, rest,
                  drop_key=lambda k: k == MASK_KEY)
    got = DflashSpec.from_gguf(GGUFFile(out))
    got.check_target(ModelSpec.from_gguf(target), str(out))
    return DflashSynthResult(out, got, len(tensors), out.stat().st_size)
