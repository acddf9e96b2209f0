"""CPU decode (and prefill) speed of both real models, against llama.cpp in the same run.

For each model: tokens/s of plain greedy decoding through the engine (one token per step), of
greedy decoding with n-gram speculation (verify width 4), and, when the `llama_cpp` package is
importable (see bench/llamacpp_reference.py), of llama.cpp decoding the same tokens with the
same thread count. Without it the llama.cpp columns say so and no ratio is printed: the only
baseline is one measured in the same run.

    python bench/cpu_decode.py [--tokens 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from service.config import EngineConfig, models_dir_from_env  # noqa: E402
from service.engine.engine import Engine  # noqa: E402
from service.engine.types import Collected, GenerationRequest, SamplingParams, StoppingCriteria  # noqa: E402
from service.gguf.fetch import fetch_model  # noqa: E402
from service.logging import configure_logging  # noqa: E402

MODELS = ("smollm2-135m", "gemma3-270m")
PROMPTS = {
    "prose": "Once upon a time, in a small village by the sea,",
    "code": 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
}


def decode(engine: Engine, ids, n: int, speculative: bool | None) -> Collected:
    """n greedy tokens after `ids` (the end-of-generation tokens ignored), every event kept."""
    req = GenerationRequest("bench", tuple(ids), SamplingParams(temperature=0.0),
                            StoppingCriteria(max_new_tokens=n, ignore_eos=True),
                            speculative=speculative)
    out = Collected()
    for ev in engine.generate(req):
        out.add(ev)
    return out


def engine_tok_s(engine: Engine, ids: list[int], n: int, speculative: bool) -> float:
    out = decode(engine, ids, n, speculative)
    t = out.finished.timings
    return (len(out.token_ids) - 1) / (t.decode_ms / 1e3)


def prefill_prompt(n: int) -> list[int]:
    """A fixed pseudo-random prompt of n token ids (the same for every engine and run)."""
    return [100 + (i * 7919) % 20000 for i in range(n)]


def prefill_ms(engine: Engine, n: int) -> float:
    """The engine's prefill time of prefill_prompt(n)."""
    return decode(engine, prefill_prompt(n), 1, None).finished.timings.prefill_ms


def engine_prefill_tok_s(engine: Engine, n: int) -> float:
    return n / (prefill_ms(engine, n) / 1e3)


def llamacpp_prefill_tok_s(path: Path, n: int, threads: int) -> float | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=str(path), n_ctx=1024, n_threads=threads, verbose=False)
    t0 = time.perf_counter()
    llm.eval(prefill_prompt(n))
    return n / (time.perf_counter() - t0)


def llamacpp_tok_s(path: Path, ids: list[int], n: int, threads: int) -> float | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=str(path), n_ctx=512, n_threads=threads, verbose=False)
    llm.eval(ids)
    tok = int(llm.scores[llm.n_tokens - 1].argmax())
    t0 = time.perf_counter()
    for _ in range(n - 1):
        llm.eval([tok])
        row = llm.scores[llm.n_tokens - 1]
        tok = int(row.argmax())
    return (n - 1) / (time.perf_counter() - t0)


NOT_MEASURED = ("* llama.cpp not measured: the llama_cpp package is not importable here "
                "(see bench/llamacpp_reference.py), so there is no baseline and no ratio")


def _rate(value: float | None) -> str:
    return f"{value:9.1f}/s" if value is not None else f"{'-':>9}* "


def _ratio(ours: float, ref: float | None, width: int) -> str:
    return f"{ours / ref:{width - 1}.2f}x" if ref is not None else f"{'-':>{width}}"


def decode_table(rows: list[dict], tokens: int, threads: int, repeats: int) -> str:
    """The decode table. rows: model, prompt, specstream, specstream_spec (tok/s) and llama_cpp
    (tok/s measured in this run, or None when llama.cpp could not run: then no ratio)."""
    lines = [f"\nCPU decode, greedy, {tokens} tokens, {threads} threads (median of {repeats})",
             f"{'model':14} {'prompt':6} {'specstream':>11} {'+ngram spec':>12} "
             f"{'llama.cpp':>11} {'ratio':>6} {'ratio spec':>10}"]
    for r in rows:
        ref = r["llama_cpp"]
        lines.append(f"{r['model']:14} {r['prompt']:6} {r['specstream']:9.1f}/s "
                     f"{r['specstream_spec']:10.1f}/s {_rate(ref)} "
                     f"{_ratio(r['specstream'], ref, 6)} {_ratio(r['specstream_spec'], ref, 10)}")
    if any(r["llama_cpp"] is None for r in rows):
        lines.append(NOT_MEASURED)
    return "\n".join(lines)


def prefill_table(rows: list[dict], n: int, threads: int) -> str:
    """The prefill table. rows: model, specstream and llama_cpp (tok/s or None), as above."""
    lines = [f"\nCPU prefill, {n} prompt tokens, {threads} threads",
             f"{'model':14} {'specstream':>11} {'llama.cpp':>11} {'ratio':>6}"]
    for r in rows:
        ref = r["llama_cpp"]
        lines.append(f"{r['model']:14} {r['specstream']:9.1f}/s {_rate(ref)} "
                     f"{_ratio(r['specstream'], ref, 6)}")
    if any(r["llama_cpp"] is None for r in rows):
        lines.append(NOT_MEASURED)
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill row")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()
    configure_logging("warning")
    rows, prefill = [], []
    for name in MODELS:
        path = fetch_model(name, models_dir_from_env())
        eng = Engine.load(path, EngineConfig(backend="cpu", n_ctx=1024, n_slots=1,
                                             threads=args.threads, verify_width=4))
        eng.start()
        eng.warmup()
        for label, text in PROMPTS.items():
            ids = eng.text_prompt_ids(text)
            plain = statistics.median(engine_tok_s(eng, ids, args.tokens, False)
                                      for _ in range(args.repeats))
            spec = statistics.median(engine_tok_s(eng, ids, args.tokens, True)
                                     for _ in range(args.repeats))
            rows.append({"model": name, "prompt": label, "specstream": plain,
                         "specstream_spec": spec,
                         "llama_cpp": llamacpp_tok_s(path, ids, args.tokens, args.threads)})
        prefill.append({"model": name, "specstream": engine_prefill_tok_s(eng, args.prefill),
                        "llama_cpp": llamacpp_prefill_tok_s(path, args.prefill, args.threads)})
        eng.stop()
    print(decode_table(rows, args.tokens, args.threads, args.repeats))
    print(prefill_table(prefill, args.prefill, args.threads))
    if args.json:
        Path(args.json).write_text(json.dumps({"decode": rows, "prefill": prefill}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
