"""Throughput and latency against the number of concurrent streams, through the real gRPC server.

One engine behind a localhost gRPC server (BackgroundServer + SpecstreamClient, as in
bench/server_overhead.py); for each concurrency level c (--levels; on the CPU backend level 8 is
added), c client threads each stream one request of --tokens tokens at the same time (greedy, or
with --sampled temperature 0.8, top_p 0.95 and seed 1000 + i for stream i). Per level: aggregate
tok/s (all tokens / wall time of the level), per-stream tok/s (tokens / that stream's wall time,
median), time to first token p50/p99 over the streams, inter-token latency p50/p99 (the gap
before each token as its client sees it; a message of k tokens counts k gaps of 1/k of it), the
prompt tokens the prefix cache served, and the aggregate throughput against one stream's,
measured in the same run. The goals of issue 9 follow, computed from these rows.

Prompts: a text model's streams use the fixed short texts of bench/server_overhead.py (their
repeats may come from the prefix cache: the "cached" column); synthetic models (`--model
synth-8b|synth-1b|synth-tiny`, generated seeded into --synth-dir and reused) and `--prompts ids`
get --prompt-tokens random ordinary vocabulary ids, fresh per level and round.

Where the time goes, per level: the engine thread's wall time per iteration split into
scheduling (admission, the plan), drafting, packing (the step's rows and sampling records into
the runner's buffer, and the upload), the model step (on the CPU the whole forward pass and
sampling; on a GPU the launch), readback (waiting for the choices: a GPU's step time shows
here), emitting (stop checks, detokenization, the Deltas handed to the stream writers), other
and idle (service/engine/stepprofile.IterationProfile); the host's part in all (schedule +
draft + pack + emit + other), as wall time and as the engine thread's own CPU time (which a
busy machine or the GIL held by the event loop does not inflate), and the model step's CPU;
the event-loop wake-ups that carried the streams' events (hops); and the CPU seconds of the
engine thread, of the gRPC event-loop thread (protobuf and grpc.aio's stream writes) and of the
rest of the process (gRPC's core threads and these client threads).

Prefix part (--prefix-tokens N, 0 skips it), through the same server after the levels: request A
is a random N-token prefix + a 16-token suffix, 1 token generated; request B the same prefix +
another suffix. Time to first token of A (uncached) and B (cached), their ratio and both
requests' Usage.cached_prompt_tokens; median of 3 rounds, each with a fresh prefix.

Engine settings: --n-ctx (default: long enough for the streams and the prefix requests),
--n-slots (default: the highest level); --kv-cache-memory, --prefill-chunk, --max-step-tokens,
--no-prefix-cache and --gemv-mma reach EngineConfig only when given.

    python bench/concurrency.py [--model smollm2-135m|PATH|synth-8b|synth-1b|synth-tiny]
        [--backend cpu|cuda|auto] [--levels 1,4,16,64] [--tokens 256] [--sampled]
        [--prompts text|ids] [--prompt-tokens 32] [--prefix-tokens 2000] [--rounds 1]
        [--n-ctx N] [--n-slots N] [--kv-cache-memory 8GiB] [--prefill-chunk N]
        [--max-step-tokens N]
        [--no-prefix-cache] [--gemv-mma] [--no-overlap] [--speculative] [--threads 0]
        [--synth-dir DIR] [--seed 0] [--json PATH] [--plot PNG]
    python bench/plot_concurrency.py RESULT.json [MORE.json ...] OUT.png   (redraw from JSON)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from server_overhead import PROMPTS, Run  # noqa: E402
from synth_model import DEFAULT_DIR, synth_model  # noqa: E402

from clients import SpecstreamClient  # noqa: E402
from service.config import DEFAULT_MODEL, EngineConfig, ServerConfig, models_dir_from_env  # noqa: E402,E501
from service.logging import configure_logging  # noqa: E402
from service.serve import BackgroundServer  # noqa: E402

SYNTH = {"synth-8b": "llama3-8b", "synth-1b": "llama3.2-1b", "synth-tiny": "tiny"}
SUFFIX_TOKENS = 16
PREFIX_ROUNDS = 3
# (streams, aggregate at least this many times one stream's, check p99 ITL <= 2x; backend or
# None for every backend) -- issue 9's goals.
GOALS = ((16, 10.0, True, None), (64, 25.0, False, None), (8, 2.0, False, "cpu"))
# (streams joining at once, TTFT p99 at most this many ms, backend) -- issue 20's goals
TTFT_GOALS = ((16, 500.0, "cpu"), (64, 1000.0, "cuda"))


class TokenRun(Run):
    """Run plus the number of tokens each message carried (for per-token gaps) and the usage
    of the Finished message."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []
        self.cached = 0
        self.prompt_tokens = 0

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


def stream(client: SpecstreamClient, kw: dict) -> TokenRun:
    run = TokenRun()
    for r in client.generate(**kw):
        if r.HasField("delta"):
            run.tokens_arrived(len(r.delta.token_ids))
        elif r.HasField("finished"):
            run.cached = r.finished.usage.cached_prompt_tokens
            run.prompt_tokens = r.finished.usage.prompt_tokens
    run.done()
    return run


def request(prompt: list[int], tokens: int, a, i: int) -> dict:
    """client.generate keywords of stream i."""
    kw = {"tokens": prompt, "max_new_tokens": tokens, "ignore_eos": True,
          "speculative": None if a.speculative else False}
    if a.sampled:
        return {**kw, "temperature": 0.8, "top_p": 0.95, "seed": 1000 + i}
    return {**kw, "temperature": 0.0}


def thread_cpu() -> dict[int, tuple[str, float]]:
    """Each thread of this process: native id -> (its name, CPU seconds user + system), from
    /proc (Linux; empty elsewhere)."""
    out, tick = {}, os.sysconf("SC_CLK_TCK")
    for task in Path("/proc/self/task").glob("*"):
        try:
            comm = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(task.name)] = (comm, (int(fields[11]) + int(fields[12])) / tick)
    return out


GRPC_CORE = ("grpc", "default-execut", "resolver-execu", "global-timer")   # C-core thread names


class LevelProfile:
    """Where a level's time goes: the engine thread's wall time per iteration split into parts
    (service/engine/stepprofile.IterationProfile), and CPU seconds by thread: the engine
    thread, the server's event-loop thread (request parsing, protobuf, the stream writes of
    grpc.aio), gRPC's C-core threads, the other Python threads (the benchmark's clients) and
    the native compute pool (numba's and BLAS's other workers)."""

    def __init__(self, engine, loop_thread, loop) -> None:
        from service.engine.stepprofile import IterationProfile
        from service.server_generate import mailbox

        self.engine, self.loop_id = engine, loop_thread.native_id
        self.box = mailbox(loop)
        self.hops0 = self.box.hops
        engine.stats.profile = self.prof = IterationProfile()
        self.cpu0 = thread_cpu()

    def done(self, wall: float) -> dict[str, float]:
        import threading

        cpu = thread_cpu()
        self.engine.stats.profile = None
        py = {t.native_id for t in threading.enumerate()}
        got = dict.fromkeys(("engine_cpu_s", "grpc_loop_cpu_s", "grpc_core_cpu_s",
                             "clients_cpu_s", "pool_cpu_s"), 0.0)
        for tid, (comm, s) in cpu.items():
            s -= self.cpu0.get(tid, ("", 0.0))[1]
            key = ("engine_cpu_s" if tid == self.engine._thread.native_id
                   else "grpc_loop_cpu_s" if tid == self.loop_id
                   else "grpc_core_cpu_s" if comm.startswith(GRPC_CORE)
                   else "clients_cpu_s" if tid in py else "pool_cpu_s")
            got[key] += s
        return {**self.prof.summary(), **got, "hops": self.box.hops - self.hops0, "wall_s": wall}


def level(client: SpecstreamClient, reqs: list[dict], profile=None) -> dict[str, float]:
    """All requests at once, one client thread each; `profile()` a LevelProfile started."""
    prof = profile() if profile else None
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(reqs)) as pool:
        runs = list(pool.map(lambda r: stream(client, r), reqs))
    wall = time.perf_counter() - t0
    where = prof.done(wall) if prof else None
    tokens = sum(r.tokens for r in runs)
    gaps = [g for r in runs for g in r.token_gaps_ms()]
    ttft = [r.first_token_s() * 1e3 for r in runs]
    return {"streams": len(reqs), "tokens": tokens, "wall_s": wall, "agg_tok_s": tokens / wall,
            **steady(runs),
            "stream_tok_s": statistics.median(r.tokens / r.wall for r in runs),
            "ttft_p50_ms": pct(ttft, 0.5), "ttft_p99_ms": pct(ttft, 0.99),
            "itl_p50_ms": pct(gaps, 0.5), "itl_p99_ms": pct(gaps, 0.99),
            "cached": sum(r.cached for r in runs), "profile": where}


def steady(runs: list[TokenRun]) -> dict[str, float]:
    """Generation with every stream of the level decoding: the tokens that arrived after the
    last stream's first token and up to the first stream's last one, over that window (what
    llama-batched-bench's S_TG counts: decode steps of all the streams, no prompt in the
    time); NaN when the window is empty (a stream ended before the last one started). And the
    prompt phase: prompt tokens of all streams over the time until the last first token."""
    starts = [r.stamps[0] for r in runs if r.stamps]
    ends = [r.stamps[-1] for r in runs if r.stamps]
    if len(starts) < len(runs):
        return {"steady_tok_s": float("nan"), "steady_s": 0.0, "prompt_tok_s": float("nan")}
    lo, hi = max(starts), min(ends)
    got = sum(n for r in runs for t, n in zip(r.stamps, r.sizes, strict=True) if lo < t <= hi)
    span = hi - lo
    first = max(r.first_token_s() for r in runs)
    return {"steady_tok_s": got / span if span > 0 else float("nan"), "steady_s": max(span, 0.0),
            "prompt_tok_s": sum(r.prompt_tokens for r in runs) / first}


def ordinary_ids(tok) -> np.ndarray:
    """Ids of NORMAL vocabulary entries (no control, byte or unused tokens); every id when the
    model has no token attributes."""
    from service.model.tokenizer import TokenAttr

    ids = [i for i in range(tok.vocab_size) if tok.token_attr(i) == TokenAttr.NORMAL]
    return np.array(ids if ids else range(tok.vocab_size), dtype=np.int64)      # [n]


def random_prompt(pool: np.ndarray, n: int, rng: np.random.Generator) -> list[int]:
    return [int(x) for x in rng.choice(pool, n)]


# ---------------------------------------------------------------- goals, tables
def goals(rows: list[dict], backend: str) -> list[dict]:
    """Issue 9's concurrency goals for the levels this run has, against its own 1-stream row."""
    by = {r["streams"]: r for r in rows}
    if 1 not in by:
        return []
    one, out = by[1], []
    for n, times, itl, only in GOALS:
        if n not in by or only not in (None, backend):
            continue
        ratio = by[n]["agg_tok_s"] / one["agg_tok_s"]
        out.append({"goal": f"{n} streams: aggregate >= {times:g}x one stream's",
                    "value": ratio, "met": ratio >= times})
        if itl:
            r = by[n]["itl_p99_ms"] / one["itl_p99_ms"]
            out.append({"goal": f"{n} streams: p99 ITL <= 2x one stream's", "value": r,
                        "met": r <= 2.0})
    for n, ms, only in TTFT_GOALS:
        if n in by and only == backend:
            t = by[n]["ttft_p99_ms"]
            out.append({"goal": f"{n} streams joining at once: TTFT p99 <= {ms:g} ms",
                        "value": t, "met": t <= ms})
    return out


def print_table(rows: list[dict]) -> None:
    base = int(rows[0]["streams"]) if rows else 1      # "ratio": against the first level run
    cols = [("streams", "streams", "{:>8.0f}"), ("tokens", "tokens", "{:>8.0f}"),
            ("wall_s", "wall s", "{:>8.2f}"), ("agg_tok_s", "agg tok/s", "{:>10.1f}"),
            ("stream_tok_s", "tok/s/str", "{:>10.1f}"), ("steady_tok_s", "steady", "{:>9.1f}"),
            ("steady_s", "for s", "{:>7.2f}"), ("prompt_tok_s", "prompt/s", "{:>10.0f}"),
            ("ttft_p50_ms", "TTFT p50", "{:>10.0f}"),
            ("ttft_p99_ms", "TTFT p99", "{:>10.0f}"), ("itl_p50_ms", "ITL p50", "{:>9.1f}"),
            ("itl_p99_ms", "ITL p99", "{:>9.1f}"), ("cached", "cached", "{:>8.0f}"),
            ("ratio", f"x {base} str", "{:>8.2f}")]
    print("".join(f"{h:>{len(f.format(0))}}" for _, h, f in cols) + "   (ms for TTFT/ITL)")
    for r in rows:
        print("".join(f.format(r[k]) for k, _, f in cols))


def print_profile(rows: list[dict]) -> None:
    """The engine thread's ms per iteration by part, and the CPU seconds of the threads."""
    parts = ("schedule", "draft", "pack", "step", "readback", "emit", "other", "idle", "host",
             "host_cpu", "step_cpu")
    cpus = ("engine_cpu_s", "pool_cpu_s", "grpc_loop_cpu_s", "grpc_core_cpu_s", "clients_cpu_s")
    print("\nwhere the time goes: the engine thread's ms per iteration (host: schedule + draft + "
          "pack + emit + other, wall and the engine thread's CPU; step_cpu: the model step's "
          "CPU), and CPU s of the level by thread (engine, compute pool, gRPC event loop, gRPC "
          "core, client threads); hops: event-loop wake-ups for the streams")
    print(f"{'streams':>8}{'iters':>7}{'steps':>7}" + "".join(f"{p:>9}" for p in parts)
          + "".join(f"{h:>10}" for h in ("engine", "pool", "grpc-loop", "grpc-core", "clients"))
          + f"{'hops':>7}{'wall s':>8}")
    for r in rows:
        p = r.get("profile")
        if not p:
            continue
        print(f"{r['streams']:>8}{p['iterations']:>7}{p['steps']:>7}"
              + "".join(f"{p[k]:>9.2f}" for k in parts)
              + "".join(f"{p[c]:>10.2f}" for c in cpus) + f"{p['hops']:>7}{p['wall_s']:>8.2f}")


def met(ok: bool) -> str:
    return "met" if ok else "missed"


# ---------------------------------------------------------------- llama.cpp, same file
def parse_batched_bench(text: str) -> dict[int, dict[str, float]]:
    """llama-batched-bench's markdown table: streams (B) -> its columns (PP, TG, N_KV, T_PP,
    S_PP, T_TG, S_TG, T, S; seconds and tok/s)."""
    rows: dict[int, dict[str, float]] = {}
    head: list[str] = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.lstrip().startswith("|") or len(cells) < 2:
            continue
        if "S_TG t/s" in cells:
            head = [c.split()[0] for c in cells]
        elif head and len(cells) == len(head) and not cells[0].startswith("-"):
            try:
                vals = dict(zip(head, map(float, cells), strict=True))
            except ValueError:
                continue
            rows[int(vals["B"])] = vals
    return rows


def llamacpp_batched(binary: str, path: str, a, levels: list[int]) -> dict[int, dict]:
    """llama-batched-bench on the same file: prompts of --prompt-tokens, --tokens generated,
    the same levels (flash attention on, every layer on the GPU)."""
    import subprocess

    ctx = max(levels) * (a.prompt_tokens + a.tokens) + 256
    out = subprocess.run([binary, "-m", str(path), "-npp", str(a.prompt_tokens), "-ntg",
                          str(a.tokens), "-npl", ",".join(map(str, levels)), "-fa", "1",
                          "-c", str(ctx), "-ngl", "99"], capture_output=True, text=True,
                         timeout=1200)
    if out.returncode != 0:
        print(f"llama-batched-bench failed: {out.stderr[-300:]}")
        return {}
    return parse_batched_bench(out.stdout)


def llamacpp_goals(rows: list[dict], llama: dict[int, dict]) -> list[dict]:
    """Issue 20's goal against llama.cpp: 64 streams' generation >= 1.5x its S_TG (this run's
    steady rate: every stream decoding, as S_TG counts)."""
    out = []
    for r in rows:
        ref = llama.get(int(r["streams"]))
        if r["streams"] == 64 and ref and ref.get("S_TG"):
            v = r["steady_tok_s"] / ref["S_TG"]
            out.append({"goal": "64 streams: steady generation >= 1.5x llama.cpp's S_TG",
                        "value": v, "met": v >= 1.5})
    return out


def print_llamacpp(rows: list[dict], llama: dict[int, dict], prompt_tokens: int) -> None:
    print("\nagainst llama-batched-bench on the same file (S_TG: generation with every stream "
          "decoding, against this run's steady rate; S: prompt + generated tokens over the "
          "whole run, against this run's (prompt + generated tokens) / wall)")
    print(f"{'streams':>8}{'S_TG':>10}{'steady':>10}{'ratio':>8}{'S':>10}{'ours':>10}"
          f"{'ratio':>8}{'S_PP':>10}{'prompt/s':>10}")
    for r in rows:
        ref = llama.get(int(r["streams"]))
        if not ref:
            continue
        ours = (r["tokens"] + r["streams"] * prompt_tokens) / r["wall_s"]
        print(f"{r['streams']:>8.0f}{ref['S_TG']:>10.1f}{r['steady_tok_s']:>10.1f}"
              f"{r['steady_tok_s'] / ref['S_TG']:>8.2f}{ref['S']:>10.1f}{ours:>10.1f}"
              f"{ours / ref['S']:>8.2f}{ref['S_PP']:>10.1f}{r['prompt_tok_s']:>10.1f}")


# ---------------------------------------------------------------- prefix cache
def prefix_part(client: SpecstreamClient, pool: np.ndarray, a) -> dict:
    """TTFT of a request on a fresh random prefix (A) and of one on the same prefix (B), median
    of PREFIX_ROUNDS rounds with a new prefix each."""
    rng = np.random.default_rng([a.seed, 2])
    rounds = []
    for k in range(PREFIX_ROUNDS):
        prefix = random_prompt(pool, a.prefix_tokens, rng)
        runs = [stream(client, request(prefix + random_prompt(pool, SUFFIX_TOKENS, rng), 1, a,
                                       k)) for _ in "AB"]
        rounds.append({"ttft_a_ms": runs[0].first_token_s() * 1e3,
                       "ttft_b_ms": runs[1].first_token_s() * 1e3,
                       "cached_a": runs[0].cached, "cached_b": runs[1].cached})
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    ratio = med["ttft_b_ms"] / med["ttft_a_ms"]
    return {"prefix_tokens": a.prefix_tokens, "suffix_tokens": SUFFIX_TOKENS, **med,
            "ratio": ratio, "rounds": rounds,
            "goal": {"goal": "cached TTFT <= 1/10 uncached", "value": ratio,
                     "met": ratio <= 0.1}}


# ---------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="known name, GGUF path, or " + "|".join(SYNTH))
    p.add_argument("--backend", default="cpu", choices=("cpu", "cuda", "auto"))
    p.add_argument("--levels", default="1,4,16,64", help="concurrency levels")
    p.add_argument("--tokens", type=int, default=256, help="max_new_tokens per stream")
    p.add_argument("--sampled", action="store_true",
                   help="temperature 0.8, top_p 0.95, seed 1000+i (default greedy)")
    p.add_argument("--prompts", choices=("text", "ids"),
                   help="default: text for a text model, ids for a synthetic one")
    p.add_argument("--prompt-tokens", type=int, default=32, help="length of id prompts")
    p.add_argument("--prefix-tokens", type=int, default=2000, help="shared prefix (0: skip)")
    p.add_argument("--rounds", type=int, default=1, help="runs per level (the best is kept)")
    p.add_argument("--speculative", action="store_true", help="leave speculation on")
    g = p.add_argument_group("engine")
    g.add_argument("--n-ctx", type=int, help="default: prompt + tokens (or prefix) + 64")
    g.add_argument("--n-slots", type=int, help="default: the highest level")
    g.add_argument("--kv-cache-memory", help="EngineConfig.kv_cache_memory (e.g. 8GiB, 0.5)")
    g.add_argument("--prefill-chunk", type=int,
                   help="EngineConfig.prefill_chunk (CUDA: <= 64 runs prompt chunks as captured "
                        "steps on the row-invariant GEMVs, not eager GEMM steps)")
    g.add_argument("--max-step-tokens", type=int, help="EngineConfig.max_step_tokens")
    g.add_argument("--no-prefix-cache", action="store_true", help="EngineConfig.prefix_cache=False")
    g.add_argument("--gemv-mma", action="store_true",
                   help="EngineConfig.gemv_mma=True (CUDA: Q4_K/Q6_K GEMVs on tensor cores)")
    g.add_argument("--no-overlap", action="store_true",
                   help="EngineConfig.overlap='off' (plain decode steps one at a time)")
    g.add_argument("--threads", type=int, default=0, help="CPU backend threads (0 = all)")
    g.add_argument("--one-prompt-a-step", action="store_true",
                   help="the scheduler's wide step holds one prompt chunk, as before segmented "
                        "steps (the baseline of their A/B in one lease)")
    g = p.add_argument_group("synthetic models")
    g.add_argument("--synth-dir", default=DEFAULT_DIR)
    g.add_argument("--seed", type=int, default=0, help="synthetic weights and random prompts")
    p.add_argument("--llama-batched-bench", default="", metavar="BINARY",
                   help="llama.cpp's llama-batched-bench: run on the same file with the same "
                        "prompt length, tokens and levels (--prompts ids), ratios and issue "
                        "20's goal printed")
    p.add_argument("--json", metavar="PATH", help="write rows, goals, prefix figures, config")
    p.add_argument("--plot", metavar="PNG", help="draw the plot (needs matplotlib)")
    a = p.parse_args(argv)
    a.level_list = sorted({int(x) for x in a.levels.split(",") if x.strip()})
    if not a.level_list or min(a.level_list) < 1:
        p.error("--levels: positive integers")
    for name in ("tokens", "prompt_tokens", "rounds"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return a


def engine_fields(a, backend: str, levels: list[int]) -> dict:
    """EngineConfig keywords: the options given, nothing else."""
    need = max(a.prompt_tokens + a.tokens, a.prefix_tokens + SUFFIX_TOKENS + 1)
    fields = {"backend": backend, "n_ctx": a.n_ctx or need + 64,
              "n_slots": a.n_slots or max(levels), "threads": a.threads}
    if a.kv_cache_memory is not None:
        fields["kv_cache_memory"] = a.kv_cache_memory
    if a.prefill_chunk is not None:
        fields["prefill_chunk"] = a.prefill_chunk
    if a.max_step_tokens is not None:
        fields["max_step_tokens"] = a.max_step_tokens
    if a.no_prefix_cache:
        fields["prefix_cache"] = False
    if a.gemv_mma:
        fields["gemv_mma"] = True
    if a.no_overlap:
        fields["overlap"] = "off"
    return fields


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    configure_logging("warning")

    from service.backends import resolve_backend_name
    from service.engine.engine import Engine
    from service.gguf.fetch import resolve_model

    backend = resolve_backend_name(a.backend)
    levels = sorted(set(a.level_list) | ({8} if backend == "cpu" else set()))
    fields = engine_fields(a, backend, levels)
    missing = sorted(set(fields) - {f.name for f in dataclasses.fields(EngineConfig)})
    if missing:
        raise SystemExit(f"this EngineConfig has no field {', '.join(missing)}")
    if a.model in SYNTH:
        path, _ = synth_model(a.synth_dir, SYNTH[a.model], "Q4_K_M", a.seed)
    else:
        path = resolve_model(a.model, models_dir_from_env())
    engine = Engine.load(path, EngineConfig(**fields))
    if a.one_prompt_a_step:
        engine.scheduler.wide_rows = 0      # one chunk a wide step (policy.py)
    engine.start()
    engine.warmup()
    tok = engine.tokenizer
    kind = a.prompts or ("ids" if a.model in SYNTH or not tok.can_encode else "text")
    pool = ordinary_ids(tok)
    texts = [tok.encode(t) for t in PROMPTS] if kind == "text" else []

    def prompts(n: int, rnd: int) -> list[list[int]]:
        if texts:
            return [texts[i % len(texts)] for i in range(n)]
        rng = np.random.default_rng([a.seed, 1, n, rnd])       # fresh per level and round
        return [random_prompt(pool, a.prompt_tokens, rng) for _ in range(n)]

    print(f"model {engine.info.name} backend {engine.info.backend}; streams of {a.tokens} "
          f"tokens, {'sampled' if a.sampled else 'greedy'}, {kind} prompts, speculation "
          f"{'on' if a.speculative else 'off'}, best of {a.rounds}; engine {fields}"
          f"{'; one prompt a wide step' if a.one_prompt_a_step else ''}", flush=True)
    rows, prefix = [], None
    server_cfg = ServerConfig(host="127.0.0.1", port=0, metrics_port=-1)
    t0 = time.perf_counter()
    try:
        with BackgroundServer(engine, server_cfg) as srv, \
                SpecstreamClient(srv.target, timeout=3600) as client:
            stream(client, request(prompts(1, a.rounds)[0], a.tokens, a, 0))   # warm-up
            for n in levels:
                runs = []
                for r in range(a.rounds):
                    ps = prompts(n, r)
                    runs.append(level(client, [request(p, a.tokens, a, i)
                                               for i, p in enumerate(ps)],
                                      lambda: LevelProfile(engine, srv._thread, srv._loop)))
                rows.append(max(runs, key=lambda x: x["agg_tok_s"]))
                rows[-1]["ratio"] = rows[-1]["agg_tok_s"] / rows[0]["agg_tok_s"]
                print(f"  {n} streams: {rows[-1]['agg_tok_s']:.1f} tok/s", flush=True)
            if a.prefix_tokens > 0:
                if a.prefix_tokens + SUFFIX_TOKENS + 1 > engine.info.n_ctx:
                    print(f"prefix part skipped: {a.prefix_tokens} + {SUFFIX_TOKENS} tokens do "
                          f"not fit n_ctx {engine.info.n_ctx}")
                else:
                    prefix = prefix_part(client, pool, a)
    finally:
        engine.stop(10)
    print()
    print_table(rows)
    print_profile(rows)
    s = engine.stats
    graphs = getattr(engine.model.backend, "n_graphs", 0)
    stats = {"decode_steps": s.decode_steps, "decode_rows": s.decode_rows,
             "prefill_steps": s.prefill_steps, "mixed_steps": s.mixed_steps,
             "segmented_steps": s.segmented_steps,
             "prefill_chunks": s.prefill_chunks, "max_sequences": s.max_sequences,
             "preemptions": s.preemptions, "cached_tokens": s.cached_tokens,
             "graphs": graphs, "kv_blocks": engine.pool.n_blocks,
             "kv_block_size": engine.pool.block_size}
    print(f"engine: {s.decode_steps} decode steps for {s.decode_rows} rows, "
          f"{s.prefill_chunks} prompt chunks ({s.mixed_steps} steps beside decode rows, "
          f"{s.prefill_steps} prefill-only steps, {s.segmented_steps} of them segmented: "
          f"several prompts' chunks), at most {s.max_sequences} sequences in a step, "
          f"{s.preemptions} preemptions, {s.cached_tokens} prompt tokens from the prefix "
          f"cache, {graphs} CUDA graphs captured; KV pool {engine.pool.n_blocks} blocks of "
          f"{engine.pool.block_size}")
    if prefix:
        print(f"\nprefix of {a.prefix_tokens} tokens + {SUFFIX_TOKENS}, median of "
              f"{PREFIX_ROUNDS}: TTFT uncached {prefix['ttft_a_ms']:.1f} ms (cached prompt "
              f"tokens {prefix['cached_a']:.0f}), cached {prefix['ttft_b_ms']:.1f} ms (cached "
              f"prompt tokens {prefix['cached_b']:.0f}); ratio {prefix['ratio']:.3f}")
    llama = {}
    if a.llama_batched_bench:
        if kind != "ids":
            print("\nllama-batched-bench skipped: it needs --prompts ids (prompts of "
                  "--prompt-tokens)")
        else:
            llama = llamacpp_batched(a.llama_batched_bench, path, a, levels)
            print_llamacpp(rows, llama, a.prompt_tokens)
    gl = goals(rows, backend) + llamacpp_goals(rows, llama) + ([prefix["goal"]] if prefix
                                                               else [])
    print("\ngoals (this run):")
    for g in gl:
        unit = "" if g["goal"].startswith("cached") else " ms" if "TTFT p99" in g["goal"] else "x"
        print(f"  {g['goal']}: {met(g['met'])} ({g['value']:.2f}{unit})")
    results = {"config": {"args": sys.argv[1:] if argv is None else argv, "model": a.model,
                          "model_name": engine.info.name, "backend": engine.info.backend,
                          "engine": fields, "tokens": a.tokens, "sampled": a.sampled,
                          "prompts": kind, "prompt_tokens": a.prompt_tokens,
                          "rounds": a.rounds, "speculative": a.speculative,
                          "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
               "rows": rows, "goals": gl, "prefix": prefix, "engine_stats": stats,
               "llamacpp_batched": {str(k): v for k, v in llama.items()},
               "seconds": time.perf_counter() - t0}
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
        print(f"results written to {a.json}")
    if a.plot:
        from plot_concurrency import plot

        plot([results], a.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
