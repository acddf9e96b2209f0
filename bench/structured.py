"""Structured output's cost per token: constrained vs unconstrained decoding in the same run.

At 1 and 16 concurrent streams (SmolLM2, greedy, speculation off), the wall time per generated
token of requests with a constraint against the same requests without one, and their ratio
(goal <= 1.05x), for two constraints: a JSON-schema-free regex that keeps the model's text
(words, spaces and punctuation, so every step carries a full-vocabulary mask; its counted
repetition {1,4000} is the costly case for xgrammar's masks, bench/maskfill.py) and a JSON schema
of one free string field (the common case: a tool call's arguments), whose masks xgrammar fills
from its per-state cache. Greedy constrained rows run overlapped (a fed row chooses without its
mask and the host checks it against the mask, filled meanwhile: docs/structured-output.md); the
table also gives how many overlapped choices the masks refused.

    python bench/structured.py [--backend cpu|cuda] [--model smollm2-135m|synth-8b|synth-1b|PATH]
        [--tokens 64] [--rounds 2] [--regex R] [--constraints regex,json] [--sampled]

--sampled: seeded sampling; constrained rows then run overlapped with their masks filled while
the model runs, sampled after it (masks_later).

The synthetic 8B (llama3-8b shapes, Q4_K_M, seeded, generated into --synth-dir and reused)
carries a real tokenizer, so its masks are as large as a real model's; its text is noise, so
a constraint may end early (the per-token figure counts only the tokens that came).

Every request asks for --tokens tokens at least (min_tokens: no end token before them, so an
unconstrained or regex-constrained stream runs them all); a JSON stream ends where its object
closes. Each case runs untimed first until a run meets no new step shape (warm_shapes), so
the step shapes of its streams' ends are captured graphs by then, as on a server that has run
a while (a step's graph is keyed by its logits rows too).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from synth_model import DEFAULT_DIR, synth_model  # noqa: E402

from service.config import EngineConfig, models_dir_from_env  # noqa: E402
from service.engine import constraint as C  # noqa: E402
from service.engine.engine import Engine  # noqa: E402
from service.engine.stepprofile import IterationProfile, StepStats  # noqa: E402
from service.engine.types import (  # noqa: E402
    Collected,
    Constraint,
    GenerationRequest,
    SamplingParams,
    StoppingCriteria,
)
from service.gguf.fetch import fetch_model  # noqa: E402
from service.logging import configure_logging  # noqa: E402

SYNTH = {"synth-8b": "llama3-8b", "synth-1b": "llama3.2-1b"}    # synthetic Q4_K_M, seed 0
PROMPT = "Write a few sentences about the sea, the wind and the boats:"
LOOSE = Constraint("regex", r"[A-Za-z ,.;'\-]{1,4000}")
# one free string field: the model writes its sentences inside the JSON string
NOTE = Constraint("json_schema", json.dumps({
    "type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"],
    "additionalProperties": False}))


def per_token_ms(eng: Engine, streams: int, tokens: int, constraint: Constraint | None,
                 sampled: bool = False, profile: dict | None = None) -> tuple[float, int]:
    """ms per token of one stream after its first (the decode steps' cost, whatever the
    prompt's and however many tokens a constraint lets through before it ends), the mean over
    the streams, and the overlapped choices the masks refused. `profile`: filled with the
    engine thread's ms per iteration by part (stepprofile.IterationProfile.summary)."""
    ids = tuple(eng.text_prompt_ids(PROMPT))
    reqs = [GenerationRequest(f"r{i}", ids, SamplingParams(temperature=0.8, seed=i)
                              if sampled else SamplingParams(temperature=0.0),
                              StoppingCriteria(max_new_tokens=tokens, min_tokens=tokens),
                              speculative=False, constraint=constraint)
            for i in range(streams)]
    results = [Collected() for _ in reqs]
    first = [0.0] * streams           # when each stream's first token came
    last = [0.0] * streams            # and its last
    left = threading.Semaphore(0)

    def sink(i: int):
        def add(ev) -> None:        # on the engine thread: record, and count the finished
            now = time.perf_counter()
            had = len(results[i].token_ids)
            results[i].add(ev)
            if not had and results[i].token_ids:
                first[i] = now
            if len(results[i].token_ids) > had:
                last[i] = now
            if results[i].finished is not None:
                left.release()
        return add

    with eng._lock:
        eng.stats = StepStats()
        eng.stats.profile = IterationProfile()
    for i, req in enumerate(reqs):
        eng.submit(req, sink(i))
    for _ in reqs:
        left.acquire()
    if profile is not None:
        with eng._lock:
            profile.update(eng.stats.profile.summary())
    failed = [r.finished.error for r in results if r.finished.error]
    if failed:      # a failed stream's time would be timed as if it had decoded
        raise RuntimeError(f"{len(failed)} of {streams} streams failed: {failed[0]}")
    per = [1000 * (last[i] - first[i]) / (len(r.token_ids) - 1)
           for i, r in enumerate(results) if len(r.token_ids) > 1]
    if not per:
        raise RuntimeError("no stream made two tokens: nothing to time")
    return sum(per) / len(per), eng.stats.mask_refusals


WARM_RUNS = 8     # at most this many untimed runs of a case (warm_shapes)


def warm_shapes(eng: Engine, streams: int, tokens: int, constraint: Constraint | None,
                sampled: bool) -> int:
    """Run the case untimed until a run makes the backend meet no step shape it had not run
    twice (CUDA: a shape's first step runs eagerly, its second is captured into a graph, the
    later ones replay it): sampled streams end at different tokens where their constraint
    completes, and every count of logits rows is a shape of its own, so one run may meet
    shapes the last did not. At least two runs, at most WARM_RUNS; returns how many ran (a
    backend that captures nothing: two)."""
    be = eng.runner.model.backend
    seen = getattr(be, "_seen", None)
    for run in range(1, WARM_RUNS + 1):
        before = (len(seen), be.n_graphs) if seen is not None else None
        per_token_ms(eng, streams, tokens, constraint, sampled)
        if run >= 2 and (seen is None or (len(seen), be.n_graphs) == before):
            return run
    return WARM_RUNS


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--model", default="smollm2-135m",
                    help="smollm2-135m, synth-8b / synth-1b (llama3-8b / llama3.2-1b shapes, "
                         "Q4_K_M) or a GGUF path")
    ap.add_argument("--synth-dir", default=DEFAULT_DIR)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="best of this many runs each")
    ap.add_argument("--streams", default="1,16")
    ap.add_argument("--overlap", choices=("auto", "on", "off"), default="auto",
                    help="the engine's overlap mode (off: both sides run the same loop, so "
                         "the ratio is the mask's own cost)")
    ap.add_argument("--regex", default=LOOSE.text,
                    help="the constraint (a counted repetition such as {1,4000} costs xgrammar "
                         "far more per mask than + : bench/maskfill.py)")
    ap.add_argument("--constraints", default="regex,json",
                    help="which constraints to time: regex (--regex), json (a one-field schema)")
    ap.add_argument("--sampled", action="store_true",
                    help="seeded sampling (temperature 0.8) instead of greedy: constrained rows "
                         "then sample once their masks are filled, overlapped")
    ap.add_argument("--fill-threads", type=int, default=C.FILL_THREADS,
                    help="threads of a threaded batch mask fill (constraint.FILL_THREADS; "
                         "default every core)")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)
    configure_logging("warning")
    C.FILL_THREADS = args.fill_threads
    counts = [int(s) for s in args.streams.split(",")]
    if args.model in SYNTH:
        path, _ = synth_model(args.synth_dir, SYNTH[args.model], "Q4_K_M", 0)
    elif Path(args.model).is_file():
        path = Path(args.model)
    else:
        path = fetch_model(args.model, models_dir_from_env())
    eng = Engine.load(path, EngineConfig(backend=args.backend, n_ctx=512,
                                         n_slots=max(counts), overlap=args.overlap))
    eng.start()
    rows = []
    try:
        eng.warmup()
        kinds = {"regex": Constraint("regex", args.regex), "json": NOTE}
        cases = [(k, kinds[k]) for k in args.constraints.split(",")]
        for _, c in cases:
            per_token_ms(eng, 1, 4, c, args.sampled)   # xgrammar's import and compile
        for n in counts:
            per_token_ms(eng, n, 4, None)              # this batch size's first steps
            for kind, c in cases:
                warm_shapes(eng, n, args.tokens, c, args.sampled)
                profs = [({}, {}) for _ in range(args.rounds)]
                runs = [(per_token_ms(eng, n, args.tokens, None, args.sampled, pp),
                         per_token_ms(eng, n, args.tokens, c, args.sampled, pc))
                        for pp, pc in profs]
                plain = min(p for (p, _), _ in runs)                    # interleaved
                cons, refused = min(c for _, c in runs)
                best_p = min(range(len(runs)), key=lambda i: runs[i][0][0])
                best_c = min(range(len(runs)), key=lambda i: runs[i][1][0])
                rows.append({"constraint": kind, "streams": n, "plain_ms": plain,
                             "constrained_ms": cons, "ratio": cons / plain,
                             "refused": refused, "plain_profile": profs[best_p][0],
                             "constrained_profile": profs[best_c][1]})
    finally:
        eng.stop()
    print(f"structured output, {args.backend}, overlap {args.overlap}, {args.model}, "
          f"{'sampled' if args.sampled else 'greedy'}, {args.tokens} "
          f"tokens, best of {args.rounds} (ms per token per stream after its first; goal ratio "
          f"<= 1.05); regex {args.regex!r}, json {NOTE.text}")
    print(f"{'constraint':>10} {'streams':>8} {'plain':>9} {'constrained':>12} {'ratio':>7} "
          f"{'refused':>8}")
    for r in rows:
        print(f"{r['constraint']:>10} {r['streams']:>8} {r['plain_ms']:>9.2f} "
              f"{r['constrained_ms']:>12.2f} {r['ratio']:>6.3f}x {r['refused']:>8}")
    print("\nwhere an iteration goes (the engine thread, ms per iteration of the best run; on an "
          "asynchronous backend `step` is the launch and `readback` the wait for the device)")
    parts = ("schedule", "pack", "step", "readback", "emit", "other")
    print(f"{'constraint':>10} {'streams':>8} {'side':>12} {'iters':>6} "
          + " ".join(f"{p:>8}" for p in parts) + f" {'host':>8}")
    for r in rows:
        for side in ("plain", "constrained"):
            p = r[f"{side}_profile"]
            print(f"{r['constraint']:>10} {r['streams']:>8} {side:>12} {p['iterations']:>6} "
                  + " ".join(f"{p[k]:>8.3f}" for k in parts) + f" {p['host']:>8.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
