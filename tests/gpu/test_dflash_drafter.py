"""The dflash drafter on the CUDA backend (tests/engine/test_dflash_drafter.py's identities):
tiny-qwen3 as the target with captured steps, random synthetic DFlash drafters (`synth
--dflash`: two layers, F16, block 16; one layer, Q8_0, a 300-id draft vocabulary with its own
embeddings and causal block attention, block 8; a DSpark one, Q8_0, anchor-first with the
confidence head and the draft_p_min cut at 0.5, block 16), drafting in full.

Greedy output with speculation equals plain greedy output at widths 2, 6 and 16, seeded sampled
speculation equals plain sampling (tokens and log-probabilities), a request alone equals it in a
batch of four speculating requests, and trees of 4, 8 and 16 nodes equal plain greedy output.
A random drafter is almost never right: acceptance is printed, not asserted; drafting is. These
are identities, so they have no tolerance; they have not run on a GPU yet (the next H200 run
is their first)."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.tools.synth_dflash import DflashOptions, synthesize_dflash
from tests.engine.test_dflash_drafter import N_NEW, SAMPLED, TARGET, WIDTHS
from tests.engine.test_moe_speculation import PROMPTS, batch_equals_alone
from tests.support.engines import running_engine
from tests.support.models import model_path
from tests.support.speculation import (
    greedy_equals_plain_at_widths,
    plain_greedy_ids,
    sampled_equals_plain,
    trees_equal_plain_at_budgets,
)

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

DRAFTERS = {"f16": DflashOptions(seed=6, layers=(1, 2), n_layer=2, n_ff=256, quant="F16",
                                 weight_std=0.1),
            "q8_0-reduced-causal": DflashOptions(seed=7, layers=(0, 2), n_ff=256, quant="Q8_0",
                                                 draft_vocab=300, own_embedding=True,
                                                 causal=True, block_size=8, weight_std=0.1),
            "dspark-q8_0-cut": DflashOptions(seed=8, layers=(1, 2), n_ff=256, quant="Q8_0",
                                             markov_rank=32, markov_std=0.8,
                                             confidence_head=True, weight_std=0.1)}
P_MIN = {"dspark-q8_0-cut": 0.5}


def cuda_engine(drafter: Path | None = None, **options):
    """tiny-qwen3 on CUDA with captured steps, verify width 16, drafting in full; with
    `drafter` the dflash drafter."""
    extra = ({"drafter": "dflash", "draft_model": str(drafter),
              "draft_p_min": P_MIN.get(drafter.stem, 0.0)} if drafter else {})
    return running_engine(TARGET, **{"backend": "cuda", "n_ctx": 256, "n_slots": 1,
                                     "verify_width": 16, "cuda_graphs": True, **extra,
                                     **options}, draft_in_full=True)


@pytest.fixture(scope="module")
def plain_ids() -> list[list[int]]:
    with cuda_engine() as eng:
        return plain_greedy_ids(eng, PROMPTS, N_NEW)


@pytest.fixture(scope="module")
def drafters(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("dfgpu")
    return {k: synthesize_dflash(d / f"{k}.gguf", model_path(TARGET), o).path
            for k, o in DRAFTERS.items()}


@pytest.mark.parametrize("which", list(DRAFTERS))
def test_greedy_speculation_equals_plain_greedy_on_cuda(drafters, plain_ids, which):
    with cuda_engine(drafters[which]) as eng:
        assert eng.info.drafter == "dflash"
        for _ in greedy_equals_plain_at_widths(eng, PROMPTS, plain_ids, widths=WIDTHS,
                                               max_new_tokens=N_NEW, label=which):
            pass


@pytest.mark.parametrize("which", list(DRAFTERS))
def test_sampled_speculation_equals_plain_sampling_on_cuda(drafters, which):
    with cuda_engine(drafters[which], verify_width=6) as eng:
        drafted, _ = sampled_equals_plain(eng, PROMPTS, SAMPLED)
    assert drafted > 0


@pytest.mark.parametrize("which", list(DRAFTERS))
def test_a_request_alone_equals_it_in_a_speculating_batch_on_cuda(drafters, which):
    with cuda_engine(drafters[which], n_slots=4, verify_width=6) as eng:
        got = batch_equals_alone(eng, "dflash")
    print(f"\n{which}: {sum(g.finished.usage.accepted_draft_tokens for g in got)} drafts "
          "accepted in the batch")


@pytest.mark.parametrize("which", list(DRAFTERS))
def test_trees_equal_plain_greedy_on_cuda(drafters, plain_ids, which):
    """Tree verify over the block's top candidates per depth, budgets 4, 8 and 16, captured
    steps."""
    with cuda_engine(drafters[which], tree_budget=4) as eng:
        trees_equal_plain_at_budgets(eng, PROMPTS, plain_ids, budgets=(4, 8, 16),
                                     max_new_tokens=N_NEW, label=which)
