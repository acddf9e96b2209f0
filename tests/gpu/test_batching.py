"""Continuous batching on the CUDA backend over the paged KV cache: N = 1, 4, 16, 64 concurrent
requests give, per request, exactly the tokens (and log-probabilities) the same request gives
alone, greedy and seeded sampling, with and without speculation (GEMV and attention per row:
steps of up to 64 rows are step-size invariant on the GPU too), with the prefix cache on (the
reference engine has it off) and through preemptions in a pool too small for the streams."""

from __future__ import annotations

import pytest

from service.config import EngineConfig
from service.engine.engine import Engine
from tests.batching import MODES, alone, requests, same_output, smollm2_prompts, together
from tests.conftest import TINY, load_json, real_model_path

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def smol_cuda():
    eng = Engine.load(real_model_path("smollm2-135m"),
                      EngineConfig(backend="cuda", n_ctx=256, n_slots=64, prefix_cache=False,
                                   kv_cache_memory="1GiB"))
    eng.start()
    eng.verify_alpha = 0.0     # draft in full: speculating requests verify several rows a step
    yield eng
    eng.stop(10)


@pytest.mark.parametrize("n", [1, 4, 16, 64])
@pytest.mark.parametrize("mode", MODES)
def test_batched_requests_equal_solo_runs_on_cuda(smol_cuda, mode, n):
    reqs = requests(mode, n, smollm2_prompts(), base_tokens=24)
    ref = [alone(smol_cuda, r) for r in reqs]
    got, stats = together(smol_cuda, reqs)
    bad = [r.request_id for r, a, b in zip(reqs, got, ref, strict=True) if not same_output(a, b)]
    assert not bad, (bad, [(a.token_ids, b.token_ids) for a, b in zip(got, ref, strict=True)])
    assert (stats.max_sequences > 1) == (n > 1)


def test_more_streams_than_a_step_take_turns_on_cuda():
    eng = Engine.load(TINY / "tiny-qwen3.gguf",
                      EngineConfig(backend="cuda", n_ctx=128, n_slots=20, prefill_chunk=32,
                                   max_step_tokens=32))
    eng.start()
    eng.verify_alpha = 0.0
    try:
        prompts = [[(7 * i + j) % 200 + 3 for j in range(5 + i % 7)] for i in range(9)]
        reqs = requests("mixed-spec", 20, prompts, base_tokens=24)
        ref = [alone(eng, r) for r in reqs]
        got, stats = together(eng, reqs)
        assert all(same_output(a, b) for a, b in zip(got, ref, strict=True))
        assert stats.max_sequences == 16
    finally:
        eng.stop(10)


def _shared_prompts(n: int) -> list[list[int]]:
    system = [(11 * j) % 900 + 20 for j in range(40)]
    return [system + [(7 * i + j) % 500 + 5 for j in range(3 + i % 5)] for i in range(n)]


def test_prefix_cache_and_preemption_keep_solo_tokens_on_cuda(smol_cuda):
    """Prefix cache on and a pool of 20 blocks of 16 (one context of 256 is 16 blocks) for
    16 streams of ~60 positions: cached prompts and preempted streams give exactly the
    tokens the reference engine (no prefix cache, a large pool) gives them alone."""
    eng = Engine.load(real_model_path("smollm2-135m"),
                      EngineConfig(backend="cuda", n_ctx=256, n_slots=16, prefill_chunk=32,
                                   kv_cache_memory=str(20 * 16 * 30 * 3 * 64 * 2 * 2)))
    eng.start()
    eng.verify_alpha = 0.0
    try:
        assert eng.pool.n_blocks == 20
        reqs = requests("mixed-spec", 16, _shared_prompts(4), base_tokens=24)
        ref = [alone(smol_cuda, r) for r in reqs]
        alone(eng, reqs[0])                       # the system prompt's blocks get cached
        got, stats = together(eng, reqs)
        bad = [i for i, (a, b) in enumerate(zip(got, ref, strict=True))
               if not same_output(a, b)]
        assert not bad, [(got[i].token_ids, ref[i].token_ids) for i in bad]
        assert stats.preemptions > 0 and stats.cached_tokens > 0
        with eng._lock:
            eng.pool.check()
    finally:
        eng.stop(10)


@pytest.fixture(scope="module")
def gemma_mma():
    """Gemma-3 (Q4_K_M) with every Q4_K / Q6_K GEMV on tensor cores (EngineConfig.gemv_mma)."""
    eng = Engine.load(real_model_path("gemma3-270m"),
                      EngineConfig(backend="cuda", n_ctx=256, n_slots=16, gemv_mma=True))
    eng.start()
    eng.verify_alpha = 0.0
    yield eng
    eng.stop(10)


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
