"""The gRPC server: the state its servicers share, and the grpc.aio server they run in.

The servicers are the only place that converts protobuf <-> domain types:
    server_generate.py   GenerationService (Generate, Tokenize, Detokenize) and the event stream
    server_orca.py       the ORCA load report a Generate call may ask for in its trailer
    server_config.py     ConfigService (GetModelInfo, GetConfig, ValidateConfig)
    server_requests.py   a GenerateRequest (or TokenizeRequest) as the engine's GenerationRequest
    vllm_service.py      vllm.grpc.engine.VllmEngine (ServerConfig.vllm_engine), for the SMG
                         gateway; its request mapping in vllm_requests.py
One interceptor (service/interceptors.py) maps every exception to its status code.

    client --Generate--> GenerationServicer --submit(GenerationRequest, sink)--> Engine thread
    client <--Started/Delta*/Finished-- EventBuffer <--LoopMailbox (one loop hop a batch)-- sink

Prompts are rendered and tokenized on a small thread pool (`PROMPT_WORKERS`), never on the event
loop (ServingState.off_loop).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from service.config import EngineConfig, ServerConfig
from service.errors import UnavailableError
from service.interceptors import ServiceInterceptor, status_for
from service.metrics import Metrics
from service.proto_build import DocumentedPool, stubs
from service.server_auth import AuthInterceptor, TokenAuthenticator
from service.server_config import ConfigServicer
from service.server_generate import GenerationServicer
from service.server_orca import LoadReporter

PROMPT_WORKERS = 2               # prompts rendered/tokenized at once; more wait their turn
CONSTRAINT_WORKERS = 1           # constraints compiled at once, apart from the prompts


def service_names() -> tuple[str, str]:
    """Full names of the GenerationService and the ConfigService."""
    pb = stubs()
    return (pb.generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name,
            pb.config_pb2.DESCRIPTOR.services_by_name["ConfigService"].full_name)


# ------------------------------------------------------------------------- serving state
@dataclass
class ServingState:
    """What the servicers share: the engine once loaded, the startup config, the drain flags."""

    engine_config: EngineConfig
    server_config: ServerConfig = field(default_factory=ServerConfig)
    metrics: Metrics = field(default_factory=Metrics)
    load: LoadReporter = field(default_factory=LoadReporter)  # ORCA reports (server_orca.py)
    health: health.aio.HealthServicer = field(default_factory=health.aio.HealthServicer)
    engine: Any = None               # service.engine.engine.Engine once loaded and warmed up
    draining: bool = False
    cut_off: bool = False            # the grace period ran out: calls still open are cancelled
    open_requests: set[Any] = field(default_factory=set)  # engine handles of open streams
    prompt_pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        PROMPT_WORKERS, thread_name_prefix="prompt"))
    # xgrammar compiles cannot be interrupted and some small grammars take minutes (1,250
    # characters of `"a"?` items: seconds; 5,000: minutes): on a pool of their own they hold up
    # other constrained requests only, never the prompts and Tokenize calls of the rest
    constraint_pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        CONSTRAINT_WORKERS, thread_name_prefix="constraint"))

    def require_engine(self, *, admitting: bool = False) -> Any:
        if admitting and self.draining:
            raise UnavailableError("the server is shutting down; send the request to another "
                                   "replica")
        if self.engine is None:
            raise UnavailableError("the model is still loading; retry shortly")
        if not getattr(self.engine, "healthy", True):
            raise UnavailableError("the engine has stopped; send the request to another replica")
        return self.engine

    async def set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", *service_names()):
            await self.health.set(name, status)

    async def off_loop(self, fn: Any, *args: Any) -> Any:
        """fn(*args) on the prompt pool: tokenizing and rendering never block the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.prompt_pool, fn, *args)

    async def compile_off_loop(self, fn: Any, *args: Any) -> Any:
        """fn(*args) (a constraint compile) on the constraint pool."""
        return await asyncio.get_running_loop().run_in_executor(self.constraint_pool, fn, *args)


# ------------------------------------------------------------------------- the server
def server_options(cfg: ServerConfig) -> list[tuple[str, int]]:
    """Channel arguments chosen on purpose (README.md, "Limits and keepalive")."""
    opts = [
        ("grpc.max_receive_message_length", cfg.max_receive_message_bytes),
        ("grpc.max_send_message_length", cfg.max_send_message_bytes),
        ("grpc.keepalive_time_ms", int(cfg.keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(cfg.keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms",
         int(cfg.min_ping_interval_s * 1000)),
        ("grpc.http2.max_ping_strikes", 2),
        ("grpc.so_reuseport", 0),    # a second server on the same port fails instead of sharing
    ]
    if cfg.max_connection_age_s > 0:
        opts += [("grpc.max_connection_age_ms", int(cfg.max_connection_age_s * 1000)),
                 ("grpc.max_connection_age_grace_ms", int(cfg.grace_period_s * 1000))]
    return opts


def build_server(state: ServingState, auth: TokenAuthenticator | None = None
                 ) -> grpc.aio.Server:
    """A grpc.aio server with our services, health and (unless turned off) reflection, not yet
    bound or started. With `auth`, every call but health needs one of its tokens: the access
    log and metrics (the outer interceptor) see refused calls too. The first call generates
    the stubs when they are missing or stale."""
    pb = stubs()
    cfg = state.server_config
    interceptors: list[grpc.aio.ServerInterceptor] = [
        ServiceInterceptor(state.metrics, cut_off=lambda: state.cut_off,
                           max_send_bytes=cfg.max_send_message_bytes)]
    if auth is not None:
        interceptors.append(AuthInterceptor(auth, status_for))
    server = grpc.aio.server(interceptors=interceptors, options=server_options(cfg),
                             compression=grpc.Compression.NoCompression)
    pb.generation_pb2_grpc.add_GenerationServiceServicer_to_server(
        GenerationServicer(state), server)
    pb.config_pb2_grpc.add_ConfigServiceServicer_to_server(ConfigServicer(state), server)
    if state.server_config.vllm_engine:     # the SMG gateway's protocol (docs/scale-out.md)
        from service.vllm_service import add_vllm_engine

        add_vllm_engine(state, server)
    health_pb2_grpc.add_HealthServicer_to_server(state.health, server)
    if cfg.reflection:
        reflection.enable_server_reflection(
            (*service_names(), health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME), server, pool=DocumentedPool())
    return server
