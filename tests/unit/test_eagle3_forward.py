"""The host EAGLE-3 draft forward (service/model/eagle3_forward.py) on synthetic drafters for
tiny-qwen3: fed from a tapped target step, KV rows that make chunked decoding equal one-shot
decoding, the d2t scatter against the full-vocabulary drafter it was cut from, and the flags
it reads. (llama.cpp's draft logits as the oracle are issue 22's next step.)"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from service.backends.cpu.backend import CpuBackend
from service.engine.runner import GREEDY, ModelRunner, StepInput
from service.gguf.reader import GGUFFile
from service.model.eagle3 import Eagle3Spec
from service.model.eagle3_forward import Eagle3Draft
from service.model.hidden import HiddenTap
from service.tools.synth_eagle3 import synthesize_eagle3
from tests.support.gguf_edit import rewrite
from tests.support.models import build_model, model_path

TARGET = "tiny-qwen3"
N_CTX = 64


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("e3f")
    full = synthesize_eagle3(d / "full.gguf", model_path(TARGET), seed=4, layers=(1, 2, 3),
                             quant="F32", weight_std=0.1).path
    return {"full": full}


def draft(path: Path) -> Eagle3Draft:
    f = GGUFFile(path)
    return Eagle3Draft(Eagle3Spec.from_gguf(f), f, GGUFFile(model_path(TARGET)), N_CTX)


def features(n: int) -> tuple[np.ndarray, list[int]]:
    """The tap rows (n, 3E) of a 12-token target prefill at the drafter's points, and ids."""
    tr = build_model(TARGET, CpuBackend(threads=1), n_ctx=N_CTX, max_tokens=16)
    ids = [(29 * i + 5) % tr.spec.vocab_size for i in range(n)]
    runner = ModelRunner(tr, 1, N_CTX, hidden=HiddenTap((1, 2, 3)))   # the drafter's layers
    inp = StepInput(ids, range(n), [0] * n, [n - 1], [GREEDY], hidden=True)
    runner.step(inp)
    return np.array(runner.hidden_states(inp)), ids


def test_a_tapped_target_step_feeds_the_drafter(files):
    f, ids = features(12)
    d = draft(files["full"])
    assert f.shape == (12, 3 * d.spec.n_embd_target)
    g = d.encode(f)                                                      # (12, E)
    logits, y = d.decode(ids[1:] + [0], g, 0)      # token i+1 with the target's row i
    assert logits.shape == (12, d.spec.vocab_size) and y.shape == (12, d.spec.n_embd)
    assert np.isfinite(logits).all() and logits.std() > 0


def test_chunked_decoding_equals_one_shot_decoding(files):
    """Rows 0..11 in one call, and as 5 + 1 + 6 rows in three calls over the kept KV rows: the
    same logits (causal attention over the drafter's own cache), and y chains as g."""
    f, ids = features(12)
    one = draft(files["full"])
    g = one.encode(f)
    whole, y_whole = one.decode(ids, g, 0)
    parts = draft(files["full"])
    got = [parts.decode(ids[a:b], g[a:b], a)[0] for a, b in ((0, 5), (5, 6), (6, 12))]
    np.testing.assert_allclose(np.concatenate(got), whole, rtol=1e-5, atol=1e-5)
    # a later token changes no earlier row
    other = draft(files["full"])
    changed = other.decode(ids[:11] + [(ids[11] + 1) % 1024], g, 0)[0]
    np.testing.assert_array_equal(changed[:11], whole[:11])
    assert not np.array_equal(changed[11], whole[11])
    assert np.isfinite(y_whole).all()


def test_the_reduced_vocabulary_scatters_to_its_target_ids(files, tmp_path):
    """A drafter cut to draft ids S (d2t = S, output = the full drafter's rows S): its logits
    at S are the full drafter's, every other id -inf."""
    full = GGUFFile(files["full"])
    w = np.frombuffer(full.tensor("output.weight").raw, np.float32).reshape(
        full.tensor("output.weight").shape)                              # (V, E) f32
    rng = np.random.default_rng(0)
    S = np.sort(rng.choice(w.shape[0], 200, replace=False)).astype(np.int64)
    T = gguf.GGMLQuantizationType
    cut = rewrite(files["full"], tmp_path / "cut.gguf",
                  tensors={"output.weight": (np.ascontiguousarray(w[S]), T.F32),
                           "d2t": (S, T.I64)})
    f, ids = features(6)
    a, b = draft(files["full"]), draft(cut)
    la = a.decode(ids, a.encode(f), 0)[0]
    lb = b.decode(ids, b.encode(f), 0)[0]
    # (equal up to sgemm's blocking of 200 rows against 1024)
    np.testing.assert_allclose(lb[:, S], la[:, S], rtol=1e-5, atol=1e-5)
    off = np.ones(la.shape[1], bool)
    off[S] = False
    assert np.isneginf(lb[:, off]).all()


@pytest.mark.parametrize("key", ["eagle3.norm_before_residual", "eagle3.norm_before_fc"])
def test_the_flags_change_the_forward(files, tmp_path, key):
    V = gguf.GGUFValueType
    extra = {}
    if key.endswith("fc"):
        extra = {"enc.output_norm.weight": (np.full(768, 1.5, np.float32),
                                            gguf.GGMLQuantizationType.F32)}
    flagged = rewrite(files["full"], tmp_path / "flag.gguf", meta={key: (True, V.BOOL)},
                      tensors=extra)
    f, ids = features(4)
    a, b = draft(files["full"]), draft(flagged)
    assert not np.allclose(a.decode(ids, a.encode(f), 0)[0], b.decode(ids, b.encode(f), 0)[0])
