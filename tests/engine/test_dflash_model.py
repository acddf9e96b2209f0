"""The DFlash drafter on the CPU backend (service/model/dflash_model.py) against the numpy
reference (service/model/dflash_forward.py), fed a tapped tiny-qwen3 target step: the backend's
f16 KV cache is the one difference (the reference keeps f32 rows)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from service.backends.cpu.backend import CpuBackend
from service.engine.runner import GREEDY, ModelRunner, StepInput
from service.errors import ModelFormatError
from service.gguf.reader import GGUFFile
from service.model.dflash import DflashSpec
from service.model.dflash_forward import DflashDraft
from service.model.dflash_model import DflashModel
from service.tools.synth_dflash import DflashOptions, synthesize_dflash
from tests.support.models import build_model, model_path

TARGET, N_CTX, M = "tiny-qwen3", 64, 16
VARIANTS = {
    "plain": DflashOptions(layers=(1, 2), n_layer=2, n_ff=256),
    "reduced-causal": DflashOptions(layers=(0, 2), draft_vocab=300, own_embedding=True,
                                    causal=True, block_size=8),
    "partial-rope": DflashOptions(layers=(0, 1, 2), rope_dims=32, own_embedding=True),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("dfm")
    return {k: synthesize_dflash(d / f"{k}.gguf", model_path(TARGET),
                                 replace(o, seed=8, quant="F32", weight_std=0.1)).path
            for k, o in VARIANTS.items()}


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(((a - b) ** 2).mean() / (b ** 2).mean()))


def ints(a) -> np.ndarray:
    return np.asarray(a, np.int32)


def both(path: Path, model_spec=lambda s: s) -> tuple[np.ndarray, np.ndarray]:
    """Inject 12 tapped rows as 7 + 5 (slot 1), run a block of 6 at position 12, inject 3 more
    rows at 12.. (overwriting the block's K/V there) and run a block of 4 at 15: the backend
    model's logits (10, Vd) and the reference's. model_spec: changes the backend model's spec
    (a negative control)."""
    tr = build_model(TARGET, CpuBackend(threads=1), n_ctx=N_CTX, max_tokens=M)
    f = GGUFFile(path)
    spec = DflashSpec.from_gguf(f)
    runner = ModelRunner(tr, 1, N_CTX, hidden=spec.tap)
    ids = [(31 * i + 7) % tr.spec.vocab_size for i in range(15)]
    inp = StepInput(ids, range(15), [0] * 15, [14], [GREEDY], hidden=True)
    runner.step(inp)
    feats = np.array(runner.hidden_states(inp))                          # (15, P E) f32
    model = DflashModel(model_spec(spec), f, tr, n_ctx=N_CTX, n_slots=2, max_tokens=M)
    ref = DflashDraft(spec, f, GGUFFile(model_path(TARGET)), N_CTX)
    slot, mask = 1, spec.mask_token
    for a, b in ((0, 7), (7, 12)):
        model.inject(feats[a:b], ints(range(a, b)), ints([slot] * (b - a)))
    ref.inject(ref.encode(feats[:12]), 0)
    got, want = [], []
    for n, block in ((12, [ids[12]] + [mask] * 5), (15, [99, mask, mask, 3])):
        if n == 15:
            model.inject(feats[12:15], ints(range(12, 15)), ints([slot] * 3))
            ref.inject(ref.encode(feats[12:15]), 12)
        T = len(block)
        got.append(np.array(model.block(ints(block), ints(range(n, n + T)), ints([slot] * T),
                                        n)))
        w = ref.block(block, n)                                          # (T, V)
        want.append(w[:, ref.d2t] if spec.has_d2t else w)
    return np.concatenate(got), np.concatenate(want)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_backend_drafter_matches_the_reference(files, variant):
    """Logits within 0.2% (relative RMS; measured at most 2.4e-4) of the reference at every
    row, the same argmax where the reference's top two are 0.05 apart."""
    got, want = both(files[variant])
    assert got.shape == want.shape
    errs = [rel(g, w) for g, w in zip(got, want, strict=True)]
    print(f"\n{variant}: relative RMS max {max(errs):.1e}")
    for r, e in enumerate(errs):
        assert e <= 2e-3, (r, e)
        top = np.sort(want[r])[-2:]
        if top[1] - top[0] >= 0.05:
            assert got[r].argmax() == want[r].argmax(), r


def test_the_bound_catches_wrong_block_masking(files):
    """The block attended causally where the file says otherwise (or the reverse)."""
    for variant in ("plain", "reduced-causal"):
        got, want = both(files[variant], lambda s: replace(s, causal=not s.causal))
        assert max(rel(g, w) for g, w in zip(got, want, strict=True)) > 2e-2, variant


def test_a_drafter_for_another_target_is_refused(files):
    tr = build_model(TARGET, CpuBackend(threads=1), n_ctx=N_CTX, max_tokens=M)
    f = GGUFFile(files["plain"])
    spec = DflashSpec.from_gguf(f)
    tr.spec = replace(tr.spec, n_embd=512)
    with pytest.raises(ModelFormatError, match="drafter's width is 256"):
        DflashModel(spec, f, tr, n_ctx=N_CTX, n_slots=1, max_tokens=M)
