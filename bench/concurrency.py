"""Throughput and latency against the number of concurrent streams, through the real gRPC server.

One engine behind a localhost gRPC server (BackgroundServer + SpecstreamClient, as in
bench/server_overhead.py); for each concurrency level c, c client threads each stream one greedy
request of --tokens tokens at the same time. Per level: aggregate tok/s (all tokens / wall time
of the level), per-stream tok/s (tokens / that stream's wall time, median), time to first token
(median and p99 over the streams), inter-token latency p50/p99 (the gap before each token as
its client sees it; a message of k tokens counts k gaps of 1/k of it), and the aggregate
throughput against one stream's, measured in the same run.

    python bench/concurrency.py [--model smollm2-135m] [--backend cpu|cuda] [--tokens 64]
                                [--max-streams 8] [--rounds 1] [--speculative]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from server_overhead import PROMPTS, Run, via_grpc  # noqa: E402

from clients import SpecstreamClient  # noqa: E402
from service.config import DEFAULT_MODEL, EngineConfig, ServerConfig, models_dir_from_env  # noqa: E402,E501
from service.engine.types import GenerationRequest, SamplingParams, StoppingCriteria  # noqa: E402
from service.logging import configure_logging  # noqa: E402
from service.serve import BackgroundServer  # noqa: E402

LEVELS = (1, 4, 8, 16, 32, 64)


class TokenRun(Run):
    """Run plus the number of tokens each message carried (for per-token gaps)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def tokens_arrived(self, n: int) -> None:
        if n:
            self.sizes.append(n)
        super().tokens_arrived(n)

    def first_token_s(self) -> float:
        return self.stamps[0] - self.t0 if self.stamps else float("nan")

    def token_gaps_ms(self) -> list[float]:
        gaps = []
        for g, n in zip(self.gaps_ms(), self.sizes[1:], strict=True):
            gaps += [g / n] * n
        return gaps


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def stream(client: SpecstreamClient, req: GenerationRequest) -> TokenRun:
    return via_grpc(client, req, TokenRun())


def level(client: SpecstreamClient, reqs: list[GenerationRequest]) -> dict[str, float]:
    """All requests at once, one client thread each."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(reqs)) as pool:
        runs = list(pool.map(lambda r: stream(client, r), reqs))
    wall = time.perf_counter() - t0
    tokens = sum(r.tokens for r in runs)
    gaps = [g for r in runs for g in r.token_gaps_ms()]
    ttft = [r.first_token_s() * 1e3 for r in runs]
    return {"streams": len(reqs), "tokens": tokens, "wall_s": wall, "agg_tok_s": tokens / wall,
            "stream_tok_s": statistics.median(r.tokens / r.wall for r in runs),
            "ttft_p50_ms": pct(ttft, 0.5), "ttft_p99_ms": pct(ttft, 0.99),
            "itl_p50_ms": pct(gaps, 0.5), "itl_p99_ms": pct(gaps, 0.99)}


def print_table(rows: list[dict[str, float]]) -> None:
    cols = [("streams", "streams", "{:>8.0f}"), ("tokens", "tokens", "{:>8.0f}"),
            ("wall_s", "wall s", "{:>8.2f}"), ("agg_tok_s", "agg tok/s", "{:>10.1f}"),
            ("stream_tok_s", "tok/s/str", "{:>10.1f}"), ("ttft_p50_ms", "TTFT p50", "{:>10.0f}"),
            ("ttft_p99_ms", "TTFT p99", "{:>10.0f}"), ("itl_p50_ms", "ITL p50", "{:>9.1f}"),
            ("itl_p99_ms", "ITL p99", "{:>9.1f}"), ("ratio", "x 1 str", "{:>8.2f}")]
    print("".join(f"{h:>{len(f.format(0))}}" for _, h, f in cols) + "   (ms for TTFT/ITL)")
    for r in rows:
        print("".join(f.format(r[k]) for k, _, f in cols))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--backend", default="cpu")
    p.add_argument("--tokens", type=int, default=64, help="max_new_tokens per stream")
    p.add_argument("--max-streams", type=int, default=8, help="highest concurrency level")
    p.add_argument("--rounds", type=int, default=1, help="runs per level (the best is kept)")
    p.add_argument("--speculative", action="store_true", help="leave speculation on")
    a = p.parse_args(argv)
    configure_logging("warning")

    from service.engine.scheduler import Engine
    from service.gguf.fetch import resolve_model

    levels = [n for n in LEVELS if n <= a.max_streams]
    cfg = EngineConfig(backend=a.backend, n_ctx=1024, n_slots=max(levels))
    engine = Engine.load(resolve_model(a.model, models_dir_from_env()), cfg)
    engine.start()
    engine.warmup()
    tok = engine.tokenizer
    reqs = [GenerationRequest(
        f"c-{i}", tuple(tok.encode(PROMPTS[i % len(PROMPTS)])), SamplingParams(temperature=0.0),
        StoppingCriteria(max_new_tokens=a.tokens, ignore_eos=True),
        speculative=None if a.speculative else False) for i in range(max(levels))]
    print(f"model {engine.info.name} backend {engine.info.backend}; streams of {a.tokens} "
          f"tokens, speculation {'on' if a.speculative else 'off'}, best of {a.rounds}")
    rows = []
    server_cfg = ServerConfig(host="127.0.0.1", port=0, metrics_port=-1)
    try:
        with BackgroundServer(engine, server_cfg) as srv, \
                SpecstreamClient(srv.target, timeout=600) as client:
            stream(client, reqs[0])                 # connection and first-call warm-up
            for n in levels:
                rows.append(max((level(client, reqs[:n]) for _ in range(a.rounds)),
                                key=lambda r: r["agg_tok_s"]))
                rows[-1]["ratio"] = rows[-1]["agg_tok_s"] / rows[0]["agg_tok_s"]
    finally:
        engine.stop(10)
    print_table(rows)
    s = engine.stats
    print(f"engine: {s.decode_steps} decode steps for {s.decode_rows} rows, "
          f"{s.prefill_steps} prefill steps, at most {s.max_sequences} sequences in a step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
