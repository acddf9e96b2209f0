"""The DSpark Markov head on the CPU: loading (absent, disabled for another vocabulary size,
malformed), the correction applied by backend ops against numpy, a headed drafter's chain
against a numpy reference, greedy identity with a headed drafter, and `fit-markov` (the residual
on its corpus falls, the written file round-trips)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from structlog.testing import capture_logs

from service.backends import create_backend
from service.engine.spec.markov_head import W1_NAME, W2_NAME, MarkovHead, meta_key, read_head_shape
from service.errors import ModelFormatError
from service.gguf.quants import dequantize
from service.gguf.reader import GGUFFile
from service.model.spec import ModelSpec
from service.model.tokenizer import Tokenizer
from service.tools.fit_markov import fit_markov, window_logits, write_head
from service.tools.quantize import requantize
from tests.engine.test_model_drafter import _State, captured_drafting_run, model_engine
from tests.support.engines import run, running_engine
from tests.support.models import TINY, build_model, load_json, model_path

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "bench/corpus/markov_fit.txt"
V = 49152                        # SmolLM2's vocabulary


def _random_head(vocab: int, rank: int, scale: float, seed: int = 0):
    """W1, W2 (vocab, rank) f32 whose corrections W2 @ W1[p] are about `scale` logits."""
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((vocab, rank)).astype(np.float32)
    w2 = (rng.standard_normal((vocab, rank)) * scale / np.sqrt(rank)).astype(np.float32)
    return w1, w2


def _tensor(f: GGUFFile, name: str) -> np.ndarray:
    t = f.tensors[name]
    return dequantize(t.raw, t.qtype, t.shape)                          # (V, R) f32


@pytest.fixture(scope="module")
def draft4(requantized) -> Path:
    return requantized("smollm2", "q8_0", 4)


@pytest.fixture(scope="module")
def headed(draft4, tmp_path_factory) -> tuple[Path, np.ndarray, np.ndarray]:
    """The 4-block copy with a random rank-8 F32 head strong enough to move argmaxes."""
    w1, w2 = _random_head(V, 8, 4.0)
    out = tmp_path_factory.mktemp("markov") / "smol-4l-rand.gguf"
    write_head(GGUFFile(draft4), out, w1, w2, "f32")
    return out, w1, w2


# ---------------------------------------------------------------- loading
def test_a_draft_file_without_a_head_loads_and_drafts_as_before(draft4, headed):
    zero = headed[0].with_name("smol-4l-zero.gguf")
    write_head(GGUFFile(draft4), zero, np.zeros((V, 4), np.float32),
               np.zeros((V, 4), np.float32), "f16")
    prompt = load_json("llamacpp_smollm2_greedy.json")["cases"][3]["prompt_ids"]
    with model_engine(str(draft4), start=False) as plain, \
            model_engine(str(zero), start=False) as zeroed:
        assert plain.drafter.head is None and "Markov" not in plain.info.draft_model
        assert zeroed.drafter.head.rank == 4 and "Markov head rank 4" in zeroed.info.draft_model
        a, b = _State(0, list(prompt)), _State(0, list(prompt))
        plain.drafter.start(a)
        zeroed.drafter.start(b)
        assert plain.drafter.propose(a, 5) == zeroed.drafter.propose(b, 5)


def test_a_head_of_another_vocabulary_size_is_disabled_with_a_warning(draft4, tmp_path):
    out = tmp_path / "smol-4l-small-head.gguf"
    write_head(GGUFFile(draft4), out, *_random_head(1000, 4, 1.0), "f16")
    with capture_logs() as logs, model_engine(str(out), start=False) as eng:
        pass
    assert eng.drafter.head is None and "Markov" not in eng.info.draft_model
    warn = [e for e in logs if e["event"] == "markov_head_disabled"]
    assert warn and warn[0]["log_level"] == "warning"
    assert "1000" in warn[0]["reason"] and str(V) in warn[0]["reason"]


def test_a_malformed_head_is_a_model_format_error(tmp_path):
    tiny = GGUFFile(TINY / "tiny-qwen3.gguf")
    vocab = ModelSpec.from_gguf(tiny).vocab_size
    w1, w2 = _random_head(vocab, 4, 1.0)
    cases = {"differ": (w1, np.zeros((vocab, 8), np.float32))}
    for name, (a, b) in cases.items():
        out = tmp_path / f"{name}.gguf"
        write_head(tiny, out, a, b, "f32")
        with pytest.raises(ModelFormatError, match="differ; both are"):
            read_head_shape(GGUFFile(out), vocab)
    ok = tmp_path / "ok.gguf"
    write_head(tiny, ok, w1, w2, "f16")
    f = GGUFFile(ok)
    assert read_head_shape(f, vocab).rank == 4
    arch = f.get("general.architecture")
    assert f.get(meta_key(arch, "enabled")) is True
    assert f.get(meta_key(arch, "markov_rank")) == 4
    assert f.get(meta_key(arch, "vocab_size")) == vocab
    # the metadata must agree with the tensors
    f.metadata[meta_key(arch, "markov_rank")] = 5
    with pytest.raises(ModelFormatError, match="markov_rank = 5"):
        read_head_shape(f, vocab)


# ---------------------------------------------------------------- applying it
def test_the_applied_head_equals_numpy(headed):
    path, w1, w2 = headed
    f = GGUFFile(path)
    be = create_backend("cpu")
    head = MarkovHead(f, read_head_shape(f, V), be)
    rng = np.random.default_rng(1)
    for ids in ([17], [5, 9000, 123], [0, 0, 0, 0, 49151]):
        logits = rng.standard_normal((1, V)).astype(np.float32)         # (1, V)
        want = logits[0].astype(np.float64) + w2.astype(np.float64) @ w1[ids[-1]]
        head.apply(np.array(ids, np.int32), logits)
        np.testing.assert_allclose(logits[0], want, rtol=1e-5, atol=1e-4)


def test_a_headed_drafter_chain_follows_the_numpy_reference(draft4, headed):
    """d_{i+1} = argmax(draft logits of the row fed d_i + W2 @ W1[d_i]), the draft logits from
    a full forward over the prefix; every pick has a clear top-1/top-2 gap (> 0.01)."""
    path, w1, w2 = headed
    prompt = load_json("llamacpp_smollm2_greedy.json")["cases"][0]["prompt_ids"]
    with model_engine(str(path), start=False) as eng:
        seq = _State(0, list(prompt))
        eng.drafter.start(seq)
        got = eng.drafter.propose(seq, 4)
    ref_model = build_model(path, n_ctx=128, max_tokens=64)
    ids, plain_moved = list(prompt), 0
    for tok in got:
        *_, (_, logits) = window_logits(ref_model, ids)
        row = logits[-1].astype(np.float64)                             # (V,)
        fixed = row + w2.astype(np.float64) @ w1[ids[-1]]
        top = np.sort(fixed)[-2:]
        assert top[1] - top[0] > 0.01
        assert tok == int(fixed.argmax())
        plain_moved += int(row.argmax()) != tok
        ids.append(tok)
    assert plain_moved > 0              # the head decided at least one draft


def test_greedy_output_with_a_headed_drafter_equals_plain_greedy(headed):
    cases = load_json("llamacpp_smollm2_greedy.json")["cases"][:4]
    with running_engine("smollm2") as plain_eng:
        plain = [run(plain_eng, c["prompt_ids"], max_new_tokens=16, ignore_eos=True,
                     speculative=False).token_ids for c in cases]
    with model_engine(str(headed[0])) as eng:
        for width in (2, 6):
            eng.config = replace(eng.config, verify_width=width)
            drafted = 0
            for c, ref in zip(cases, plain, strict=True):
                out = run(eng, c["prompt_ids"], max_new_tokens=16, ignore_eos=True)
                assert out.token_ids == ref, (width, c["name"])
                drafted += out.finished.usage.draft_tokens
            assert drafted > 0


# ---------------------------------------------------------------- fitting
def test_fit_markov_lowers_the_residual_on_its_corpus_and_round_trips(draft4, tmp_path):
    target = model_path("smollm2")
    out = tmp_path / "fitted.gguf"
    r = fit_markov(target, draft4, out, rank=8, corpus=str(CORPUS), n_tokens=192)
    assert (r.n_tokens, r.rank) == (192, 8) and r.loss_after < r.loss_before
    # measured again here: centered residuals of the two models, with and without the head
    tf, df, f = GGUFFile(target), GGUFFile(draft4), GGUFFile(out)
    w1, w2 = _tensor(f, W1_NAME), _tensor(f, W2_NAME)                   # (V, 8) each
    ids = Tokenizer.from_metadata(tf.metadata).encode(CORPUS.read_text())[:192]
    models = [build_model(p, n_ctx=256, max_tokens=64) for p in (target, draft4)]
    before = after = 0.0
    for (chunk, t), (_, d) in zip(*(window_logits(m, ids) for m in models), strict=True):
        res = (t - d).astype(np.float64)
        res -= res.mean(axis=1, keepdims=True)
        before += float((res ** 2).sum())
        after += float(((res - w1[chunk] @ w2.T) ** 2).sum())
    before, after = before / (192 * V), after / (192 * V)
    print(f"\nfit-markov rank 8 on 192 corpus tokens: {before:.3f} -> {after:.3f}")
    assert after < 0.9 * before
    np.testing.assert_allclose([before, after], [r.loss_before, r.loss_after], rtol=1e-3)
    # the round trip: the draft's tensors and keys unchanged, the head's metadata, zero rows
    for name, t in df.tensors.items():
        assert f.tensors[name].qtype == t.qtype and np.array_equal(f.tensors[name].raw, t.raw)
    assert {k for k in df.metadata} <= set(f.metadata)
    seen = np.zeros(V, bool)
    seen[ids] = True
    assert not w1[~seen].any() and w1[seen].any()
    assert read_head_shape(f, V).rank == 8
    # a second fit into the headed file replaces the head
    again = fit_markov(target, out, tmp_path / "refit.gguf", rank=4, corpus=str(CORPUS),
                       n_tokens=64, dtype="f32")
    g = GGUFFile(again.path)
    assert g.tensors[W1_NAME].shape == (V, 4) and read_head_shape(g, V).rank == 4


def test_fit_markov_cli_on_a_corpus_generated_by_the_target(draft4, tmp_path, capsys):
    from service.cli import main

    out = tmp_path / "gen.gguf"
    assert main(["fit-markov", "smollm2-135m", str(draft4), str(out), "--rank", "4",
                 "--corpus", "-generate", "--tokens", "40", "--seed", "3"]) == 0
    line = capsys.readouterr().out
    assert "rank 4 Markov head fitted on 40 positions" in line, line
    before, after = (float(x) for x in line.rsplit("logit ", 1)[1].split(",")[0].split(" -> "))
    assert after < before
    assert read_head_shape(GGUFFile(out), V).rank == 4
    assert main(["fit-markov", "smollm2-135m", str(draft4), str(out), "--rank", "0",
                 "--corpus", "nowhere.txt"]) == 2


def test_headed_draft_steps_obey_the_capture_rules(headed):
    """With the CPU backend's capture rules on, the head's ops inside the draft step use only
    workspace buffers and the same op sequence per step shape (what a CUDA graph needs)."""
    spec = captured_drafting_run(str(headed[0]))
    assert spec.finished.usage.draft_tokens > 0


def test_quantize_keeps_a_head_at_8_bits_or_refuses_it_at_4(tmp_path):
    tiny = GGUFFile(TINY / "tiny-qwen3.gguf")
    vocab = ModelSpec.from_gguf(tiny).vocab_size
    w1, w2 = _random_head(vocab, 64, 1.0)
    write_head(tiny, tmp_path / "h.gguf", w1, w2, "f32")
    q8 = GGUFFile(requantize(tmp_path / "h.gguf", tmp_path / "h8.gguf", "q8_0").path)
    assert q8.tensors[W1_NAME].qtype.name == "Q8_0" and read_head_shape(q8, vocab).rank == 64
    be = create_backend("cpu")
    head = MarkovHead(q8, read_head_shape(q8, vocab), be)
    logits = np.zeros((1, vocab), np.float32)
    head.apply(np.array([5], np.int32), logits)
    np.testing.assert_allclose(logits[0], w2 @ w1[5], atol=0.05 * np.abs(w2 @ w1[5]).max())
    q4 = GGUFFile(requantize(tmp_path / "h.gguf", tmp_path / "h4.gguf", "q4_0").path)
    with pytest.raises(ModelFormatError, match="Q4_0; the head is stored as"):
        read_head_shape(q4, vocab)
