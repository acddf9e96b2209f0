"""The dflash drafter's block as one backend step (graph_block; one captured CUDA graph per
(rows, k) on CUDA) on the CPU backend with the capture rules on: tiny-qwen3 as the target,
random DFlash drafters (full vocabulary; d2t, own embeddings, causal) and DSpark ones (Markov
head with the confidence head and the draft_p_min cut; bonus anchor with d2t).

- The block run as one step proposes exactly the eager block's drafts (the same ops in the same
  order) after a prompt and after verify steps accepting some drafts, for every k, and tree
  candidates in between still match; nothing in the step breaks a capture rule.
- Through the engine, greedy speculation with it equals plain greedy output.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from service.backends import backend_options
from service.backends.cpu.backend import CpuBackend
from service.engine.runner import GREEDY as ROW_GREEDY
from service.engine.runner import StepInput
from service.engine.spec.dflash_drafter import DflashDrafter
from tests.engine.test_dflash_drafter import (
    N_NEW,
    OPTIONS,
    PROMPTS,
    dflash_engine,
    synth_drafters,
)
from tests.engine.test_dspark_drafter import OPTIONS as DSPARK
from tests.support.engines import run
from tests.support.speculation import start_tapped


@pytest.fixture(scope="module")
def drafters(tmp_path_factory) -> dict[str, Path]:
    """test_dflash_drafter.py's and test_dspark_drafter.py's drafters."""
    return synth_drafters(tmp_path_factory.mktemp("dfg"), {
        **OPTIONS, "dspark-conf": DSPARK["anchor-conf"], "dspark-bonus": DSPARK["bonus-reduced"]})


def drive(d: DflashDrafter, runner, prompt: list[int], ks: list[int]) -> list[list[int]]:
    """Prefill `prompt` in slot 0 (tapped), extend, then for each k: propose (and every third
    time tree candidates), verify [seed, drafts] keeping a varying prefix plus a made-up bonus,
    extend the kept rows. Returns every proposal and candidates' chain."""
    st, _ = start_tapped(d, runner, prompt)
    out = []
    for j, k in enumerate(ks):
        got = d.propose(st, k)
        out.append(got)
        if j % 3 == 2:
            out.append(d.candidates(st, k, 2)[0])
        H = len(st.history)
        rows = [st.history[-1], *got]
        vin = StepInput(rows, range(H - 1, H - 1 + len(rows)), [0] * len(rows),
                        range(len(rows)), [ROW_GREEDY] * len(rows), hidden=True)
        runner.step(vin)
        keep = j % len(rows)
        st.history += [*got[:keep], (rows[keep] * 7 + 3) % 1024]
        d.extend(st, range(keep + 1), range(H - 1, H + keep), runner.hidden_states(vin))
    return out


@pytest.mark.parametrize("which", ["random", "reduced", "dspark-conf", "dspark-bonus"])
def test_the_block_as_one_step_proposes_the_eager_blocks_drafts(drafters, which):
    prompt = [(41 * i + 3) % 1024 for i in range(11)]
    ks = [1, 2, 4, 6, 3, 5, 7, 2, 4]
    p_min = 0.3 if which == "dspark-conf" else 0.0
    with backend_options("cpu", capture_rules=True), dflash_engine(drafters[which],
                                                                  start=False) as eng:
        eager, runner = eng.drafter, eng.runner
        assert not eager.graph_block
        eager = DflashDrafter(eager.model, eager.model_name, p_min=p_min)
        want = drive(eager, runner, prompt, ks)
        one = DflashDrafter(eager.model, eager.model_name, p_min=p_min, graph_block=True)
        got = drive(one, runner, prompt, ks)
        state = eng.model.backend.capture_state
    assert got == want and any(want)
    assert {k[2] for k in state.sequences if len(k) > 2} >= {"dflash-block"}


@pytest.mark.parametrize("which", ["random", "dspark-bonus"])
def test_greedy_speculation_with_the_block_as_one_step_equals_plain(drafters, which,
                                                                   monkeypatch):
    with dflash_engine(drafters[which]) as eng:
        plain = [run(eng, p, max_new_tokens=N_NEW, ignore_eos=True,
                     speculative=False).token_ids for p in PROMPTS[:2]]
    monkeypatch.setattr(CpuBackend, "graphs", True, raising=False)   # as a capturing backend
    with backend_options("cpu", capture_rules=True), dflash_engine(drafters[which]) as eng:
        assert eng.drafter.graph_block
        got = [run(eng, p, max_new_tokens=N_NEW, ignore_eos=True, speculative=True)
               for p in PROMPTS[:2]]
    assert [r.token_ids for r in got] == plain
    assert sum(r.finished.usage.draft_tokens for r in got) > 0
