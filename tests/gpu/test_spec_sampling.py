"""Sampled requests speculate exactly on the CUDA backend: with the n-gram drafter and with a
full q8_0 self-drafter, on both real models where a drafter of their own vocabulary exists,
every seeded request (temperatures, top-k/top-p/min-p, the repetition penalty, greedy with a
penalty) gives the tokens plain seeded sampling gives, and drafts are accepted. The penalty
case checks that a verify row's penalty window sees the drafts before it (record_tokens runs
before the sample op inside the captured step)."""

from __future__ import annotations

import pytest

from tests.engine.test_spec_sampling import SAMPLED, compare
from tests.gpu.test_models import cuda_engine, real_path
from tests.support.models import load_json

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


def prompts(name: str) -> list[list[int]]:
    return [c["prompt_ids"] for c in load_json(f"llamacpp_{name}_greedy.json")["cases"]]


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_sampled_speculation_equals_plain_sampling_ngram_cuda(name):
    with cuda_engine(name, verify_width=16, n_slots=1, draft_in_full=True) as eng:
        drafted, accepted = compare(eng, prompts(name), SAMPLED)
        print(f"\n{name} ngram, sampled: {accepted}/{drafted} drafts accepted")
        assert accepted > 10


def test_sampled_speculation_equals_plain_sampling_model_drafter_cuda(requantized):
    draft = requantized(real_path("smollm2"), "q8_0")
    with cuda_engine("smollm2", drafter="model", draft_model=str(draft), verify_width=6,
                     n_slots=1, draft_in_full=True) as eng:
        drafted, accepted = compare(eng, prompts("smollm2"), SAMPLED)
        print(f"\nfull q8_0 drafter, sampled: {accepted}/{drafted} drafts accepted")
        assert accepted > 0.3 * drafted
