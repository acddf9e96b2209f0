"""Mixed steps: prefill chunks of up to 64 rows ride in the decode step (several prompts' chunks
in one step, FIFO, within the step's row limit); a wider chunk, or the oldest prompt's chunk
that does not fit, runs as a step of its own; chunk boundaries never depend on the load. And
through the engine on the CPU: a request's tokens alone equal its tokens among many joining at
once (test_batching.py runs every sampling and speculation mode; here the tiny models, a long
prompt beside short ones, and the overlapped loop)."""

from __future__ import annotations

import numpy as np
import pytest

from service.engine.mixed import mixed_input, split_mixed
from service.engine.runner.step import StepOutput
from service.engine.scheduler.blocks import BlockPool
from service.engine.scheduler.kv import KVManager
from service.engine.scheduler.plan import StepPlan
from service.engine.scheduler.policy import Scheduler
from service.engine.scheduler.sequence import Sequence
from service.engine.types import GenerationRequest, SamplingParams, StoppingCriteria
from tests.support.batching import alone, requests, same_output, together
from tests.support.engines import running_engine
from tests.support.models import TINY_MODELS


def seq(i: int, n_prompt: int, greedy: bool = True) -> Sequence:
    sampling = SamplingParams(temperature=0.0 if greedy else 0.8, seed=i)
    req = GenerationRequest(f"r{i}", tuple(range(3 + i, 3 + i + n_prompt)), sampling,
                            StoppingCriteria(max_new_tokens=8, ignore_eos=True))
    return Sequence(request=req, sink=lambda ev: None, seed_value=i, text=None,
                    eog_ids=frozenset(), n_ctx=512, speculative=False)


def scheduler(n_slots=16, step_rows=64, prefill_chunk=256, n_blocks=512, max_blocks=32
              ) -> Scheduler:
    pool = BlockPool(n_blocks, 16, n_slots, max_blocks)
    return Scheduler(KVManager(pool, n_slots), n_ctx=512, max_queue=64, step_rows=step_rows,
                     prefill_chunk=prefill_chunk)


def decoded(s: Sequence, token: int = 7) -> None:
    """What the engine does when a prompt's last chunk chose its first token."""
    s.n_past = len(s.request.prompt_ids)
    s.generated.append(token)
    s.history.append(token)
    s.seed = token


def decoding(sch: Scheduler, n: int) -> tuple[list[Sequence], StepPlan]:
    """n sequences of 4-token prompts added and scheduled once (the first plan), then all
    taken as decoding, as the engine leaves them once their prompts chose."""
    seqs = [seq(i, 4) for i in range(n)]
    for s in seqs:
        sch.add(s)
    first = sch.schedule()
    for s in seqs:
        decoded(s)
    return seqs, first


# ---------------------------------------------------------------- the plan
def test_joining_prompts_share_steps_fifo_within_the_row_limit():
    sch = scheduler()
    seqs = [seq(i, 5 + i % 4) for i in range(16)]          # 5..8 tokens: 104 rows in all
    for s in seqs:
        sch.add(s)
    plan = sch.schedule()
    took = [c.seq for c in plan.prefill]
    assert took == seqs[:len(took)] and plan.wide == () and not plan.decode
    rows = sum(len(c.tokens) for c in plan.prefill)
    assert rows <= 64 < rows + len(seqs[len(took)].request.prompt_ids)
    assert all(c.choose and c.start == 0 and c.tokens == list(c.seq.request.prompt_ids)
               for c in plan.prefill)
    for c in plan.prefill:                                  # they chose their first tokens
        decoded(c.seq)
    plan = sch.schedule()                                   # decode rows first, then the rest
    assert [r.seq for r in plan.decode] == took
    assert [c.seq for c in plan.prefill] == seqs[len(took):]
    assert plan.mixed_rows == len(took) + sum(len(s.request.prompt_ids) for s in seqs[len(took):])


def test_a_wide_chunk_runs_alone_and_short_ones_ride_past_it():
    sch = scheduler(prefill_chunk=100)
    long, short = seq(0, 250), [seq(i, 6) for i in (1, 2)]
    for s in (long, *short):
        sch.add(s)
    plan = sch.schedule()
    (own,) = plan.wide
    assert own.seq is long and len(own.tokens) == 100 and not own.choose
    assert [c.seq for c in plan.prefill] == short
    long.n_past = 100                                       # the same chunk boundaries next
    assert [len(c.tokens) for c in sch.schedule().wide] == [100]


def test_chunks_keep_their_size_whatever_the_room():
    """A chunk is never cut to the room left: it waits for a step with room (or, the oldest,
    runs alone), so its rows and boundaries are the same under any load."""
    sch = scheduler(step_rows=16, prefill_chunk=12)
    running, first = decoding(sch, 10)
    assert [c.seq for c in first.prefill] == running[:4]    # 4 x 4 rows fill the step
    a, b = seq(20, 30), seq(21, 5)
    sch.add(a)
    sch.add(b)
    plan = sch.schedule()
    assert len(plan.decode) == 10                           # 6 rows of room
    assert [(c.seq, len(c.tokens)) for c in plan.wide] == [(a, 12)]    # the oldest: alone
    assert [c.seq for c in plan.prefill] == [b] and len(plan.prefill[0].tokens) == 5


def test_a_chunk_that_does_not_fit_waits_unless_it_is_the_oldest():
    sch = scheduler(step_rows=16, prefill_chunk=16)
    a, b, c = seq(0, 10), seq(1, 10), seq(2, 4)
    for s in (a, b, c):
        sch.add(s)
    plan = sch.schedule()
    assert [x.seq for x in plan.prefill] == [a, c] and plan.wide == ()     # b waits
    decoded(a)
    decoded(c)
    plan = sch.schedule()
    assert [x.seq for x in plan.prefill] == [b] and len(plan.decode) == 2


def speculating(sch: Scheduler, n: int, width: int) -> list[Sequence]:
    """n speculating sequences of `width`, admitted, their prompts (4 tokens) computed."""
    spec = [seq(i, 4) for i in range(n)]
    for s in spec:
        s.speculative, s.verify_width = True, width
        sch.add(s)
    sch.schedule()
    for s in spec:
        decoded(s)
    return spec


def test_drafts_shrink_before_a_waiting_chunk_is_left_out():
    sch = scheduler()
    speculating(sch, 2, 8)
    plan = sch.schedule()
    assert [r.n_draft for r in plan.decode] == [6, 6]       # alone: all their length allows
    late = seq(5, 60)
    sch.add(late)
    plan = sch.schedule()
    assert [c.seq for c in plan.prefill] == [late] and plan.wide == ()
    assert plan.mixed_rows == 64 and sum(r.n_draft for r in plan.decode) == 2


def test_draft_lengths_follow_the_step_costs_at_the_batch_size():
    """The step's chains are weighed together (width.allocate_drafts) at the step's size: 8
    sequences at the prior acceptance (0.6) on a table where rows are free up to 16 and each
    row past them costs a sixteenth of a step take the 8 free rows (one draft each, the
    largest gains), all 24 when every row is free, none when each row costs a step."""
    sch = scheduler()
    spec = speculating(sch, 8, 4)
    sch.row_costs = [1.0] * 17 + [r / 16 for r in range(17, 65)]
    assert [r.n_draft for r in sch.schedule().decode] == [1] * 8
    assert sch.draft_length(spec[0]) == 3          # one sequence's 3 drafts: rows 11 <= 16
    sch.row_costs = [1.0] * 65
    assert [r.n_draft for r in sch.schedule().decode] == [3] * 8
    sch.row_costs = [float(max(r, 1)) for r in range(65)]
    assert [r.n_draft for r in sch.schedule().decode] == [0] * 8
    sch.row_costs, sch.verify_alpha = [], 0.0      # the linear model, verification free
    assert [r.n_draft for r in sch.schedule().decode] == [3] * 8


# ---------------------------------------------------------------- the step's rows
def test_mixed_input_puts_the_choosing_rows_last_and_splits_back():
    sch = scheduler()
    d, p, q = seq(0, 3), seq(1, 4), seq(2, 50)
    for s in (d, p, q):
        sch.add(s)
    sch.schedule()
    decoded(d, 9)
    q.n_past = 0
    chunks = [c for c in sch.schedule().prefill]
    assert [c.seq for c in chunks] == [p, q]
    batch = [(d, [9])]
    inp = mixed_input(batch, chunks)
    ids = list(inp.token_ids)
    # p's first 3 rows and q's first 49 choose nothing; then d's seed; then p's and q's last
    assert ids == [*p.request.prompt_ids[:3], *q.request.prompt_ids[:49], 9,
                   p.request.prompt_ids[3], q.request.prompt_ids[49]]
    assert list(inp.positions) == [0, 1, 2, *range(49), 3, 3, 49]
    assert list(inp.slots) == [p.slot] * 3 + [q.slot] * 49 + [d.slot, p.slot, q.slot]
    assert list(inp.logit_rows) == [52, 53, 54]
    assert [r.token_index for r in inp.sampling] == [1, 0, 0]
    assert inp.kv_positions is None
    out = StepOutput(np.array([11, 12, 13], np.int32), (None,) * 3)
    dec, parts = split_mixed(batch, chunks, out)
    assert [list(o.token_ids) for o in dec] == [[11]]
    assert [list(o.token_ids) for o in parts] == [[12], [13]]


# ---------------------------------------------------------------- through the engine
@pytest.mark.parametrize("name", TINY_MODELS)
def test_tiny_models_give_solo_tokens_among_streams_joining_at_once(name):
    with running_engine(name, n_slots=12, draft_in_full=True) as eng:
        prompts = [[(5 * i + j) % 200 + 3 for j in range(5 + i % 4)] for i in range(12)]
        reqs = requests("mixed-spec", 12, prompts, base_tokens=8)
        ref = [alone(eng, r) for r in reqs]
        got, stats = together(eng, reqs)
        assert all(same_output(a, b) for a, b in zip(got, ref, strict=True))
        # 12 prompts joined in fewer steps than prompts, and chunks rode beside decode rows
        assert stats.prefill_chunks == 12 and stats.prefill_steps < 12
        assert stats.mixed_steps > 0


@pytest.mark.parametrize("overlap", ["on", "off"])
def test_a_long_prompt_alone_and_short_ones_riding_give_solo_tokens(overlap):
    """A 150-token prompt in 100-token chunks (each a step of its own) joins with short ones
    that ride in the decode steps, while earlier streams decode (overlapped or not); the
    prefix cache off, so the long prompt is computed in both runs."""
    with running_engine("smollm2", n_slots=8, prefill_chunk=100, overlap=overlap,
                        prefix_cache=False) as eng:
        long = [(13 * j) % 3000 + 10 for j in range(150)]
        short = [[(7 * i + j) % 500 + 5 for j in range(5 + i)] for i in range(4)]
        reqs = requests("sampled", 6, [short[0], long, *short[1:], short[0]], base_tokens=10)
        ref = [alone(eng, r) for r in reqs]
        got, stats = together(eng, reqs)
        assert all(same_output(a, b) for a, b in zip(got, ref, strict=True))
        assert stats.prefill_chunks == 7 and stats.prefill_steps >= 2
