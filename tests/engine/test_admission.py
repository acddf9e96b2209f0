"""The admission queue: ordered by request priority (lower first), FIFO within a level; a
preempted sequence goes back to its arrival place; preemption takes the lowest priority first;
priority out of range is refused naming the field; the step counters behind the gauges."""

from __future__ import annotations

import threading

import pytest

from service.engine.stepprofile import StepStats
from service.engine.types import (
    Finished,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    Started,
    StoppingCriteria,
)
from service.errors import CapacityError, InvalidRequestError
from tests.engine.test_mixed_steps import decoded, scheduler, seq
from tests.support.engines import running_engine


def with_priority(i: int, priority: int, n_prompt: int = 4):
    s = seq(i, n_prompt)
    s.request = GenerationRequest(s.request.request_id, s.request.prompt_ids,
                                  s.request.sampling, s.request.stopping, priority=priority)
    return s


def test_lower_priority_values_are_admitted_first_fifo_within_a_level():
    sch = scheduler(n_slots=1)
    first = with_priority(0, 9)
    sch.add(first)
    sch.schedule()                                  # holds the only slot
    waiting = [with_priority(i, p) for i, p in enumerate([5, 0, 5, -3, 0, 1000, -1000], 1)]
    for s in waiting:
        sch.add(s)
    order = []
    while sch.waiting:
        sch.release(sch.running[0])
        sch.schedule()
        order.append(sch.running[0].request.request_id)
    assert order == ["r7", "r4", "r2", "r5", "r1", "r3", "r6"]


def test_a_preempted_sequence_goes_back_to_its_arrival_place():
    sch = scheduler(n_slots=2)
    a, b = with_priority(0, 0), with_priority(1, 0)
    sch.add(a)
    sch.add(b)
    sch.schedule()
    later = [with_priority(2, 0), with_priority(3, 1), with_priority(4, -1)]
    for s in later:
        sch.add(s)
    sch._preempt(b)
    assert [s.request.request_id for s in sch.waiting] == ["r4", "r1", "r2", "r3"]


def test_preemption_takes_the_lowest_priority_first():
    """A pool of 6 blocks of 16: three running sequences hold two each; the one asking for a
    third block preempts the lowest-priority one (highest value), not the youngest."""
    sch = scheduler(n_slots=3, n_blocks=6, max_blocks=3)
    seqs = [with_priority(0, 0, 20), with_priority(1, 7, 20), with_priority(2, 0, 20)]
    for s in seqs:
        sch.add(s)
    sch.schedule()
    for s in seqs:
        for t in range(13):          # 12 decoded tokens and the seed: the next row needs a
            decoded(s, 100 + t)      # third block
        s.n_past = 32
    plan = sch.schedule()
    assert seqs[1] not in sch.running and seqs[1] in sch.waiting
    assert plan.preempted >= 1


@pytest.mark.parametrize("priority", [-1001, 1001, 2**31 - 1])
def test_priority_out_of_range_is_refused(priority):
    req = GenerationRequest("x", (1, 2), priority=priority)
    with pytest.raises(InvalidRequestError) as e:
        req.validate(100, 64)
    assert e.value.field == "priority"
    GenerationRequest("x", (1, 2), priority=-1000).validate(100, 64)


def test_a_full_queue_is_refused_with_a_retry_delay():
    sch = scheduler(n_slots=1)
    sch.max_queue = 2
    for i in range(3):                # one for the free slot, two waiting
        sch.add(seq(i, 3))
    with pytest.raises(CapacityError) as e:
        sch.add(seq(9, 3))
    assert e.value.retry_after_s > 0


def test_step_counts_behind_the_gauges():
    st = StepStats()
    st.count_step(3, 5, 2, 11)          # 3 sequences' 5 decode rows beside 2 chunks of 11 rows
    st.count_step(0, 0, 1, 100)         # a chunk alone
    st.count_decode(4, 4)               # an overlapped plain step
    assert (st.steps, st.step_tokens, st.last_rows, st.last_tokens) == (3, 120, 4, 4)
    assert (st.decode_steps, st.mixed_steps, st.prefill_steps, st.prefill_chunks) == (2, 1, 1, 3)
    st.idle()
    assert (st.last_rows, st.last_tokens, st.steps) == (0, 0, 3)


def test_the_engine_starts_waiting_requests_in_priority_order():
    """One slot: requests submitted at once start (Started) lowest priority value first, in
    submission order within a level."""
    with running_engine("tiny-qwen3", n_slots=1) as eng:
        events: list[tuple[str, object]] = []
        done = threading.Event()
        prios = {"a": 3, "b": 0, "c": 3, "d": -2, "e": 0}

        def sink_for(rid):
            def sink(ev):
                events.append((rid, ev))
                if isinstance(ev, Finished) and sum(isinstance(e, Finished)
                                                    for _, e in events) == len(prios):
                    done.set()
            return sink

        with eng._lock:
            for rid, p in prios.items():
                eng.submit(GenerationRequest(rid, (5, 6, 7), SamplingParams(temperature=0.0),
                                             StoppingCriteria(max_new_tokens=3), priority=p),
                           sink_for(rid))
        assert done.wait(120)
        assert [rid for rid, ev in events if isinstance(ev, Started)] == ["d", "b", "e", "a", "c"]
        assert all(ev.reason is FinishReason.LENGTH for _, ev in events
                   if isinstance(ev, Finished))
