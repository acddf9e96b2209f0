"""bench/speculative.py's pure pieces: the oracle drafter hits its tokens-per-step target, its
inverse formula, the identity report, the tables and goals; and the oracle through the real
engine on a tiny synthetic model. Nothing here times anything or asserts a speed."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _module(name: str):
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))            # speculative.py imports spec_tables
    return importlib.import_module(name)


@pytest.fixture(scope="module")
def S():
    return _module("spec_tables")


RECORDED = [int(t) for t in np.random.default_rng(7).integers(0, 1000, 12001)]
PROMPT = [3, 1, 4, 1, 5]


@pytest.mark.parametrize("width,target", [(6, 4.27), (6, 2.0), (4, 3.0), (16, 8.0), (2, 1.5)])
def test_oracle_hits_its_tokens_per_step_target(S, width, target):
    p = S.p_for_tokens_per_step(target, width - 1)
    oracle = S.OracleDrafter(1000, seed=1)
    oracle.configure(RECORDED, len(PROMPT), p)
    steps, drafted, accepted = S.simulate_chain(oracle, PROMPT, RECORDED, width)
    assert steps + accepted == len(RECORDED) - 1          # each step: its accepted drafts + 1
    assert (len(RECORDED) - 1) / steps == pytest.approx(target, rel=0.03)
    # drafts after the first corrupted one are verified but never accepted
    assert accepted / drafted == pytest.approx((target - 1) / (width - 1), abs=0.02)
    assert oracle.off_record == 0                         # the history stayed the recorded one


def test_oracle_at_the_extremes(S):
    rec = RECORDED[:101]
    perfect = S.OracleDrafter(1000)
    perfect.configure(rec, len(PROMPT), 1.0)
    # 100 tokens after the first: 16 steps of 5 drafts + 1, then one of 3 drafts + 1
    assert S.simulate_chain(perfect, PROMPT, rec, 6) == (17, 83, 83)
    wrong = S.OracleDrafter(1000)
    wrong.configure(rec, len(PROMPT), 0.0)
    seq = S._History(history=[*PROMPT, *rec[:10]])
    draft = wrong.propose(seq, 5)
    assert len(draft) == 5
    assert all(d != t and 0 <= d < 1000 for d, t in zip(draft, rec[10:15], strict=True))
    assert S.simulate_chain(wrong, PROMPT, rec, 6)[2] == 0


def test_p_for_tokens_per_step_inverts_the_expectation(S):
    for k in (1, 5, 15):
        for t in (1.0, 1.7, (k + 2) / 2, k + 1.0):
            assert S.expected_tokens_per_step(S.p_for_tokens_per_step(t, k), k) == \
                pytest.approx(t, abs=1e-9)
    assert S.p_for_tokens_per_step(S.REF_TOKENS_PER_STEP, S.REF_WIDTH - 1) == \
        pytest.approx(0.8617, abs=1e-3)
    with pytest.raises(ValueError):
        S.p_for_tokens_per_step(6.5, 5)


def test_identity_report(S):
    assert S.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert S.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert S.first_difference([1, 2, 3], [1, 2]) == 2
    assert S.identity_text([None, None]) == "identical"
    assert S.identity_text([None, 17, 3]) == "differs p1@17"


def _real_rows() -> list[dict]:
    base = {"model": "smollm2-135m", "kind": "code"}
    return [{**base, "drafter": "plain", "verify": "-", "drafted": 0, "accepted": 0,
             "tokens": 63, "tok_s": 40.0, "speedup": 1.0, "identical": "(reference)"},
            {**base, "drafter": "ngram", "verify": "chain 6", "alpha": 0.18, "drafted": 40,
             "accepted": 30, "tokens": 63, "tok_s": 70.0, "speedup": 1.75,
             "identical": "differs p0@12"},
            {**base, "drafter": "self q8_0 28/30L", "verify": "tree 8", "error": "ConfigError"}]


def test_real_table_lines(S):
    lines = S.real_table(_real_rows(), "title").splitlines()
    assert len(lines) == 5
    assert "1.00" in lines[2] and "(reference)" in lines[2]
    # 63 tokens in 63 - 30 = 33 steps
    assert " 0.18 " in lines[3] and " 0.18 " not in lines[2]
    assert "30/40 75.0%" in lines[3] and "1.91" in lines[3] and "1.75x" in lines[3]
    assert lines[3].endswith("differs p0@12")
    assert "error: ConfigError" in lines[4]


def _synth_rows(ratio8: float, speedup: float) -> tuple[list[dict], list[dict]]:
    verify = [{"width": w, "rows": w, "kv": 1024, "step_s": 0.004 * r, "ratio": r}
              for w, r in ((1, 1.0), (8, ratio8))]
    oracle = [{"width": 6, "target": 4.27, "p": 0.862, "tokens_per_step": 4.3,
               "acceptance": 0.66, "tok_s": 220.0 * speedup, "speedup": speedup,
               "identical": "identical"},
              {"width": 16, "target": 6.56, "p": 0.862, "tokens_per_step": 6.5,
               "acceptance": 0.37, "tok_s": 500.0, "speedup": 2.27, "identical": "differs @9"}]
    return verify, oracle


@pytest.mark.parametrize("ratio8,speedup,met", [(1.4, 3.2, (True, True)),
                                                (1.9, 2.5, (False, False))])
def test_goals_met_or_missed(S, ratio8, speedup, met):
    verify, oracle = _synth_rows(ratio8, speedup)
    g = S.goals("8b", verify, oracle)
    assert [x["met"] for x in g] == list(met)
    assert [x["value"] for x in g] == [ratio8, speedup]
    table = S.goals_table(g)
    assert table.count("MET") == sum(met) and table.count("missed") == 2 - sum(met)


def test_synth_tables_mark_the_goal_rows(S):
    verify, oracle = _synth_rows(1.4, 3.2)
    v = S.verify_table(verify, "llama3-8b").splitlines()
    assert "goal" in v[3] and "goal" not in v[2] and "1.40x" in v[3]
    o = S.oracle_table(oracle, "llama3-8b", 220.0, 512).splitlines()
    assert "220.0 tok/s" in o[0]
    assert "goal" in o[2] and "3.20x" in o[2] and "goal" not in o[3]
    assert o[3].endswith("differs @9")


def test_oracle_through_the_engine_on_a_tiny_model(tmp_path):
    """The bench's engine path: plain greedy records, the oracle at p = 1 and width 4 makes
    every step commit 4 tokens and the output equal the recorded one."""
    from service.config import EngineConfig
    from service.tools import synth

    B = _module("speculative")
    path = synth.synthesize(tmp_path / "m.gguf", "tiny", "Q8_0", seed=1).path
    cfg = EngineConfig(backend="cpu", n_ctx=128, n_slots=1, verify_width=16, drafter="none")
    eng, oracle = B.oracle_engine(path, cfg, seed=0)
    eng.start()
    try:
        eng.verify_alpha = 0.0
        prompt = [1016, 72, 101, 300, 500, 7]
        recorded = B.decode(eng, prompt, 33, False).token_ids
        row = B.oracle_row(eng, oracle, prompt, recorded, 4, 4.0, 1)
        never = B.oracle_row(eng, oracle, prompt, recorded, 4, 1.0, 1)
    finally:
        eng.stop(10)
    assert len(recorded) == 33
    assert row["identical"] == "identical" and row["tokens_per_step"] == 4.0
    assert row["acceptance"] == 1.0 and oracle.off_record == 0
    assert never["identical"] == "identical" and never["tokens_per_step"] == 1.0
