"""One stream's decode speed three ways, side by side, as users get it and as the step allows:

    python bench/e2e_decode.py [--models synth-1b,synth-8b,smollm2-135m] [--tokens 256]
                               [--rounds 2] [--backend cuda] [--json PATH]
                               [--parts step,default,engine,no-overlap,grpc,mma]

- step: the graph-replayed decode step back to back (bench/gpu_decode.py `_decode_rate`: the
  position uploaded, the step replayed, the argmax fed back on the device, the id read), the
  ceiling the engine loop is held to (CUDA only);
- engine: `Engine.generate` of `--tokens` greedy tokens (speculation off, end token ignored)
  after a 16-token prompt (the server's default n_ctx, 4096), tok/s = 1000 /
  Finished.timings.per_token_decode_ms, the best of `--rounds` runs, with the overlapped loop
  (config `overlap` on) and without it (off);
- grpc: the same request through the gRPC server (in this process, on a localhost socket) to
  a real client, tok/s over the tokens after the first as the client receives them;
- mma: the overlapped engine with `gemv_mma` (the tensor-core GEMV family at every width,
  one column on its c1 kernels), beside the default dp4a GEMVs (CUDA only);
- default: the engine with the server's default speculation (n-gram drafter, verify width 4)
  and the request's speculation left at its default, overlapped: what a user of the default
  server gets on text the drafter rarely matches;
- llama.cpp: `llama-bench -n 128 -p 0 -fa 1 -r 3` on the same file, when --llama-bench names
  the binary (bench/llamacpp_cuda.sh builds it from the vendored source), with the ratios.

Synthetic models (synth-1b = llama3.2-1b, synth-8b = llama3-8b, synth-30b-a3b = qwen3-30b-a3b,
Q4_K_M, seed 0) are generated into --synth-dir and reused (--parts: fewer loads of a large
file); real models come from $SPECSTREAM_MODELS_DIR. The last lines are a
table with each figure and its ratio to the step rate.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from synth_model import DEFAULT_DIR, synth_model  # noqa: E402

SYNTH = {"synth-1b": "llama3.2-1b", "synth-8b": "llama3-8b", "synth-30b-a3b": "qwen3-30b-a3b"}
PARTS = ("step", "default", "engine", "no-overlap", "grpc", "mma")
PROMPT = tuple(range(1000, 1016))


def model_file(name: str, synth_dir: str) -> Path | None:
    from service.config import models_dir_from_env

    if name in SYNTH:
        return synth_model(synth_dir, SYNTH[name])[0]
    path = models_dir_from_env() / f"{name}.gguf"
    return path if path.is_file() else None


def step_rate(path: Path, tokens: int) -> float:
    from gpu_decode import _decode_rate

    from service.backends.cuda.backend import CudaBackend
    from service.gguf.reader import GGUFFile
    from service.model.spec import ModelSpec
    from service.model.transformer import Transformer

    f = GGUFFile(path)
    be = CudaBackend(graphs=True)
    tr = Transformer(ModelSpec.from_gguf(f), f, be, n_ctx=512, n_slots=1, max_tokens=32)
    rate = _decode_rate(be, tr, tokens)
    del tr, be
    return rate


def request(tokens: int, speculative: bool | None = False):
    from service.engine.types import GenerationRequest, SamplingParams, StoppingCriteria

    return GenerationRequest("bench", PROMPT, SamplingParams(temperature=0.0),
                             StoppingCriteria(max_new_tokens=tokens, ignore_eos=True),
                             speculative=speculative)


def engine_rate(engine, tokens: int, speculative: bool | None = False) -> float:
    from service.engine.types import Finished

    fin = [e for e in engine.generate(request(tokens, speculative), timeout=600)
           if isinstance(e, Finished)]
    return 1000.0 / fin[0].timings.per_token_decode_ms


def llamacpp_rate(binary: str, path: Path) -> float | None:
    """llama-bench's tg128 tok/s on `path` (flash attention on, 3 repetitions)."""
    import subprocess

    out = subprocess.run([binary, "-m", str(path), "-p", "0", "-n", "128", "-fa", "1",
                          "-r", "3", "-o", "json"], capture_output=True, text=True,
                         timeout=600)
    if out.returncode != 0:
        print(f"  llama-bench failed on {path.name}: {out.stderr[-300:]}")
        return None
    return float(json.loads(out.stdout)[0]["avg_ts"])


def grpc_rate(engine, tokens: int) -> float:
    from clients import SpecstreamClient
    from service.serve import BackgroundServer

    with BackgroundServer(engine) as srv, SpecstreamClient(srv.target, timeout=600) as client:
        best = 0.0
        for _ in range(2):              # the first call warms the channel and the server path
            got, t_first, t_last = 0, 0.0, 0.0
            for r in client.generate(tokens=PROMPT, temperature=0.0, max_new_tokens=tokens,
                                     ignore_eos=True, speculative=False):
                if r.WhichOneof("event") == "delta" and r.delta.token_ids:
                    now = time.perf_counter()
                    if not got:
                        t_first = now
                    got += len(r.delta.token_ids)
                    t_last = now
            best = max(best, (got - 1) / (t_last - t_first))
        return best


def bench(name: str, path: Path, a) -> dict:
    from service.config import EngineConfig
    from service.engine.engine import Engine

    row: dict = {"model": name, "file": str(path)}
    if a.llama_bench:
        row["llamacpp"] = llamacpp_rate(a.llama_bench, path)
    if a.backend == "cuda" and "step" in a.parts:
        row["step"] = step_rate(path, a.tokens)
    if "default" in a.parts:
        eng = Engine.load(path, EngineConfig(backend=a.backend, n_slots=4))
        eng.start()
        try:
            engine_rate(eng, 32, None)
            row["default"] = max(engine_rate(eng, a.tokens, None) for _ in range(a.rounds))
        finally:
            eng.stop(30)
    for key, overlap, mma in (("engine", "on", False), ("engine_no_overlap", "off", False),
                              ("engine_mma", "on", True)):
        want_grpc = key == "engine" and "grpc" in a.parts
        if (key == "engine" and "engine" not in a.parts and not want_grpc) or (
                key == "engine_no_overlap" and "no-overlap" not in a.parts) or (
                key == "engine_mma" and ("mma" not in a.parts or a.backend != "cuda")):
            continue
        cfg = EngineConfig(backend=a.backend, n_slots=4, verify_width=1,
                           drafter="none", overlap=overlap, gemv_mma=mma)
        eng = Engine.load(path, cfg)
        eng.start()
        try:
            engine_rate(eng, 32)                                    # warm every step shape
            row[key] = max(engine_rate(eng, a.tokens) for _ in range(a.rounds))
            if want_grpc:
                row["grpc"] = grpc_rate(eng, a.tokens)
        finally:
            eng.stop(30)
    print(f"  {name}: " + ", ".join(f"{k} {v:.0f}" for k, v in row.items()
                                     if isinstance(v, float)), flush=True)
    return row


def table(rows: list[dict]) -> str:
    head = ("| model | llama.cpp tg128 | step (graph) | engine, overlapped | engine, one step "
            "at a time | gRPC, overlapped | default server config | engine, --gemv-mma | "
            "engine/step | engine/llama.cpp | gRPC/llama.cpp | --gemv-mma/engine |")
    lines = [head, "|" + " --- |" * 12]

    def cell(v) -> str:
        return f"{v:.0f}" if v else "-"

    for r in rows:
        step, base = r.get("step"), r.get("llamacpp")

        def ratio(k: str, over, r=r) -> str:
            return f"{r[k] / over:.2f}x" if over and r.get(k) else "-"

        lines.append(f"| {r['model']} | {cell(base)} | {cell(step)} | {cell(r.get('engine'))} | "
                     f"{cell(r.get('engine_no_overlap'))} | {cell(r.get('grpc'))} | "
                     f"{cell(r.get('default'))} | {cell(r.get('engine_mma'))} | "
                     f"{ratio('engine', step)} | {ratio('engine', base)} | "
                     f"{ratio('grpc', base)} | {ratio('engine_mma', r.get('engine'))} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="synth-1b,synth-8b,smollm2-135m")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--synth-dir", default=DEFAULT_DIR)
    ap.add_argument("--json", default="")
    ap.add_argument("--parts", default=",".join(PARTS),
                    help=f"which figures to measure, of {','.join(PARTS)} (each loads the model)")
    ap.add_argument("--llama-bench", default="", metavar="BINARY",
                    help="llama.cpp's llama-bench: its tg128 on the same files, side by side")
    a = ap.parse_args()
    a.parts = a.parts.split(",")
    if not set(a.parts) <= set(PARTS):
        ap.error(f"--parts: of {','.join(PARTS)}")
    rows = []
    for name in a.models.split(","):
        path = model_file(name, a.synth_dir)
        if path is None:
            print(f"  {name}: not present, skipped")
            continue
        rows.append(bench(name, path, a))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    print(f"\nDecode tok/s, one stream, greedy, {a.tokens} tokens after a 16-token prompt "
          f"({a.backend})")
    print(table(rows))


if __name__ == "__main__":
    main()
