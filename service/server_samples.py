"""n > 1: parallel samples of one prompt, for both gRPC protocols (specstream.v1's
GenerateRequest.n and the vLLM protocol's sampling_params.n).

Sample i is its own engine request: the same prompt and controls, request id "<id>-<i>" and
seed base + i (mod 2^64), base being the request's seed or, unset, one the server draws (so the
samples differ, and replaying with sample 0's reported seed and the same n gives them all
again). A greedy request's samples are identical (their seeds draw nothing).

The prompt is processed once: sample 0 is submitted first and the others when its prompt is done
(its first Delta or its Finished), so they take its full KV blocks from the prefix cache and
compute only the partial last block. Without a prefix cache all go at once. The events of every
sample come out merged as they arrive, each with its sample index, until every sample finished.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from service.engine.sampling import resolve_seed
from service.engine.types import (
    Event,
    Finished,
    FinishReason,
    GenerationRequest,
    Started,
    Timings,
    Usage,
)
from service.errors import InvalidRequestError


def sample_requests(base: GenerationRequest, n: int) -> list[GenerationRequest]:
    """The n samples of `base` (itself when n == 1)."""
    if n == 1:
        return [base]
    seed = resolve_seed(base.sampling.seed, base.sampling.greedy)
    return [replace(base, request_id=f"{base.request_id}-{i}",
                    sampling=replace(base.sampling, seed=(seed + i) % 2**64)) for i in range(n)]


def check_samples_fit(n: int, config: Any, field: str) -> None:
    """INVALID_ARGUMENT on `field` when n samples (n engine requests) are more than the engine
    runs and queues at once, n_slots + max_queue: the samples past that were refused with
    RESOURCE_EXHAUSTED after sample 0 had started, on an idle server too, so a client that
    honoured the retry delay retried forever."""
    most = config.n_slots + config.max_queue
    if n > most:
        raise InvalidRequestError(field, f"{n} samples; this server runs and queues at most "
                                  f"{most} requests (n_slots {config.n_slots} + max_queue "
                                  f"{config.max_queue})")


class SampleGroup:
    """The engine requests of one call's samples, their event buffers and handles."""

    def __init__(self, engine: Any, reqs: list[GenerationRequest], stream_buffer: int,
                 on_submit: Callable[[Any], None] = lambda handle: None) -> None:
        from service.server_generate import EventBuffer  # it imports this module

        loop = asyncio.get_running_loop()
        self._engine, self._reqs, self._on_submit = engine, reqs, on_submit
        self._given = reqs
        self.buffers = [EventBuffer(loop, stream_buffer) for _ in reqs]
        self.handles: list[Any] = []
        self.done = [False] * len(reqs)
        staged = len(reqs) > 1 and getattr(engine.config, "prefix_cache", False)
        if staged:           # sample 0 computes the prompt's log-probabilities for all
            self._reqs = reqs[:1] + [replace(r, prompt_logprobs=None) for r in reqs[1:]]
        self._prompt_logprobs: tuple = ()
        self._submit(1 if staged else len(reqs))

    def _submit(self, upto: int) -> None:
        for i in range(len(self.handles), upto):
            handle = self._engine.submit(self._reqs[i], self.buffers[i].sink)
            self.handles.append(handle)
            self._on_submit(handle)

    async def events(self) -> AsyncIterator[tuple[int, Event]]:
        """(sample index, event) as they come, until every sample has sent Finished."""
        n = len(self._reqs)
        if n == 1:                  # one stream: its buffer alone, no task per event
            buf = self.buffers[0]
            while not self.done[0]:
                event = await buf.get()
                self.done[0] = isinstance(event, Finished)
                yield 0, event
            return
        reqs_given = self._given
        pending: dict[asyncio.Future, int] = {}

        def wait(i: int) -> None:
            pending[asyncio.ensure_future(self.buffers[i].get())] = i

        for i in range(len(self.handles)):
            wait(i)
        try:
            while pending:
                ready, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(ready, key=pending.__getitem__):
                    i = pending.pop(task)
                    event = task.result()
                    if isinstance(event, Finished):
                        self.done[i] = True
                    else:
                        wait(i)
                    staged = i == 0 and not isinstance(event, Started) and len(self.handles) < n
                    if isinstance(event, Started) and i == 0:
                        self._prompt_logprobs = event.prompt_logprobs
                    elif isinstance(event, Started) and self._reqs[i] is not reqs_given[i]:
                        event = replace(event, prompt_logprobs=self._prompt_logprobs)
                    yield i, event
                    if staged and self._cancelled(event):
                        for j in range(len(self.handles), n):   # never started: end them too
                            self.done[j] = True
                            yield j, Finished(FinishReason.CANCELLED, Usage(), Timings())
                    elif staged:
                        first = len(self.handles)
                        self._submit(n)          # sample 0's prompt is processed
                        for j in range(first, n):
                            wait(j)
        finally:
            for task in pending:
                task.cancel()

    @staticmethod
    def _cancelled(event: Event) -> bool:
        return isinstance(event, Finished) and event.reason in (FinishReason.CANCELLED,
                                                                FinishReason.ERROR)

    def unfinished(self) -> list[Any]:
        """Handles of the submitted samples that have not finished."""
        return [h for h, d in zip(self.handles, self.done, strict=False) if not d]
