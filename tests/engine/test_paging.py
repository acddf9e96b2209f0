"""The paged KV cache through the engine on the CPU: requests give exactly their solo tokens
with the prefix cache on (their cached rows hold the bits a full prefill gives them: every
chunk here is on the step-size-invariant path), a pool too small for the streams preempts and
resumes them without changing a token, the prefix cache hits an identical system prompt and
misses a changed one, and after random cancels and completions every block is back."""

from __future__ import annotations

import random
import threading
import time

import pytest

from service.config import EngineConfig
from service.engine.engine import Engine
from service.engine.types import (
    Finished,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    StoppingCriteria,
)
from service.gguf.reader import GGUFFile
from service.model.spec import ModelSpec
from tests.batching import Result, alone, requests, same_output, sampled, together
from tests.conftest import TINY

MODEL = TINY / "tiny-qwen3.gguf"
BS = 16


def cpu_block_bytes(path=MODEL) -> int:
    """Bytes of one KV block on the CPU backend (float32 K and V rows of every layer)."""
    s = ModelSpec.from_gguf(GGUFFile(path))
    return BS * 4 * s.n_layer * s.n_head_kv * (s.head_dim + s.head_dim_v)


def start(**overrides) -> Engine:
    cfg = EngineConfig(**{"backend": "cpu", "n_ctx": 256, "n_slots": 16, "prefill_chunk": 32,
                          "kv_block_size": BS, **overrides})
    eng = Engine.load(MODEL, cfg)
    eng.start()
    eng.verify_alpha = 0.0          # draft in full whatever the machine's load
    return eng


def wait_idle(eng: Engine) -> None:
    t0 = time.perf_counter()
    while eng.active or eng.queue_depth:
        assert time.perf_counter() - t0 < 10
        time.sleep(0.01)


def pool_whole(eng: Engine) -> None:
    wait_idle(eng)
    with eng._lock:
        p = eng.pool
        p.check()
        assert p.free_blocks + p.cached_blocks == p.n_blocks and not p.ref.any()
        assert sorted(eng._free_slots) == list(range(eng.config.n_slots))


SYSTEM = [(11 * j) % 900 + 20 for j in range(40)]     # a 40-token shared "system prompt"


def shared_prompts(n: int) -> list[list[int]]:
    return [SYSTEM + [(7 * i + j) % 500 + 5 for j in range(3 + i % 5)] for i in range(n)]


@pytest.fixture(scope="module")
def plain():
    """The reference: no prefix cache, a pool of 16 full contexts."""
    eng = start(prefix_cache=False, kv_cache_memory=str(16 * 16 * cpu_block_bytes()))
    yield eng
    eng.stop(10)


@pytest.mark.parametrize("n", [1, 4, 16])
@pytest.mark.parametrize("mode", ["greedy-spec", "mixed-spec"])
def test_prefix_reuse_gives_solo_tokens(plain, mode, n):
    eng = start()
    try:
        reqs = requests(mode, n, shared_prompts(4), base_tokens=12)
        ref = [alone(plain, r) for r in reqs]
        first = alone(eng, reqs[0])                 # fills the cache with the system prompt
        assert same_output(first, ref[0]) and first.finished.usage.cached_prompt_tokens == 0
        got, stats = together(eng, reqs)
        bad = [i for i, (a, b) in enumerate(zip(got, ref, strict=True)) if not same_output(a, b)]
        assert not bad, [(got[i].token_ids, ref[i].token_ids) for i in bad]
        cached = [g.finished.usage.cached_prompt_tokens for g in got]
        assert all(c >= 32 for c in cached), cached        # SYSTEM's 2 whole blocks at least
        assert stats.cached_tokens == sum(cached)
        pool_whole(eng)
    finally:
        eng.stop(10)


def test_prefix_cache_hits_the_same_system_prompt_and_misses_a_changed_one():
    eng = start()
    try:
        def ask(prompt) -> int:
            r = alone(eng, GenerationRequest(f"p{len(prompt)}-{prompt[0]}", tuple(prompt),
                                             SamplingParams(temperature=0.0),
                                             StoppingCriteria(max_new_tokens=2)))
            return r.finished.usage.cached_prompt_tokens

        assert ask(SYSTEM + [1, 2, 3]) == 0
        assert ask(SYSTEM + [4, 5]) == 32           # whole blocks of SYSTEM: 2 x 16
        assert ask([SYSTEM[0] + 1] + SYSTEM[1:] + [4, 5]) == 0     # first token changed
        changed = SYSTEM[:20] + [3] + SYSTEM[21:] + [4, 5]
        assert ask(changed) == 16                   # block 0 still matches, block 1 not
        long = SYSTEM + [1, 2, 3] + [9] * 30        # 73 tokens: the first request's rows +
        assert ask(long) == 32                      # its generated ones are not the same ids
        assert eng.pool.hits >= 3
        pool_whole(eng)
    finally:
        eng.stop(10)


def test_no_prefix_cache_computes_every_prompt(plain):
    r = alone(plain, GenerationRequest("a", tuple(SYSTEM + [1]), SamplingParams(temperature=0.0),
                                       StoppingCriteria(max_new_tokens=2)))
    r2 = alone(plain, GenerationRequest("b", tuple(SYSTEM + [1]),
                                        SamplingParams(temperature=0.0),
                                        StoppingCriteria(max_new_tokens=2)))
    assert r.finished.usage.cached_prompt_tokens == r2.finished.usage.cached_prompt_tokens == 0
    assert r.token_ids == r2.token_ids and plain.pool.cached_blocks == 0


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_a_full_pool_preempts_and_resumes_without_changing_a_token(plain, prefix_cache):
    """A pool of 20 blocks (one context is 16) for 6 streams that need ~6 blocks each:
    streams are preempted mid-decode, recompute and go on with exactly their solo tokens
    (greedy, speculating and seeded sampling with a penalty)."""
    eng = start(kv_cache_memory=str(20 * cpu_block_bytes()), prefix_cache=prefix_cache)
    try:
        assert eng.pool.n_blocks == 20
        prompts = [[(13 * i + 5 * j) % 700 + 9 for j in range(30 + 3 * i)] for i in range(6)]
        reqs = requests("mixed-spec", 6, prompts, base_tokens=60)
        ref = [alone(plain, r) for r in reqs]
        got, stats = together(eng, reqs)
        assert stats.preemptions > 0
        bad = [i for i, (a, b) in enumerate(zip(got, ref, strict=True)) if not same_output(a, b)]
        assert not bad, [(got[i].token_ids, ref[i].token_ids) for i in bad]
        pool_whole(eng)
    finally:
        eng.stop(10)


def test_random_cancels_and_completions_return_every_block():
    eng = start(kv_cache_memory=str(24 * cpu_block_bytes()))
    rng = random.Random(3)
    try:
        prompts = shared_prompts(6) + [[(5 * i + j) % 300 + 7 for j in range(8 + 9 * i)]
                                       for i in range(6)]
        for round_ in range(3):
            done = threading.Semaphore(0)
            results = [Result() for _ in range(14)]
            handles = []

            def sink_for(i, results=results, done=done):
                def sink(ev):
                    results[i].add(ev)
                    if isinstance(ev, Finished):
                        done.release()
                return sink

            for i in range(14):
                greedy = rng.random() < 0.5
                req = GenerationRequest(
                    f"r{round_}-{i}", tuple(rng.choice(prompts)),
                    SamplingParams(temperature=0.0) if greedy else sampled(i),
                    StoppingCriteria(max_new_tokens=rng.randrange(1, 80), ignore_eos=True),
                    speculative=None if greedy and rng.random() < 0.5 else False)
                handles.append(eng.submit(req, sink_for(i)))
                time.sleep(rng.random() * 0.01)
            for h in handles:               # cancels at random times: before, during, after
                if rng.random() < 0.4:
                    time.sleep(rng.random() * 0.05)
                    h.cancel()
            for _ in range(14):
                assert done.acquire(timeout=300)
            reasons = {r.finished.reason for r in results}
            assert reasons <= {FinishReason.LENGTH, FinishReason.CANCELLED}
            assert all(r.finished.error is None for r in results)
            pool_whole(eng)
    finally:
        eng.stop(10)


def test_a_pool_smaller_than_one_context_is_refused_at_startup():
    from service.errors import ConfigError

    with pytest.raises(ConfigError, match="kv_cache_memory") as e:
        Engine.load(MODEL, EngineConfig(backend="cpu", n_ctx=256, kv_block_size=BS,
                                        kv_cache_memory=str(15 * cpu_block_bytes())))
    assert "one full context" in str(e.value)
