"""Segmented steps on the CUDA backend (tests/engine/test_segmented_steps.py on the CPU): each
prompt's chunk in a step of several computes the bits of its own step (its chosen token, its
log-probabilities, its KV rows), its GEMM runs taking the calls of its own step on a weight tile
dequantized once for all, and prompts joining at once give the tokens they give alone."""

from __future__ import annotations

import pytest

from tests.engine.test_segmented_steps import (
    MAX_TOKENS,
    N_CTX,
    N_SLOTS,
    segmented_against_own_steps,
)
from tests.gpu.test_models import cuda_engine
from tests.support.batching import alone, requests, same_output, together
from tests.support.models import TINY_MODELS, build_model

pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("name", TINY_MODELS)
def test_each_run_of_a_segmented_step_gets_the_bits_of_its_own_step_on_cuda(name, graphs):
    from service.backends.cuda.backend import CudaBackend

    runner = segmented_against_own_steps(build_model(
        name, CudaBackend(graphs=graphs), n_ctx=N_CTX, n_slots=N_SLOTS, max_tokens=MAX_TOKENS,
        max_logits=16))
    assert [runner.padded(n) for n in (100, 40, 130)] == [128, 64, 256]


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_prompts_prefilled_together_give_their_solo_tokens_on_cuda(mode):
    with cuda_engine("smollm2", n_slots=8, prefill_chunk=512, prefix_cache=False) as eng:
        prompts = [[(13 * j + 7 * i) % 3000 + 10 for j in range(n)]
                   for i, n in enumerate((70, 90, 110, 130, 300, 150, 128, 128))]
        reqs = requests(mode, 8, prompts, base_tokens=6)
        ref = [alone(eng, r) for r in reqs]
        got, stats = together(eng, reqs)
        bad = [r.request_id for r, a, b in zip(reqs, got, ref, strict=True)
               if not same_output(a, b)]
        assert not bad, bad
        assert stats.segmented_steps >= 2, stats.__dict__
