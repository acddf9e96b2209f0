"""Check that `specstream synth` files load and run in llama.cpp (a development tool).

For each preset and quant mix it writes a file with `specstream synth --layers N`, then, in a
separate interpreter that imports `llama_cpp` (llama-cpp-python, built from source; no project
dependency), loads it with `Llama(model_path, n_ctx=64)`, tokenizes a short text, evaluates its
first tokens and checks that every logit is finite. Each file runs in its own process, so an
abort inside llama.cpp is reported as a failed row instead of ending the run; on a load error the
file is loaded again with llama.cpp's log on, and its error lines become the note.

For the files named with --compare, the logits of all evaluated tokens are compared with the CPU
engine's (`CpuBackend(act_quant=True)`, llama.cpp's activation rounding) with the measure of
tests/golden/test_tiny_models.py: mean |centered difference| / std of llama.cpp's logits, per
token (that test accepts a median of 5% over the positions of a prompt).

    .venv/bin/python bench/llamacpp_synth_check.py --llama-python /tmp/llenv/bin/python \\
        --out /tmp/synthchk
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

TEXT = "The quick brown fox jumps over the lazy dog."
PRESETS = ("tiny", "tiny-moe", "llama3.2-1b", "qwen3-30b-a3b")
QUANTS = ("Q4_K_M", "Q8_0", "Q4_0", "Q6_K", "F16")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))       # the CPU engine of this checkout (imported by compare only)


# ---------------------------------------------------------------- llama.cpp side (its own python)
def probe(path: str, n_eval: int, logits_out: str | None, verbose: bool) -> dict:
    """Load `path` in llama.cpp, evaluate the first `n_eval` tokens of TEXT; runs under the
    interpreter that has `llama_cpp`, and imports nothing from this project."""
    from llama_cpp import Llama, __version__

    llm = Llama(model_path=path, n_ctx=64, n_threads=2, logits_all=True, verbose=verbose,
                seed=0)
    add_bos = llm.metadata.get("tokenizer.ggml.add_bos_token", "false") == "true"
    ids = llm.tokenize(TEXT.encode(), add_bos=add_bos)[:n_eval]
    llm.eval(ids)
    scores = np.array(llm.scores[:llm.n_tokens], np.float32)              # (T, V) f32
    if logits_out:
        np.save(logits_out, scores)
    finite = bool(np.isfinite(scores).all())
    return {"version": __version__, "ids": [int(i) for i in ids], "finite": finite,
            "std": float(np.median(scores.std(axis=1))) if finite else None}


# ---------------------------------------------------------------- project side
def synth(out: Path, preset: str, quant: str, layers: int) -> Path:
    path = out / f"{preset}-{quant}-L{layers}.gguf"
    cmd = [sys.executable, "-m", "service.cli", "synth", "--preset", preset, "--quant", quant,
           "--layers", str(layers), str(path)]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    return path


def run_probe(llama_python: str, path: Path, n_eval: int, logits_out: Path | None) -> dict:
    cmd = [llama_python, __file__, "--probe", str(path), "--n-eval", str(n_eval)]
    if logits_out:
        cmd += ["--logits-out", str(logits_out)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode == 0:
        return json.loads(r.stdout.strip().splitlines()[-1])
    tail = r.stderr.strip().splitlines()[-1:] or [f"exit status {r.returncode}"]
    if "Traceback" not in r.stderr:           # killed or aborted inside llama.cpp
        return {"error": f"crashed ({r.returncode}): {tail[0]}"}
    v = subprocess.run(cmd + ["--verbose"], capture_output=True, text=True)
    lines = [ln.strip() for ln in v.stderr.splitlines()
             if "error" in ln.lower() or "failed" in ln.lower()]
    return {"error": "; ".join(dict.fromkeys(lines[:4])) or tail[0]}


def compare(path: Path, ids: list[int], ref: np.ndarray) -> np.ndarray:
    """Relative difference per token between the CPU engine's logits and llama.cpp's `ref`."""
    from service.backends.cpu.backend import CpuBackend
    from service.gguf.reader import GGUFFile
    from service.model.spec import ModelSpec
    from service.model.transformer import Transformer, positions_for

    f = GGUFFile(path)
    tr = Transformer(ModelSpec.from_gguf(f), f, CpuBackend(act_quant=True), n_ctx=64, n_slots=1,
                     max_tokens=32)
    t = len(ids)
    ours = np.array(tr.forward(np.array(ids, np.int32), positions_for(0, t),
                               np.zeros(t, np.int32), t, t))                # (T, V) f32
    d = ours - ref
    d -= d.mean(axis=1, keepdims=True)          # a common shift does not change the softmax
    return np.abs(d).mean(axis=1) / ref.std(axis=1)


def check(args) -> list[list[str]]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, version = [], "?"
    for preset in args.presets:
        for quant in args.quants:
            path = synth(out, preset, quant, args.layers)
            mb = path.stat().st_size / 1e6
            cmp = f"{preset}:{quant}" in args.compare
            npy = path.with_suffix(".logits.npy") if cmp else None
            r = run_probe(args.llama_python, path, args.n_eval, npy)
            version = r.get("version", version)
            if "error" in r:
                rows.append([preset, quant, str(args.layers), f"{mb:.1f}", "FAILED", "-",
                             r["error"][:200]])
            else:
                note = f"{len(r['ids'])} tokens, logit std {r['std']:.2f}" if r["finite"] else ""
                if cmp and r["finite"]:
                    rel = compare(path, r["ids"], np.load(npy))
                    note += (f"; CPU engine vs llama.cpp: token 0 {rel[0]:.2%}, "
                             f"median {np.median(rel):.2%}, max {rel.max():.2%}")
                rows.append([preset, quant, str(args.layers), f"{mb:.1f}", "ok",
                             "yes" if r["finite"] else "NO", note])
            if not args.keep:
                path.unlink()
                if npy:
                    npy.unlink(missing_ok=True)
    print(f"llama.cpp: llama-cpp-python {version}; text {TEXT!r}")
    return rows


def print_table(rows: list[list[str]]) -> None:
    head = ["preset", "quant", "layers", "file MB", "llama.cpp load", "logits finite", "note"]
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    for r in [head, ["-" * w for w in widths]] + rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-python", help="an interpreter that can import llama_cpp")
    ap.add_argument("--out", default="/tmp/synthchk", help="directory for the files")
    ap.add_argument("--presets", nargs="+", default=list(PRESETS))
    ap.add_argument("--quants", nargs="+", default=list(QUANTS))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--n-eval", type=int, default=6, help="tokens evaluated per file")
    ap.add_argument("--compare", nargs="*", default=["tiny:Q8_0"], metavar="PRESET:QUANT",
                    help="files whose logits are compared with the CPU engine's")
    ap.add_argument("--keep", action="store_true", help="keep the files")
    ap.add_argument("--probe", help=argparse.SUPPRESS)
    ap.add_argument("--logits-out", help=argparse.SUPPRESS)
    ap.add_argument("--verbose", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe:
        print(json.dumps(probe(args.probe, args.n_eval, args.logits_out, args.verbose)))
        return 0
    if not args.llama_python:
        ap.error("--llama-python is required")
    print_table(check(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
