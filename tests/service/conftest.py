"""A real server on a localhost port: the CPU engine with the real SmolLM2 model.

The engine is loaded once per session and served in-process (BackgroundServer: its own event
loop thread, real sockets, real client). Tests that need their own process (SIGTERM, startup
exit codes) start `specstream serve` as a subprocess (grpc_harness.ServeProcess).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from clients import SpecstreamClient
from service.config import DEFAULT_MODEL, models_dir_from_env
from service.gguf.fetch import resolve_model
from service.logging import configure_logging
from service.proto_build import stubs
from service.serve import BackgroundServer

from .grpc_harness import TEST_ENGINE, ServeProcess

stubs()  # the test modules import service.proto directly; a fresh clone has no stubs yet


@pytest.fixture(scope="session")
def model_path() -> Path:
    return resolve_model(DEFAULT_MODEL, models_dir_from_env())   # fetched on first use


@pytest.fixture(scope="session")
def engine(model_path):
    from service.engine.engine import Engine

    eng = Engine.load(model_path, TEST_ENGINE)
    eng.start()
    eng.warmup()
    yield eng
    eng.stop(10)


@pytest.fixture(scope="session")
def server(engine) -> Iterator[BackgroundServer]:
    configure_logging("warning")   # servers log from background threads; keep output readable
    srv = BackgroundServer(engine).start()
    yield srv
    srv.stop()


@pytest.fixture()
def client(server) -> Iterator[SpecstreamClient]:
    with SpecstreamClient(server.target, timeout=120) as c:
        yield c


@pytest.fixture()
def serve_subprocess():
    started: list[ServeProcess] = []

    def start(args: list[str], env: dict[str, str] | None = None) -> ServeProcess:
        p = ServeProcess(args, env)
        started.append(p)
        return p

    yield start
    for p in started:
        p.kill()
