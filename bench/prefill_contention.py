"""Prefill time of one prompt through the engine, alone and beside a busy numpy process.

Prompts longer than 16 tokens go through BLAS sgemm (service/backends/cpu/matmul.py), so prefill
speed depends on how many threads the BLAS pool runs next to another process that wants the cores.
For each thread count the script times a prefill of `--tokens` prompt tokens on an idle
machine, then again while a neighbour process multiplies matrices with numpy (its own BLAS pool
at its default size), and prints the medians and the ratio busy / idle.

    python bench/prefill_contention.py [--model smollm2-135m] [--tokens 64] [--threads 1 2]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cpu_decode import prefill_ms  # noqa: E402  (bench/ is this script's sys.path[0])

from service.config import EngineConfig, models_dir_from_env  # noqa: E402
from service.engine.engine import Engine  # noqa: E402
from service.gguf.fetch import fetch_model  # noqa: E402
from service.logging import configure_logging  # noqa: E402

# A neighbour that keeps every core busy with numpy sgemm for at most `seconds` seconds.
NEIGHBOUR = """
import sys, time
import numpy as np
a = np.random.default_rng(0).random((768, 768), dtype=np.float32)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    a @ a
"""


def measure(engine: Engine, n: int, repeats: int) -> float:
    return statistics.median(prefill_ms(engine, n) for _ in range(repeats))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    configure_logging("warning")
    path = fetch_model(args.model, models_dir_from_env())
    rows = []
    for threads in args.threads:
        eng = Engine.load(path, EngineConfig(backend="cpu", n_ctx=1024, n_slots=1,
                                             threads=threads, drafter="none"))
        eng.start()
        eng.warmup()
        idle = measure(eng, args.tokens, args.repeats)
        seconds = 5 + args.repeats * 10
        neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR, str(seconds)])
        try:
            time.sleep(1.0)                     # let the neighbour start its threads
            busy = measure(eng, args.tokens, args.repeats)
        finally:
            neighbour.terminate()
            neighbour.wait(10)
        rows.append((threads, idle, busy))
        eng.stop()
    print(f"\nprefill of {args.tokens} tokens, {args.model}, median of {args.repeats}")
    print(f"{'threads':>7} {'idle ms':>9} {'busy ms':>9} {'busy/idle':>9}")
    for threads, idle, busy in rows:
        print(f"{threads:>7} {idle:9.1f} {busy:9.1f} {busy / idle:8.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
