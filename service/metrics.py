"""Prometheus metrics on their own HTTP port, in a registry of their own.

A private `CollectorRegistry` per server keeps several servers in one process (tests) apart.
RPC counts and durations are recorded by the interceptor; LLM metrics (tokens, time to first
token, per-token latency, queue time, speculative acceptance) by the Generate servicer from each
request's Finished event; queue depth, active requests, KV pool usage and the last step's rows
and tokens are read from the engine at scrape time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from service.engine.types import Finished

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
_RATIO_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.rpcs = Counter("specstream_rpcs", "RPCs by method and status code",
                            ["method", "code"], registry=r)
        self.rpc_seconds = Histogram("specstream_rpc_duration_seconds",
                                     "RPC duration (whole stream for Generate)", ["method"],
                                     buckets=_LATENCY_BUCKETS_S, registry=r)
        self.requests = Counter("specstream_generate_requests",
                                "Generate requests finished, by finish reason", ["reason"],
                                registry=r)
        self.prompt_tokens = Counter("specstream_prompt_tokens", "Prompt tokens processed",
                                     registry=r)
        self.completion_tokens = Counter("specstream_completion_tokens", "Tokens generated",
                                         registry=r)
        self.draft_tokens = Counter("specstream_draft_tokens", "Tokens proposed by the drafter",
                                    registry=r)
        self.accepted_draft_tokens = Counter("specstream_accepted_draft_tokens",
                                             "Drafted tokens accepted by the model", registry=r)
        self.acceptance = Histogram("specstream_speculative_acceptance_ratio",
                                    "Accepted / drafted tokens per request (requests that "
                                    "drafted)", buckets=_RATIO_BUCKETS, registry=r)
        self.ttft = Histogram("specstream_time_to_first_token_seconds",
                              "Admission to first generated token", buckets=_LATENCY_BUCKETS_S,
                              registry=r)
        self.queue_time = Histogram("specstream_queue_time_seconds",
                                    "Admission to the engine's first step on the request",
                                    buckets=_LATENCY_BUCKETS_S, registry=r)
        self.per_token = Histogram("specstream_time_per_output_token_seconds",
                                   "Decode time per token after the first",
                                   buckets=_TOKEN_BUCKETS_S, registry=r)
        self.streams = Gauge("specstream_open_streams", "Generate streams open", registry=r)
        self.merged_deltas = Counter("specstream_merged_deltas",
                                     "Deltas merged because a client read slower than the "
                                     "engine produced", registry=r)
        self.queue_depth = Gauge("specstream_queue_depth", "Requests waiting for a slot",
                                 registry=r)
        self.active = Gauge("specstream_active_requests", "Requests holding a slot", registry=r)
        self.cached_prompt_tokens = Counter("specstream_prefix_cache_tokens",
                                            "Prompt tokens served from the prefix cache",
                                            registry=r)
        self.kv_blocks = Gauge("specstream_kv_cache_blocks",
                               "KV cache pool blocks by state (used: held by running "
                               "sequences, cached: reusable prefix blocks, free)", ["state"],
                               registry=r)
        self.preemptions = Gauge("specstream_preemptions",
                                 "Sequences preempted for KV blocks since the engine started",
                                 registry=r)
        self.kv_usage = Gauge("specstream_kv_cache_usage_ratio",
                              "Fraction of the KV cache pool's blocks held by running sequences",
                              registry=r)
        self.running_rows = Gauge("specstream_running_rows",
                                  "Decode rows (each running sequence's next token and its "
                                  "drafts) of the engine's last step; 0 when idle", registry=r)
        self.step_tokens = Gauge("specstream_step_tokens",
                                 "Tokens the engine's last step computed (decode rows and "
                                 "prompt rows); 0 when idle", registry=r)
        self.steps = Gauge("specstream_engine_steps",
                           "Model steps since the engine started (with "
                           "specstream_engine_step_tokens: mean tokens per step)", registry=r)
        self.steps_tokens = Gauge("specstream_engine_step_tokens",
                                  "Tokens computed by the engine's steps since it started",
                                  registry=r)
        self._http: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def bind_engine(self, queue_depth: Callable[[], float], active: Callable[[], float],
                    pool=None, preemptions: Callable[[], float] | None = None,
                    stats: Callable[[], Any] | None = None) -> None:
        """Gauges read the engine's counters when scraped (`pool`: its KV BlockPool; `stats`:
        its current StepStats)."""
        self.queue_depth.set_function(queue_depth)
        self.active.set_function(active)
        if pool is not None:
            self.kv_blocks.labels("used").set_function(lambda: pool.used_blocks)
            self.kv_blocks.labels("cached").set_function(lambda: pool.cached_blocks)
            self.kv_blocks.labels("free").set_function(lambda: pool.free_blocks)
            self.kv_usage.set_function(lambda: pool.used_blocks / max(pool.n_blocks, 1))
        if preemptions is not None:
            self.preemptions.set_function(preemptions)
        if stats is not None:
            self.running_rows.set_function(lambda: stats().last_rows)
            self.step_tokens.set_function(lambda: stats().last_tokens)
            self.steps.set_function(lambda: stats().steps)
            self.steps_tokens.set_function(lambda: stats().step_tokens)

    def observe_rpc(self, method: str, code: str, seconds: float) -> None:
        self.rpcs.labels(method, code).inc()
        self.rpc_seconds.labels(method).observe(seconds)

    def observe_finished(self, finished: Finished, merged: int = 0) -> None:
        u, t = finished.usage, finished.timings
        self.requests.labels(finished.reason.value).inc()
        self.prompt_tokens.inc(u.prompt_tokens)
        self.completion_tokens.inc(u.completion_tokens)
        self.merged_deltas.inc(merged)
        self.cached_prompt_tokens.inc(u.cached_prompt_tokens)
        if u.draft_tokens:
            self.draft_tokens.inc(u.draft_tokens)
            self.accepted_draft_tokens.inc(u.accepted_draft_tokens)
            self.acceptance.observe(u.accepted_draft_tokens / u.draft_tokens)
        self.queue_time.observe(t.queue_ms / 1e3)
        if u.completion_tokens:
            self.ttft.observe(t.time_to_first_token_ms / 1e3)
        if u.completion_tokens > 1:
            self.per_token.observe(t.per_token_decode_ms / 1e3)

    def serve(self, host: str, port: int) -> int:
        """Starts the /metrics HTTP server on its own thread; returns the bound port."""
        self._http, self._thread = start_http_server(port, addr=host, registry=self.registry)
        return self._http.server_port

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
