"""Structured output's host work per decode step: the constrained rows' matchers take their
committed tokens and fill their next masks, one row at a time (Matcher.accept + mask + done,
the path of a row that commits alone) against one batch per step (constraint.advance_rows:
xgrammar's batch accept and threaded batch fill + done), in the same run. No model runs: the
rows write fixed real texts (an English passage, a JSON object), as a model would.

    python bench/maskfill.py [--rows 1,16] [--threaded-rows 4] [--fill-threads N] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from service.config import models_dir_from_env  # noqa: E402
from service.engine import constraint as C  # noqa: E402
from service.engine.types import Constraint  # noqa: E402
from service.gguf.fetch import fetch_model  # noqa: E402
from service.gguf.reader import GGUFFile  # noqa: E402
from service.model.tokenizer import Tokenizer  # noqa: E402

SEA = ("The sea was calm that morning, and the wind came softly from the west. The boats "
       "left the harbour one by one; their sails caught the light, and the gulls followed them "
       "out past the rocks, crying over the water. By noon the fishermen had cast their nets, "
       "and the old captain watched the clouds gather over the hills behind the town.")
PERSON = json.dumps({"name": "Ada Lovelace", "n": 36, "tags": ["mathematician", "writer",
                     "analyst", "poet of science", "countess"]})    # ", " and ": "
# (constraint, the text its rows write: real text, as a model would, not random tokens)
CASES = {
    "loose regex": (Constraint("regex", r"[A-Za-z ,.;'\-]{1,4000}"), SEA),  # structured.py's
    "json schema": (Constraint("json_schema", json.dumps({
        "type": "object", "additionalProperties": False, "required": ["name", "n", "tags"],
        "properties": {"name": {"type": "string"}, "n": {"type": "integer"},
                       "tags": {"type": "array", "items": {"type": "string"}}}})), PERSON),
}


def walks(tok: Tokenizer, compiled, text: str, n: int) -> list[list[int]]:
    """n rows writing `text` (its tokens, checked against the constraint), each row `r` tokens
    behind row 0's start so the rows sit in different states."""
    ids = tok.encode(text, add_bos=False)
    m = C.Matcher(compiled, tok.vocab_size)
    for t in ids:
        if not m.accept(t):
            raise SystemExit(f"the bench text is refused by its constraint at token {t}")
    return [ids[r % 4:] for r in range(n)]


def one_by_one(ms: list[C.Matcher], tokens: list[int], host: np.ndarray) -> None:
    for r, (m, t) in enumerate(zip(ms, tokens, strict=True)):
        m.accept(t)
        mask = m.mask()
        m.done(mask)
        host[r] = mask                        # the runner's pack into its pinned buffer


def batched(ms: list[C.Matcher], tokens: list[int], host: np.ndarray) -> None:
    masks, _ = C.advance_rows(ms, tokens)
    for r, m in enumerate(ms):
        m.done(masks[r])
        m.ahead = None
        host[r] = masks[r]


CLOCK = time.perf_counter     # --clock cpu: the process's CPU time (every thread's)


def per_step_ms(fn, tok, compiled, paths: list[list[int]]) -> float:
    """The median step's host time (a loaded machine's preemptions land in a few steps)."""
    steps = min(len(p) for p in paths)
    ms = [C.Matcher(compiled, tok.vocab_size) for _ in paths]
    host = np.empty((len(paths), C.mask_words(tok.vocab_size)), np.int32)
    times = []
    for s in range(steps):
        t0 = CLOCK()
        fn(ms, [p[s] for p in paths], host)
        times.append(CLOCK() - t0)
    return 1000 * float(np.median(times))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--threaded-rows", type=int, default=C.THREADED_ROWS)
    ap.add_argument("--fill-threads", type=int, default=C.FILL_THREADS,
                    help="threads of a batch fill (default: the engine's, every core)")
    ap.add_argument("--thread-min-ms", type=float, default=C.THREAD_MIN_MS,
                    help="a batch goes threaded where one thread would take this long (0: "
                         "always, from --threaded-rows rows)")
    ap.add_argument("--rounds", type=int, default=3, help="best of this many runs each")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: the process's CPU time (a shared, loaded host's wall time is "
                         "mostly other processes'; threads then show no gain)")
    args = ap.parse_args(argv)
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    C.THREADED_ROWS, C.FILL_THREADS = args.threaded_rows, args.fill_threads
    C.THREAD_MIN_MS = args.thread_min_ms
    tok = Tokenizer.from_metadata(
        GGUFFile(fetch_model("smollm2-135m", models_dir_from_env())).metadata)
    print(f"host ms per constrained step, {args.clock} time (SmolLM2 vocabulary, median step, "
          f"best of {args.rounds}; {args.fill_threads} threads from {args.threaded_rows} rows "
          f"where one thread takes {args.thread_min_ms} ms)")
    print(f"{'constraint':>12} {'rows':>5} {'one by one':>11} {'batch':>8} {'ratio':>7}")
    for name, (c, text) in CASES.items():
        compiled = C.compile_constraint(tok, c, tok.vocab_size)
        for n in (int(s) for s in args.rows.split(",")):
            paths = walks(tok, compiled, text, n)
            a = min(per_step_ms(one_by_one, tok, compiled, paths) for _ in range(args.rounds))
            b = min(per_step_ms(batched, tok, compiled, paths) for _ in range(args.rounds))
            print(f"{name:>12} {n:>5} {a:>11.3f} {b:>8.3f} {b / a:>6.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
