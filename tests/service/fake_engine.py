"""A scripted stand-in for the engine, for server mechanics only (backpressure, error mapping,
loading/draining states). Everything about generation itself is tested with the real engine."""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import SimpleNamespace

from service.config import EngineConfig
from service.engine.types import (
    Delta,
    Event,
    Finished,
    FinishReason,
    GenerationRequest,
    Started,
    Timings,
    Usage,
)


class FakeHandle:
    def __init__(self) -> None:
        self.cancelled = threading.Event()
        self.request_id = ""

    def cancel(self) -> None:
        self.cancelled.set()


class FakeEngine:
    """submit() runs `script(request, sink, handle)` on a thread, or raises `raises`."""

    def __init__(self, script: Callable | None = None, raises: BaseException | None = None,
                 config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig(backend="cpu", drafter="none", verify_width=1)
        self.script, self.raises = script, raises
        self.info = SimpleNamespace(name="fake", backend="cpu", n_ctx=self.config.n_ctx)
        self.handles: list[FakeHandle] = []
        self.queue_depth = 0
        self.active = 0

    def submit(self, request: GenerationRequest, sink: Callable[[Event], None]) -> FakeHandle:
        if self.raises is not None:
            raise self.raises
        handle = FakeHandle()
        self.handles.append(handle)
        threading.Thread(target=self.script, args=(request, sink, handle), daemon=True).start()
        return handle

    def stop(self, timeout: float | None = None) -> None:
        pass


def finished(reason: FinishReason = FinishReason.LENGTH, n: int = 0,
             error: str | None = None) -> Finished:
    return Finished(reason, Usage(1, n), Timings(), None, error)


def burst(n: int, text: str, done: threading.Event) -> Callable:
    """A script emitting n one-token Deltas as fast as the sink takes them."""
    def script(request, sink, handle) -> None:
        sink(Started(prompt_tokens=len(request.prompt_ids), seed=7))
        for i in range(n):
            sink(Delta((i,), f"{i}:{text};"))
        sink(finished(n=n))
        done.set()
    return script
