"""The `dflash` drafter through the engine on the CPU (service/engine/spec/dflash_drafter.py):
tiny-qwen3 as the target, random-weight DFlash drafters written for it (`synth --dflash`).

- Its drafts equal the numpy reference's (service/model/dflash_forward.py) fed the same tapped
  target rows, where the reference's top-two gap is clear, after a prompt and again after a
  partial acceptance (the verify step's accepted rows injected, the block's rows overwritten).
- Tree candidates: the chain is the block rows' argmax, candidates best first.
- Speculative output equals plain output: greedy at widths 2, 6 and 16 (full and reduced
  draft vocabulary), seeded sampling, a request alone equals it in a batch of four
  speculating requests, and prompts in chunks with a cached prefix. A random drafter is almost
  never right, so these test the machinery, not the acceptance.

llama.cpp's agreement with the reference: tests/golden/test_dflash_oracle.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from service.config import EngineConfig
from service.engine.runner import GREEDY as ROW_GREEDY
from service.engine.runner import StepInput
from service.engine.spec.dflash_drafter import DflashDrafter
from service.engine.types import SamplingParams
from service.gguf.reader import GGUFFile
from service.model.dflash_forward import DflashDraft
from service.tools.synth_dflash import DflashOptions, synthesize_dflash
from tests.engine.test_moe_speculation import PROMPTS, batch_equals_alone
from tests.support.engines import run, running_engine
from tests.support.models import model_path
from tests.support.speculation import (
    DraftSeq,
    greedy_equals_plain_at_widths,
    plain_greedy_ids,
    prefill_and_extend,
    sampled_equals_plain,
)

TARGET, N_NEW = "tiny-qwen3", 24
WIDTHS = (2, 6, 16)
SAMPLED = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.02, seed=11)
NEAR_TIE = 0.05               # reference logit gap below which backend and reference may differ


COMMON = dict(n_ff=256, quant="F32", weight_std=0.1)
# random drafters for tiny-qwen3: two layers, full vocabulary, block 16; one layer with a
# 300-id draft vocabulary, its own embeddings, causal block attention, block 8
OPTIONS = {"random": DflashOptions(seed=6, layers=(1, 2), n_layer=2, **COMMON),
           "reduced": DflashOptions(seed=7, layers=(0, 2), draft_vocab=300, own_embedding=True,
                                    causal=True, block_size=8, **COMMON)}


def synth_drafters(out: Path, options: dict[str, DflashOptions]) -> dict[str, Path]:
    """Each of `options` synthesized for TARGET into folder out: name -> file."""
    t = model_path(TARGET)
    return {name: synthesize_dflash(out / f"{name}.gguf", t, o).path
            for name, o in options.items()}


@pytest.fixture(scope="module")
def drafters(tmp_path_factory) -> dict[str, Path]:
    return synth_drafters(tmp_path_factory.mktemp("dfd"), OPTIONS)


def dflash_engine(path: Path, **overrides):
    """tiny-qwen3 drafted for by `path`, verify width 16, drafting in full."""
    return running_engine(TARGET, **{"drafter": "dflash", "draft_model": str(path),
                                     "verify_width": 16, **overrides}, draft_in_full=True)


@pytest.fixture(scope="module")
def plain_ids() -> list[list[int]]:
    with running_engine(TARGET) as eng:
        return plain_greedy_ids(eng, PROMPTS, N_NEW)


# ---------------------------------------------------------------- against the reference
def reference_drafts(d: DflashDrafter, path: Path, feats: np.ndarray, history: list[int],
                     k: int) -> tuple[list[int], list[float]]:
    """The reference's k drafts after `history` from the target's rows feats (H - 1, P E) of
    positions 0..H-2, and the top-1/top-2 logit gap of each draft's row."""
    ref = DflashDraft(d.spec, GGUFFile(path), GGUFFile(model_path(TARGET)), 64)
    ref.inject(ref.encode(feats), 0)
    H = len(history)
    rows = ref.block([history[-1]] + [d.spec.mask_token] * k, H - 1)[1:]   # (k, V)
    top = np.sort(rows, axis=1)[:, -2:]
    return [int(i) for i in rows.argmax(axis=1)], (top[:, 1] - top[:, 0]).tolist()


def agree_where_clear(got: list[int], want: list[int], gaps: list[float]) -> int:
    """Drafts equal wherever the reference's gap is clear (each draft is its own row of one
    forward: a near-tie at one does not part the others); the number compared."""
    assert len(got) == len(want)
    n = 0
    for a, b, gap in zip(got, want, gaps, strict=True):
        if gap >= NEAR_TIE:
            assert a == b, (got, want, gaps)
            n += 1
    return n


@pytest.mark.parametrize("which", ["random", "reduced"])
def test_drafts_equal_the_reference_after_a_prompt_and_a_partial_acceptance(drafters, which):
    """A 9-token prompt prefilled (tapped), then a verify step of [seed, d1..d5] of which the
    target keeps the seed and d1..d2 plus a bonus token: both times the drafter's drafts equal
    the reference's, fed the same target rows, wherever the reference's gap is clear."""
    prompt = [(37 * i + 11) % 1024 for i in range(9)]
    k = 6
    with dflash_engine(drafters[which], start=False) as eng:
        d, runner = eng.drafter, eng.runner
        assert isinstance(d, DflashDrafter) and runner.hidden_tap == d.tap
        k = min(k, d.max_drafts)
        P = len(prompt)
        st, seed, feats = prefill_and_extend(d, runner, prompt)
        got = d.propose(st, k)
        want, gaps = reference_drafts(d, drafters[which], feats, st.history, k)
        compared = agree_where_clear(got, want, gaps)
        rows = [seed, *got[:5]]
        vin = StepInput(rows, range(P, P + 6), [0] * 6, range(6), [ROW_GREEDY] * 6, hidden=True)
        runner.step(vin)
        vfeats = np.array(runner.hidden_states(vin))                     # (6, P E)
        st.history += [*got[:2], (got[2] + 1) % 1024]
        d.extend(st, range(3), range(P, P + 3), runner.hidden_states(vin))
        again = d.propose(st, k)
        want2, gaps2 = reference_drafts(d, drafters[which], np.concatenate([feats, vfeats[:3]]),
                                        st.history, k)
        compared += agree_where_clear(again, want2, gaps2)
        if d.spec.has_d2t:
            assert set(got + again) <= set(d.model.d2t.tolist())
    print(f"\n{which}: {compared}/{2 * k} drafts compared")
    assert compared >= k


def test_tree_candidates_are_the_blocks_rows(drafters):
    prompt = [(53 * i + 5) % 1024 for i in range(10)]
    with dflash_engine(drafters["random"], start=False) as eng:
        d = eng.drafter
        st, _, _ = prefill_and_extend(d, eng.runner, prompt)
        chain, ids, logp = d.candidates(st, 5, 3)
        assert ids.shape == logp.shape == (5, 3)
        assert chain == ids[:, 0].tolist() == d.propose(st, 5)
        assert (np.diff(logp, axis=1) <= 0).all() and (logp < 0).all()


def test_a_stale_slot_proposes_nothing(drafters):
    """Before its context is extended to the seed's predecessor, a slot drafts nothing."""
    with dflash_engine(drafters["random"], start=False) as eng:
        st = DraftSeq(0, [5, 6, 7])
        eng.drafter.start(st)
        assert eng.drafter.propose(st, 4) == []
        assert eng.drafter.candidates(st, 4, 2)[0] == []
        eng.drafter.release(st)
        assert eng.drafter.slots_in_use == frozenset()


def test_the_config_needs_a_draft_model():
    problems = dict(EngineConfig(drafter="dflash").problems())
    assert "the dflash drafter needs a draft model" in problems["draft_model"]


# ---------------------------------------------------------------- identity through the engine
@pytest.mark.parametrize("which", ["random", "reduced"])
def test_greedy_speculation_equals_plain_greedy(drafters, plain_ids, which):
    with dflash_engine(drafters[which]) as eng:
        assert isinstance(eng.drafter, DflashDrafter)
        assert eng.info.drafter == "dflash" and "DFlash" in eng.info.draft_model
        for _ in greedy_equals_plain_at_widths(eng, PROMPTS, plain_ids, widths=WIDTHS,
                                               max_new_tokens=N_NEW, label=which):
            pass


def test_sampled_speculation_equals_plain_sampling(drafters):
    with dflash_engine(drafters["random"], verify_width=6) as eng:
        drafted, _ = sampled_equals_plain(eng, PROMPTS, SAMPLED)
    assert drafted > 0


def test_a_request_alone_equals_it_in_a_speculating_batch(drafters):
    with dflash_engine(drafters["random"], n_slots=4, verify_width=6) as eng:
        batch_equals_alone(eng, "dflash")


def test_trees_and_chunked_prompts_with_a_cached_prefix(drafters):
    """Tree verify over the block's top candidates, and prompts longer than a prefill chunk,
    the second sharing the first's prefix (its cached blocks are not recomputed, so the drafter
    never sees those rows): output equals plain."""
    prompt = [(13 * i + 3) % 1000 + 1 for i in range(70)]
    other = prompt[:48] + [7, 8, 9]
    with dflash_engine(drafters["random"], prefill_chunk=16, verify_width=6,
                       tree_budget=8) as eng:
        for p in (prompt, other, prompt):
            spec = run(eng, p, max_new_tokens=12, ignore_eos=True)
            plain = run(eng, p, max_new_tokens=12, ignore_eos=True, speculative=False)
            assert spec.token_ids == plain.token_ids
            assert spec.finished.usage.draft_tokens > 0
