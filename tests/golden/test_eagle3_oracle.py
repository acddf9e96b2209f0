"""EAGLE-3 drafters against llama.cpp's draft logits (tests/data/tiny/llamacpp_eagle3_logits.json,
made by bench/llamacpp_eagle3_oracle.py: its docstring has the sequence of calls, the one
common/speculative.cpp's `draft-eagle3` makes for one sequence).

The drafters are seeded `synthesize_eagle3` files of the tiny-qwen3 target (a plain F16 one, a
Q8_0 one with a reduced draft vocabulary and its own token embeddings, an F16 one normed before
fc); the test rewrites them and checks their sha256 against the fixture's, so a synthesizer
change cannot pass silently. Three checks per drafter:

- capture points: our CPU backend's tapped target rows (the inputs of the target layers) against
  the features llama.cpp extracted;
- the encoder: g = fc(features) of llama.cpp's features, against llama.cpp's g;
- the decoder: the prefill pairs (token[P + 1], g[P]), then the draft chain teacher-forced on
  llama.cpp's draft ids, each row fed our own pre-norm output; logits per row against llama.cpp's
  (relative_errors: mean |centered difference| over the spread of llama.cpp's row; an argmax
  check would add nothing: rows within d of each other can only disagree on a gap under 2d).
  Both the drafter the engine runs (service/model/eagle3_model.py on the CPU backend, rounding
  activations as llama.cpp does) and the numpy reference (service/model/eagle3_forward.py, f32
  activations) are checked.

The drafters' weights are F16 / Q8_0, which llama.cpp multiplies with activations rounded to
f16 / q8_0: the backend doing the same agrees to about 1e-5 (relative) where the features are
rounded alike, the f32 reference to a few 1e-3. Bounds over the values measured (pytest -s
prints them); negative controls show that each check catches a real mistake.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from service.backends.cpu.backend import CpuBackend
from service.engine.runner import GREEDY, ModelRunner, StepInput
from service.gguf.reader import GGUFFile
from service.model.eagle3 import Eagle3Spec
from service.model.eagle3_forward import Eagle3Draft
from service.model.eagle3_model import Eagle3Model
from service.model.transformer import positions_for
from service.tools.synth_eagle3 import synthesize_eagle3
from tests.support.logits import relative_errors
from tests.support.models import build_model, load_json, model_path

FIXTURE = load_json("tiny/llamacpp_eagle3_logits.json")
N_CTX = 64
# (g, logits) bounds; measured maxima: backend 1.9e-5, 1.4e-3; reference F16 2.4e-4, 2.6e-3,
# Q8_0 6.2e-3, 5.8e-3 (the backend's largest is the norm-before-fc file's: its f16-rounded
# normed features differ in a few last bits, which this random drafter amplifies ~70x)
BACKEND_BOUNDS = (1e-4, 5e-3)
REFERENCE_BOUNDS = {"F16": (1e-3, 1e-2), "Q8_0": (2e-2, 2e-2)}
# tapped target rows (relative RMS): measured median 0.010, max 0.087 (one sensitive row of
# this random network; a tap one layer off measures tens of percent)
FEATURE_MEDIAN, FEATURE_MAX = 0.02, 0.15


def unpack(d: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(d["f32"]), np.float32).reshape(d["shape"]).copy()


def rel_rms(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per row: RMS of the difference over the RMS of the reference row b."""
    return np.sqrt(((a - b) ** 2).mean(-1) / (b ** 2).mean(-1))


@pytest.fixture(scope="module")
def drafters(tmp_path_factory) -> dict[str, Path]:
    d, out = tmp_path_factory.mktemp("e3o"), {}
    for name, entry in FIXTURE["drafters"].items():
        path = synthesize_eagle3(d / f"{name}.gguf", model_path("tiny-qwen3"),
                                 layers=tuple(FIXTURE["layers"]),
                                 weight_std=FIXTURE["weight_std"], **entry["options"]).path
        assert hashlib.sha256(path.read_bytes()).hexdigest() == entry["sha256"], (
            f"{name}: synthesize_eagle3 writes other bytes than the fixture's file; rerun "
            "bench/llamacpp_eagle3_oracle.py")
        out[name] = path
    return out


def target(act_quant: bool = True):
    return build_model("tiny-qwen3", CpuBackend(threads=1, act_quant=act_quant), n_ctx=N_CTX,
                       max_tokens=32)


def test_the_target_layers_are_the_ones_llama_cpp_extracts(drafters):
    ids, ref = FIXTURE["prompt_ids"], unpack(FIXTURE["features"])         # (T, 3 E)
    T = len(ids)
    spec = Eagle3Spec.from_gguf(GGUFFile(next(iter(drafters.values()))))
    assert list(spec.target_layers) == FIXTURE["layers"]
    runner = ModelRunner(target(), 1, N_CTX, hidden=spec.tap)
    inp = StepInput(ids, range(T), [0] * T, [T - 1], [GREEDY], hidden=True)
    runner.step(inp)
    ours = np.array(runner.hidden_states(inp))                             # (T, 3 E)
    errs = rel_rms(ours, ref)
    E = ours.shape[1] // 3
    shifted = rel_rms(ours[:, :2 * E], ref[:, E:])      # our layers k against llama.cpp's k + 1
    print(f"\ntarget rows: relative RMS median {np.median(errs):.3f}, max {errs.max():.3f}; "
          f"one layer off: median {np.median(shifted):.3f}")
    assert np.median(errs) <= FEATURE_MEDIAN and errs.max() <= FEATURE_MAX
    assert np.median(shifted) > 10 * FEATURE_MEDIAN     # the bounds catch a tap one layer off


def reference_chain(path: Path, entry: dict, spec_of=lambda s: s) -> tuple[np.ndarray,
                                                                             np.ndarray]:
    """The numpy reference: g of llama.cpp's features, then prefill and the teacher-forced
    chain; (g (T, E), logits (DEPTH, Vd))."""
    f = GGUFFile(path)
    spec = spec_of(Eagle3Spec.from_gguf(f))
    ref = Eagle3Draft(spec, f, GGUFFile(model_path("tiny-qwen3")), N_CTX)
    ids, T = FIXTURE["prompt_ids"], len(FIXTURE["prompt_ids"])
    g = ref.encode(unpack(FIXTURE["features"]))                            # (T, E)
    ref.decode(ids[1:], g[:T - 1], 0)
    rows, tok, state = [], entry["t0"], g[T - 1:]
    for k, d in enumerate(entry["draft_ids"]):
        logits, y = ref.decode([tok], state, T - 1 + k)                    # (1, V), (1, E)
        rows.append(logits[0][ref.d2t] if spec.has_d2t else logits[0])
        tok, state = d, y
    return g, np.array(rows)


def backend_chain(path: Path, entry: dict) -> tuple[np.ndarray, np.ndarray]:
    """The same on the engine's drafter (Eagle3Model on the CPU backend)."""
    f = GGUFFile(path)
    spec = Eagle3Spec.from_gguf(f)
    model = Eagle3Model(spec, f, target(), n_ctx=N_CTX, n_slots=1, max_tokens=32)
    ids, T = FIXTURE["prompt_ids"], len(FIXTURE["prompt_ids"])
    g = np.zeros((T, spec.n_embd), np.float32)
    model.encode(unpack(FIXTURE["features"]), g)

    def step(toks, g_rows, start):
        n = len(toks)
        logits = model.decode(np.array(toks, np.int32), positions_for(start, n),
                              np.zeros(n, np.int32), start + n, g_rows, 1)
        return np.array(logits)[-1], np.array(model.ws_y[n - 1:n])

    step(ids[1:], g[:T - 1], 0)
    rows, tok, state = [], entry["t0"], g[T - 1:]
    for k, d in enumerate(entry["draft_ids"]):
        row, y = step([tok], state, T - 1 + k)
        rows.append(row)
        tok, state = d, y
    return g, np.array(rows)


def errors(chain, path: Path, entry: dict, **kw) -> tuple[float, np.ndarray]:
    g, ours = chain(path, entry, **kw)
    ref = np.array(entry["logits"], np.float32)                            # (DEPTH, Vd)
    assert ours.shape == ref.shape
    return float(rel_rms(g, unpack(entry["g"])).max()), relative_errors(ours, ref)


@pytest.mark.parametrize("name", list(FIXTURE["drafters"]))
def test_the_engines_drafter_gives_llama_cpps_draft_logits(drafters, name):
    g_err, rel = errors(backend_chain, drafters[name], FIXTURE["drafters"][name])
    print(f"\n{name}: g relative RMS max {g_err:.1e}; draft rows relative error {rel.max():.1e}")
    assert g_err <= BACKEND_BOUNDS[0] and rel.max() <= BACKEND_BOUNDS[1], rel


@pytest.mark.parametrize("name", list(FIXTURE["drafters"]))
def test_the_reference_gives_llama_cpps_draft_logits(drafters, name):
    entry = FIXTURE["drafters"][name]
    g_err, rel = errors(reference_chain, drafters[name], entry)
    print(f"\n{name}: g relative RMS max {g_err:.1e}; draft rows relative error {rel.max():.1e}")
    g_bound, bound = REFERENCE_BOUNDS[entry["options"]["quant"]]
    assert g_err <= g_bound and rel.max() <= bound, rel


def test_the_bounds_catch_a_wrong_residual(drafters):
    """The residual of the normed g instead of the raw one (norm_before_residual, a flag real
    files carry) breaks every drafter's bound."""
    for name, entry in FIXTURE["drafters"].items():
        _, rel = errors(reference_chain, drafters[name], entry,
                        spec_of=lambda s: replace(s, norm_before_residual=True))
        assert rel.max() > 10 * REFERENCE_BOUNDS[entry["options"]["quant"]][1], (name, rel)
