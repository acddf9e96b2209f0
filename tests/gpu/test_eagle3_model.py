"""The EAGLE-3 drafter (service/model/eagle3_model.py) on the CUDA backend against the same
drafter on the CPU backend rounding activations the GPU's way (act_quant="gpu"), from the same
tapped target rows: synthetic drafters for tiny-qwen3 (F16 weights; Q8_0 with a reduced
vocabulary and the pre-fc norm)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from service.backends.cpu.backend import CpuBackend
from service.engine.runner import GREEDY, ModelRunner, StepInput
from service.gguf.reader import GGUFFile
from service.model.eagle3 import Eagle3Spec
from service.model.eagle3_model import Eagle3Model
from service.model.hidden import HiddenTap
from service.model.transformer import positions_for
from service.tools.synth_eagle3 import synthesize_eagle3
from tests.support.models import build_model, model_path

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

TARGET, N_CTX, M = "tiny-qwen3", 64, 16
VARIANTS = {"f16": dict(quant="F16"),
            "q8_0-reduced": dict(quant="Q8_0", draft_vocab=300, norm_before_fc=True)}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("e3g")
    return {k: synthesize_eagle3(d / f"{k}.gguf", model_path(TARGET), seed=8, layers=(1, 2, 3),
                                 weight_std=0.1, **kw).path for k, kw in VARIANTS.items()}


def features() -> tuple[np.ndarray, list[int]]:
    tr = build_model(TARGET, CpuBackend(threads=1), n_ctx=N_CTX, max_tokens=M)
    runner = ModelRunner(tr, 1, N_CTX, hidden=HiddenTap((1, 2, 3)))
    ids = [(31 * i + 7) % tr.spec.vocab_size for i in range(12)]
    inp = StepInput(ids, range(12), [0] * 12, [11], [GREEDY], hidden=True)
    runner.step(inp)
    return np.array(runner.hidden_states(inp)), ids


def drafter_logits(path: Path, be, feats: np.ndarray, ids: list[int]) -> np.ndarray:
    """Logits (13, Vd): a 12-row decode step, then one row at position 12 (its g row 11)."""
    tr = build_model(TARGET, be, n_ctx=N_CTX, max_tokens=M)
    f = GGUFFile(path)
    m = Eagle3Model(Eagle3Spec.from_gguf(f), f, tr, n_ctx=N_CTX, n_slots=1, max_tokens=M)
    x = be.upload_vector(feats.reshape(-1)).reshape(feats.shape)         # (12, 3Et) f32
    g = be.zeros((12, m.spec.n_embd))                                    # (12, E) f32
    m.encode(x, g)
    dev = [be.zeros((12,), "int32") for _ in range(3)]
    be.upload_ints(np.array(ids, np.int32), dev[0])
    be.upload_ints(positions_for(0, 12), dev[1])
    out = [be.to_host(m.decode(dev[0], dev[1], dev[2], 12, g, 12))]
    be.upload_ints(positions_for(12, 1), dev[1][:1])
    out.append(be.to_host(m.decode(dev[0][:1], dev[1][:1], dev[2][:1], 13, g[11:12], 1)))
    return np.concatenate([np.asarray(o) for o in out])


# The q8_0 drafter's fc input (3 E wide) quantizes its activations into 8-bit blocks the
# backend first sized for the target's widest K (the H200 refused it: "activations (12, 768)
# exceed the prepared buffers"); Eagle3Model now sizes the scratch again over its own matrices
# (Transformer.prepare_backend).
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_cuda_drafter_matches_the_cpu_drafter(files, variant):
    from service.backends.cuda.backend import CudaBackend

    feats, ids = features()
    gpu = drafter_logits(files[variant], CudaBackend(graphs=False), feats, ids)
    cpu = drafter_logits(files[variant], CpuBackend(act_quant="gpu"), feats, ids)
    errs = [float(np.sqrt(((g - c) ** 2).mean() / (c ** 2).mean()))
            for g, c in zip(gpu, cpu, strict=True)]
    print(f"{variant}: relative RMS per row: " + " ".join(f"{e:.1e}" for e in errs))
    assert max(errs) <= 0.02, errs
    for g, c in zip(gpu, cpu, strict=True):
        top = np.sort(c)[-2:]
        if top[1] - top[0] >= 0.5:
            assert g.argmax() == c.argmax()
