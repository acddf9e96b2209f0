"""Requests a careless or hostile client sends: each is refused (or served) with the status
its docs name, costs bounded work, and leaves the server serving everyone else."""

from __future__ import annotations

import io

import grpc
import pytest

from clients import error_details
from service.engine.types import Delta, Started
from service.logging import configure_logging
from tests.support.fake_engine import FakeEngine, finished
from tests.support.grpc_harness import TEST_ENGINE, serving

GEN = "/specstream.v1.GenerationService"


def _answer(request, sink, handle) -> None:
    sink(Started(prompt_tokens=len(request.prompt_ids), seed=3))
    sink(Delta((5,), "five"))
    sink(finished(n=1))


def _error(fn) -> object:
    with pytest.raises(grpc.RpcError) as ei:
        fn()
    return error_details(ei.value)


# ------------------------------------------------------------------ request ids
def test_request_id_in_the_body_is_bounded_like_the_metadata_form():
    log = io.StringIO()
    configure_logging("info", stream=log)
    try:
        with serving(FakeEngine(_answer, config=TEST_ENGINE)) as (_, c):
            e = _error(lambda: c.complete(tokens=[1], request_id="x" * 1_000_000))
            assert (e.code, [f for f, _ in e.field_violations]) == (
                "INVALID_ARGUMENT", ["request_id"])
            assert len(e.message) < 300
            ok = c.complete(tokens=[1], request_id="y" * 128)     # the bound itself is fine
            assert ok.text == "five"
    finally:
        configure_logging("warning")
    assert "x" * 200 not in log.getvalue()                         # not logged in full
