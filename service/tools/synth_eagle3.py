"""`specstream synth --eagle3 TARGET OUT.gguf`: a seeded random-weight EAGLE-3 drafter in
llama.cpp's format (service/model/eagle3.py) for a given target: the target's width, heads,
FFN size, RoPE and tokenizer; three target layers (by default EAGLE-3's low / middle / high:
2, n // 2, n - 3, sorted); optionally a reduced draft vocabulary (d2t, a seeded sorted subset of
the target's ids) and the drafter's own token embeddings.

Weights are normal with standard deviation `weight_std` (F32, F16, or Q8_0 via the gguf
package's quantizer for the 2-D ones), norm weights 1 + uniform(-0.05, 0.05) in F32; every
tensor from its own generator seeded by (seed, name), so a file depends on its options only.
The written file is re-read by Eagle3Spec.from_gguf and checked against the target before
this returns.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from service.errors import ConfigError
from service.gguf.reader import GGUFFile
from service.model.eagle3 import ARCH, Eagle3Spec
from service.model.spec import ModelSpec
from service.tools.drafter_weights import QUANTS, geometry, random_weights, write_drafter


@dataclass(frozen=True)
class Eagle3SynthResult:
    path: Path
    spec: Eagle3Spec
    n_tensors: int
    n_bytes: int


def default_layers(n_layer: int) -> tuple[int, int, int]:
    """EAGLE-3's low / middle / high target layers (2, n // 2, n - 3), sorted; for shallow
    targets, three distinct points of 0..n_layer."""
    pts = sorted({min(2, n_layer), n_layer // 2, max(n_layer - 3, 0)})
    if len(pts) < 3:
        pts = sorted({0, n_layer // 2, n_layer})
    if len(pts) < 3:
        raise ConfigError([("eagle3", f"a target of {n_layer} layers has no three distinct "
                                      "capture points")])
    return tuple(pts)


def draft_spec(t: ModelSpec, layers: tuple[int, ...], draft_vocab: int, own_embedding: bool,
                norm_before_fc: bool) -> Eagle3Spec:
    """An EAGLE-3 head of the target's shapes (width, heads, FFN size, RoPE) reading `layers`,
    with its own output (draft_vocab rows; 0: the target's vocabulary, no d2t)."""
    return Eagle3Spec(
        n_embd=t.n_embd, n_embd_target=t.n_embd, target_layers=tuple(layers),
        n_head=t.n_head, n_head_kv=t.n_head_kv, head_dim=t.head_dim, n_ff=t.n_ff,
        vocab_size=t.vocab_size, draft_vocab=draft_vocab or t.vocab_size,
        n_ctx_train=t.n_ctx_train, rms_eps=t.rms_eps, rope_base=t.layers[0].rope_base,
        rope_dims=t.rope_dims, norm_before_fc=norm_before_fc, norm_before_residual=False,
        own_embedding=own_embedding, own_output=True, has_d2t=bool(draft_vocab),
        has_rope_freqs=False)


def _problems(t: ModelSpec, layers, draft_vocab: int, quant: str, weight_std: float,
              out: Path) -> list[tuple[str, str]]:
    p = []
    if quant not in QUANTS:
        p.append(("quant", f"{quant!r} is not one of " + ", ".join(QUANTS)))
    if layers is not None and (len(layers) != 3 or len(set(layers)) != 3
                               or not all(0 <= k <= t.n_layer for k in layers)):
        p.append(("target-layers", f"{list(layers)}: three distinct layers in "
                                   f"[0, {t.n_layer}] wanted"))
    if not 0 <= draft_vocab <= t.vocab_size:
        p.append(("draft-vocab", f"{draft_vocab} is out of range [0, {t.vocab_size}]"))
    if not weight_std > 0:
        p.append(("weight-std", f"{weight_std} must be positive"))
    if t.n_ff < 1 or t.head_dim != t.head_dim_v:
        p.append(("eagle3", "the target has no dense FFN size or unequal key/value head "
                            "sizes; an EAGLE-3 block needs both"))
    if not out.parent.is_dir():
        p.append(("out", f"{out.parent} is not a directory"))
    return p


def synthesize_eagle3(out: str | os.PathLike, target: str | os.PathLike, *, seed: int = 0,
                      layers: tuple[int, ...] | None = None, draft_vocab: int = 0,
                      own_embedding: bool = False, norm_before_fc: bool = False,
                      quant: str = "F16", weight_std: float = 0.02) -> Eagle3SynthResult:
    """Write a random EAGLE-3 drafter for `target` (a GGUF path) to `out`; ConfigError listing
    every bad option."""
    out, tf = Path(out), GGUFFile(target)
    t = ModelSpec.from_gguf(tf)
    if problems := _problems(t, layers, draft_vocab, quant, weight_std, out):
        raise ConfigError(problems)
    spec = draft_spec(t, layers or default_layers(t.n_layer), draft_vocab, own_embedding,
                       norm_before_fc)
    return write_eagle3(out, tf, spec, _tensors(spec, seed, weight_std), quant)


def write_eagle3(out: Path, target: GGUFFile, spec: Eagle3Spec,
                 tensors: dict[str, np.ndarray], quant: str = "F32") -> Eagle3SynthResult:
    """Write the drafter `spec` with the given weights (spec.tensor_shapes()'s names and
    shapes, f32; d2t i64) for `target`, re-read and checked against it (tests build drafters of
    chosen weights with it)."""
    _write(out, target, spec, tensors, quant)
    got = Eagle3Spec.from_gguf(GGUFFile(out))
    got.check_target(ModelSpec.from_gguf(target), str(out))
    return Eagle3SynthResult(out, got, len(tensors), out.stat().st_size)


def _tensors(spec: Eagle3Spec, seed: int, std: float) -> dict[str, np.ndarray]:
    return random_weights(spec.tensor_shapes(), seed, std, spec.vocab_size)


def _write(out: Path, target: GGUFFile, spec: Eagle3Spec, tensors: dict[str, np.ndarray],
           quant: str) -> None:
    def flags(w) -> None:
        if spec.norm_before_fc:
            w.add_bool(f"{ARCH}.norm_before_fc", True)
        if spec.norm_before_residual:
            w.add_bool(f"{ARCH}.norm_before_residual", True)

    u32 = [("target_hidden_size", spec.n_embd_target), *geometry(spec, 1)]
    write_drafter(out, target, ARCH, spec, u32, tensors, quant, flags)

