"""Admission through the server: GenerateRequest.priority reaches the engine (and is refused
out of range, naming the field), a full queue answers RESOURCE_EXHAUSTED with its retry delay
in the status details and in the grpc-retry-pushback-ms trailer, and the engine gauges (queue
depth, running rows, KV usage, tokens per step) read what the engine holds."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest
from prometheus_client import generate_latest

from clients import error_details
from service.engine.stepprofile import StepStats
from service.engine.types import Started
from service.errors import CapacityError
from service.metrics import Metrics
from tests.service.test_grpc_metrics_clients import scrape, value
from tests.support.fake_engine import FakeEngine, finished
from tests.support.grpc_harness import serving


def test_priority_reaches_the_engine():
    seen = []

    def answer(request, sink, handle) -> None:
        seen.append(request.priority)
        sink(Started(prompt_tokens=len(request.prompt_ids), seed=0))
        sink(finished())

    with serving(FakeEngine(answer)) as (_, c):
        list(c.generate(tokens=[1, 2], priority=-7))
        list(c.generate(tokens=[1, 2]))
        list(c.generate(tokens=[1, 2], priority=1000))
    assert seen == [-7, 0, 1000]


@pytest.mark.parametrize("priority", [-1001, 5000])
def test_priority_out_of_range_is_invalid_argument(fake_client, priority):
    with pytest.raises(grpc.RpcError) as ei:
        list(fake_client.generate(tokens=[1, 2], priority=priority))
    e = error_details(ei.value)
    assert e.code == "INVALID_ARGUMENT" and e.field_violations[0][0] == "priority"


def test_a_full_queue_sends_the_retry_delay_in_a_plain_trailer_too():
    with serving(FakeEngine(raises=CapacityError("64 requests are waiting", 1.5))) as (_, c):
        with pytest.raises(grpc.RpcError) as ei:
            list(c.generate(tokens=[1, 2]))
    trailers = dict(ei.value.trailing_metadata())
    assert trailers["grpc-retry-pushback-ms"] == "1500"
    assert error_details(ei.value).retry_after_s == 1.5       # and in the status details


def test_engine_gauges_read_the_engine():
    m = Metrics()
    pool = SimpleNamespace(used_blocks=3, cached_blocks=1, free_blocks=4, n_blocks=8)
    st = StepStats()
    m.bind_engine(lambda: 2, lambda: 5, pool, lambda: 0, lambda: st)
    st.count_step(5, 9, 2, 12)          # 5 sequences' 9 decode rows beside 2 chunks of 12 rows
    text = generate_latest(m.registry).decode()
    assert value(text, "specstream_queue_depth") == 2
    assert value(text, "specstream_running_rows") == 9
    assert value(text, "specstream_step_tokens") == 21
    assert value(text, "specstream_kv_cache_usage_ratio") == 3 / 8
    assert value(text, "specstream_engine_steps") == 1
    assert value(text, "specstream_engine_step_tokens") == 21
    st.idle()
    text = generate_latest(m.registry).decode()
    assert value(text, "specstream_running_rows") == 0 == value(text, "specstream_step_tokens")


def test_engine_gauges_of_the_real_server(server, client):
    before = value(scrape(server), "specstream_engine_steps")
    client.complete("Hello there", max_new_tokens=4, ignore_eos=True, temperature=0.0)
    text = scrape(server)
    assert value(text, "specstream_engine_steps") >= before + 2   # the prompt, then decoding
    assert value(text, "specstream_engine_step_tokens") >= value(text, "specstream_engine_steps")
    assert 0 <= value(text, "specstream_kv_cache_usage_ratio") <= 1
    assert value(text, "specstream_queue_depth") == 0
