"""Continuous batching on the CPU: every request gives, in any batch, exactly what it gives
alone (greedy and seeded sampling, with and without speculation), steps really hold several
sequences, a cancel in the middle of a batch frees its slot and leaves the others unchanged."""

from __future__ import annotations

import threading

import pytest

from service.engine.types import (
    Delta,
    Finished,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    StoppingCriteria,
)
from tests.support.batching import (
    MODES,
    alone,
    requests,
    same_output,
    smollm2_prompts,
    together,
)
from tests.support.engines import Engine, Result, running_engine, wait_idle
from tests.support.models import TINY, TINY_MODELS


def engine(model: str, **overrides):
    """16 slots of 256 tokens; speculating requests draft in full, so they verify several
    rows per step whatever the machine's load."""
    return running_engine(model, **{"n_slots": 16, **overrides}, draft_in_full=True)


@pytest.fixture(scope="module")
def smol_16():
    with engine("smollm2") as eng:
        yield eng


SOLO: dict[str, Result] = {}     # request id -> its output alone (request i is the same for all N)


def solo(eng: Engine, req: GenerationRequest) -> Result:
    key = f"{eng.info.name}/{req.request_id}"
    if key not in SOLO:
        SOLO[key] = alone(eng, req)
    return SOLO[key]


@pytest.mark.parametrize("n", [1, 4, 16])
@pytest.mark.parametrize("mode", MODES)
def test_batched_requests_equal_solo_runs(smol_16, mode, n):
    reqs = requests(mode, n, smollm2_prompts())
    ref = [solo(smol_16, r) for r in reqs]
    got, stats = together(smol_16, reqs)
    bad = [r.request_id for r, a, b in zip(reqs, got, ref, strict=True) if not same_output(a, b)]
    assert not bad, (bad, [(a.token_ids, b.token_ids) for a, b in zip(got, ref, strict=True)])
    assert (stats.max_sequences > 1) == (n > 1)
    # the prompts shared steps (mixed steps: up to 64 rows each), later ones beside decode rows
    assert stats.prefill_chunks == n and stats.prefill_steps == 1
    assert (stats.mixed_steps > 0) == (sum(len(r.prompt_ids) for r in reqs) > 64)


@pytest.mark.parametrize("name", [*TINY_MODELS, str(TINY / "tiny-laguna-q8.gguf")])
def test_more_streams_than_a_step_take_turns(name):
    """20 streams over 16-row steps (max_step_tokens 32: 16 decode rows, 16-token prefill
    chunks): drafts shrink, then sequences sit steps out in turns; each still equals its solo
    run (the MoE, Laguna and mixed-quant models too)."""
    with engine(name, n_slots=20, prefill_chunk=32, max_step_tokens=32) as eng:
        prompts = [[(7 * i + j) % 200 + 3 for j in range(5 + i % 7)] for i in range(9)]
        reqs = requests("mixed-spec", 20, prompts, base_tokens=24)
        ref = [alone(eng, r) for r in reqs]
        got, stats = together(eng, reqs)
        diff = [(i, a.token_ids, b.token_ids, a.logprobs, b.logprobs, a.text, b.text,
                 a.finished, b.finished)
                for i, (a, b) in enumerate(zip(got, ref, strict=True)) if not same_output(a, b)]
        assert not diff
        assert stats.max_sequences == 16 and stats.decode_rows <= 16 * stats.decode_steps


def test_steps_are_batched(smol_16):
    """Four streams decode in shared steps: far fewer decode steps than tokens."""
    reqs = requests("greedy", 4, smollm2_prompts(), base_tokens=16)
    got, stats = together(smol_16, reqs)
    tokens = sum(len(g.token_ids) for g in got)
    # each stream's first token comes from its prefill; every later one from a decode step
    assert stats.prefill_chunks == 4 and stats.decode_rows == tokens - 4
    assert stats.max_sequences == 4
    assert stats.decode_steps < (tokens - 4) / 2, (stats.decode_steps, tokens)


def test_sampling_does_not_depend_on_the_batch(smol_16):
    """A seeded request's draws are keyed by (seed, token index): the same text alone, beside
    three others, and beside three others that differ (other seeds, other prompts)."""
    prompts = smollm2_prompts()
    mine = GenerationRequest("mine", tuple(prompts[2]), SamplingParams(
        temperature=1.0, top_k=0, top_p=1.0, seed=77), StoppingCriteria(max_new_tokens=16))
    others = [GenerationRequest(f"o{i}", tuple(prompts[(i + seed) % 8]), SamplingParams(
        temperature=1.0, seed=seed * 10 + i), StoppingCriteria(max_new_tokens=12 + 4 * i))
        for seed in (1, 2) for i in range(3)]
    ref = alone(smol_16, mine)
    a, _ = together(smol_16, [others[0], mine, others[1], others[2]])
    b, _ = together(smol_16, [others[3], others[4], others[5], mine])
    assert same_output(a[1], ref) and same_output(b[3], ref)
    assert a[0].token_ids != b[0].token_ids      # the neighbours did change


def test_cancel_in_a_batch_frees_the_slot():
    """Four slots full, a fifth request queued: cancelling one stream mid-batch admits the
    queued one, and every other stream gives the tokens it gives alone."""
    with engine("smollm2", n_slots=4) as eng:
        reqs = requests("mixed-spec", 5, smollm2_prompts(), base_tokens=14)
        ref = [alone(eng, r) for i, r in enumerate(reqs) if i != 1]
        results = [Result() for _ in reqs]
        done = [threading.Event() for _ in reqs]
        victim_started = threading.Event()
        admitted_while_running: list[bool] = []

        def sink_for(i):
            def sink(ev):
                results[i].add(ev)
                if i == 4 and ev is results[4].started:
                    admitted_while_running.append(not done[3].is_set())
                if isinstance(ev, Delta) and i == 1 and len(results[1].token_ids) >= 3:
                    victim_started.set()
                if isinstance(ev, Finished):
                    done[i].set()
            return sink

        victim_req = GenerationRequest("victim", tuple(smollm2_prompts()[5]), SamplingParams(
            temperature=0.0), StoppingCriteria(max_new_tokens=10_000, ignore_eos=True))
        handles = []
        with eng._lock:
            for i, r in enumerate(reqs):
                handles.append(eng.submit(victim_req if i == 1 else r, sink_for(i)))
        assert victim_started.wait(120)
        assert not done[4].is_set() and results[4].started is None   # still queued
        handles[1].cancel()
        assert all(d.wait(300) for d in done)
        assert results[1].finished.reason is FinishReason.CANCELLED
        rest = [r for i, r in enumerate(results) if i != 1]
        assert all(same_output(a, b) for a, b in zip(rest, ref, strict=True))
        # the queued request took the freed slot while the others were still running
        assert admitted_while_running == [True]
        wait_idle(eng)
        assert sorted(eng._free_slots) == [0, 1, 2, 3]
