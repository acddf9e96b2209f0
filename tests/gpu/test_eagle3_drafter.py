"""The eagle3 drafter on the CUDA backend (tests/engine/test_eagle3_drafter.py's identities):
tiny-qwen3 as the target with captured steps, a random F16 head (`synth --eagle3`) and the
bigram head fitted to the CUDA target's own plain greedy output (F16), drafting in full.

Greedy output with speculation equals plain greedy output at widths 2, 6 and 16, seeded sampled
speculation equals plain sampling, and a request alone equals it in a batch of four speculating
requests; trees of 4, 8 and 16 nodes equal plain greedy output. Acceptance is printed; the
bigram head's must be above zero. The heads are F16: a Q8_0 head's fc input outgrows the
target's prepared activation blocks on CUDA (tests/gpu/test_eagle3_model.py's expected
failure)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.test_eagle3_drafter import (
    N_NEW,
    SAMPLED,
    TARGET,
    WIDTHS,
    bigram_head,
    successors,
)
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


def cuda_engine(head: Path | None = None, **options):
    """tiny-qwen3 on CUDA with captured steps, verify width 16, drafting in full; with `head`
    the eagle3 drafter."""
    extra = {"drafter": "eagle3", "draft_model": str(head)} if head else {}
    return running_engine(TARGET, **{"backend": "cuda", "n_ctx": 256, "n_slots": 1,
                                     "verify_width": 16, "cuda_graphs": True, **extra,
                                     **options}, draft_in_full=True)


@pytest.fixture(scope="module")
def plain_ids() -> list[list[int]]:
    with cuda_engine() as eng:
        return plain_greedy_ids(eng, PROMPTS, N_NEW)


@pytest.fixture(scope="module")
def heads(tmp_path_factory, plain_ids) -> dict[str, Path]:
    from service.tools.synth_eagle3 import synthesize_eagle3

    d = tmp_path_factory.mktemp("e3gpu")
    return {"random": synthesize_eagle3(d / "random.gguf", model_path(TARGET), seed=6,
                                        layers=(1, 2, 3), quant="F16", weight_std=0.1).path,
            "agreeing": bigram_head(d / "bigram.gguf", successors(PROMPTS, plain_ids),
                                    quant="F16")}


@pytest.mark.parametrize("which", ["random", "agreeing"])
def test_greedy_speculation_equals_plain_greedy_on_cuda(heads, plain_ids, which):
    with cuda_engine(heads[which]) as eng:
        for got in greedy_equals_plain_at_widths(eng, PROMPTS, plain_ids, widths=WIDTHS,
                                                 max_new_tokens=N_NEW, label=which):
            if which == "agreeing":
                assert got.accepted > 0


@pytest.mark.parametrize("which", ["random", "agreeing"])
def test_sampled_speculation_equals_plain_sampling_on_cuda(heads, which):
    with cuda_engine(heads[which], verify_width=6) as eng:
        for params in SAMPLED:
            sampled_equals_plain(eng, PROMPTS, params)


@pytest.mark.parametrize("which", ["random", "agreeing"])
def test_a_request_alone_equals_it_in_a_speculating_batch_on_cuda(heads, which):
    with cuda_engine(heads[which], n_slots=4, verify_width=6) as eng:
        got = batch_equals_alone(eng, "eagle3")
    print(f"\n{which}: {sum(g.finished.usage.accepted_draft_tokens for g in got)} drafts "
          "accepted in the batch")


@pytest.mark.parametrize("which", ["random", "agreeing"])
def test_trees_equal_plain_greedy_on_cuda(heads, plain_ids, which):
    """Tree verify over the head's top-4 per depth, budgets 4, 8 and 16, captured steps."""
    with cuda_engine(heads[which], tree_budget=4) as eng:
        trees_equal_plain_at_budgets(eng, PROMPTS, plain_ids, budgets=(4, 8, 16),
                                     max_new_tokens=N_NEW, label=which)
