"""Per-token streaming cost of the gRPC server against the engine alone.

The same greedy requests run twice per round, interleaved: straight through `Engine.generate`
(the baseline) and through a real localhost gRPC stream (BackgroundServer + SpecstreamClient).
The difference per generated token is what the server adds: the sink hop onto the event loop,
protobuf encoding, HTTP/2 framing and the client's decoding. A second table streams tokens from
a synthetic source that costs nothing, which isolates the transport's own ceiling (what a much
faster engine would see).

    python bench/server_overhead.py [--model smollm2-135m] [--backend cpu] [--tokens 32]
                                    [--requests 4] [--rounds 3] [--concurrency 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clients import SpecstreamClient  # noqa: E402
from service.config import (  # noqa: E402
    DEFAULT_MODEL,
    EngineConfig,
    ServerConfig,
    models_dir_from_env,
)
from service.engine.types import (  # noqa: E402
    Delta,
    Finished,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    Started,
    StoppingCriteria,
    Timings,
    Usage,
)
from service.logging import configure_logging  # noqa: E402
from service.serve import BackgroundServer  # noqa: E402

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):",
           "The three primary colors are", "Water boils at", "My favourite book is"]


# ------------------------------------------------------------------------- measurement
class Run:
    """Wall time and inter-token gaps of one request, as its consumer sees them."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.stamps: list[float] = []
        self.tokens = 0
        self.messages = 0
        self.wall = 0.0

    def tokens_arrived(self, n: int) -> None:
        if n:
            self.stamps.append(time.perf_counter())
            self.tokens += n
            self.messages += 1

    def done(self) -> None:
        self.wall = time.perf_counter() - self.t0

    def gaps_ms(self) -> list[float]:
        return [(b - a) * 1e3 for a, b in zip(self.stamps, self.stamps[1:], strict=False)]


def via_engine(engine, req: GenerationRequest) -> Run:
    run = Run()
    for ev in engine.generate(req):
        if isinstance(ev, Delta):
            run.tokens_arrived(len(ev.token_ids))
    run.done()
    return run


def via_grpc(client: SpecstreamClient, req: GenerationRequest, run: Run | None = None) -> Run:
    """Stream `req` through the client, recording token arrivals into `run` (a new Run)."""
    run = Run() if run is None else run
    s, st = req.sampling, req.stopping
    for r in client.generate(tokens=list(req.prompt_ids), temperature=s.temperature,
                             max_new_tokens=st.max_new_tokens, ignore_eos=st.ignore_eos,
                             speculative=req.speculative):
        if r.HasField("delta"):
            run.tokens_arrived(len(r.delta.token_ids))
    run.done()
    return run


def run_batch(fn, reqs, concurrency: int) -> list[Run]:
    if concurrency == 1:
        return [fn(r) for r in reqs]
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(fn, reqs))


def summarize(runs: list[Run], wall_s: float) -> dict[str, float]:
    tokens = sum(r.tokens for r in runs)
    gaps = sorted(g for r in runs for g in r.gaps_ms())
    pick = (lambda q: gaps[min(len(gaps) - 1, int(q * len(gaps)))]) if gaps else (lambda q: 0.0)
    return {"tokens": tokens, "deltas": sum(r.messages for r in runs), "wall_s": wall_s,
            "ms_per_token": wall_s * 1e3 / max(tokens, 1),
            "gap_p50_ms": pick(0.5), "gap_p99_ms": pick(0.99)}


def print_table(title: str, rows: dict[str, dict[str, float]], base: str, other: str) -> None:
    print(f"\n{title}")
    print(f"{'path':<16}{'tokens':>8}{'deltas':>8}{'wall s':>10}{'ms/token':>10}"
          f"{'gap p50 ms':>12}{'gap p99 ms':>12}")
    for name, m in rows.items():
        print(f"{name:<16}{m['tokens']:>8.0f}{m['deltas']:>8.0f}{m['wall_s']:>10.3f}"
              f"{m['ms_per_token']:>10.3f}{m['gap_p50_ms']:>12.3f}{m['gap_p99_ms']:>12.3f}")
    b, o = rows[base], rows[other]
    added = o["ms_per_token"] - b["ms_per_token"]
    print(f"server adds {added:+.3f} ms/token; ratio {other}/{base} = "
          f"{o['ms_per_token'] / max(b['ms_per_token'], 1e-9):.3f}")


# ------------------------------------------------------------------------- synthetic source
class InstantEngine:
    """Emits max_new_tokens one-token Deltas with no compute: the transport alone."""

    def __init__(self, config: EngineConfig) -> None:
        self.config, self.queue_depth, self.active = config, 0, 0
        self.info = type("Info", (), {"name": "instant", "backend": "none", "n_ctx": 0})()

    def submit(self, request, sink):
        def run() -> None:
            n = request.stopping.max_new_tokens
            sink(Started(len(request.prompt_ids), 0))
            for i in range(n):
                sink(Delta((i % 1000,), "x"))
            sink(Finished(FinishReason.LENGTH, Usage(len(request.prompt_ids), n), Timings()))
        threading.Thread(target=run, daemon=True).start()
        return type("Handle", (), {"cancel": lambda self: None})()

    def generate(self, request):
        import queue

        q: queue.Queue = queue.Queue()
        self.submit(request, q.put)
        while True:
            ev = q.get()
            yield ev
            if isinstance(ev, Finished):
                return


# ------------------------------------------------------------------------- main
def measure(engine, reqs, rounds: int, concurrency: int, stream_buffer: int = 64
            ) -> dict[str, dict[str, float]]:
    results: dict[str, list[dict[str, float]]] = {"engine alone": [], "gRPC stream": []}
    cfg = ServerConfig(host="127.0.0.1", port=0, metrics_port=-1, stream_buffer=stream_buffer)
    with BackgroundServer(engine, cfg) as srv, \
            SpecstreamClient(srv.target, timeout=600) as client:
        via_grpc(client, reqs[0])                     # connection and first-call warm-up
        for _ in range(rounds):
            for name, fn in (("engine alone", lambda r: via_engine(engine, r)),
                             ("gRPC stream", lambda r: via_grpc(client, r))):
                t0 = time.perf_counter()
                runs = run_batch(fn, reqs, concurrency)
                results[name].append(summarize(runs, time.perf_counter() - t0))
    # Median of the rounds, per metric.
    return {name: {k: statistics.median(m[k] for m in ms) for k in ms[0]}
            for name, ms in results.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--backend", default="cpu")
    p.add_argument("--tokens", type=int, default=32, help="max_new_tokens per request")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--speculative", action="store_true", help="leave speculation on")
    p.add_argument("--synthetic-tokens", type=int, default=2000,
                   help="tokens per request from the zero-cost source (0 skips that table)")
    a = p.parse_args(argv)
    configure_logging("warning")

    from service.engine.engine import Engine
    from service.gguf.fetch import resolve_model

    cfg = EngineConfig(backend=a.backend, n_ctx=1024, n_slots=max(4, a.concurrency))
    engine = Engine.load(resolve_model(a.model, models_dir_from_env()), cfg)
    engine.start()
    engine.warmup()
    try:
        tok = engine.tokenizer
        reqs = [GenerationRequest(
            f"bench-{i}", tuple(tok.encode(PROMPTS[i % len(PROMPTS)])),
            SamplingParams(temperature=0.0),
            StoppingCriteria(max_new_tokens=a.tokens, ignore_eos=True),
            speculative=None if a.speculative else False) for i in range(a.requests)]
        print(f"model {engine.info.name} backend {engine.info.backend}; {a.requests} requests x "
              f"{a.tokens} tokens, concurrency {a.concurrency}, median of {a.rounds} rounds")
        rows = measure(engine, reqs, a.rounds, a.concurrency)
        print_table("real engine", rows, "engine alone", "gRPC stream")
    finally:
        engine.stop(10)

    if a.synthetic_tokens:
        fake = InstantEngine(cfg)
        sreqs = [GenerationRequest(f"s-{i}", (1, 2, 3), SamplingParams(temperature=0.0),
                                   StoppingCriteria(max_new_tokens=a.synthetic_tokens))
                 for i in range(a.requests)]
        # A buffer this large never merges Deltas: every token is its own message.
        rows = measure(fake, sreqs, a.rounds, a.concurrency,
                       stream_buffer=10 * a.synthetic_tokens)
        print_table("zero-cost token source (transport ceiling)", rows, "engine alone",
                    "gRPC stream")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
