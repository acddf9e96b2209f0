"""Where the engine thread's time goes in the overlapped decode loop, by call: the mean wall ms
per iteration of the runner's calls (submit, sample, collect) and the backend's and model's
calls inside them (uploads, graph launches, downloads, the wait), the constrained rows' batch
accept + mask fill (advance_rows) and the streams' emits, for plain and for constrained
requests in turn (seeded sampling, speculation off, the structured bench's requests).

    python bench/hostcalls.py [--backend cuda] [--model synth-1b] [--constraint json|regex]
        [--streams 16] [--tokens 64]

A call's time is its own wall time on the host (an asynchronous backend's launch, not the
device's work); nested calls are named by their caller (`submit/forward/run_step`). On the CPU
backend the overlap is forced on (--overlap on), so the same calls run, synchronously.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import structured as SB  # noqa: E402

from service.config import models_dir_from_env  # noqa: E402
from service.engine.engine import Engine, EngineConfig  # noqa: E402
from service.engine.runner.model_runner import ModelRunner  # noqa: E402
from service.engine.scheduler import sequence as SQ  # noqa: E402
from service.gguf.fetch import fetch_model  # noqa: E402
from service.logging import configure_logging  # noqa: E402


class CallTimes:
    """Wall time and count per call path, for the calls `wrap` replaced (restored by undo)."""

    def __init__(self) -> None:
        self.ms: collections.Counter[str] = collections.Counter()
        self.n: collections.Counter[str] = collections.Counter()
        self._stack: list[str] = []
        self._undo: list[tuple[Any, str, Any, bool]] = []

    def wrap(self, owner: Any, name: str) -> None:
        inner = getattr(owner, name)
        own = name in vars(owner)

        def timed(*a, **k):
            key = "/".join([*self._stack, name.lstrip("_")])
            self._stack.append(name.lstrip("_"))
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                self.ms[key] += 1e3 * (time.perf_counter() - t0)
                self.n[key] += 1
                self._stack.pop()

        self._undo.append((owner, name, inner, own))
        setattr(owner, name, timed)

    def undo(self) -> None:
        for owner, name, inner, own in reversed(self._undo):
            if own:
                setattr(owner, name, inner)
            else:
                delattr(owner, name)
        self._undo.clear()

    def table(self, per: int) -> list[tuple[str, float, float]]:
        """(call path, calls per iteration, ms per iteration), by path."""
        return [(k, self.n[k] / per, self.ms[k] / per) for k in sorted(self.ms)]


def measure(eng: Engine, streams: int, tokens: int, constraint, times: CallTimes) -> tuple:
    times.ms.clear()
    times.n.clear()
    ms, _ = SB.per_token_ms(eng, streams, tokens, constraint, True)
    return ms, max(times.n["submit"], 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--model", default="synth-1b",
                    help="smollm2-135m, synth-8b / synth-1b or a GGUF path (as structured.py)")
    ap.add_argument("--synth-dir", default=SB.DEFAULT_DIR)
    ap.add_argument("--constraint", choices=("json", "regex"), default="json")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args(argv)
    configure_logging("warning")
    if args.model in SB.SYNTH:
        path, _ = SB.synth_model(args.synth_dir, SB.SYNTH[args.model], "Q4_K_M", 0)
    elif Path(args.model).is_file():
        path = Path(args.model)
    else:
        path = fetch_model(args.model, models_dir_from_env())
    eng = Engine.load(path, EngineConfig(backend=args.backend, n_ctx=512, n_slots=args.streams,
                                         overlap="on"))
    eng.start()
    times = CallTimes()
    c = SB.NOTE if args.constraint == "json" else SB.LOOSE
    try:
        eng.warmup()
        for cons in (c, c, None):           # xgrammar's compile; the shapes captured
            SB.per_token_ms(eng, args.streams, args.tokens, cons, True)
        be = eng.runner.model.backend
        for name in ("submit", "sample", "collect", "_pack"):
            times.wrap(ModelRunner, name)
        for name in ("upload_step", "run_step", "queue_download", "wait_download", "feed_ids"):
            times.wrap(be, name)
        times.wrap(eng.runner.model, "forward")
        times.wrap(SQ, "advance_rows")
        times.wrap(SQ.Sequence, "emit")
        print(f"host calls of the overlapped loop, {args.backend}, {args.model}, "
              f"{args.streams} streams, {args.tokens} tokens, sampled, {args.constraint} "
              f"constraint (ms per iteration; an iteration is one submitted step)")
        for side, cons in (("plain", None), ("constrained", c)):
            ms, per = measure(eng, args.streams, args.tokens, cons, times)
            print(f"== {side}: {ms:.3f} ms per token per stream, {per} iterations")
            print(f"{'call':<34} {'calls/it':>9} {'ms/it':>8}")
            for key, calls, t in times.table(per):
                print(f"{key:<34} {calls:>9.2f} {t:>8.3f}")
    finally:
        times.undo()
        eng.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
