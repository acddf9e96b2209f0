"""Cancellation, deadlines, concurrency, slow readers and SIGTERM drain."""

from __future__ import annotations

import io
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from clients import SpecstreamClient
from service.config import ServerConfig
from service.engine.types import Delta, Started
from service.logging import configure_logging
from service.serve import BackgroundServer
from service.server_generate import EventBuffer
from tests.support.engines import wait_idle
from tests.support.fake_engine import FakeEngine, burst
from tests.support.grpc_harness import SERVE_FLAGS, serving

LONG = {"max_new_tokens": 400, "ignore_eos": True, "temperature": 0.0}


def _next_request_served(client, engine) -> None:
    """The engine is free: a new request is admitted without waiting and completes."""
    assert engine.active == 0 and engine.queue_depth == 0
    done = client.complete("Hi", max_new_tokens=2, temperature=0.0)
    assert done.finish_reason in ("LENGTH", "EOS")


def test_cancel_frees_the_slot(client, engine):
    wait_idle(engine)
    stream = client.generate("Count: 1, 2, 3,", **LONG)
    kinds = [next(stream).WhichOneof("event"), next(stream).WhichOneof("event")]
    assert kinds == ["started", "delta"]
    assert engine.active == 1
    stream.close()                                   # leaving the loop cancels the call
    wait_idle(engine)
    _next_request_served(client, engine)


def test_cancel_every_slot_then_serve(server, engine):
    """Fill every slot (and the queue) with long requests, cancel them all: all slots free."""
    clients = [SpecstreamClient(server.target) for _ in range(engine.config.n_slots + 2)]
    streams = [c.generate("Once upon a time", **LONG) for c in clients]
    for s in streams[:engine.config.n_slots]:
        assert next(s).HasField("started")
    for s in streams:
        s.close()
    wait_idle(engine)
    with SpecstreamClient(server.target) as c:
        _next_request_served(c, engine)
    for c in clients:
        c.close()


def test_deadline_frees_the_slot(client, engine):
    with pytest.raises(grpc.RpcError) as ei:
        list(client.generate("Count: 1, 2, 3,", timeout=1.5, **LONG))
    assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_idle(engine)
    with engine._lock:                  # every KV block is back: free or cached, none held
        engine.pool.check()
        assert engine.pool.used_blocks == 0 and not engine.pool.owned
    _next_request_served(client, engine)


PROMPTS = [f"{subject} is" for subject in (
    "The sun", "Water", "A cat", "Paris", "Music", "The ocean", "Mathematics", "A tree",
    "Coffee", "The moon", "Python", "A river", "Winter", "The brain", "Gold", "Bread")]


def test_16_concurrent_streams_match_running_alone(server, client, engine):
    kw = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    alone = [client.complete(p, **kw) for p in PROMPTS]

    def run(prompt: str):
        with SpecstreamClient(server.target, timeout=300) as c:
            return c.complete(prompt, **kw)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(run, PROMPTS))
    for p, a, b in zip(PROMPTS, alone, together, strict=True):
        assert (b.text, b.token_ids, b.finish_reason) == (a.text, a.token_ids, "LENGTH"), p
    wait_idle(engine)


# ------------------------------------------------------------------ slow readers
def test_event_buffer_merges_deltas_past_its_bound():
    import asyncio

    async def run() -> list:
        buf = EventBuffer(asyncio.get_running_loop(), maxsize=4)
        for i in range(100):
            buf._push(Delta((i,), str(i)))
        return [await buf.get() for _ in range(4)], buf.merged

    events, merged = asyncio.run(run())
    assert merged == 96
    ids = [t for e in events for t in e.token_ids]
    assert ids == list(range(100)) and "".join(e.text for e in events) == "".join(
        str(i) for i in range(100))


def test_slow_reader_never_blocks_the_engine():
    """The engine pushes 3000 deltas (about 3 MB) while the client reads nothing: all pushes
    return at once, and the client later gets every token in order, merged into fewer Deltas."""
    produced = threading.Event()
    n, text = 3000, "x" * 1000
    engine = FakeEngine(script=burst(n, text, produced))
    with serving(engine) as (srv, c):
        stream = c.generate(tokens=[1])
        assert next(stream).HasField("started")
        assert produced.wait(30), "the engine thread was blocked by a slow client"
        rest = list(stream)
    deltas = [r.delta for r in rest if r.HasField("delta")]
    assert rest[-1].HasField("finished")
    assert [t for d in deltas for t in d.token_ids] == list(range(n))
    assert "".join(d.text for d in deltas) == "".join(f"{i}:{text};" for i in range(n))
    assert len(deltas) < n


# ------------------------------------------------------------------ SIGTERM
def test_sigterm_drains(serve_subprocess, model_path):
    srv = serve_subprocess([str(model_path), *SERVE_FLAGS, "--grace-period", "60",
                            "--drain-delay", "4"])
    srv.wait_listening()
    with SpecstreamClient(srv.target, timeout=300) as c:
        c.wait_ready(120)
        assert c.health("specstream.v1.GenerationService") == "SERVING"
        stream = c.generate("The capital of France is", max_new_tokens=24, ignore_eos=True,
                            temperature=0.0, speculative=False)
        first = [next(stream), next(stream)]
        assert first[0].HasField("started")
        srv.terminate()
        time.sleep(0.5)
        assert c.health() == "NOT_SERVING"           # during the drain delay
        with pytest.raises(grpc.RpcError) as ei:
            list(c.generate("Hello", max_new_tokens=2))
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        rest = list(stream)                          # the in-flight stream finishes normally
    assert rest[-1].HasField("finished")
    tokens = sum(len(r.delta.token_ids) for r in first + rest if r.HasField("delta"))
    assert tokens == 24 and rest[-1].finished.usage.completion_tokens == 24
    rc, log = srv.wait(60)
    assert rc == 0, log
    assert '"draining"' in log and '"stopped"' in log


def test_dead_engine_turns_health_not_serving_and_refuses_generate():
    engine = FakeEngine(script=burst(1, "x", threading.Event()))
    engine.healthy = True
    with serving(engine) as (srv, c):
        assert c.health() == "SERVING"
        engine.healthy = False                # the engine thread died
        deadline = time.monotonic() + 10
        while c.health() == "SERVING":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert c.health() == "NOT_SERVING"
        with pytest.raises(grpc.RpcError) as e:
            list(c.generate(tokens=[1]))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


# ------------------------------------------------------------------ status of cut-off calls
GENERATE = "/specstream.v1.GenerationService/Generate"


def _endless(request, sink, handle) -> None:
    """A scripted request that streams until it is cancelled."""
    sink(Started(prompt_tokens=1, seed=1))
    while not handle.cancelled.is_set():
        sink(Delta((1,), "x"))
        time.sleep(0.02)


def _rpc_count(srv, code: str) -> float:
    value = srv.service.state.metrics.registry.get_sample_value(
        "specstream_rpcs_total", {"method": GENERATE, "code": code})
    return value or 0.0


def _wait_count(srv, code: str, n: int) -> None:
    deadline = time.monotonic() + 10
    while _rpc_count(srv, code) < n:
        assert time.monotonic() < deadline, f"{code}: {_rpc_count(srv, code)} of {n}"
        time.sleep(0.02)


def test_cancelled_expired_and_cut_off_streams_keep_their_status():
    """Metrics and the access log record what the client saw, never OK: cancelled streams
    CANCELLED, expired ones DEADLINE_EXCEEDED, streams cut off by the shutdown grace period
    UNAVAILABLE."""
    log = io.StringIO()
    configure_logging("info", stream=log)
    engine = FakeEngine(script=_endless)
    cfg = ServerConfig(host="127.0.0.1", port=0, metrics_port=0, grace_period_s=0.5)
    srv = BackgroundServer(engine, cfg, engine_cfg=engine.config).start()
    try:
        with SpecstreamClient(srv.target) as c:
            for _ in range(5):
                stream = c.generate(tokens=[1])
                assert next(stream).HasField("started")
                stream.close()
            _wait_count(srv, "CANCELLED", 5)
            with pytest.raises(grpc.RpcError) as ei:
                list(c.generate(tokens=[1], timeout=0.5))
            assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            _wait_count(srv, "DEADLINE_EXCEEDED", 1)
            stream = c.generate(tokens=[1])
            assert next(stream).HasField("started")
            srv.stop()                                   # the grace period runs out
            with pytest.raises(grpc.RpcError) as ei:
                list(stream)
            assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        configure_logging("warning")
    assert _rpc_count(srv, "UNAVAILABLE") == 1 and _rpc_count(srv, "OK") == 0
    codes = [e["code"] for e in map(json.loads, log.getvalue().splitlines())
             if e.get("event") == "rpc" and e.get("method") == GENERATE]
    assert codes == ["CANCELLED"] * 5 + ["DEADLINE_EXCEEDED", "UNAVAILABLE"]
