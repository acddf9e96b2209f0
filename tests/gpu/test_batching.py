"""Continuous batching on the CUDA backend over the paged KV cache: N = 1, 4, 16, 64 concurrent
requests give, per request, exactly the tokens (and log-probabilities) the same request gives
alone, greedy and seeded sampling, with and without speculation (GEMV and attention per row:
steps of up to 64 rows are step-size invariant on the GPU too), with the prefix cache on (the
reference engine has it off) and through preemptions in a pool too small for the streams."""

from __future__ import annotations

import pytest

from tests.gpu.test_models import cuda_engine as cuda_engine_of
from tests.support.batching import (
    MODES,
    alone,
    requests,
    same_output,
    shared_prompts,
    smollm2_prompts,
    together,
)
from tests.support.models import load_json

pytestmark = pytest.mark.gpu


def cuda_engine(model: str, **overrides):
    """256-token contexts; speculating requests draft in full, so they verify several rows a
    step."""
    return cuda_engine_of(model, **{"n_ctx": 256, **overrides}, draft_in_full=True)


@pytest.fixture(scope="module")
def smol_cuda():
    with cuda_engine("smollm2", n_slots=64, prefix_cache=False, kv_cache_memory="1GiB") as eng:
        yield eng


@pytest.mark.parametrize("n", [1, 4, 16, 64])
@pytest.mark.parametrize("mode", MODES)
def test_batched_requests_equal_solo_runs_on_cuda(smol_cuda, mode, n):
    reqs = requests(mode, n, smollm2_prompts(), base_tokens=24)
    ref = [alone(smol_cuda, r) for r in reqs]
    got, stats = together(smol_cuda, reqs)
    bad = [r.request_id for r, a, b in zip(reqs, got, ref, strict=True) if not same_output(a, b)]
    assert not bad, (bad, [(a.token_ids, b.token_ids) for a, b in zip(got, ref, strict=True)])
    assert (stats.max_sequences > 1) == (n > 1)
    # the prompts joined at once: chunks shared steps, the later ones beside decode rows
    assert stats.prefill_chunks == n
    assert (stats.mixed_steps > 0) == (sum(len(r.prompt_ids) for r in reqs) > 64)


def test_more_streams_than_a_step_take_turns_on_cuda():
    with cuda_engine("tiny-qwen3", n_ctx=128, n_slots=20, prefill_chunk=32,
                     max_step_tokens=32) as eng:
        prompts = [[(7 * i + j) % 200 + 3 for j in range(5 + i % 7)] for i in range(9)]
        reqs = requests("mixed-spec", 20, prompts, base_tokens=24)
        ref = [alone(eng, r) for r in reqs]
        got, stats = together(eng, reqs)
        assert all(same_output(a, b) for a, b in zip(got, ref, strict=True))
        assert stats.max_sequences == 16


def test_prefix_cache_and_preemption_keep_solo_tokens_on_cuda(smol_cuda):
    """Prefix cache on and a pool of 20 blocks of 16 (one context of 256 is 16 blocks) for
    16 streams of ~60 positions: cached prompts and preempted streams give exactly the
    tokens the reference engine (no prefix cache, a large pool) gives them alone."""
    with cuda_engine("smollm2", n_slots=16, prefill_chunk=32,
                     kv_cache_memory=str(20 * 16 * 30 * 3 * 64 * 2 * 2)) as eng:
        assert eng.pool.n_blocks == 20
        reqs = requests("mixed-spec", 16, shared_prompts(4), base_tokens=24)
        ref = [alone(smol_cuda, r) for r in reqs]
        alone(eng, reqs[0])                       # the system prompt's blocks get cached
        got, stats = together(eng, reqs)
        bad = [i for i, (a, b) in enumerate(zip(got, ref, strict=True))
               if not same_output(a, b)]
        assert not bad, [(got[i].token_ids, ref[i].token_ids) for i in bad]
        assert stats.preemptions > 0 and stats.cached_tokens > 0
        with eng._lock:
            eng.pool.check()


@pytest.fixture(scope="module")
def gemma_mma():
    """Gemma-3 (Q4_K_M) with every Q4_K / Q6_K GEMV on tensor cores (EngineConfig.gemv_mma)."""
    with cuda_engine("gemma3", n_slots=16, gemv_mma=True) as eng:
        yield eng


@pytest.mark.parametrize("n", [1, 4, 16])
@pytest.mark.parametrize("mode", ["greedy-spec", "mixed-spec"])
def test_mma_mode_keeps_batching_and_speculation_exact(gemma_mma, mode, n):
    """In the tensor-core mode a column's bits do not depend on the step's width either:
    batched requests equal their solo runs, and speculating greedy requests equal plain
    greedy decoding (verify rows and single steps agree)."""
    prompts = [c["prompt_ids"] for c in load_json("llamacpp_gemma3_greedy.json")["cases"]]
    assert gemma_mma.model.backend.gemv_mma
    reqs = requests(mode, n, prompts, base_tokens=24)
    ref = [alone(gemma_mma, r) for r in reqs]
    got, _ = together(gemma_mma, reqs)
    bad = [i for i, (a, b) in enumerate(zip(got, ref, strict=True)) if not same_output(a, b)]
    assert not bad, [(got[i].token_ids, ref[i].token_ids) for i in bad]
    plain = [alone(gemma_mma, r) for r in requests("greedy", n, prompts, base_tokens=24)]
    for i, (a, b) in enumerate(zip(got, plain, strict=True)):
        if reqs[i].sampling.temperature == 0.0:
            assert a.token_ids == b.token_ids, i


@pytest.fixture(scope="module")
def smol_mma():
    """SmolLM2 (Q4_1, K = 576: 18 groups a row) with every quantized GEMV on tensor cores:
    steps of 17..64 rows run the 32- and 64-column tiles."""
    with cuda_engine("smollm2", n_slots=64, prefix_cache=False, kv_cache_memory="1GiB",
                     gemv_mma=True) as eng:
        yield eng


@pytest.mark.parametrize("mode", ["greedy-spec", "mixed-spec"])
def test_mma_mode_keeps_64_streams_exact(smol_mma, mode):
    """64 requests at once in the tensor-core mode (steps up to 64 rows wide) equal their solo
    runs, and speculating greedy ones equal plain greedy decoding."""
    assert smol_mma.model.backend.gemv_mma
    reqs = requests(mode, 64, smollm2_prompts(), base_tokens=24)
    ref = [alone(smol_mma, r) for r in reqs]
    got, stats = together(smol_mma, reqs)
    bad = [r.request_id for r, a, b in zip(reqs, got, ref, strict=True) if not same_output(a, b)]
    assert not bad, (bad, [(a.token_ids, b.token_ids) for a, b in zip(got, ref, strict=True)])
    assert stats.max_sequences > 1
    plain = [alone(smol_mma, r) for r in requests("greedy", 64, smollm2_prompts(),
                                                   base_tokens=24)]
    for i, (a, b) in enumerate(zip(got, plain, strict=True)):
        if reqs[i].sampling.temperature == 0.0:
            assert a.token_ids == b.token_ids, i
