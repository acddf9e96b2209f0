"""structlog setup: one JSON object per line on stderr, request ids bound per RPC.

`configure_logging()` is called once by a process entry point (serve, bench); library code only
calls `structlog.get_logger(__name__)`. Request ids live in structlog's contextvars, which
asyncio copies into each RPC's task, so concurrent streams never mix their ids.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}


def configure_logging(level: str = "info", fmt: str = "json", stream: TextIO | None = None) -> None:
    """JSON (or console) lines with timestamp, level, event, logger and any bound context."""
    stream = _CurrentStderr() if stream is None else stream
    renderer = (structlog.processors.JSONRenderer() if fmt == "json"
                else structlog.dev.ConsoleRenderer(colors=False))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            structlog.processors.UnicodeDecoder(),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS.get(level, logging.INFO)),
        logger_factory=structlog.WriteLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    # Libraries using stdlib logging (grpc, numba) go through the same renderer, warnings and up.
    root = logging.getLogger()
    root.handlers = [h for h in root.handlers if not isinstance(h, _ToStructlog)]
    root.addHandler(_ToStructlog())
    root.setLevel(logging.WARNING)


class _CurrentStderr:
    """Whatever sys.stderr is at write time (it may be replaced after logging is configured)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


class _ToStructlog(logging.Handler):
    """A stdlib record as one structlog event; its exception and stack go along, rendered by
    format_exc_info / StackInfoRenderer into the "exception" / "stack" keys."""

    def emit(self, record: logging.LogRecord) -> None:
        extra: dict[str, object] = {}
        if record.exc_info:
            extra["exc_info"] = record.exc_info
        if record.stack_info:
            extra["stack"] = record.stack_info   # already formatted by the logging module
        try:
            structlog.get_logger(record.name).log(record.levelno, record.getMessage(),
                                                  logger=record.name, **extra)
        except Exception:  # noqa: BLE001 - logging must never raise into the caller
            self.handleError(record)


def bind_request_id(request_id: str) -> None:
    """Adds request_id to every log line of the current task (one RPC)."""
    structlog.contextvars.bind_contextvars(request_id=request_id)
