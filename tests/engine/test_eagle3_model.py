"""The EAGLE-3 drafter on the CPU backend (service/model/eagle3_model.py) against the numpy
reference (service/model/eagle3_forward.py), fed from a tapped tiny-qwen3 target step: the
backend's f16 KV cache is the one difference (the reference keeps f32 rows)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from service.backends.cpu.backend import CpuBackend
from service.engine.runner import GREEDY, ModelRunner, StepInput
from service.errors import ModelFormatError
from service.gguf.reader import GGUFFile
from service.model.eagle3 import Eagle3Spec
from service.model.eagle3_forward import Eagle3Draft
from service.model.eagle3_model import Eagle3Model
from service.model.transformer import positions_for
from service.tools.synth_eagle3 import synthesize_eagle3
from tests.support.models import build_model, model_path

TARGET, N_CTX, M = "tiny-qwen3", 64, 16
VARIANTS = {"plain": {}, "reduced": dict(draft_vocab=300, own_embedding=True),
            "normed": dict(norm_before_fc=True)}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("e3m")
    return {k: synthesize_eagle3(d / f"{k}.gguf", model_path(TARGET), seed=6, layers=(1, 2, 3),
                                 quant="F32", weight_std=0.1, **kw).path
            for k, kw in VARIANTS.items()}


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(((a - b) ** 2).mean() / (b ** 2).mean()))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_backend_drafter_matches_the_reference(files, variant):
    """Encode 12 tapped rows, decode them as 7 + 5 rows: logits within 0.2% (relative RMS) of
    the reference at every row, the same argmax where the reference's top two are 0.05 apart,
    and the pre-norm outputs likewise."""
    tr = build_model(TARGET, CpuBackend(threads=1), n_ctx=N_CTX, max_tokens=M)
    f = GGUFFile(files[variant])
    spec = Eagle3Spec.from_gguf(f)
    runner = ModelRunner(tr, 1, N_CTX, hidden=spec.tap)
    ids = [(31 * i + 7) % tr.spec.vocab_size for i in range(12)]
    inp = StepInput(ids, range(12), [0] * 12, [11], [GREEDY], hidden=True)
    runner.step(inp)
    feats = np.array(runner.hidden_states(inp))                          # (12, 3E) f32
    model = Eagle3Model(spec, f, tr, n_ctx=N_CTX, n_slots=1, max_tokens=M)
    ref = Eagle3Draft(spec, f, GGUFFile(model_path(TARGET)), N_CTX)
    g = np.zeros((12, spec.n_embd), np.float32)
    model.encode(feats, g)
    g_ref = ref.encode(feats)
    assert rel(g, g_ref) <= 1e-6           # float32 summation order only
    want, y_ref = ref.decode(ids, g_ref, 0)                              # (12, V), (12, E)
    if spec.has_d2t:
        want = want[:, ref.d2t]                                          # (12, Vd)
    got, ys = [], []
    for a, b in ((0, 7), (7, 12)):
        n = b - a
        logits = model.decode(np.array(ids[a:b], np.int32), positions_for(a, n),
                              np.zeros(n, np.int32), b, g[a:b], n)
        got.append(np.array(logits))
        ys.append(np.array(model.ws_y[:n]))
    got = np.concatenate(got)
    assert got.shape == want.shape
    assert rel(np.concatenate(ys), y_ref) <= 2e-3
    for r in range(12):
        assert rel(got[r], want[r]) <= 2e-3, (r, rel(got[r], want[r]))
        top = np.sort(want[r])[-2:]
        if top[1] - top[0] >= 0.05:
            assert got[r].argmax() == want[r].argmax(), r


def test_a_drafter_for_another_target_is_refused(files):
    tr = build_model("tiny-qwen3", CpuBackend(threads=1), n_ctx=N_CTX, max_tokens=M)
    f = GGUFFile(files["plain"])
    spec = Eagle3Spec.from_gguf(f)
    tr.spec = replace(tr.spec, n_embd=512)
    with pytest.raises(ModelFormatError, match="target_hidden_size 256"):
        Eagle3Model(spec, f, tr, n_ctx=N_CTX, n_slots=1, max_tokens=M)
