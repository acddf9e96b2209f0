"""The paged KV cache through the engine on the CPU: requests give exactly their solo tokens
with the prefix cache on (their cached rows hold the bits a full prefill gives them: every
chunk here is on the step-size-invariant path), a pool too small for the streams preempts and
resumes them without changing a token, the prefix cache hits an identical system prompt and
misses a changed one, with prefix_cache_exact a hit on rows of wide prefill chunks is taken
only where the prompt would compute them alike (bit-identical log-probabilities), and after
random cancels and completions every block is back."""

from __future__ import annotations

import random
import time

import pytest

from service.engine.types import FinishReason, GenerationRequest, SamplingParams, StoppingCriteria
from service.model.spec import ModelSpec
from tests.support.batching import (
    SYSTEM,
    Streams,
    alone,
    requests,
    same_output,
    sampled,
    shared_prompts,
    together,
)
from tests.support.engines import Engine, engine_config, running_engine, wait_idle
from tests.support.models import model_path, open_gguf

MODEL = "tiny-qwen3"
BS = 16


def cpu_block_bytes() -> int:
    """Bytes of one KV block on the CPU backend (float32 K and V rows of every layer)."""
    s = ModelSpec.from_gguf(open_gguf(MODEL))
    return BS * 4 * s.n_layer * s.n_head_kv * (s.head_dim + s.head_dim_v)


def engine(**overrides):
    """16 slots, 32-token prefill chunks, blocks of BS rows, drafting in full whatever the
    machine's load."""
    return running_engine(MODEL, **{"n_slots": 16, "prefill_chunk": 32, "kv_block_size": BS,
                                    **overrides}, draft_in_full=True)


def pool_whole(eng: Engine) -> None:
    wait_idle(eng)
    with eng._lock:
        p = eng.pool
        p.check()
        assert p.free_blocks + p.cached_blocks == p.n_blocks and not p.ref.any()
        assert sorted(eng._free_slots) == list(range(eng.config.n_slots))


@pytest.fixture(scope="module")
def plain():
    """The reference: no prefix cache, a pool of 16 full contexts."""
    with engine(prefix_cache=False, kv_cache_memory=str(16 * 16 * cpu_block_bytes())) as eng:
        yield eng


@pytest.mark.parametrize("n", [1, 4, 16])
@pytest.mark.parametrize("mode", ["greedy-spec", "mixed-spec"])
def test_prefix_reuse_gives_solo_tokens(plain, mode, n):
    with engine() as eng:
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


def test_prefix_cache_hits_the_same_system_prompt_and_misses_a_changed_one():
    with engine() as eng:
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


LONG = [(7 * j) % 900 + 20 for j in range(300)]   # a 300-token shared prefix


def _ask(eng: Engine, prompt: list[int], rid: str):
    return alone(eng, GenerationRequest(rid, tuple(prompt), SamplingParams(temperature=0.0),
                                        StoppingCriteria(max_new_tokens=6), top_logprobs=2))


def test_hits_are_cut_back_to_rows_computed_as_the_prompt_computes_them():
    """Chunks of 128 tokens: wider than 64 rows, so the CPU backend computes them on its wide
    path (BLAS), where a row's bits depend on the chunk's shape. A hit is taken only where the
    cached rows came from the same chunks the prompt's own prefill takes, and the tokens and
    log-probabilities then equal a fresh run's bit for bit."""
    wide = {"prefill_chunk": 128, "n_ctx": 512, "n_slots": 4}
    x = LONG + [1 + j for j in range(50)]           # 350 tokens: chunks 128, 128, 94 (wide)
    y = LONG + [60 + j for j in range(50)]
    w1 = LONG + [200 + j for j in range(10)]        # 310 tokens: chunks 128, 128, 54
    w2 = LONG + [300 + j for j in range(10)]
    with engine(prefix_cache=False, **wide) as fresh:
        ref = {k: _ask(fresh, p, k) for k, p in (("y", y), ("w2", w2))}
    with engine(prefix_cache_exact=True, **wide) as eng:
        assert _ask(eng, x, "x").finished.usage.cached_prompt_tokens == 0
        got = _ask(eng, y, "y")
        # y matches x's blocks up to 288, inside x's third chunk (256, 94): cut back to 256
        assert got.finished.usage.cached_prompt_tokens == 256
        assert same_output(got, ref["y"])
        assert _ask(eng, w1, "w1").finished.usage.cached_prompt_tokens == 256
        got = _ask(eng, w2, "w2")
        # w1's rows 256..287 came from its narrow last chunk, as w2's do: all of them reused
        assert got.finished.usage.cached_prompt_tokens == 288
        assert same_output(got, ref["w2"])
        pool_whole(eng)
    with engine(**wide) as eng:                      # the default: every matching block
        _ask(eng, x, "x")
        assert _ask(eng, y, "y").finished.usage.cached_prompt_tokens == 288


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
    with engine(kv_cache_memory=str(20 * cpu_block_bytes()), prefix_cache=prefix_cache) as eng:
        assert eng.pool.n_blocks == 20
        prompts = [[(13 * i + 5 * j) % 700 + 9 for j in range(30 + 3 * i)] for i in range(6)]
        reqs = requests("mixed-spec", 6, prompts, base_tokens=60)
        ref = [alone(plain, r) for r in reqs]
        got, stats = together(eng, reqs)
        assert stats.preemptions > 0
        bad = [i for i, (a, b) in enumerate(zip(got, ref, strict=True)) if not same_output(a, b)]
        assert not bad, [(got[i].token_ids, ref[i].token_ids) for i in bad]
        pool_whole(eng)


def test_random_cancels_and_completions_return_every_block():
    rng = random.Random(3)
    with engine(kv_cache_memory=str(24 * cpu_block_bytes())) as eng:
        prompts = shared_prompts(6) + [[(5 * i + j) % 300 + 7 for j in range(8 + 9 * i)]
                                       for i in range(6)]
        for round_ in range(3):
            streams = Streams(eng)
            for i in range(14):
                greedy = rng.random() < 0.5
                streams.submit(GenerationRequest(
                    f"r{round_}-{i}", tuple(rng.choice(prompts)),
                    SamplingParams(temperature=0.0) if greedy else sampled(i),
                    StoppingCriteria(max_new_tokens=rng.randrange(1, 80), ignore_eos=True),
                    speculative=None if greedy and rng.random() < 0.5 else False))
                time.sleep(rng.random() * 0.01)
            for h in streams.handles:       # cancels at random times: before, during, after
                if rng.random() < 0.4:
                    time.sleep(rng.random() * 0.05)
                    h.cancel()
            results = streams.wait(300)
            reasons = {r.finished.reason for r in results}
            assert reasons <= {FinishReason.LENGTH, FinishReason.CANCELLED}
            assert all(r.finished.error is None for r in results)
            pool_whole(eng)


def test_a_pool_smaller_than_one_context_is_refused_at_startup():
    from service.errors import ConfigError

    with pytest.raises(ConfigError, match="kv_cache_memory") as e:
        Engine.load(model_path(MODEL), engine_config(
            kv_block_size=BS, kv_cache_memory=str(15 * cpu_block_bytes())))
    assert "one full context" in str(e.value)


def test_the_default_pool_holds_a_full_context_for_every_slot_within_the_free_memory():
    """kv_cache_memory '' gives every slot a full context (n_slots streams at once, none
    preempted), capped at the backend's kv_pool_share of the free memory, never below one
    context."""
    from service.backends.cpu.backend import CpuBackend
    from service.engine.loader import pool_blocks

    eng = Engine.load(model_path(MODEL), engine_config(n_slots=16, kv_block_size=BS))
    full = -(-eng.config.n_ctx // BS)
    assert eng.pool.n_blocks == 16 * full

    spec = ModelSpec.from_gguf(open_gguf(MODEL))
    per_block = cpu_block_bytes()
    config = engine_config(n_slots=16, kv_block_size=BS)
    backend = CpuBackend(threads=1)
    share = backend.kv_pool_share
    for free_blocks, want in ((4000, 16 * full), (400, int(share * 400)), (3, full)):
        backend.memory_free = lambda n=free_blocks: n * per_block
        assert pool_blocks(config, backend, [spec]) == want, free_blocks
