"""The sampling controls through the CUDA engine (SmolLM2): penalties, logit_bias and min_tokens
give the same tokens with speculation on and off and alone or batched (the CPU tests' requests,
tests/engine/test_sampling_controls.py), and prompt log-probabilities equal the CPU backend's
within the two backends' logit bounds."""

from __future__ import annotations

import numpy as np
import pytest

from tests.engine.test_sampling_controls import controlled_requests
from tests.gpu.test_models import REAL_BOUNDS, cuda_engine
from tests.support.batching import alone, same_output, smollm2_prompts, together
from tests.support.engines import run, running_engine

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def smol_cuda():
    # n-gram length 1: a draft whenever the last token came before, so the penalized (less
    # repetitive) outputs are still verified in drafts
    with cuda_engine("smollm2", n_ctx=512, n_slots=8, draft_in_full=True, ngram_size=1) as eng:
        yield eng


def test_controls_are_exact_under_speculation_and_batching_on_cuda(smol_cuda):
    off = [alone(smol_cuda, r) for r in controlled_requests(False)]
    on = [alone(smol_cuda, r) for r in controlled_requests(None)]
    for a, b in zip(on, off, strict=True):
        assert same_output(a, b), (a.token_ids, b.token_ids)
    assert sum(r.finished.usage.draft_tokens for r in on) > 0
    batched, _ = together(smol_cuda, controlled_requests(None))
    for a, b in zip(batched, off, strict=True):
        assert same_output(a, b), (a.token_ids, b.token_ids)


def test_a_banned_token_never_comes_on_cuda(smol_cuda):
    from service.engine.types import SamplingParams

    prompt = smollm2_prompts()[1]
    plain = run(smol_cuda, prompt, max_new_tokens=16, ignore_eos=True).token_ids
    p = SamplingParams(temperature=0.0, logit_bias=((plain[0], -100.0),))
    assert plain[0] not in run(smol_cuda, prompt, p, max_new_tokens=16,
                               ignore_eos=True).token_ids


def test_prompt_logprobs_match_the_cpu_backend(smol_cuda):
    prompt = (smollm2_prompts()[0] * 8)[:150]
    got = run(smol_cuda, prompt, max_new_tokens=2, ignore_eos=True,
              prompt_logprobs=3).started.prompt_logprobs
    with running_engine("smollm2", n_ctx=512) as cpu:
        want = run(cpu, prompt, max_new_tokens=2, ignore_eos=True,
                   prompt_logprobs=3).started.prompt_logprobs
    assert [lp.token_id for lp in got] == prompt[1:] == [lp.token_id for lp in want]
    # the backends' logits differ by up to REAL_BOUNDS (test_models.py: worst 0.6, mean 0.12
    # of centered logits); a log-probability adds the normaliser's difference: twice the bound
    d = np.abs(np.array([lp.logprob for lp in got]) - [lp.logprob for lp in want])
    worst, mean = REAL_BOUNDS["smollm2"]
    assert d.max() <= 2 * worst and d.mean() <= 2 * mean, (d.max(), d.mean())
