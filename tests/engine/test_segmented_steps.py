"""Segmented steps: several prompts' chunks wider than a mixed step takes, computed as ONE step
in which each chunk is a run padded alone and computed exactly as its own step would compute it
(runner/step.py StepInput.segments, model/transformer.Segmented, the backends' matmul
segments). Checked on the CPU backend bit for bit against each chunk's own step (its chosen
token, its log-probabilities and the KV rows it wrote, read back by a decode step), on the
scheduler's plan (FIFO, the padded rows within the wide step's budget, a scoring chunk alone),
through the engine (tokens alone equal tokens among many joining at once) and on the fake CUDA
device (each weight tile dequantized once for every chunk, one GEMM per chunk and tile)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from service.backends.cpu.backend import CpuBackend
from service.engine.runner import GREEDY, ModelRunner, StepInput
from service.engine.types import (
    Finished,
    GenerationRequest,
    SamplingParams,
    StoppingCriteria,
)
from tests.engine.test_mixed_steps import decoded, seq
from tests.support.batching import alone, requests, same_output, together
from tests.support.engines import running_engine
from tests.support.models import TINY_MODELS, build_model

N_SLOTS, N_CTX, MAX_TOKENS = 6, 256, 512
ROW = replace(GREEDY, n_top=4)          # the chosen token and four alternatives, as logprobs


def prompt(i: int, n: int) -> list[int]:
    return [(37 * i + 11 * j) % 240 + 3 for j in range(n)]


def outputs(out) -> list[tuple]:
    """A step's choices as comparable values: ids and every log-probability's bits."""
    rows = []
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        rows.append((int(tok), np.float32(lp.logprob).tobytes(),
                     tuple((t, np.float32(v).tobytes()) for t, v in lp.top)))
    return rows


@pytest.mark.parametrize("name", TINY_MODELS)
def test_each_run_of_a_segmented_step_gets_the_bits_of_its_own_step(name):
    runner = segmented_against_own_steps(build_model(
        name, CpuBackend(threads=1), n_ctx=N_CTX, n_slots=N_SLOTS, max_tokens=MAX_TOKENS,
        max_logits=16))
    # CPU padding: multiples of 16 past 16 rows
    assert [runner.padded(n) for n in (100, 40, 130)] == [112, 48, 144]


def segmented_against_own_steps(tr) -> ModelRunner:
    """Three chunks (100, 40 and 130 rows from positions 0, 0 and 16: one of them not choosing,
    the 40-row one on the step-size-invariant path on both backends) in one step on slots 3..5
    against each in a step of its own on slots 0..2: the same chosen tokens and
    log-probabilities, and a decode step on every slot after them (it reads every KV row the
    chunks wrote) the same too; each run padded alone, its padding rows first."""
    runner = ModelRunner(tr, N_SLOTS, N_CTX)
    chunks = [(prompt(0, 100), 0, True), (prompt(1, 40), 0, True), (prompt(2, 130), 16, False)]
    # slot 2's chunk starts at 16: its first 16 positions from a step of their own, both sides
    for slot in (2, 5):
        runner.step(StepInput(prompt(9, 16), range(16), [slot] * 16, [], []))
    solo = []
    for slot, (toks, start, choose) in enumerate(chunks):
        n = len(toks)
        solo += outputs(runner.step(StepInput(toks, range(start, start + n), [slot] * n,
                                              [n - 1] if choose else [],
                                              [ROW] if choose else [])))
    ids, pos, slots, rows = [], [], [], []
    for j, (toks, start, choose) in enumerate(chunks):
        ids += toks
        pos += range(start, start + len(toks))
        slots += [3 + j] * len(toks)
        if choose:
            rows.append(len(ids) - 1)
    inp = StepInput(ids, pos, slots, rows, [ROW] * len(rows),
                    segments=[len(c[0]) for c in chunks])
    T, where, segmented = runner._layout(inp)
    a, b, c = (runner.padded(n) for n in (100, 40, 130))
    assert T == a + b + c and [r[:2] for r in segmented.runs] == [
        (0, a), (a, a + b), (a + b, T)]
    assert segmented.logit_rows == (a - 1, a + b - 1)
    assert where[0] == a - 100 and where[100] == a + b - 40
    assert outputs(runner.step(inp)) == solo
    # the KV rows: one decode row per slot, each slot's next position, alone per slot
    nxt = [100, 40, 146]
    for j in range(3):
        a, b = (runner.step(StepInput([7], [nxt[j]], [s], [0], [ROW])) for s in (j, 3 + j))
        assert outputs(a) == outputs(b), f"chunk {j}'s KV rows differ"
    return runner


def test_segmented_inputs_are_checked():
    tr = build_model("tiny-qwen3", CpuBackend(threads=1), n_ctx=N_CTX, n_slots=N_SLOTS,
                     max_tokens=64, max_logits=16)
    runner = ModelRunner(tr, N_SLOTS, N_CTX)
    ids = list(range(1, 41))
    with pytest.raises(ValueError, match="adding up"):
        runner.step(StepInput(ids, range(40), [0] * 40, [39], [GREEDY], segments=[20, 19]))
    with pytest.raises(ValueError, match="runs' last rows"):
        runner.step(StepInput(ids, range(40), [0] * 40, [30], [GREEDY], segments=[20, 20]))
    with pytest.raises(ValueError, match="exceeds the model's 64"):    # 3 x 32 padded rows
        runner.step(StepInput(list(range(1, 52)), [*range(17)] * 3,
                              [0] * 17 + [1] * 17 + [2] * 17, [50], [GREEDY],
                              segments=[17, 17, 17]))


# ---------------------------------------------------------------- the plan
def test_wide_chunks_share_a_step_fifo_within_its_padded_rows():
    """Budget 256 padded rows, rows padded to multiples of 64: the oldest chunk (100 -> 128)
    and the next wide ones while they fit (90 -> 128; then 70 -> 128 waits), a short prompt
    riding in the mixed step meanwhile, the next plan taking the rest in order."""
    from tests.engine.test_mixed_steps import scheduler
    sch = scheduler(prefill_chunk=256)
    sch.wide_rows, sch._padded = 256, lambda n: -(-n // 64) * 64
    a, b, short, c = seq(0, 100), seq(1, 90), seq(2, 6), seq(3, 70)
    for s in (a, b, short, c):
        sch.add(s)
    plan = sch.schedule()
    assert [x.seq for x in plan.wide] == [a, b] and [x.seq for x in plan.prefill] == [short]
    assert all(x.choose and x.start == 0 for x in plan.wide)
    for s in (a, b, short):
        decoded(s)
    plan = sch.schedule()
    assert [x.seq for x in plan.wide] == [c] and len(plan.decode) == 3


def test_a_scoring_chunk_runs_alone_and_no_budget_means_one_chunk():
    from tests.engine.test_mixed_steps import scheduler
    sch = scheduler(prefill_chunk=256)
    sch.wide_rows = 1024
    scoring, a, b = seq(0, 100), seq(1, 100), seq(2, 100)
    scoring.request = replace(scoring.request, prompt_logprobs=1)
    scoring.prompt_scores = {}
    for s in (scoring, a, b):
        sch.add(s)
    assert scoring.scoring_prompt
    assert [x.seq for x in sch.schedule().wide] == [scoring]
    decoded(scoring)
    scoring.prompt_scores = None
    assert [x.seq for x in sch.schedule().wide] == [a, b]
    one = scheduler(prefill_chunk=256)               # wide_rows 0: one chunk a step, as before
    for s in (seq(4, 100), seq(5, 100)):
        one.add(s)
    assert len(one.schedule().wide) == 1


def test_a_narrow_oldest_chunk_runs_alone():
    """The oldest prompt's chunk of up to 64 rows that found no room beside the decode rows
    runs as a step of its own: wide chunks join a segmented step only behind a wide one."""
    from tests.engine.test_mixed_steps import decoding, scheduler
    sch = scheduler(step_rows=16, prefill_chunk=256)
    sch.wide_rows = 1024
    decoding(sch, 12)
    small, big = seq(20, 10), seq(21, 100)
    sch.add(small)
    sch.add(big)
    plan = sch.schedule()
    assert len(plan.decode) == 12 and [c.seq for c in plan.wide] == [small]


# ---------------------------------------------------------------- through the engine
@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_prompts_prefilled_together_give_their_solo_tokens(mode):
    """Six prompts of 70..300 tokens (prefill chunk 256: the longest takes two chunks, the
    others one, each wider than a mixed step; padded to multiples of 16, so 80 + 96 rows,
    then 112 + 128, share a step of at most 256) joining at once on SmolLM2: segmented steps
    ran, and every request's tokens and log-probabilities equal its run alone (prefix cache
    off, so each is computed both times)."""
    with running_engine("smollm2", n_slots=6, n_ctx=512, prefill_chunk=256,
                        prefix_cache=False) as eng:
        prompts = [[(13 * j + 7 * i) % 3000 + 10 for j in range(n)]
                   for i, n in enumerate((70, 90, 110, 130, 300, 150))]
        reqs = requests(mode, 6, prompts, base_tokens=4)
        ref = [alone(eng, r) for r in reqs]
        assert eng.stats.segmented_steps == 0           # alone, nothing to share a step with
        got, stats = together(eng, reqs)
        assert all(same_output(a, b) for a, b in zip(got, ref, strict=True))
        assert stats.segmented_steps >= 2, stats.__dict__


@pytest.mark.parametrize("name", ["tiny-qwen3moe", "tiny-llama-mixq"])
def test_tiny_models_prefilled_together_give_their_solo_tokens(name):
    with running_engine(name, n_slots=4, prefill_chunk=256, prefix_cache=False) as eng:
        prompts = [prompt(i, 66 + 9 * i) for i in range(4)]
        reqs = requests("mixed-spec", 4, prompts, base_tokens=6)
        ref = [alone(eng, r) for r in reqs]
        got, stats = together(eng, reqs)
        assert all(same_output(a, b) for a, b in zip(got, ref, strict=True))
        assert stats.segmented_steps >= 1, stats.__dict__


def test_a_segmented_step_on_the_fake_device_dequantizes_each_tile_once(compiled):
    """tiny-qwen3 on the CUDA backend over the fake device: three 100-token prompts (each
    padded to 128 rows; the wide step holds 256) joining at once run as one segmented step of
    two and one step of one, so the GEMMs are three prompts' worth (each with 128 columns, the
    pointers of its own rows: the fake cuBLAS checks every range) and the dequantizations two
    steps' worth."""
    from tests.support import cuda_steps

    with cuda_steps.fake_device_engine(compiled, n_ctx=512, n_slots=3, prefill_chunk=256) \
            as (dev, eng):
        def run(reqs) -> None:
            got, _ = together(eng, reqs)
            assert all(isinstance(r.finished, Finished) and r.finished.error is None
                       for r in got)

        def counts() -> tuple[int, int]:
            return (len(dev.gemms),
                    sum(1 for x in dev.launches if x.kernel.startswith("dequant_")))

        def req(i: int) -> GenerationRequest:
            return GenerationRequest(f"p{i}", tuple(prompt(i, 100)),
                                     SamplingParams(temperature=0.0),
                                     StoppingCriteria(max_new_tokens=2, ignore_eos=True))

        g0, d0 = counts()
        run([req(0)])
        g1, d1 = counts()
        one_g, one_d = g1 - g0, d1 - d0
        assert one_g and one_d and eng.stats.segmented_steps == 0
        run([req(i) for i in (1, 2, 3)])
        g2, d2 = counts()
        assert eng.stats.segmented_steps == 1
        assert (g2 - g1, d2 - d1) == (3 * one_g, 2 * one_d)
        assert {g.n for g in dev.gemms[g0:]} == {128}


def test_a_failed_segmented_step_runs_its_chunks_one_at_a_time(monkeypatch):
    """A segmented step that raises commits nothing: the engine runs its chunks each as a step
    of its own, and the requests get the tokens they get alone."""
    with running_engine("tiny-qwen3", n_slots=4, prefill_chunk=256, prefix_cache=False) as eng:
        reqs = requests("greedy", 3, [prompt(i, 70 + 10 * i) for i in range(3)], base_tokens=5)
        ref = [alone(eng, r) for r in reqs]
        step, failed = eng.runner.step, []

        def failing(inp):
            if inp.segments is not None:
                failed.append(list(inp.segments))
                raise RuntimeError("injected")
            return step(inp)

        monkeypatch.setattr(eng.runner, "step", failing)
        got, stats = together(eng, reqs)
        assert failed and stats.segmented_steps == 0
        assert all(same_output(a, b) for a, b in zip(got, ref, strict=True))


def test_moe_chunks_in_a_segmented_step_on_the_fake_device(compiled):
    """tiny-qwen3moe on the fake CUDA device: three 100-token prompts joining at once run a
    segmented step (the mixture of experts per chunk, every launch's ranges checked) and
    finish without error."""
    from tests.support.fake_cupy import install
    from tests.support.models import TINY

    with install(compiled), running_engine(
            TINY / "tiny-qwen3moe.gguf", backend="cuda", n_slots=3, n_ctx=512,
            prefill_chunk=256) as eng:
        reqs = [GenerationRequest(f"m{i}", tuple(prompt(i, 100)), SamplingParams(temperature=0.0),
                                  StoppingCriteria(max_new_tokens=2, ignore_eos=True))
                for i in range(3)]
        got, stats = together(eng, reqs)
        assert stats.segmented_steps == 1
        assert all(r.finished.error is None and len(r.token_ids) == 2 for r in got)
