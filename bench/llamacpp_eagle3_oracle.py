"""Regenerate the EAGLE-3 oracle fixture: llama.cpp's draft logits for seeded synthetic EAGLE-3
drafters of the tiny-qwen3 target (tests/data/tiny/llamacpp_eagle3_logits.json).

For the target (tests/data/tiny/tiny-qwen3.gguf) and each drafter of `DRAFTERS` (written by
`synthesize_eagle3` into a temporary directory; the fixture keeps the file's sha256, the test
rewrites the same bytes), llama.cpp runs what common/speculative.cpp's `draft-eagle3` does for
one sequence:

    target   PROMPT_IDS as one batch with the inputs of the drafter's three target layers
             extracted: features (T, 3 E_t); its greedy first token t0 from the last row
    encode   g = the drafter's encoder over every feature row: (T, E)
    prefill  decoder pairs (token[P + 1], g[P]) at positions P = 0..T-2, no outputs
    chain    (t0, g[T-1]) at position T-1, then (d_k, y_k) at T + k: DEPTH rows, each one
             decode with its logits and pre-norm output y_k; d_k = the argmax (llama.cpp's
             drafting sampler is top-k 10 and takes the most probable candidate)

and stores the features and g (float32, base64), t0, the draft ids and each chain row's logits
(4 decimals; with a reduced draft vocabulary only its d2t columns, the rest being -inf).
llama.cpp runs in its own interpreter (llama-cpp-python 0.3.36 built from source for the CPU,
2 threads; see bench/llamacpp_moe_oracle.py for the build command; bench/llamacpp_ext.py binds
the C functions llama_cpp's module lacks):

    .venv/bin/python bench/llamacpp_eagle3_oracle.py --llama-python /tmp/llenv/bin/python
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
from llamacpp_oracle import pack, run_probe

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "data" / "tiny"
OUT = TINY / "llamacpp_eagle3_logits.json"
TARGET = "tiny-qwen3"
# a qwen3 graph exposes the inputs of layers 0..n_layer-1 (not the final residual)
LAYERS = (0, 1, 2)
PROMPT_IDS = [504, 72, 101, 108, 108, 111, 300, 17, 256, 411, 33, 90, 257, 258, 480, 5,
              77, 140, 141, 142, 399, 12, 260, 261]
DEPTH = 6
WEIGHT_STD = 0.15
# name -> synthesize_eagle3 options
DRAFTERS: dict[str, dict] = {
    "plain-f16": dict(seed=11, quant="F16"),
    "reduced-own-embedding-q8": dict(seed=12, quant="Q8_0", draft_vocab=300,
                                     own_embedding=True),
    "norm-before-fc-f16": dict(seed=13, quant="F16", norm_before_fc=True),
}


# ---------------------------------------------------------------- llama.cpp side (its own python)
def probe(target: str, drafter: str, ids: list[int], depth: int) -> dict:
    """Runs under the interpreter that has `llama_cpp`; imports nothing from this project."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from llama_cpp import __version__
    from llamacpp_ext import (
        DECODE,
        ENCODE,
        Entry,
        Runtime,
        get_embeddings_layer_inp,
        get_embeddings_nextn,
        get_embeddings_nextn_ith,
        rows,
        set_embeddings_layer_inp,
        set_embeddings_nextn,
        target_layer_ids,
    )

    tgt = Runtime(target)
    dft = Runtime(drafter, other=tgt)
    layers = target_layer_ids(dft.model)
    for k in layers:
        set_embeddings_layer_inp(tgt.ctx, k, True)
    set_embeddings_nextn(dft.ctx, True, True)
    T, Et, E = len(ids), tgt.n_embd, dft.n_embd
    tgt.process(DECODE, [Entry(t, p, p == T - 1) for p, t in enumerate(ids)])
    last = np.sort(tgt.logits(T - 1))                                       # (V,)
    t0, t0_gap = int(np.argmax(tgt.logits(T - 1))), float(last[-1] - last[-2])
    feats = np.concatenate([rows(get_embeddings_layer_inp(tgt.ctx, k), T, Et) for k in layers],
                           axis=1)                                           # (T, 3 Et)
    dft.process(ENCODE, [Entry(None, p, True, feats[p]) for p in range(T)])
    g = rows(get_embeddings_nextn(dft.ctx), T, E)                           # (T, E)
    dft.process(DECODE, [Entry(ids[p + 1], p, False, g[p]) for p in range(T - 1)])
    draft, logits = [], []
    tok, state, pos = t0, g[T - 1], T - 1
    for _ in range(depth):
        dft.process(DECODE, [Entry(tok, pos, True, state)])
        row = dft.logits(0)                                                  # (V,)
        state = rows(get_embeddings_nextn_ith(dft.ctx, 0), 1, E)[0]          # (E,)
        tok, pos = int(np.argmax(row)), pos + 1
        draft.append(tok)
        logits.append(row)
    return {"version": __version__, "layers": layers, "features": pack(feats), "g": pack(g),
            "t0": t0, "t0_gap": t0_gap, "draft_ids": draft, "logits": np.array(logits)}


# ---------------------------------------------------------------- project side
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-python", help="an interpreter that can import llama_cpp")
    ap.add_argument("--probe", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe:
        res = probe(*args.probe, PROMPT_IDS, DEPTH)
        res["logits"] = res["logits"].tolist()
        print(json.dumps(res))
        return 0
    if not args.llama_python:
        ap.error("--llama-python is required")
    sys.path.insert(0, str(ROOT))
    from service.tools.synth_eagle3 import synthesize_eagle3

    target = TINY / f"{TARGET}.gguf"
    out = {"target": target.name, "layers": list(LAYERS), "prompt_ids": PROMPT_IDS,
           "depth": DEPTH, "weight_std": WEIGHT_STD, "drafters": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, opts in DRAFTERS.items():
            r = synthesize_eagle3(Path(tmp) / f"{name}.gguf", target, layers=LAYERS,
                                  weight_std=WEIGHT_STD, **opts)
            res = run_probe(args.llama_python, __file__, str(target), str(r.path))
            out["llama_cpp"] = res.pop("version")
            out["features"] = res.pop("features")       # the same target run for every drafter
            out["t0_gap"] = res.pop("t0_gap")
            if res.pop("layers") != list(LAYERS):
                raise SystemExit(f"{name}: llama.cpp read other target layers")
            logits = np.array(res.pop("logits"), np.float64)                 # (DEPTH, V)
            if r.spec.has_d2t:
                from service.gguf.reader import GGUFFile
                logits = logits[:, GGUFFile(r.path).index_tensor("d2t")]     # (DEPTH, Vd)
            sha = hashlib.sha256(r.path.read_bytes()).hexdigest()
            out["drafters"][name] = {"options": opts, "sha256": sha, **res,
                                     "logits": logits.round(4).tolist()}
            print(f"{name}: {r.n_bytes / 1e6:.2f} MB, t0 {res['t0']}, drafts "
                  f"{res['draft_ids']}, logit std {np.median(logits.std(axis=1)):.2f}")
    OUT.write_text(json.dumps(out, separators=(",", ":")) + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size / 1e3:.0f} kB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
