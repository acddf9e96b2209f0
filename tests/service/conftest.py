"""Servers of the service tests on localhost ports: the CPU engine with the real SmolLM2 model,
and the scripted engine (tests/support/fake_engine.py) where the model adds nothing to what a
test asserts (how request fields are checked and refused).

The real engine is loaded once per session and served in-process (BackgroundServer: its own
event loop thread, real sockets, real client). Tests that need their own process (SIGTERM,
startup exit codes) start `specstream serve` as a subprocess (grpc_harness.ServeProcess).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from clients import SpecstreamClient
from service.config import DEFAULT_MODEL
from service.engine.types import Started
from service.logging import configure_logging
from service.proto_build import stubs
from service.serve import BackgroundServer
from tests.support.engines import running_engine
from tests.support.fake_engine import FakeEngine, finished
from tests.support.grpc_harness import TEST_ENGINE, ServeProcess, serving
from tests.support.models import model_path as resolve

stubs()  # the test modules import service.proto directly; a fresh clone has no stubs yet


@pytest.fixture(scope="session")
def model_path() -> Path:
    return resolve(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def engine(model_path):
    with running_engine(model_path, config=TEST_ENGINE) as eng:
        eng.warmup()
        yield eng


@pytest.fixture(scope="session")
def server(engine) -> Iterator[BackgroundServer]:
    configure_logging("warning")   # servers log from background threads; keep output readable
    with BackgroundServer(engine) as srv:
        yield srv


@pytest.fixture()
def client(server) -> Iterator[SpecstreamClient]:
    with SpecstreamClient(server.target, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def fake_client() -> Iterator[SpecstreamClient]:
    """A client of a server around the scripted engine with the real engine's config
    (TEST_ENGINE) and vocabulary size: requests are checked exactly as the real server checks
    them; one that passes gets Started and Finished at once."""
    def answer(request, sink, handle) -> None:
        sink(Started(prompt_tokens=len(request.prompt_ids), seed=0))
        sink(finished())

    with serving(FakeEngine(answer, config=TEST_ENGINE)) as (_, client):
        yield client


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
