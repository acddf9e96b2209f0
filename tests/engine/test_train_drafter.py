"""`specstream train-drafter --kind eagle3` on the tiny-qwen3 target (random weights: its greedy
continuations are still a fixed function of the context, which a head can learn).

- A short training (48 random prompts x 24 tokens, a 300-token draft vocabulary, two unroll
  steps) lowers the held-out loss at every unroll step and lifts the held-out acceptance far
  above the untrained head's.
- The written file is an EAGLE-3 head for the target (Eagle3Spec.from_gguf, check_target), and
  the reference forward (service/model/eagle3_forward.py) run on it as a chain gives the
  trainer's acceptance, and the trainer's logits row for row (extend and chain rows).
- An engine drafting with it (`--drafter eagle3`) gives plain greedy output and accepts drafts.
- With n_top the generation keeps each position's top tokens, the choice first.
- A generation kept with --data is reused only by a run that would generate the same; weight
  decay shrinks the head's matrices alone.
- The CLI runs end to end on a prompts file of token ids (with soft labels) and reports bad
  options at once.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from service.gguf.quants import dequantize
from service.gguf.reader import GGUFFile
from service.model.eagle3 import D2T, Eagle3Spec
from service.model.eagle3_forward import Eagle3Draft
from service.model.spec import ModelSpec
from service.tools.eagle3_data import TargetRunner, collect
from service.tools.eagle3_fit import make_batch, target_tensor, target_to_draft
from service.tools.eagle3_head import Eagle3Head, trained_names
from service.tools.train_drafter import TrainReport, train_drafter
from service.tools.train_options import TrainOptions
from tests.support.cli import run_cli
from tests.support.engines import run, running_engine
from tests.support.models import model_path
from tests.support.speculation import greedy_equals_plain_at_widths

TARGET, N_NEW = "tiny-qwen3", 24
OPTS = TrainOptions(tokens=N_NEW, holdout=0.25, draft_vocab=300, unroll=2, epochs=20, lr=3e-3,
                    quant="F32", depth=3, slots=16)


def random_prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1024, rng.integers(4, 12)).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> TrainReport:
    out = tmp_path_factory.mktemp("train") / "head.gguf"
    return train_drafter(model_path(TARGET), out, OPTS, random_prompts(48, seed=0))


def test_training_lowers_the_held_out_loss_and_lifts_acceptance(trained):
    before, after = trained.before, trained.after_held
    print(f"\nheld-out loss {before.loss} -> {after.loss}, acceptance {before.acceptance} -> "
          f"{after.acceptance} over {after.starts} starts")
    assert trained.train == (36, 36 * N_NEW) and trained.held == (12, 12 * N_NEW)
    assert after.starts >= 200
    assert (after.loss < before.loss / 4).all()
    assert after.acceptance[0] >= 0.25 and before.acceptance[0] <= 0.05
    assert (after.acceptance >= before.acceptance + 0.05).all()
    assert trained.after_train.loss[0] < after.loss[0]        # fits what it saw best
    assert trained.fit.steps == 20 * 5


def test_the_file_is_an_eagle3_head_for_the_target(trained):
    f = GGUFFile(trained.path)
    spec = Eagle3Spec.from_gguf(f)
    spec.check_target(ModelSpec.from_gguf(GGUFFile(model_path(TARGET))))
    assert spec == trained.spec
    assert (spec.target_layers, spec.draft_vocab, spec.n_embd) == ((0, 1, 2), 300, 256)
    assert spec.has_d2t and spec.own_output and not spec.own_embedding
    d2t = f.index_tensor(D2T)
    assert (np.diff(d2t) > 0).all()                           # sorted, distinct


def test_the_reference_forward_on_the_file_gives_the_trainers_acceptance(trained):
    assert np.abs(trained.reference - trained.after_held.acceptance).max() <= 0.02


def test_the_trainers_logits_are_the_reference_forwards(trained):
    """The written tensors in the trainer's head: its extend rows (unroll step 0) and chain
    rows (step 1: token t[P + 1], g = the step-0 output at P - 1, after the real rows < P)
    equal the reference's rows of the draft vocabulary."""
    f, target = GGUFFile(trained.path), GGUFFile(model_path(TARGET))
    spec = Eagle3Spec.from_gguf(f)
    params = {n: dequantize(f.tensor(n).raw, f.tensor(n).qtype, f.tensor(n).shape)
              for n in trained_names(spec)}
    head = Eagle3Head(spec, params, target_tensor(target, "token_embd.weight"), 64)
    runner = TargetRunner(model_path(TARGET), spec.target_layers, n_slots=1, n_ctx=64)
    seq = collect(runner, random_prompts(1, seed=5), 16, 64)[0]
    d2t = f.index_tensor(D2T)
    batch = make_batch([seq], target_to_draft(d2t, spec.vocab_size), 2)
    step0, step1 = (x[0] for x in head.logits(batch, 2))                 # (R, Vd) each
    ref = Eagle3Draft(spec, f, target, 64)
    g = ref.encode(batch.feats[0])
    tokens = batch.tokens[0]
    for P in range(len(tokens)):
        real, y = ref.decode(tokens[P:P + 1], g[P:P + 1], P)
        assert np.abs(real[0, d2t] - step0[P]).max() <= 1e-4 * np.abs(step0[P]).max()
        if P + 1 < len(tokens):
            chain, _ = ref.decode(tokens[P + 1:P + 2], y, P + 1)
            assert np.abs(chain[0, d2t] - step1[P + 1]).max() <= 1e-4 * np.abs(
                step1[P + 1]).max()


def test_generation_keeps_the_top_tokens_with_n_top():
    """Every fed position's n_top most likely tokens: the choice first, log-probabilities
    descending and of a distribution (their mass at most 1); the choices are n_top = 0's."""
    prompts = random_prompts(3, seed=11)
    plain = collect(TargetRunner(model_path(TARGET), (0, 1, 2), n_slots=2, n_ctx=64),
                    prompts, 8, 64)
    topped = collect(TargetRunner(model_path(TARGET), (0, 1, 2), n_slots=2, n_ctx=64,
                                  n_top=4), prompts, 8, 64)
    for a, b in zip(plain, topped, strict=True):
        assert a.top_ids is None and np.array_equal(a.choice, b.choice)
        assert b.top_ids.shape == b.top_logp.shape == (len(b.ids) - 1, 4)
        assert np.array_equal(b.top_ids[:, 0], b.choice)
        assert (np.diff(b.top_logp, axis=1) <= 0).all()
        assert (np.exp(b.top_logp).sum(1) <= 1 + 1e-5).all()


def test_a_kept_generation_is_reused_only_for_the_same_run(tmp_path, monkeypatch):
    """--data: the first run writes the generation, a second with the same target, prompts,
    split and tokens reads it back (the same sequences, soft-label tokens included, and no
    generation), one with other tokens generates afresh and writes its own."""
    from service.tools import train_drafter as td

    data, prompts = tmp_path / "gen.npz", random_prompts(8, seed=21)
    opts = TrainOptions(tokens=6, holdout=0.25, slots=4, soft_labels=3, data=str(data))
    t = ModelSpec.from_gguf(GGUFFile(model_path(TARGET)))
    first = td._generate(model_path(TARGET), t, (0, 1, 2), opts, prompts)
    assert data.is_file()
    calls = []
    monkeypatch.setattr(td, "collect", lambda *a: calls.append(a) or [])
    again = td._generate(model_path(TARGET), t, (0, 1, 2), opts, prompts)
    assert not calls
    for a, b in zip(first[0] + first[1], again[0] + again[1], strict=True):
        for f in ("ids", "feats", "choice", "top_ids", "top_logp"):
            assert np.array_equal(getattr(a, f), getattr(b, f)), f
        assert a.n_prompt == b.n_prompt
    assert [len(x) for x in again[:2]] == [6, 2]
    monkeypatch.undo()
    other = td._generate(model_path(TARGET), t, (0, 1, 2),
                         TrainOptions(tokens=5, holdout=0.25, slots=4, data=str(data)), prompts)
    assert max(s.n_generated for s in other[0] + other[1]) == 5
    assert other[0][0].top_ids is None


def test_weight_decay_shrinks_the_matrices_alone():
    """AdamW's decoupled decay: with no gradient a matrix shrinks by lr * wd per step, a norm
    (1-D) does not move; without decay nothing moves."""
    from service.tools.eagle3_fit import Adam

    params = {"w": np.ones((2, 3), np.float32), "norm": np.ones(3, np.float32)}
    zero = {k: np.zeros_like(v) for k, v in params.items()}
    Adam(params, weight_decay=0.1).step(zero, 0.01)
    assert np.allclose(params["w"], 1 - 0.01 * 0.1) and np.array_equal(params["norm"], np.ones(3))
    Adam(params).step(zero, 0.01)
    assert np.allclose(params["w"], 1 - 0.01 * 0.1)


def test_an_engine_drafting_with_the_trained_head_gives_plain_greedy_output(trained):
    prompts = random_prompts(4, seed=99)                       # none of them trained on
    with running_engine(TARGET) as eng:
        plain = [run(eng, p, max_new_tokens=N_NEW, ignore_eos=True, speculative=False).token_ids
                 for p in prompts]
    with running_engine(TARGET, drafter="eagle3", draft_model=str(trained.path),
                        verify_width=4, draft_in_full=True) as eng:
        got = list(greedy_equals_plain_at_widths(eng, prompts, plain, widths=(2, 4),
                                                 max_new_tokens=N_NEW, label="trained"))
    assert all(a.accepted > 0 for a in got)


# ---------------------------------------------------------------- the command line
def test_the_cli_trains_on_a_prompts_file_of_token_ids(capsys, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in random_prompts(12, seed=3)))
    out = tmp_path / "cli.gguf"
    code, text, err = run_cli(capsys, "train-drafter", str(model_path(TARGET)), str(out),
                              "--kind", "eagle3", "--prompts", str(prompts), "--tokens", "8",
                              "--epochs", "2", "--holdout", "0.25", "--quant", "Q8_0",
                              "--draft-vocab", "64", "--depth", "2", "--soft-labels", "5")
    assert code == 0, err
    assert "9 training / 3 held-out prompts" in text
    assert "held-out acceptance, depth 2" in text and "reference forward" in text
    assert Eagle3Spec.from_gguf(GGUFFile(out)).draft_vocab == 64


def test_the_cli_reports_every_bad_option(capsys, tmp_path):
    code, _, err = run_cli(capsys, "train-drafter", str(model_path(TARGET)),
                           str(tmp_path / "no" / "x.gguf"), "--kind", "dflash", "--unroll", "0",
                           "--holdout", "1.5", "--draft-vocab", "5000", "--quant", "Q4_0",
                           "--soft-labels", "21", "--weight-decay", "2",
                           "--data", str(tmp_path / "none" / "d.npz"))
    assert code == 2
    for what in ("kind: 'dflash'", "unroll: 0", "holdout: 1.5", "draft-vocab: 5000",
                 "quant: 'Q4_0'", "is not a directory", "soft-labels: 21", "weight-decay: 2",
                 "data: "):
        assert what in err, what


def test_text_prompts_need_a_tokenizer(capsys, tmp_path):
    """tiny-qwen3 has no vocabulary texts: the shipped (text) corpus cannot be encoded."""
    code, _, err = run_cli(capsys, "train-drafter", str(model_path(TARGET)),
                           str(tmp_path / "x.gguf"))
    assert code == 2 and "no tokenizer to encode text prompts" in err
    assert not Path(tmp_path / "x.gguf").exists()
