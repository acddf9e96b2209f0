"""The stdlib bridge of service/logging.py: library log records keep their tracebacks."""

from __future__ import annotations

import io
import json
import logging

from service.logging import configure_logging


def test_stdlib_exception_keeps_its_traceback():
    out = io.StringIO()
    configure_logging("info", stream=out)
    try:
        try:
            raise ValueError("boom in a library")
        except ValueError:
            logging.getLogger("some.library").exception("library call failed")
    finally:
        configure_logging("warning")
    (line,) = [json.loads(x) for x in out.getvalue().splitlines() if "library call" in x]
    assert (line["event"], line["logger"], line["level"]) == (
        "library call failed", "some.library", "error")
    assert "Traceback (most recent call last)" in line["exception"]
    assert "ValueError: boom in a library" in line["exception"]
