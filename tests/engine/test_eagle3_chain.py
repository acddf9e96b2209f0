"""The eagle3 drafter's captured chain (service/engine/spec/eagle3_chain.py) on the CPU backend
with the capture rules on: tiny-qwen3 as the target, random EAGLE-3 heads (full vocabulary;
reduced vocabulary with own embeddings; reduced vocabulary on the target's embeddings).

- The chain run as one backend step proposes exactly the eager chain's drafts (the same ops in
  the same order) after a prompt, after verify steps accepting some drafts (boundaries of 1..4
  rows), for every k, again for the same history (a rerun), and through tree candidates (which
  decode a held boundary eagerly first); nothing in the step breaks a capture rule.
- Likewise for three sequences in three slots drafting between shared verify steps (each
  slot's held boundary kept apart).
- Through the engine, greedy speculation with the chain equals plain greedy output.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from service.backends import backend_options
from service.backends.cpu.backend import CpuBackend
from service.engine.runner import GREEDY as ROW_GREEDY
from service.engine.runner import StepInput
from service.engine.spec.eagle3_drafter import Eagle3Drafter
from service.tools.synth_eagle3 import synthesize_eagle3
from tests.engine.test_eagle3_drafter import N_NEW, PROMPTS, TARGET, eagle3_engine
from tests.support.engines import run
from tests.support.models import model_path
from tests.support.speculation import start_tapped


@pytest.fixture(scope="module")
def heads(tmp_path_factory) -> dict[str, Path]:
    d, t = tmp_path_factory.mktemp("e3c"), model_path(TARGET)
    return {"random": synthesize_eagle3(d / "random.gguf", t, seed=6, layers=(1, 2, 3),
                                        quant="F32", weight_std=0.1).path,
            "reduced": synthesize_eagle3(d / "reduced.gguf", t, seed=7, layers=(0, 2, 3),
                                         quant="Q8_0", weight_std=0.1, draft_vocab=300,
                                         own_embedding=True, norm_before_fc=True).path,
            "shared": synthesize_eagle3(d / "shared.gguf", t, seed=8, layers=(1, 2, 3),
                                        quant="F16", weight_std=0.1, draft_vocab=200).path}


def drive(d: Eagle3Drafter, runner, prompt: list[int], ks: list[int]) -> list[list[int]]:
    """Prefill `prompt` in slot 0 (tapped), extend, then for each k: propose k drafts (twice:
    the second must equal the first), verify [seed, drafts] keeping a varying prefix plus a
    made-up bonus, extend the kept rows. Returns every proposal and tree candidates' chains."""
    st, _ = start_tapped(d, runner, prompt)
    out = []
    for j, k in enumerate(ks):
        got = d.propose(st, k)
        assert d.propose(st, k) == got
        out.append(got)
        if j % 3 == 2:                      # tree candidates after a held (or run) boundary
            chain, _, _ = d.candidates(st, k, 2)
            out.append(chain)
        H = len(st.history)
        rows = [st.history[-1], *got]
        vin = StepInput(rows, range(H - 1, H - 1 + len(rows)), [0] * len(rows),
                        range(len(rows)), [ROW_GREEDY] * len(rows), hidden=True)
        runner.step(vin)
        keep = j % min(4, len(rows))          # drafts kept: 0..3
        st.history += [*got[:keep], (rows[keep] * 7 + 3) % 1024]
        d.extend(st, range(keep + 1), range(H - 1, H + keep), runner.hidden_states(vin))
    return out


def drive_batch(d: Eagle3Drafter, runner, prompts: list[list[int]], ks: list[int]
                ) -> list[list[int]]:
    """Like drive, with one sequence per prompt in slots 0, 1, ..: each prefilled and extended
    in turn, then per k every sequence proposes (so each slot holds its boundary while the
    others extend and draft) and ONE verify step checks all their drafts."""
    sts = [start_tapped(d, runner, prompt, s)[0] for s, prompt in enumerate(prompts)]
    out = []
    for j, k in enumerate(ks):
        drafts = [d.propose(st, k + s) for s, st in enumerate(sts)]
        out += drafts
        ids, pos, slots, first = [], [], [], []
        for st, got in zip(sts, drafts, strict=True):
            H, rows = len(st.history), [st.history[-1], *got]
            first.append(len(ids))
            ids += rows
            pos += range(H - 1, H - 1 + len(rows))
            slots += [st.slot] * len(rows)
        vin = StepInput(ids, pos, slots, range(len(ids)), [ROW_GREEDY] * len(ids), hidden=True)
        runner.step(vin)
        for s, (st, got) in enumerate(zip(sts, drafts, strict=True)):
            H, keep = len(st.history), (j + s) % (len(got) + 1)
            st.history += [*got[:keep], (st.history[-1] * 5 + j) % 1024]
            d.extend(st, range(first[s], first[s] + keep + 1), range(H - 1, H + keep),
                     runner.hidden_states(vin))
    return out


@pytest.mark.parametrize("which", ["random", "shared"])
def test_the_captured_chain_of_each_slot_in_a_batch_proposes_the_eager_drafts(heads, which):
    prompts = [[(41 * i + 3 + 7 * s) % 1024 for i in range(9 + 2 * s)] for s in range(3)]
    ks = [1, 3, 0, 2, 4, 0, 0, 5, 2, 3]     # 0: slot 0 does not draft (its boundary written)
    with backend_options("cpu", capture_rules=True), eagle3_engine(
            heads[which], start=False, n_slots=3) as eng:
        eager, runner = eng.drafter, eng.runner
        want = drive_batch(eager, runner, prompts, ks)
        chained = Eagle3Drafter(eager.model, eager.model_name, graph_chain=True)
        got = drive_batch(chained, runner, prompts, ks)
    runs = sum(1 for k in ks for s in range(3) if k + s > 0)
    assert got == want and chained.chain.steps >= runs - 3


@pytest.mark.parametrize("which", ["random", "reduced", "shared"])
def test_the_captured_chain_proposes_the_eager_chains_drafts(heads, which):
    prompt = [(41 * i + 3) % 1024 for i in range(11)]
    ks = [1, 2, 0, 4, 0, 0, 6, 3, 5, 8, 2, 7]   # 0: a step without drafts (a plain step)
    with backend_options("cpu", capture_rules=True), eagle3_engine(heads[which],
                                                                  start=False) as eng:
        eager, runner = eng.drafter, eng.runner
        assert eager.chain is None
        want = drive(eager, runner, prompt, ks)
        chained = Eagle3Drafter(eager.model, eager.model_name, graph_chain=True)
        got = drive(chained, runner, prompt, ks)
        state = eng.model.backend.capture_state
    assert got == want
    assert chained.chain.steps >= sum(1 for k in ks if k) - 1 and state.steps > 0
    assert {k[2] for k in state.sequences if len(k) > 2} >= {"eagle3-chain"}
    if which != "random":
        assert set(np.concatenate([np.asarray(w) for w in want if w])) <= set(
            eager.model.d2t.tolist())


@pytest.mark.parametrize("which", ["random", "shared"])
def test_greedy_speculation_with_the_captured_chain_equals_plain(heads, which, monkeypatch):
    with eagle3_engine(heads[which]) as eng:
        plain = [run(eng, p, max_new_tokens=N_NEW, ignore_eos=True,
                     speculative=False).token_ids for p in PROMPTS[:2]]
    monkeypatch.setattr(CpuBackend, "graphs", True, raising=False)   # as a capturing backend
    with backend_options("cpu", capture_rules=True), eagle3_engine(heads[which]) as eng:
        assert eng.drafter.chain is not None
        got = [run(eng, p, max_new_tokens=N_NEW, ignore_eos=True, speculative=True)
               for p in PROMPTS[:2]]
        assert eng.drafter.chain.steps > 0
    assert [r.token_ids for r in got] == plain
    assert sum(r.finished.usage.draft_tokens for r in got) > 0
