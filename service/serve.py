"""`specstream serve`: configuration, startup, health transitions and graceful shutdown.

    load_config -> exit 2 listing every problem
    bind gRPC + metrics ports, health NOT_SERVING  ->  resolve/fetch model, Engine.load,
    warmup, start  ->  health SERVING  ->  SIGTERM: health NOT_SERVING, Generate refused with
    UNAVAILABLE, in-flight streams get grace_period_s, engine stopped, exit 0
    SIGHUP (any time): the TLS certificate files and the token file are read again; open
    streams go on, new connections and calls get the new ones

The gRPC server answers (health, reflection, GetConfig, ValidateConfig) while the model loads;
Generate, Tokenize and GetModelInfo answer UNAVAILABLE until it is ready.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import structlog

from service.config import EngineConfig, ServerConfig, format_problems, load_config
from service.config.schema import is_loopback
from service.errors import ConfigError, SpecstreamError
from service.logging import configure_logging
from service.server import ServingState, build_server
from service.server_auth import TokenAuthenticator
from service.server_tls import CertificateStore

log = structlog.get_logger(__name__)
ENGINE_STOP_TIMEOUT_S = 10.0
FINISH_TIMEOUT_S = 2.0           # after the grace period: cancelled streams write Finished


def load_engine(server_cfg: ServerConfig, engine_cfg: EngineConfig) -> Any:
    """Resolves (fetching on first use), loads, starts and warms up the engine. Blocking."""
    from service.engine.engine import Engine
    from service.gguf.fetch import resolve_model

    path = resolve_model(server_cfg.model, server_cfg.resolved_models_dir())
    if engine_cfg.drafter == "model":    # a known name is fetched like the target's
        engine_cfg = replace(engine_cfg, draft_model=str(resolve_model(
            engine_cfg.draft_model, server_cfg.resolved_models_dir())))
    log.info("model_loading", path=str(path), backend=engine_cfg.backend)
    engine = Engine.load(path, engine_cfg, chat_template=server_cfg.chat_template)
    engine.start()
    engine.warmup()              # through the engine thread, as requests will go
    return engine


async def _in_daemon_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """Runs fn on a daemon thread: a SIGTERM during a long fetch or load need not wait for it."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not fut.done():
            (fut.set_result if ok else fut.set_exception)(value)

    def run() -> None:
        try:
            result = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
            loop.call_soon_threadsafe(settle, False, e)
        else:
            loop.call_soon_threadsafe(settle, True, result)

    threading.Thread(target=run, name="model-load", daemon=True).start()
    return await fut


class Service:
    """The gRPC server, its metrics endpoint and the engine, with their lifecycle."""

    def __init__(self, server_cfg: ServerConfig, engine_cfg: EngineConfig) -> None:
        self.state = ServingState(engine_config=engine_cfg, server_config=server_cfg)
        cfg = server_cfg
        self.auth = TokenAuthenticator(cfg.auth_token_file) if cfg.auth_token_file else None
        self.tls = (CertificateStore(cfg.tls_cert_file, cfg.tls_key_file,
                                     cfg.tls_client_ca_file) if cfg.tls else None)
        self.server = build_server(self.state, self.auth)
        self.port = 0
        self.metrics_port: int | None = None
        self._watch: asyncio.Future | None = None

    async def start(self) -> None:
        cfg = self.state.server_config
        await self.state.set_serving(False)
        address = f"{cfg.host}:{cfg.port}"
        self.port = (self.server.add_secure_port(address, self.tls.credentials())
                     if self.tls is not None else self.server.add_insecure_port(address))
        await self.server.start()
        if cfg.metrics_port >= 0:
            self.metrics_port = self.state.metrics.serve(cfg.metrics_host, cfg.metrics_port)
        security = ("mtls" if self.tls is not None and self.tls.mutual
                    else "tls" if self.tls is not None else "plaintext")
        log.info("listening", host=cfg.host, port=self.port, metrics_port=self.metrics_port,
                 transport=security, tokens=self.auth.count if self.auth else 0,
                 reflection=cfg.reflection, config_rpcs=cfg.config_rpcs)
        if self.auth is None and not is_loopback(cfg.host):
            log.warning("no_authentication", host=cfg.host,
                        hint="any client that reaches this address may call every RPC; "
                             "set --auth-token-file")

    def reload(self) -> bool:
        """SIGHUP: the certificate and token files read again. A file with a problem is
        logged and the server keeps what it had; True when everything reloaded."""
        ok = True
        for name, part in (("tls", self.tls), ("auth_tokens", self.auth)):
            if part is None:
                continue
            try:
                part.reload()
            except ConfigError as e:
                ok = False
                log.error("reload_failed", part=name, problems=[f"{f}: {m}"
                                                                 for f, m in e.problems])
        log.info("reloaded", ok=ok, tls=self.tls is not None, auth=self.auth is not None,
                 tokens=self.auth.count if self.auth else 0)
        return ok

    async def attach(self, engine: Any) -> None:
        """Serves `engine` (loaded, warmed up, started): health goes SERVING."""
        self.state.engine = engine
        stats = getattr(engine, "stats", None)
        self.state.metrics.bind_engine(
            lambda: engine.queue_depth, lambda: engine.active, getattr(engine, "pool", None),
            (lambda: engine.stats.preemptions) if hasattr(stats, "preemptions") else None,
            (lambda: engine.stats) if hasattr(stats, "step_tokens") else None)
        await self.state.set_serving(True)
        self._watch = asyncio.ensure_future(self._watch_engine(engine))
        info = engine.info
        log.info("serving", model=info.name, backend=str(info.backend), n_ctx=info.n_ctx,
                 port=self.port)

    async def _watch_engine(self, engine: Any, every_s: float = 1.0) -> None:
        """Health follows the engine: NOT_SERVING as soon as its thread has died."""
        while getattr(engine, "healthy", True):
            await asyncio.sleep(every_s)
        if not self.state.draining:
            log.error("engine_unhealthy", failure=getattr(engine, "failure", None))
            await self.state.set_serving(False)

    async def load(self) -> None:
        cfg = self.state
        await self.attach(await _in_daemon_thread(load_engine, cfg.server_config,
                                                  cfg.engine_config))

    async def drain(self, stop_engine: bool = True) -> None:
        """Health NOT_SERVING, refuse new Generate, let streams finish within the grace period."""
        st, cfg = self.state, self.state.server_config
        st.draining = True
        if self._watch is not None:
            self._watch.cancel()
        await st.health.enter_graceful_shutdown()
        log.info("draining", active=st.engine.active if st.engine is not None else 0,
                 grace_s=cfg.grace_period_s)
        if cfg.drain_delay_s > 0:
            await asyncio.sleep(cfg.drain_delay_s)
        await self._stop_server(cfg.grace_period_s)
        st.prompt_pool.shutdown(wait=False, cancel_futures=True)
        st.constraint_pool.shutdown(wait=False, cancel_futures=True)
        if stop_engine and st.engine is not None:
            await asyncio.to_thread(st.engine.stop, ENGINE_STOP_TIMEOUT_S)
        st.metrics.stop()
        log.info("stopped")

    async def _stop_server(self, grace_s: float) -> None:
        """Stops accepting calls and gives open ones grace_s to finish. Then the engine
        requests of the streams still open are cancelled: each stream ends as the proto says,
        with Finished(FINISH_REASON_CANCELLED) and status OK, within an engine step or two.
        Calls still open after FINISH_TIMEOUT_S more (a prompt still rendering, an engine that
        does not answer) are cancelled by gRPC, marked cut off first, so that the access log
        and metrics record the UNAVAILABLE their clients see."""
        st = self.state
        # A later deadline than ours: the stop(None) below is what cancels.
        stopping = asyncio.ensure_future(self.server.stop(2 * grace_s + FINISH_TIMEOUT_S))
        done, _ = await asyncio.wait({stopping}, timeout=grace_s)
        if done:
            return await stopping
        if st.open_requests:
            log.info("finishing_streams", open=len(st.open_requests))
            for handle in list(st.open_requests):
                handle.cancel()
            done, _ = await asyncio.wait({stopping}, timeout=FINISH_TIMEOUT_S)
            if done:
                return await stopping
        st.cut_off = True
        await self.server.stop(None)
        await stopping


async def _serve(server_cfg: ServerConfig, engine_cfg: EngineConfig) -> int:
    try:
        svc = Service(server_cfg, engine_cfg)
    except ConfigError as e:     # a certificate or token file changed since it was checked
        return _report_load_failure(e)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():  # a second signal: stop now
            log.warning("forced_stop", signal=sig.name)
            svc.state.cut_off = True
            asyncio.ensure_future(svc.server.stop(None))
        stop.set()

    # before the port opens: a signal sent as soon as "listening" is logged finds its handler
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    loop.add_signal_handler(signal.SIGHUP, svc.reload)
    try:
        await svc.start()
    except (RuntimeError, OSError) as e:
        log.error("bind_failed", host=server_cfg.host, port=server_cfg.port,
                  metrics_port=server_cfg.metrics_port, error=str(e))
        await svc.server.stop(0)
        return 1
    loading = asyncio.create_task(svc.load())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
    rc = 0
    if loading.done() and loading.exception() is not None:
        rc = _report_load_failure(loading.exception())
    else:
        await stopping
    stopping.cancel()
    await svc.drain()
    loading.cancel()
    return rc


def _report_load_failure(exc: BaseException) -> int:
    if isinstance(exc, ConfigError):
        print(format_problems(exc.problems), file=sys.stderr)
        log.error("startup_failed", problems=[f"{f}: {m}" for f, m in exc.problems])
        return 2
    if isinstance(exc, SpecstreamError):
        print(f"specstream serve: {exc}", file=sys.stderr)
        log.error("startup_failed", error=str(exc), kind=type(exc).__name__)
        return 1
    log.error("startup_failed", exc_info=exc)
    return 1


def serve_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `specstream serve ARGS` (argv: the arguments after `serve`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        server_cfg, engine_cfg = load_config(argv)
    except ConfigError as e:
        print(format_problems(e.problems), file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    configure_logging(server_cfg.log_level, server_cfg.log_format)
    return asyncio.run(_serve(server_cfg, engine_cfg))


# ------------------------------------------------------------------------- in-process server
class BackgroundServer:
    """A Service around an already loaded engine, on its own event-loop thread.

    For tests and benchmarks that drive the real engine through real sockets:
        with BackgroundServer(engine) as srv: SpecstreamClient(srv.target)...
    """

    def __init__(self, engine: Any, server_cfg: ServerConfig | None = None,
                 engine_cfg: EngineConfig | None = None) -> None:
        self.engine = engine         # None: a server that stays "loading" (tests of that state)
        self.engine_cfg = engine_cfg or (engine.config if engine is not None else EngineConfig())
        self.server_cfg = server_cfg or ServerConfig(host="127.0.0.1", port=0, metrics_port=0,
                                                     grace_period_s=2.0)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="grpc-loop",
                                        daemon=True)
        self.service: Service | None = None

    def _call(self, coro: Any, timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _start(self) -> None:
        self.service = Service(self.server_cfg, self.engine_cfg)
        await self.service.start()
        if self.engine is not None:
            await self.service.attach(self.engine)

    def start(self) -> BackgroundServer:
        if self.service is None:
            self._thread.start()
            self._call(self._start())
        return self

    @property
    def port(self) -> int:
        return self.service.port

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_port(self) -> int | None:
        return self.service.metrics_port

    def stop(self, stop_engine: bool = False) -> None:
        if self.service is not None:
            self._call(self.service.drain(stop_engine=stop_engine))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
