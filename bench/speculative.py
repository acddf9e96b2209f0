"""Speculative decoding benchmark (issue 8): real drafters on real models, and the verify step
and an oracle drafter on synthetic shapes; every ratio against plain decoding in the same run.

    python bench/speculative.py [--part real|synth|all] [--backend auto|cpu|cuda] [--json PATH]

(a) `--part real`: SmolLM2 and Gemma-3 (--models), on code, prose and repetitive prompts
    (bench/spec_tables.py), greedy, plain decoding against: the n-gram drafter (chain), a
    layer-truncated q8_0 self-drafter made on the fly with service.tools.quantize (`--layers`:
    N keeps blocks 0..N-1, -N drops the last N), the same with tree verify (`--tree-budget`),
    and `--draft PATH` (e.g. a draft GGUF with a fitted Markov head), chain and tree, and
    `--eagle3 PATH` (an EAGLE-3 head; rows only for the models it fits) or `--eagle3 synth` (a
    random head written per model by `synth --eagle3`: it measures the drafting path's cost,
    its drafts are almost never accepted), chain and tree. Per row:
    acceptance (accepted / drafted), mean tokens per target step, decode tok/s, speedup against
    plain, and whether every greedy output equals plain decoding's (else the first differing
    prompt and token index; the run goes on). Each configuration is its own engine, loaded with
    its EngineConfig (verify_width, drafter, draft_model, tree_budget): the table shows what the
    engine does with it. The engine chooses each step's draft length from the sequence's recent
    acceptance and the step costs it times at start (alpha, the cost of a verify row relative
    to a plain step; on a GPU the cost of a step of each size); they are timed once per model
    (by the plain/ngram engine) and given to every other engine of that model, so that timing
    noise does not make the rows decide differently; each engine learns the time its own
    drafter takes per draft as it drafts (`--alpha X` sets alpha alone, with drafting taken as
    free; 0 drafts in full every step).
(b) `--part synth`: a synthetic Q4_K_M model per --shapes (8b, 1b; tiny for a CPU check),
    generated seeded into --synth-dir (the names bench/gpu_bench.py uses, so its files are
    reused). Verify-step time for widths 1..16 at KV length --kv: runner steps of one sequence
    (CUDA graphs on), median of --reps, relative to width 1. Then end-to-end decode of
    --synth-tokens after a --kv-token prompt: plain greedy decoding records the target's own
    continuation, then the oracle drafter (spec_tables.OracleDrafter) proposes it with tokens
    corrupted so that the mean tokens per step hits a set value; at width 6 / 4.27 tokens per
    step (the reference's operating point) and a sweep, each against plain decoding in the same run.
    Synthetic weights give meaningless text; the oracle needs only the target's own tokens.
Tables are printed last, then the goals.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import spec_tables as S  # noqa: E402
from cpu_decode import decode  # noqa: E402
from synth_model import synth_model  # noqa: E402

from service.config import EngineConfig, models_dir_from_env  # noqa: E402
from service.engine.engine import Engine  # noqa: E402
from service.engine.loader import load_model  # noqa: E402
from service.engine.runner import GREEDY, StepInput  # noqa: E402
from service.engine.types import Collected  # noqa: E402
from service.logging import configure_logging  # noqa: E402

SHAPES = {"8b": "llama3-8b", "1b": "llama3.2-1b", "tiny": "tiny"}
SWEEP_TPS = (2.0, 3.0, 5.0)                   # extra tokens/step targets at the reference width
SWEEP_WIDTHS = (2, 4, 8, 12, 16)              # extra widths at the reference's per-draft p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="speculative.py", description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=("real", "synth", "all"), default="all")
    ap.add_argument("--backend", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--threads", type=int, default=0, help="CPU backend threads (0 = all)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--repeats", type=int, default=1, help="runs per measurement (median)")
    g = ap.add_argument_group("part real")
    g.add_argument("--models", default="smollm2-135m,gemma3-270m")
    g.add_argument("--tokens", type=int, default=128, help="tokens generated per prompt")
    g.add_argument("--kinds", default=",".join(S.PROMPTS), help="prompt kinds")
    g.add_argument("--width", type=int, default=6, help="verify width of every drafter row")
    g.add_argument("--layers", default="-2",
                   help="self-drafters: N keeps blocks 0..N-1, -N drops the last N")
    g.add_argument("--tree-budget", default="8", help="tree verify node budgets ('' = none)")
    g.add_argument("--draft", action="append", default=[], metavar="PATH",
                   help="a draft GGUF of the target's vocabulary (repeatable)")
    g.add_argument("--eagle3", action="append", default=[], metavar="PATH|synth",
                   help="an EAGLE-3 head (rows for the models it fits), or 'synth': a random "
                        "head per model (repeatable)")
    g.add_argument("--alpha", type=float, help="verify cost per extra row for every engine "
                   "(0: draft in full); default: timed once per model")
    g = ap.add_argument_group("part synth")
    g.add_argument("--shapes", default="8b,1b", help="of " + ", ".join(SHAPES))
    g.add_argument("--kv", type=int, default=1024, help="KV length of the verify steps, and "
                   "prompt length of the oracle decode")
    g.add_argument("--synth-tokens", type=int, default=512,
                   help="tokens of each plain and oracle decode")
    g.add_argument("--reps", type=int, default=50, help="timed runner steps per width")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--synth-dir", default="/tmp/specstream-synth")
    a = ap.parse_args(argv)
    for name in ("tokens", "repeats", "reps", "kv", "synth_tokens"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 2 <= a.width <= 16:
        ap.error("--width must be in 2..16")
    if a.alpha is not None and not 0.0 <= a.alpha <= 1.0:
        ap.error("--alpha must be in [0, 1]")
    a.layer_list = [int(x) for x in a.layers.split(",") if x.strip()]
    a.budgets = [int(x) for x in a.tree_budget.split(",") if x.strip()]
    a.shape_list = [s for s in a.shapes.split(",") if s]
    bad = [s for s in a.shape_list if s not in SHAPES]
    if bad:
        ap.error(f"unknown shape(s) {bad}; one of {', '.join(SHAPES)}")
    return a


# ---------------------------------------------------------------- part (a): real models
def real_configs(a, n_layer: int, tmp: Path, target: Path) -> list[tuple[str, str, dict]]:
    """(drafter label, verify label, EngineConfig fields) per row after plain and ngram."""
    from service.tools.quantize import requantize

    drafts = []
    for n in a.layer_list:
        keep = n if n > 0 else n_layer + n
        if not 1 <= keep <= n_layer:
            raise SystemExit(f"--layers {n}: the target has {n_layer} blocks")
        path = tmp / f"{target.stem}-{keep}l.gguf"
        if not path.is_file():
            requantize(target, path, "q8_0", keep)
        drafts.append((f"self q8_0 {keep}/{n_layer}L", path))
    drafts += [(f"draft {Path(p).name}", Path(p)) for p in a.draft]
    # the suffix drafter cold (its cache emptied before every decode: the request's own tokens
    # only) and warm (each prompt decoded once before: a request repeating an earlier one)
    out = [("suffix", f"chain {a.width}", {"drafter": "suffix"}),
           ("suffix warm", f"chain {a.width}", {"drafter": "suffix", "_warm": True})]
    for label, path in drafts:
        fields = {"drafter": "model", "draft_model": str(path)}
        out.append((label, f"chain {a.width}", fields))
        out += [(label, f"tree {b}", {**fields, "tree_budget": b}) for b in a.budgets]
    for label, path in eagle3_heads(a, tmp, target):
        fields = {"drafter": "eagle3", "draft_model": str(path)}
        out.append((label, f"chain {a.width}", fields))
        out += [(label, f"tree {b}", {**fields, "tree_budget": b}) for b in a.budgets]
    return out


def eagle3_heads(a, tmp: Path, target: Path) -> list[tuple[str, Path]]:
    """(label, path) of the --eagle3 heads that fit `target` ('synth': one written now)."""
    from service.errors import ModelFormatError
    from service.gguf.reader import GGUFFile
    from service.model.eagle3 import Eagle3Spec
    from service.model.spec import ModelSpec
    from service.tools.synth_eagle3 import synthesize_eagle3

    spec, out = ModelSpec.from_gguf(GGUFFile(target)), []
    for p in a.eagle3:
        if p == "synth":
            path = tmp / f"{target.stem}-eagle3-synth.gguf"
            if not path.is_file():
                synthesize_eagle3(path, target)
            out.append(("eagle3 synth (random)", path))
            continue
        try:
            Eagle3Spec.from_gguf(GGUFFile(p)).check_target(spec, p)
        except ModelFormatError as e:
            print(f"  --eagle3 {p}: not for {target.name} ({e})")
            continue
        out.append((f"eagle3 {Path(p).name}", Path(p)))
    return out


def _load(a, target: Path, costs: tuple[float, list[float]] | None, **fields) -> Engine:
    """An engine of `fields`, started; `costs` (verify_alpha, row_costs) replaces its own
    timing at start (the drafting cost each engine learns from its own drafter, unless
    --alpha is given: then drafts are weighed by alpha alone)."""
    fields.pop("_warm", None)
    cfg = EngineConfig(backend=a.backend, n_ctx=1024, n_slots=1, threads=a.threads,
                       verify_width=a.width, **fields)
    eng = Engine.load(target, cfg)
    eng.start()
    if costs is not None:
        eng.verify_alpha, eng.row_costs = costs
        if a.alpha is None:
            eng.draft_cost = None
    eng.warmup()
    ids = eng.text_prompt_ids(S.PROMPTS["prose"][0])
    for spec in (False, True):                  # every step shape of this config, once
        decode(eng, ids, min(16, a.tokens), spec)
    return eng


def _run_kind(a, eng: Engine, prompts: list[list[int]], spec: bool, plain=None,
              warm: bool = False) -> dict:
    """Decode every prompt of a kind (median decode time of --repeats runs per prompt). A
    suffix drafter starts each run with an empty cache, or (warm) with the prompt's own
    earlier decode in it."""
    from service.engine.spec.suffix import SuffixDrafter

    drafter = eng.speculator.drafter
    suffix = drafter if isinstance(drafter, SuffixDrafter) else None
    drafted = accepted = tokens = 0
    seconds, outs = 0.0, []
    for ids in prompts:
        runs = []
        for _ in range(a.repeats):
            if suffix is not None and suffix.cache is not None:
                suffix.cache.clear()
                if warm:
                    decode(eng, ids, a.tokens, spec)
            runs.append(decode(eng, ids, a.tokens, spec))
        out, u = runs[0], runs[0].finished.usage
        drafted, accepted = drafted + u.draft_tokens, accepted + u.accepted_draft_tokens
        tokens += len(out.token_ids) - 1                        # the first came from prefill
        seconds += statistics.median(r.finished.timings.decode_ms for r in runs) / 1e3
        outs.append(out.token_ids)
    row = {"drafted": drafted, "accepted": accepted, "tokens": tokens, "decode_s": seconds,
           "tok_s": tokens / seconds, "alpha": eng.verify_alpha if spec else None,
           "outputs": outs}
    if plain is not None:
        row["speedup"] = row["tok_s"] / plain["tok_s"]
        row["identical"] = S.identity_text([S.first_difference(r, o) for r, o in
                                            zip(plain["outputs"], outs, strict=True)])
    return row


def bench_real(a, results: dict) -> None:
    from service.gguf.fetch import fetch_model

    kinds = [k for k in a.kinds.split(",") if k]
    with tempfile.TemporaryDirectory(prefix="specbench-") as tmp:
        for name in [m for m in a.models.split(",") if m]:
            target = models_dir_from_env() / f"{name}.gguf"
            try:                          # an offline host must hold the file already
                target = target if target.is_file() else fetch_model(name, target.parent)
            except Exception as exc:
                results["real"].append({"model": name, "kind": "-", "drafter": "-",
                                        "verify": "-", "error": f"{type(exc).__name__}: {exc}"})
                continue
            base = _load(a, target, None if a.alpha is None else (a.alpha, []),
                         drafter="ngram")
            costs = base.verify_alpha, base.row_costs   # every engine of this model decides alike
            prompts = {k: [base.text_prompt_ids(t) for t in S.PROMPTS[k]] for k in kinds}
            n_layer = base.spec.n_layer
            plain, rows = {}, []
            for k in kinds:
                plain[k] = _run_kind(a, base, prompts[k], False)
                rows.append(("plain", "-", k, {**plain[k], "speedup": 1.0,
                                               "identical": "(reference)"}))
                rows.append(("ngram", f"chain {a.width}", k,
                             _run_kind(a, base, prompts[k], True, plain[k])))
                _progress(name, rows[-1])
            base.stop(10)
            for drafter, verify, fields in real_configs(a, n_layer, Path(tmp), target):
                try:
                    eng = _load(a, target, costs, **fields)
                except Exception as exc:   # a configuration the engine refuses is a table row
                    rows += [(drafter, verify, k, {"error": f"{type(exc).__name__}: {exc}"})
                             for k in kinds]
                    continue
                for k in kinds:
                    rows.append((drafter, verify, k, _run_kind(a, eng, prompts[k], True,
                                                               plain[k], "_warm" in fields)))
                    _progress(name, rows[-1])
                eng.stop(10)
                del eng
                gc.collect()
            order = {k: i for i, k in enumerate(kinds)}
            for drafter, verify, k, r in sorted(rows, key=lambda x: order[x[2]]):
                r.pop("outputs", None)
                results["real"].append({"model": name, "kind": k, "drafter": drafter,
                                        "verify": verify, **r})


def _progress(model: str, row) -> None:
    drafter, verify, kind, r = row
    print(f"  {model} {kind} {drafter} {verify}: {r['tok_s']:.1f} tok/s, "
          f"{r['accepted']}/{r['drafted']} accepted, {r['identical']}", flush=True)


# ---------------------------------------------------------------- part (b): synthetic shapes
def verify_times(eng: Engine, kv: int, reps: int) -> list[dict]:
    """Median wall time of runner steps of T rows of slot 0 at positions kv..kv+T-1 (every row
    chooses a token, as a verify step does), T = 1..16, after filling kv KV rows."""
    runner, M = eng.runner, eng.model.max_tokens
    for s in range(0, kv, M):                       # the prompt's KV rows, no logits
        n = min(M, kv - s)
        runner.step(StepInput([1 + (s + i) % 1000 for i in range(n)], range(s, s + n),
                              [0] * n))
    rows = []
    for t in range(1, 17):
        inp = StepInput([1 + i for i in range(t)], range(kv, kv + t), [0] * t, range(t),
                        [GREEDY] * t)
        for _ in range(3):                          # eager once, then capture, then replay
            runner.step(inp)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            runner.step(inp)                        # ends with the readback: synchronous
            times.append(time.perf_counter() - t0)
        rows.append({"width": t, "rows": runner.padded(t), "kv": kv,
                     "step_s": statistics.median(times)})
    for r in rows:
        r["ratio"] = r["step_s"] / rows[0]["step_s"]
    return rows


def oracle_points() -> list[tuple[int, float]]:
    """(width, tokens/step target): the reference point, a sweep of targets at its width, and
    a sweep of widths at its per-draft probability."""
    p_ref = S.p_for_tokens_per_step(S.REF_TOKENS_PER_STEP, S.REF_WIDTH - 1)
    pts = [(S.REF_WIDTH, S.REF_TOKENS_PER_STEP)] + [(S.REF_WIDTH, t) for t in SWEEP_TPS]
    pts += [(w, round(S.expected_tokens_per_step(p_ref, w - 1), 2)) for w in SWEEP_WIDTHS]
    return pts


def oracle_engine(path: Path, config: EngineConfig, seed: int
                  ) -> tuple[Engine, S.OracleDrafter]:
    """An engine on `path` whose drafter is the oracle (not started)."""
    m = load_model(path, config)
    oracle = S.OracleDrafter(m.spec.vocab_size, seed=seed)
    return Engine(m.path, m.gguf, m.spec, m.tokenizer, m.model, m.config, m.backend_name,
                  m.chat_template, oracle), oracle


def oracle_row(eng: Engine, oracle: S.OracleDrafter, prompt: list[int], recorded: list[int],
               width: int, target: float, repeats: int) -> dict:
    """Decode len(recorded) tokens at `width` with the oracle tuned to `target` tokens/step
    (the engine must draft in full: verify_alpha 0). Median tok/s of `repeats` runs, each with
    the oracle's generator restarted, so every run draws the same corruptions."""
    p = S.p_for_tokens_per_step(target, width - 1)
    eng.config = replace(eng.config, verify_width=width)
    runs = []
    for _ in range(repeats):
        oracle.configure(recorded, len(prompt), p)
        runs.append(decode(eng, prompt, len(recorded), True))
    u, n = runs[0].finished.usage, len(runs[0].token_ids) - 1
    diff = S.first_difference(recorded, runs[0].token_ids)
    return {"width": width, "target": target, "p": p,
            "tokens_per_step": n / (n - u.accepted_draft_tokens),
            "acceptance": u.accepted_draft_tokens / max(1, u.draft_tokens),
            "tok_s": statistics.median(_tok_s(r) for r in runs),
            "identical": "identical" if diff is None else f"differs @{diff}"}


def bench_synth(a, results: dict) -> None:
    for shape in a.shape_list:
        cfg = EngineConfig(backend=a.backend, n_ctx=a.kv + a.synth_tokens + 64, n_slots=1,
                           threads=a.threads, verify_width=16, drafter="none")
        path, _ = synth_model(a.synth_dir, SHAPES[shape], "Q4_K_M", a.seed)
        eng, oracle = oracle_engine(path, cfg, a.seed)
        t0 = time.perf_counter()
        verify = verify_times(eng, a.kv, a.reps)
        print(f"  {shape}: verify steps timed ({time.perf_counter() - t0:.1f} s); width 1 "
              f"{verify[0]['step_s'] * 1e3:.2f} ms, width 8 {verify[7]['ratio']:.2f}x",
              flush=True)
        eng.start()
        eng.verify_alpha = 0.0           # the oracle's drafts fill the width every step
        rng = np.random.default_rng(a.seed)
        prompt = [int(x) for x in rng.integers(0, min(1000, eng.spec.vocab_size), a.kv)]
        plain_runs = [decode(eng, prompt, a.synth_tokens, False) for _ in range(a.repeats + 1)]
        recorded = plain_runs[0].token_ids           # the first run also warms the path up
        plain_tok_s = statistics.median(_tok_s(r) for r in plain_runs[1:])
        rows = []
        for w, target in oracle_points():
            r = oracle_row(eng, oracle, prompt, recorded, w, target, a.repeats)
            rows.append({"shape": shape, **r, "speedup": r["tok_s"] / plain_tok_s,
                         "plain_tok_s": plain_tok_s})
            print(f"  {shape} oracle w={w} target {target}: {r['tokens_per_step']:.2f} "
                  f"tok/step, {r['tok_s']:.1f} tok/s", flush=True)
        eng.stop(10)
        results["verify"] += [{"shape": shape, **r} for r in verify]
        results["oracle"] += rows
        results["plain"].append({"shape": shape, "tok_s": plain_tok_s,
                                 "tokens": a.synth_tokens})
        results["goals"] += S.goals(shape, verify, rows)
        del eng, oracle
        gc.collect()                     # this shape's weights, before the next one loads


def _tok_s(out: Collected) -> float:
    return (len(out.token_ids) - 1) / (out.finished.timings.decode_ms / 1e3)


# ---------------------------------------------------------------- main
def report(results: dict, a) -> str:
    parts = []
    if results["real"]:
        parts.append(S.real_table(results["real"], (
            f"Real models, greedy, {a.tokens} tokens per prompt, {len(S.PROMPTS['code'])} "
            f"prompts per kind, verify width {a.width}, backend {results['meta']['backend']}"
            + (", drafting in full" if a.alpha == 0 else ", draft length chosen by the engine")
            + f" (median of {a.repeats})")))
    for p in results["plain"]:
        shape = p["shape"]
        parts.append(S.verify_table([r for r in results["verify"] if r["shape"] == shape],
                                    SHAPES[shape]))
        parts.append(S.oracle_table([r for r in results["oracle"] if r["shape"] == shape],
                                    SHAPES[shape], p["tok_s"], p["tokens"]))
    if results["goals"]:
        parts.append(S.goals_table(results["goals"]))
    parts.append(f"(whole run {results['seconds']:.0f} s)")
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    configure_logging("warning", fmt="console")
    from service.backends import resolve_backend_name

    t0 = time.perf_counter()
    results: dict = {"meta": {"args": sys.argv[1:] if argv is None else argv,
                              "backend": resolve_backend_name(a.backend),
                              "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
                     "real": [], "verify": [], "oracle": [], "plain": [], "goals": []}
    if a.part in ("real", "all"):
        bench_real(a, results)
    if a.part in ("synth", "all"):
        bench_synth(a, results)
    results["seconds"] = time.perf_counter() - t0
    print()
    print(report(results, a))
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
        print(f"results written to {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
