"""A scripted stand-in for the engine, for what the server does on its own: backpressure, error
mapping, loading/draining states, and the validation of request fields (the engine's own checks
run here too, so a field the engine refuses is refused the same way). Everything about generation
itself is tested with the real engine."""

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

VOCAB = 49152                    # token ids 0..VOCAB-1 are valid (SmolLM2's vocabulary size)


class FakeHandle:
    def __init__(self) -> None:
        self.cancelled = threading.Event()
        self.request_id = ""

    def cancel(self) -> None:
        self.cancelled.set()


class FakeEngine:
    """submit() checks the request as Engine.submit does (GenerationRequest.validate against
    `vocab_size` and the config's context), then raises `raises` or runs
    `script(request, sink, handle)` on a thread."""

    def __init__(self, script: Callable | None = None, raises: BaseException | None = None,
                 config: EngineConfig | None = None, vocab_size: int = VOCAB) -> None:
        self.config = config or EngineConfig(backend="cpu", drafter="none", verify_width=1)
        self.script, self.raises = script, raises
        self.spec = SimpleNamespace(vocab_size=vocab_size)
        self.info = SimpleNamespace(name="fake", backend="cpu", n_ctx=self.config.n_ctx)
        self.handles: list[FakeHandle] = []
        self.queue_depth = 0
        self.active = 0

    def submit(self, request: GenerationRequest, sink: Callable[[Event], None]) -> FakeHandle:
        request.validate(self.spec.vocab_size, self.config.n_ctx)
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
