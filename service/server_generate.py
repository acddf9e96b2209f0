"""specstream.v1.GenerationService: Generate streams a request's events; Tokenize and
Detokenize answer at once.

The engine thread never waits on a client: its sink only queues the event for the event loop
(LoopMailbox: one wake-up of the loop for everything queued before the loop drains it, so a step
costs one loop hop, not one per stream). Each stream buffers at most `stream_buffer` events;
past that, pending Deltas are merged into one, so a slow reader costs memory proportional to
its text, never an engine stall. A cancelled or expired call raises CancelledError in the
handler, whose `finally` cancels the engine request (the engine frees the slot within one
step).
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections import deque
from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import grpc
import structlog

from service.engine.types import Delta, Event, Finished, FinishReason, Started
from service.errors import InvalidRequestError
from service.proto_build import stubs
from service.server_requests import n_from_proto, optional, prompt_ids, request_from_proto
from service.server_samples import SampleGroup, check_samples_fit, sample_requests

if TYPE_CHECKING:                # generated on first use (service.proto_build.stubs)
    from service.proto import generation_pb2
    from service.server import ServingState

log = structlog.get_logger(__name__)
MAX_DETOKENIZE_IDS = 1 << 18     # ids per Detokenize call: far beyond any context, bounded work


# ------------------------------------------------------------------------- engine -> stream
def merge_deltas(a: Delta, b: Delta) -> Delta:
    return Delta(token_ids=a.token_ids + b.token_ids, text=a.text + b.text,
                 logprobs=a.logprobs + b.logprobs)


class LoopMailbox:
    """The engine thread's hand-off to one event loop, shared by every stream on it: events
    queue here (buffer, event) under a lock, and ONE call_soon_threadsafe wakes the loop for
    all that queue before it drains them, so a step that emits to 64 streams costs one loop
    hop, not 64 (each hop writes to the loop's self-pipe and contends for the GIL). Each
    buffer's events keep their order: one FIFO, drained in order on the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[EventBuffer, Event]] = []
        self._scheduled = False
        self.hops = 0                    # loop wake-ups scheduled (tests, benchmarks)

    def put(self, buffer: EventBuffer, event: Event) -> None:
        """Called on the engine thread; never blocks (beyond the lock), never raises."""
        with self._lock:
            self._items.append((buffer, event))
            if self._scheduled:
                return
            self._scheduled = True
            self.hops += 1
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:
            pass                         # the loop is closed: nobody is listening any more

    def _drain(self) -> None:
        with self._lock:
            items, self._items, self._scheduled = self._items, [], False
        for buffer, event in items:
            buffer._push(event)


_MAILBOXES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def mailbox(loop: asyncio.AbstractEventLoop) -> LoopMailbox:
    """The loop's mailbox (made on first use, on the loop's thread)."""
    box = _MAILBOXES.get(loop)
    if box is None:
        box = _MAILBOXES[loop] = LoopMailbox(loop)
    return box


class EventBuffer:
    """Bounded hand-off of one request's events from the engine thread to its stream."""

    def __init__(self, loop: asyncio.AbstractEventLoop, maxsize: int) -> None:
        self._loop = loop
        self._mailbox = mailbox(loop)
        self._maxsize = max(1, maxsize)
        self._items: deque[Event] = deque()
        self._waiter: asyncio.Future | None = None
        self.merged = 0                  # Deltas folded into an earlier one

    def sink(self, event: Event) -> None:
        """Called on the engine thread; never blocks, never raises."""
        self._mailbox.put(self, event)

    def _push(self, event: Event) -> None:
        items = self._items
        if (isinstance(event, Delta) and len(items) >= self._maxsize
                and isinstance(items[-1], Delta)):
            items[-1] = merge_deltas(items[-1], event)
            self.merged += 1
        else:
            items.append(event)          # Started/Finished are never merged: at most max + 2
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> Event:
        while not self._items:
            self._waiter = self._loop.create_future()
            await self._waiter
        return self._items.popleft()


# ------------------------------------------------------------------------- domain -> proto
@lru_cache(maxsize=1)
def _finish_reasons() -> dict[FinishReason, int]:
    values = stubs().generation_pb2.FinishReason
    return {r: values.Value(f"FINISH_REASON_{r.name}")
            for r in FinishReason if r is not FinishReason.ERROR}


def _token_logprob(pb: Any, lp: Any) -> Any:
    return pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                           top=[pb.TopLogprob(token_id=t, logprob=p) for t, p in lp.top])


def response_from_event(request_id: str, event: Event, index: int = 0
                        ) -> generation_pb2.GenerateResponse:
    pb = stubs().generation_pb2
    if isinstance(event, Started):
        return pb.GenerateResponse(request_id=request_id, index=index, started=pb.Started(
            prompt_tokens=event.prompt_tokens, seed=event.seed,
            prompt_logprobs=[_token_logprob(pb, lp) for lp in event.prompt_logprobs]))
    if isinstance(event, Delta):
        return pb.GenerateResponse(request_id=request_id, index=index, delta=pb.Delta(
            token_ids=event.token_ids, text=event.text,
            logprobs=[_token_logprob(pb, lp) for lp in event.logprobs]))
    u, t = event.usage, event.timings
    fin = pb.Finished(
        reason=_finish_reasons()[event.reason],
        usage=pb.Usage(**vars(u)), timings=pb.Timings(**vars(t)))
    if isinstance(event.matched_stop, str):
        fin.stop_sequence = event.matched_stop
    elif isinstance(event.matched_stop, int):
        fin.stop_token_id = event.matched_stop
    return pb.GenerateResponse(request_id=request_id, index=index, finished=fin)


def tokenize_response(engine: Any, ids: tuple[int, ...]) -> generation_pb2.TokenizeResponse:
    pieces = [engine.tokenizer.token_piece(i) for i in ids]
    return stubs().generation_pb2.TokenizeResponse(ids=ids, pieces=pieces)


def detokenize_response(engine: Any, ids: Sequence[int], skip_special: bool
                        ) -> generation_pb2.DetokenizeResponse:
    vocab = engine.tokenizer.vocab_size
    for i, t in enumerate(ids):
        if t >= vocab:
            raise InvalidRequestError(f"ids[{i}]", f"token id {t} is outside the "
                                                   f"vocabulary [0, {vocab})")
    text = engine.tokenizer.decode(ids, skip_special=skip_special)
    return stubs().generation_pb2.DetokenizeResponse(text=text)


# ------------------------------------------------------------------------- servicers
class GenerationServicer:
    """specstream.v1.GenerationService (registered by build_server)."""

    def __init__(self, state: ServingState) -> None:
        self._state = state

    async def Generate(self, request: generation_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> None:
        state = self._state
        engine = state.require_engine(admitting=True)
        rid = request.request_id     # the interceptor filled it in when empty
        n = n_from_proto(request)
        check_samples_fit(n, engine.config, "n")
        domain = await request_from_proto(state, engine, request)
        reqs = sample_requests(domain, n)
        # shutdown cancels each sample: Finished(CANCELLED) ends its part of the stream
        group = SampleGroup(engine, reqs, state.server_config.stream_buffer,
                            state.open_requests.add)
        state.load.admitted()
        state.metrics.streams.inc()
        try:
            async for i, event in group.events():
                if isinstance(event, Finished):
                    if event.reason is FinishReason.ERROR:
                        log.error("engine_request_failed", error=event.error)
                        raise RuntimeError("the engine failed on this request")
                    merged = group.buffers[i].merged
                    state.metrics.observe_finished(event, merged)
                    log.info("generate_finished", reason=event.reason.value, index=i,
                             prompt_tokens=event.usage.prompt_tokens,
                             completion_tokens=event.usage.completion_tokens,
                             ttft_ms=round(event.timings.time_to_first_token_ms, 3),
                             merged_deltas=merged)
                    if all(group.done):  # the trailer goes out with the status, after this
                        state.load.attach(context, engine)
                await context.write(response_from_event(rid, event, i))
        finally:
            state.metrics.streams.dec()
            for h in group.handles:
                state.open_requests.discard(h)
            left = group.unfinished()
            for h in left:           # cancel, deadline, broken connection, shutdown
                h.cancel()
            if left:
                log.info("generate_cancelled")

    async def Tokenize(self, request: generation_pb2.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> generation_pb2.TokenizeResponse:
        state = self._state
        engine = state.require_engine()
        if request.WhichOneof("input") is None:
            raise InvalidRequestError("input", "set one of text or chat")
        ids = await prompt_ids(state, engine, request)
        return await state.off_loop(tokenize_response, engine, ids)

    async def Detokenize(self, request: generation_pb2.DetokenizeRequest,
                         context: grpc.aio.ServicerContext) -> generation_pb2.DetokenizeResponse:
        state = self._state
        engine = state.require_engine()
        n = len(request.ids)
        if n > MAX_DETOKENIZE_IDS:       # refused before a copy or a lookup is made
            raise InvalidRequestError("ids", f"{n} ids; at most {MAX_DETOKENIZE_IDS} per call")
        return await state.off_loop(detokenize_response, engine, list(request.ids),
                                    optional(request, "skip_special", False, bool))
