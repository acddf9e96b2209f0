"""vllm.grpc.engine.VllmEngine: the vLLM engine protocol, served beside specstream's own API
so that the SMG gateway (and other routers that speak it) can route to this server
(docs/scale-out.md).

    Generate            token ids (or text) in; chunks of token ids out (stream) or one
                        GenerateComplete per sample; fields mapped as vllm_requests.py lists
    Abort               cancels the named requests (the gateway sends it when its client leaves)
    HealthCheck         healthy while the engine serves; draining or stopped: unhealthy
    GetModelInfo        limits, special ids, our default sampling, and a tokenizer folder
    GetTokenizer        the same folder as a zip (tokenizer.json, tokenizer_config.json,
                        config.json; service/model/hf_export.py)
    GetServerInfo       uptime, running requests, draining, KV block size, slots
    GetLoads            queue, running rows, KV usage, prefix-cache hit rate
    SubscribeKvEvents   the blocks cached now, then every block stored in or evicted from the
                        prefix cache (service/engine/kv_events.py)
Embed, FlushCache and the profiler RPCs answer UNIMPLEMENTED.

The tokenizer folder is written once per vocabulary under the system's temporary directory,
named by the archive's sha256, and advertised by absolute path: a gateway on this host loads it
from disk, one elsewhere finds no such folder and (an absolute path being no hub id) falls back
to GetTokenizer instead of downloading a namesake's tokenizer.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import tempfile
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import structlog
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc
from smg_grpc_proto.generated import common_pb2

from service import __version__
from service.engine.kv_events import KvEvent
from service.engine.types import Delta, Finished, FinishReason, Started
from service.errors import InvalidRequestError
from service.model.hf_export import ModelFacts, tokenizer_files, zip_files
from service.server_samples import SampleGroup
from service.vllm_requests import (
    DEFAULT_SAMPLING,
    complete_of,
    input_logprobs,
    output_logprobs,
    requests_from_proto,
)

if TYPE_CHECKING:
    from service.server import ServingState

log = structlog.get_logger(__name__)
CHUNK_BYTES = 1 << 20            # GetTokenizer chunk size (under every gRPC message limit)


def service_name() -> str:
    return vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"].full_name


# ------------------------------------------------------------------------- the tokenizer
class TokenizerExport:
    """The engine's vocabulary as files, a zip archive and a folder on disk, made once."""

    def __init__(self, engine: Any) -> None:
        info = engine.info
        facts = ModelFacts(name=info.name, architecture=info.architecture, n_ctx=info.n_ctx,
                           n_layer=getattr(info, "n_layer", 0), n_embd=getattr(info, "n_embd", 0))
        self.files = tokenizer_files(engine.tokenizer, engine.chat_template, facts)
        self.archive = zip_files(self.files)
        self.sha256 = hashlib.sha256(self.archive).hexdigest()
        self.folder = Path(tempfile.gettempdir()) / f"specstream-tokenizer-{self.sha256[:16]}"
        if not all((self.folder / n).is_file() for n in self.files):
            staging = Path(tempfile.mkdtemp(prefix=self.folder.name + ".", dir=self.folder.parent))
            for name, data in self.files.items():
                (staging / name).write_bytes(data)
            try:
                staging.rename(self.folder)  # atomic: a reader never sees half a folder
            except OSError:                  # another server wrote it first
                for p in staging.iterdir():
                    p.unlink()
                staging.rmdir()


# ------------------------------------------------------------------------- the servicer
class VllmEngineServicer:
    """vllm.grpc.engine.VllmEngine over the serving state's engine (see the module docstring)."""

    def __init__(self, state: ServingState) -> None:
        self._state = state
        self._live: dict[str, list[Any]] = {}     # request id -> its samples' handles
        self._t0 = time.time()
        self._last_receive = 0.0
        self._export: TokenizerExport | None = None
        self._export_lock = asyncio.Lock()

    async def _tokenizer(self, engine: Any) -> TokenizerExport | None:
        """The export, made on first use; None for a model without a vocabulary (token ids
        only: a gateway has nothing to tokenize with)."""
        if not engine.tokenizer.can_encode:
            return None
        async with self._export_lock:
            if self._export is None:
                self._export = await self._state.off_loop(TokenizerExport, engine)
            return self._export

    # ---- generation
    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> None:
        state = self._state
        engine = state.require_engine(admitting=True)
        self._last_receive = time.time()
        pb = vllm_engine_pb2
        reqs = await requests_from_proto(state, engine, request)
        rid, stream = request.request_id, request.stream
        chosen_only = request.sampling_params.HasField("logprobs") and \
            request.sampling_params.logprobs == 0
        group = SampleGroup(engine, reqs, state.server_config.stream_buffer)
        self._live[rid] = group.handles
        state.metrics.streams.inc()      # the request metrics count both protocols' requests
        try:
            ids: list[list[int]] = [[] for _ in reqs]
            deltas: list[list[Delta]] = [[] for _ in reqs]
            prompt = [0] * len(reqs)
            # the prompt's log-probabilities (prompt_logprobs), until they went out
            scores: list[Any] = [None] * len(reqs)
            async for i, event in group.events():
                if isinstance(event, Started):
                    prompt[i] = event.prompt_tokens
                    if reqs[i].prompt_logprobs is not None:
                        scores[i] = input_logprobs(pb, reqs[i].prompt_ids,
                                                   event.prompt_logprobs)
                elif isinstance(event, Delta):
                    ids[i] += event.token_ids
                    if stream:
                        chunk = pb.GenerateStreamChunk(
                            token_ids=event.token_ids, prompt_tokens=prompt[i],
                            completion_tokens=len(ids[i]), index=i)
                        if scores[i] is not None:            # the first chunk carries them
                            chunk.input_logprobs.CopyFrom(scores[i])
                            scores[i] = None
                        if event.logprobs:
                            chunk.output_logprobs.CopyFrom(
                                output_logprobs(pb, event, chosen_only))
                        await context.write(pb.GenerateResponse(chunk=chunk))
                    else:
                        deltas[i].append(event)
                else:
                    msg = self._complete(pb, event, ids[i], deltas[i], i, stream, chosen_only)
                    if scores[i] is not None:
                        msg.input_logprobs.CopyFrom(scores[i])
                    state.metrics.observe_finished(event, group.buffers[i].merged)
                    await context.write(pb.GenerateResponse(complete=msg))
        finally:
            state.metrics.streams.dec()
            self._live.pop(rid, None)
            for h in group.unfinished():  # cancel, deadline, Abort, broken connection, shutdown
                h.cancel()

    def _complete(self, pb: Any, event: Finished, ids: list[int], deltas: list[Delta],
                  index: int, stream: bool, chosen_only: bool) -> Any:
        if event.reason is FinishReason.ERROR:
            log.error("engine_request_failed", error=event.error)
            raise RuntimeError("the engine failed on this request")
        # streamed: the ids went out in the chunks; unary: all of them here
        msg = complete_of(pb, event, [] if stream else ids, index)
        lps = [lp for d in deltas for lp in d.logprobs]
        if lps and not stream:
            msg.output_logprobs.CopyFrom(output_logprobs(
                pb, Delta(tuple(ids), "", tuple(lps)), chosen_only))
        return msg

    async def Abort(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        for rid in request.request_ids:
            for handle in self._live.get(rid, ()):
                handle.cancel()
        return vllm_engine_pb2.AbortResponse()

    # ---- state
    def _serving(self) -> tuple[bool, str]:
        st = self._state
        if st.draining:
            return False, "draining: send new requests to another replica"
        if st.engine is None:
            return False, "the model is still loading"
        if not getattr(st.engine, "healthy", True):
            return False, "the engine has stopped"
        return True, "serving"

    async def HealthCheck(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        healthy, message = self._serving()
        return vllm_engine_pb2.HealthCheckResponse(healthy=healthy, message=message)

    async def GetModelInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        engine = self._state.require_engine()
        export = await self._tokenizer(engine)
        info, tok = engine.info, engine.tokenizer
        return vllm_engine_pb2.GetModelInfoResponse(
            model_path=str(info.path), is_generation=True, max_context_length=int(info.n_ctx),
            vocab_size=int(info.vocab_size), supports_vision=False,
            served_model_name=Path(info.path).stem,
            tokenizer_path=str(export.folder) if export is not None else "",
            model_type=str(info.architecture), architectures=[str(info.architecture)],
            eos_token_ids=sorted(int(i) for i in info.eog_ids),
            pad_token_id=-1, bos_token_id=tok.bos_id if tok.bos_id is not None else -1,
            max_req_input_len=int(info.n_ctx) - 1,
            default_sampling_params_json=json.dumps(DEFAULT_SAMPLING))

    async def GetServerInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        st = self._state
        engine = st.engine
        cfg = engine.config if engine is not None else st.engine_config
        pool = getattr(engine, "pool", None)
        return vllm_engine_pb2.GetServerInfoResponse(
            active_requests=(engine.active + engine.queue_depth) if engine is not None else 0,
            is_paused=st.draining, last_receive_timestamp=self._last_receive,
            uptime_seconds=time.time() - self._t0, server_type="specstream",
            data_parallel_size=1, kv_cache_dtype=f"{cfg.kv_cache_type_k}/{cfg.kv_cache_type_v}",
            block_size=pool.block_size if pool is not None else 0,
            model_dtype=str(engine.info.file_type) if engine is not None else "",
            max_num_seqs=cfg.n_slots)

    async def GetLoads(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        pb = vllm_engine_pb2
        engine = self._state.require_engine()
        if request.HasField("dp_rank") and request.dp_rank != 0:
            return pb.GetLoadsResponse(timestamp=_now(), version=__version__, dp_rank_count=1)
        pool = engine.pool
        running, waiting = engine.active, engine.queue_depth
        used, total = pool.used_blocks * pool.block_size, pool.n_blocks * pool.block_size
        load = pb.SchedulerLoad(
            dp_rank=0, num_running_reqs=running, num_waiting_reqs=waiting,
            num_total_reqs=running + waiting, num_used_tokens=used, max_total_num_tokens=total,
            token_usage=used / total if total else 0.0,
            cache_hit_rate=pool.hits / pool.lookups if pool.lookups else 0.0,
            max_running_requests=engine.config.n_slots)
        return pb.GetLoadsResponse(timestamp=_now(), version=__version__, dp_rank_count=1,
                                   loads=[load])

    # ---- not served
    async def _unimplemented(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            "not served by specstream (docs/scale-out.md)")

    Embed = FlushCache = StartProfile = StopProfile = _unimplemented

    # ---- tokenizer and KV events
    async def GetTokenizer(self, request: Any, context: grpc.aio.ServicerContext
                           ) -> AsyncIterator[Any]:
        export = await self._tokenizer(self._state.require_engine())
        if export is None:
            raise InvalidRequestError("request", "this model has no vocabulary to export",
                                      reason="FAILED_PRECONDITION")
        common = common_pb2
        data = export.archive
        for start in range(0, len(data), CHUNK_BYTES):
            last = start + CHUNK_BYTES >= len(data)
            yield common.GetTokenizerChunk(data=data[start:start + CHUNK_BYTES],
                                           sha256=export.sha256 if last else "")

    async def SubscribeKvEvents(self, request: Any, context: grpc.aio.ServicerContext
                                ) -> AsyncIterator[Any]:
        engine = self._state.require_engine()
        common = common_pb2
        events = engine.kv_events
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[KvEvent] = asyncio.Queue()

        def listener(ev: KvEvent) -> None:          # engine thread: never blocks
            try:
                loop.call_soon_threadsafe(queue.put_nowait, ev)
            except RuntimeError:
                pass                                 # the loop has closed

        snapshot = events.subscribe(listener)
        try:
            # the subscriber's view starts from nothing: clear, then every block cached now
            first = [common.KvCacheEvent(event_id=0, cleared=common.KvCacheCleared())]
            first += [_kv_event(common, ev, events.block_size) for ev in snapshot]
            seen = max((ev.event_id for ev in snapshot), default=0)
            seq = 1
            yield common.KvEventBatch(sequence_number=seq, timestamp=time.time(), events=first,
                                      dp_rank=0)
            while True:
                batch = [await queue.get()]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                batch = [ev for ev in batch if ev.event_id > seen]   # already in the snapshot
                if not batch:
                    continue
                seq += 1
                yield common.KvEventBatch(
                    sequence_number=seq, timestamp=time.time(), dp_rank=0,
                    events=[_kv_event(common, ev, events.block_size) for ev in batch])
        finally:
            events.unsubscribe(listener)


def _kv_event(common: Any, ev: KvEvent, block_size: int) -> Any:
    if ev.stored:
        stored = common.KvBlocksStored(blocks=[common.KvBlock(
            block_hash=ev.block_hash, token_ids=ev.token_ids, block_size=block_size)],
            tier=common.KV_CACHE_TIER_DEVICE, locality=common.KV_CACHE_LOCALITY_LOCAL)
        if ev.parent_hash is not None:
            stored.parent_block_hash = ev.parent_hash
        return common.KvCacheEvent(event_id=ev.event_id, stored=stored)
    return common.KvCacheEvent(event_id=ev.event_id, removed=common.KvBlocksRemoved(
        block_hashes=[ev.block_hash], tier=common.KV_CACHE_TIER_DEVICE,
        locality=common.KV_CACHE_LOCALITY_LOCAL))


def _now() -> str:
    return datetime.now(UTC).isoformat()


def add_vllm_engine(state: ServingState, server: grpc.aio.Server) -> None:
    """Registers the VllmEngine service on `server` (build_server calls this when
    ServerConfig.vllm_engine is on)."""
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(VllmEngineServicer(state), server)
