"""The `dflash` drafter with DSpark files (llama.cpp's draft-dspark) through the engine on the
CPU: tiny-qwen3 as the target, random-weight DSpark drafters written for it (`synth --dflash
--markov-rank`): one anchor-first with the confidence head (block 16), one with DFlash's
bonus-anchor layout, a 300-id draft vocabulary and a markov_w2.scale (block 8, causal).

- Its drafts (the Markov chain along the block) equal the numpy reference's fed the same tapped
  target rows, where the reference's rows are clear, after a prompt and after a partial
  acceptance; anchor-first, a block of k tokens gives k drafts, up to the full block.
- The confidence cut (draft_p_min): the drafts stop at the reference's first confidence below
  it; tree candidates are cut the same way and their chain is the block's chain.
- Speculative output equals plain output: greedy at widths 2, 6 and 16 (with and without the
  cut), seeded sampling, a request alone equals it in a batch of four, and trees. A random
  drafter is almost never right: these test the machinery, not the acceptance.

llama.cpp's agreement with the reference and the backend: tests/golden/test_dflash_oracle.py.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from service.engine.runner import GREEDY as ROW_GREEDY
from service.engine.runner import StepInput
from service.engine.spec.dflash_drafter import DflashDrafter
from service.gguf.reader import GGUFFile
from service.model.dflash_forward import DflashDraft
from tests.engine.test_dflash_drafter import (
    N_NEW,
    NEAR_TIE,
    SAMPLED,
    TARGET,
    WIDTHS,
    dflash_engine,
    synth_drafters,
)
from tests.engine.test_dflash_drafter import OPTIONS as DFLASH_OPTIONS
from tests.engine.test_moe_speculation import PROMPTS, batch_equals_alone
from tests.support.engines import run, running_engine
from tests.support.models import model_path
from tests.support.speculation import (
    greedy_equals_plain_at_widths,
    plain_greedy_ids,
    prefill_and_extend,
    sampled_equals_plain,
)

P_MIN = 0.22              # cuts the cut test's block at its fourth draft
ENGINE_P_MIN = 0.6        # cuts many of the engine runs' blocks (their confidences are higher)


OPTIONS = {"anchor-conf": replace(DFLASH_OPTIONS["random"], markov_rank=32, markov_std=0.8,
                                   confidence_head=True),
           "bonus-reduced": replace(DFLASH_OPTIONS["reduced"], markov_rank=16, markov_std=0.5,
                                    markov_scale=0.5, bonus_anchor=True)}


@pytest.fixture(scope="module")
def drafters(tmp_path_factory) -> dict[str, Path]:
    return synth_drafters(tmp_path_factory.mktemp("dsd"), OPTIONS)


@pytest.fixture(scope="module")
def plain_ids() -> list[list[int]]:
    with running_engine(TARGET) as eng:
        return plain_greedy_ids(eng, PROMPTS, N_NEW)


def reference_chain(d: DflashDrafter, path: Path, feats: np.ndarray, history: list[int],
                    k: int) -> tuple[list[int], list[float], np.ndarray | None]:
    """The reference's k drafts after `history` (the Markov chain), each draft row's top-two
    logit gap, and the rows' confidences (None without the head)."""
    s = d.spec
    ref = DflashDraft(s, GGUFFile(path), GGUFFile(model_path(TARGET)), 64)
    ref.inject(ref.encode(feats), 0)
    n = s.first_draft_row
    ids = [history[-1]] + [s.mask_token] * (k + n - 1)
    logits, drafts, conf = ref.markov(ref.block(ids, len(history) - 1), history[-1])
    top = np.sort(logits[n:], axis=1)[:, -2:]
    return drafts, (top[:, 1] - top[:, 0]).tolist(), conf


def chain_agrees(got: list[int], want: list[int], gaps: list[float]) -> int:
    """The chains equal up to a near-tie of the reference's, where they may part (the rows
    after it condition on other tokens); the number of rows compared."""
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if a != b:
            assert gaps[i] < NEAR_TIE, (got, want, gaps)
            return i
    return len(got)


@pytest.mark.parametrize("which", ["anchor-conf", "bonus-reduced"])
def test_the_chain_equals_the_reference_after_a_prompt_and_a_partial_acceptance(drafters,
                                                                                which):
    prompt = [(37 * i + 11) % 1024 for i in range(9)]
    with dflash_engine(drafters[which], start=False) as eng:
        d, runner = eng.drafter, eng.runner
        assert isinstance(d, DflashDrafter) and d.spec.dspark
        k = d.max_drafts                        # the full block: 16 anchor-first, 7 otherwise
        assert k == d.spec.block_size - d.spec.first_draft_row
        P = len(prompt)
        st, seed, feats = prefill_and_extend(d, runner, prompt)
        got = d.propose(st, k)
        want, gaps, _ = reference_chain(d, drafters[which], feats, st.history, k)
        compared = chain_agrees(got, want, gaps)
        rows = [seed, *got[:5]]
        vin = StepInput(rows, range(P, P + 6), [0] * 6, range(6), [ROW_GREEDY] * 6, hidden=True)
        runner.step(vin)
        vfeats = np.array(runner.hidden_states(vin))                     # (6, P E)
        st.history += [*got[:2], (got[2] + 1) % 1024]
        d.extend(st, range(3), range(P, P + 3), runner.hidden_states(vin))
        again = d.propose(st, k)
        want2, gaps2, _ = reference_chain(d, drafters[which],
                                          np.concatenate([feats, vfeats[:3]]), st.history, k)
        compared += chain_agrees(again, want2, gaps2)
        if d.spec.has_d2t:
            assert set(got + again) <= set(d.model.d2t.tolist())
    print(f"\n{which}: {compared}/{2 * k} drafts compared")
    assert len(got) == len(again) == k and compared >= k


def test_the_confidence_cut_stops_at_the_first_low_draft(drafters):
    """draft_p_min: propose and the tree's candidates stop where the reference's confidence
    first drops below it (the reference's confidences are not all above it, nor all below)."""
    prompt = [(53 * i + 5) % 1024 for i in range(10)]
    path = drafters["anchor-conf"]
    with dflash_engine(path, start=False, draft_p_min=P_MIN) as eng:
        d = eng.drafter
        assert d.p_min == P_MIN
        st, _, feats = prefill_and_extend(d, eng.runner, prompt)
        k = d.max_drafts
        want, gaps, conf = reference_chain(d, path, feats, st.history, k)
        low = np.flatnonzero(conf < P_MIN)
        assert 0 < low.size < k, conf
        cut = int(low[0])
        assert np.abs(conf[cut] - P_MIN) > 0.01, conf     # not a tie with the threshold
        got = d.propose(st, k)
        assert got == want[:cut], (got, want, conf)
        chain, ids, logp = d.candidates(st, k, 3)
        assert chain == got and ids.shape == logp.shape == (cut, 3)


@pytest.mark.parametrize("which", ["anchor-conf", "bonus-reduced"])
def test_greedy_speculation_equals_plain_greedy(drafters, plain_ids, which):
    with dflash_engine(drafters[which]) as eng:
        assert eng.info.drafter == "dflash" and "DSpark" in eng.info.draft_model
        for _ in greedy_equals_plain_at_widths(eng, PROMPTS, plain_ids, widths=WIDTHS,
                                               max_new_tokens=N_NEW, label=which):
            pass


def test_greedy_speculation_with_the_confidence_cut_equals_plain_greedy(drafters, plain_ids):
    """At width 16, with fewer drafts than without the cut."""
    drafted = []
    for p_min in (0.0, ENGINE_P_MIN):
        with dflash_engine(drafters["anchor-conf"], draft_p_min=p_min) as eng:
            drafted += [a.drafted for a in greedy_equals_plain_at_widths(
                eng, PROMPTS, plain_ids, widths=(16,), max_new_tokens=N_NEW,
                label=f"p_min {p_min}")]
    assert drafted[1] < drafted[0]


def test_sampled_speculation_equals_plain_sampling(drafters):
    with dflash_engine(drafters["bonus-reduced"], verify_width=6) as eng:
        drafted, _ = sampled_equals_plain(eng, PROMPTS, SAMPLED)
    assert drafted > 0


def test_a_request_alone_equals_it_in_a_speculating_batch(drafters):
    with dflash_engine(drafters["anchor-conf"], n_slots=4, verify_width=6) as eng:
        batch_equals_alone(eng, "dflash")


@pytest.mark.parametrize("which", ["anchor-conf", "bonus-reduced"])
def test_trees_equal_plain_greedy(drafters, plain_ids, which):
    with dflash_engine(drafters[which], tree_budget=8, verify_width=6) as eng:
        for prompt, plain in zip(PROMPTS, plain_ids, strict=True):
            out = run(eng, prompt, max_new_tokens=N_NEW, ignore_eos=True)
            assert out.token_ids == plain, (which, prompt)
            assert out.finished.usage.draft_tokens > 0
