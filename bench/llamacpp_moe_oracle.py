"""Regenerate the MoE oracle fixtures: tiny Laguna and qwen3moe files and llama.cpp's logits.

Writes, under tests/data/tiny/, the seeded files of `FIXTURES` (`specstream synth`'s presets
tiny-laguna, tiny-laguna-elem and tiny-qwen3moe-s at several quant mixes and seeds, weights of
std WEIGHT_STD so that the logits have a spread) and `llamacpp_moe_logits.json`: per file,
llama.cpp's logits (V per position) of every position of PROMPT_IDS evaluated as one batch,
then its greedy continuation of N_GREEDY ids, each decoded one token at a time, with the logits
of each of those steps. Also `llamacpp_laguna_tokens.json`: llama.cpp's token ids of TEXTS in
the vocabulary of `specstream synth --preset laguna-xs2` (its `laguna` pre-tokenizer; a
header-only file, loaded vocab-only).

llama.cpp runs in a separate interpreter that imports `llama_cpp` (llama-cpp-python 0.3.36 built
from source, CPU, 2 threads; no project dependency), one process per file:

    python3.11 -m venv /tmp/llenv && CMAKE_ARGS="-DGGML_NATIVE=OFF" \\
        /tmp/llenv/bin/pip install --no-binary llama-cpp-python llama-cpp-python==0.3.36
    .venv/bin/python bench/llamacpp_moe_oracle.py --llama-python /tmp/llenv/bin/python

The files are deterministic (synth's bytes depend on preset, mix, seed and std only); the
logits depend on llama.cpp's CPU build (its SIMD paths), hence the tests' tolerances.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from llamacpp_oracle import run_probe

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "data" / "tiny"
OUT = TINY / "llamacpp_moe_logits.json"
TOKENS_OUT = TINY / "llamacpp_laguna_tokens.json"
TEXTS = ["Hello world!\n\nThis is   a test.\n", "numbers 12345 and 3.14159\r\n\ttabs",
         "it's don't WE'LL", "line1\nline2\n\n\nline3  ", "\u00e9moji \U0001f600 \u00fcn\u00efcode",
         "<|endoftext|>special<s> text", "   leading spaces", "a\n b\n  c"]
WEIGHT_STD = 0.25
# ids below 504 are the tiny vocabulary's byte tokens and pieces
PROMPT_IDS = [504, 72, 101, 108, 108, 111, 300, 17, 256, 411, 33, 90, 257, 258, 480, 5,
              77, 140, 141, 142, 399, 12, 260, 261]
N_GREEDY = 12
# name -> (preset, quant mix, seed)
FIXTURES: dict[str, tuple[str, str, int]] = {
    "tiny-laguna-q8": ("tiny-laguna", "Q8_0", 1),
    "tiny-laguna-q4": ("tiny-laguna", "Q4_0", 2),
    "tiny-laguna-elem-q5": ("tiny-laguna-elem", "Q5_1", 3),
    "tiny-qwen3moe-s-q8": ("tiny-qwen3moe-s", "Q8_0", 1),
    "tiny-qwen3moe-s-q4": ("tiny-qwen3moe-s", "Q4_1", 2),
    "tiny-qwen3moe-s-f16": ("tiny-qwen3moe-s", "F16", 3),
}


# ---------------------------------------------------------------- llama.cpp side (its own python)
def probe(path: str, ids: list[int], n_greedy: int) -> dict:
    """Runs under the interpreter that has `llama_cpp`; imports nothing from this project."""
    from llama_cpp import Llama, __version__

    llm = Llama(model_path=path, n_ctx=128, n_batch=64, n_threads=2, logits_all=True,
                verbose=False, seed=0)
    llm.eval(ids)
    prompt = np.array(llm.scores[:len(ids)], np.float32)                   # (T, V)
    greedy, rows = [], []
    last = prompt[-1]
    for _ in range(n_greedy):
        tok = int(np.argmax(last))
        greedy.append(tok)
        llm.eval([tok])
        last = np.array(llm.scores[llm.n_tokens - 1], np.float32)          # (V,)
        rows.append(last)
    # 4 decimals (of float64, so the JSON holds short numbers): far below the tests' bounds
    return {"version": __version__, "logits": prompt.astype(np.float64).round(4).tolist(),
            "greedy_ids": greedy, "greedy_logits": np.array(rows, np.float64).round(4).tolist()}


def probe_tokens(path: str) -> list[list[int]]:
    from llama_cpp import Llama

    llm = Llama(model_path=path, vocab_only=True, verbose=False)
    return [llm.tokenize(t.encode(), add_bos=False, special=True) for t in TEXTS]


# ---------------------------------------------------------------- project side
def write_files() -> None:
    sys.path.insert(0, str(ROOT))
    from service.tools.synth import synthesize

    for name, (preset, quant, seed) in FIXTURES.items():
        r = synthesize(TINY / f"{name}.gguf", preset, quant, seed=seed, threads=1,
                       weight_std=WEIGHT_STD)
        print(f"{r.path.name}: {r.n_bytes / 1e6:.2f} MB")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-python", help="an interpreter that can import llama_cpp")
    ap.add_argument("--only", action="append", default=[], help="fixture names to redo")
    ap.add_argument("--probe", help=argparse.SUPPRESS)
    ap.add_argument("--probe-tokens", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe:
        print(json.dumps(probe(args.probe, PROMPT_IDS, N_GREEDY)))
        return 0
    if args.probe_tokens:
        print(json.dumps(probe_tokens(args.probe_tokens)))
        return 0
    if not args.llama_python:
        ap.error("--llama-python is required")
    write_files()
    out = json.loads(OUT.read_text()) if OUT.exists() and args.only else {"models": {}}
    out["prompt_ids"] = PROMPT_IDS
    out["weight_std"] = WEIGHT_STD
    for name, (preset, quant, seed) in FIXTURES.items():
        if args.only and name not in args.only:
            continue
        path = TINY / f"{name}.gguf"
        res = run_probe(args.llama_python, __file__, str(path), tail=2000)
        out["llama_cpp"] = res.pop("version")
        out["models"][name] = {"file": path.name, "preset": preset, "quant": quant,
                               "seed": seed} | res
        ref = np.array(res["logits"])
        print(f"{name}: logit std {np.median(ref.std(axis=1)):.2f}, greedy {res['greedy_ids']}")
    OUT.write_text(json.dumps(out, separators=(",", ":")) + "\n")
    write_tokens(args.llama_python)
    return 0


def write_tokens(llama_python: str) -> None:
    import tempfile

    from service.tools.synth import synthesize

    with tempfile.TemporaryDirectory() as tmp:
        path = synthesize(Path(tmp) / "xs2.gguf", "laguna-xs2", "Q4_K_M", n_layer=1,
                          data=False).path
        r = subprocess.run([llama_python, __file__, "--probe-tokens", str(path)],
                           capture_output=True, text=True, check=True)
    ids = json.loads(r.stdout.strip().splitlines()[-1])
    TOKENS_OUT.write_text(json.dumps({"preset": "laguna-xs2", "texts": TEXTS, "ids": ids},
                                     ensure_ascii=False) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
