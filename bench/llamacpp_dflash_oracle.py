"""Regenerate the DFlash oracle fixture: llama.cpp's draft-block logits for seeded synthetic
DFlash drafters of the tiny-qwen3 target (tests/data/tiny/llamacpp_dflash_logits.json).

For the target (tests/data/tiny/tiny-qwen3.gguf) and each drafter of `DRAFTERS` (written by
`synthesize_dflash` into a temporary directory; the fixture keeps the file's sha256, the test
rewrites the same bytes), llama.cpp runs what common/speculative.cpp's `draft-dflash` and the
server around it do for one sequence, two draft rounds:

    target    PROMPT_IDS (T) as one batch, the inputs of the drafter's target layers extracted:
              features (T, P E); its greedy token t0 (id_last) from the last row
    inject    the T feature rows as one embedding batch at positions 0..T-1 (the drafter's
              encoder fuses them and writes every layer's K/V), no outputs
    block 1   [t0, mask x (B - 1)] at positions T..T+B-1, every row an output: logits (B, V);
              the drafts d_i = argmax of rows 1..B-1 (llama.cpp's drafting sampler is top-k 10
              and takes the most probable candidate); then the drafter's positions >= T are
              removed (the server's seq_rm after drafting)
    verify    the target decodes [t0, d_1 .. d_{B-1}] at T.. with the rows' inputs extracted
              (features2); greedy acceptance: n_acc drafts equal the target's argmax, the next
              token t1 is the argmax of row n_acc; every verify row is injected at T.., then
              positions >= T + n_acc + 1 are removed from both contexts
    block 2   [t1, mask x (B - 1)] at T + n_acc + 1: logits (B, V)

A DSpark drafter (`draft-dspark`: markov_rank in its options) runs the same calls: its
blocks' logits are the Markov head's (chained inside llama.cpp's graph), its drafts are the
argmax of rows 0..B-1 (anchor-first, B drafts) or 1..B-1 (bonus anchor), so the verify step is
[t0, drafts] of B + 1 or B rows; with the confidence head each block row's confidence is read
too (llama_get_embeddings_nextn: common/speculative.cpp's p_min cut reads it there).

The mask token is the drafter vocabulary's (llama_vocab_mask); the tiny target's vocabulary is
a "none" one, which llama.cpp reads no special ids of, so its `tokenizer.ggml.mask_token_id` is
read from the metadata instead. Causal attention within the block is set from
`dflash.attention.causal` as speculative.cpp does. The drafter's context runs without flash
attention (its CPU kernel sums the attention's V rows in f16, a rounding the f32 reference does
not model and which would hide smaller mistakes; the target keeps llama.cpp's default, as in
bench/llamacpp_eagle3_oracle.py). The fixture holds, as float32 base64: each
target layer's input rows of the prompt (shared by the drafters), per drafter the verify rows'
features, t0, the drafts, n_acc, t1 and both blocks' logits (with a reduced draft vocabulary only
its d2t columns, the rest being -inf). llama.cpp runs in its own interpreter (llama-cpp-python
0.3.36 built from source for the CPU, 2 threads; bench/llamacpp_moe_oracle.py has the build
command; bench/llamacpp_ext.py binds the C functions llama_cpp's module lacks):

    .venv/bin/python bench/llamacpp_dflash_oracle.py --llama-python /tmp/llenv/bin/python
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
from llamacpp_oracle import pack, run_probe

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "data" / "tiny"
OUT = TINY / "llamacpp_dflash_logits.json"
TARGET = "tiny-qwen3"
PROMPT_IDS = [504, 72, 101, 108, 108, 111, 300, 17, 256, 411, 33, 90, 257, 258, 480, 5,
              77, 140, 141, 142, 399, 12, 260, 261]
WEIGHT_STD = 0.15
# name -> synthesize_dflash options (a qwen3 graph exposes the inputs of layers 0..n_layer-1)
DRAFTERS: dict[str, dict] = {
    "plain-2layer-q8": dict(seed=21, layers=(1, 2), n_layer=2, n_ff=256, block_size=8,
                            quant="Q8_0"),
    "reduced-causal-q8": dict(seed=22, layers=(0, 2), n_ff=256, block_size=8, draft_vocab=300,
                              own_embedding=True, causal=True, mask_token=7, quant="Q8_0"),
    "partial-rope-f16": dict(seed=23, layers=(0, 1, 2), n_ff=256, block_size=16, rope_dims=32,
                             quant="F16"),
    "own-embedding-f32": dict(seed=24, layers=(2,), n_ff=128, block_size=8,
                              own_embedding=True, quant="F32"),
    # DSpark; the Markov weights larger than the rest so the head moves the logits as much as
    # the block does (a random rank-R head's correction has std markov_std^2 sqrt(R))
    "dspark-conf-q8": dict(seed=25, layers=(1, 2), n_ff=256, block_size=8, markov_rank=32,
                           markov_std=1.0, confidence_head=True, quant="Q8_0"),
    "dspark-bonus-reduced-f16": dict(seed=26, layers=(0, 2), n_ff=256, block_size=8,
                                     draft_vocab=300, markov_rank=16, markov_std=0.8,
                                     markov_scale=0.5, bonus_anchor=True, quant="F16"),
}


# ---------------------------------------------------------------- llama.cpp side (its own python)
def _meta(model, key: str) -> str | None:
    from llama_cpp import llama_cpp as ll

    buf = ctypes.create_string_buffer(64)
    n = ll.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return buf.value.decode() if n >= 0 else None


def probe(target: str, drafter: str, ids: list[int], first: int, conf: bool) -> dict:
    """Runs under the interpreter that has `llama_cpp`; imports nothing from this project.
    first: the block row of the first draft (0: anchor-first DSpark); conf: read the DSpark
    confidence head's outputs."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from llama_cpp import __version__
    from llama_cpp import llama_cpp as ll
    from llamacpp_ext import (
        DECODE,
        Entry,
        Runtime,
        get_embeddings_layer_inp,
        get_embeddings_nextn,
        rows,
        set_embeddings_layer_inp,
        set_embeddings_nextn,
        target_layer_ids,
    )

    tgt = Runtime(target)
    # the drafter without flash attention: llama.cpp's CPU kernel accumulates the V rows in
    # f16, which moves the block's attention output by ~7e-4 (relative RMS; 1.7e-4 without it)
    # and the random drafters' logits by up to 2e-2
    dft = Runtime(drafter, other=tgt, flash_attn=ll.LLAMA_FLASH_ATTN_TYPE_DISABLED)
    layers = target_layer_ids(dft.model)
    for k in layers:
        set_embeddings_layer_inp(tgt.ctx, k, True)
    B = int(_meta(dft.model, "dflash.block_size") or 16)
    mask = ll.llama_vocab_mask(ll.llama_model_get_vocab(dft.model))
    if mask < 0:                                   # a "none" vocabulary: no special ids read
        mask = int(_meta(dft.model, "tokenizer.ggml.mask_token_id"))
    set_embeddings_nextn(dft.ctx, True, True)
    ll.llama_set_causal_attn(dft.ctx, _meta(dft.model, "dflash.attention.causal") == "true")
    T, E = len(ids), tgt.n_embd

    def features(n: int) -> np.ndarray:                                     # (n, P E)
        return np.concatenate([rows(get_embeddings_layer_inp(tgt.ctx, k), n, E)
                               for k in layers], axis=1)

    def block(anchor: int, n: int) -> tuple[np.ndarray, list[float]]:       # (B, V), (B,)
        dft.process(DECODE, [Entry(anchor if i == 0 else mask, n + i, True) for i in range(B)])
        c = rows(get_embeddings_nextn(dft.ctx), B, dft.n_embd)[:, 0] if conf else []
        return np.array([dft.logits(i) for i in range(B)]), [float(x) for x in c]

    tgt.process(DECODE, [Entry(t, p, p == T - 1) for p, t in enumerate(ids)])
    per_layer = {k: rows(get_embeddings_layer_inp(tgt.ctx, k), T, E) for k in layers}
    feats = features(T)
    t0 = int(np.argmax(tgt.logits(T - 1)))
    dft.process(DECODE, [Entry(None, p, False, feats[p]) for p in range(T)])
    logits1, conf1 = block(t0, T)
    drafts = [int(np.argmax(r)) for r in logits1[first:]]
    dft.drop_from(T)
    verify = [t0, *drafts]
    V = len(verify)
    tgt.process(DECODE, [Entry(t, T + i, True) for i, t in enumerate(verify)])
    feats2 = features(V)
    picks = [int(np.argmax(tgt.logits(i))) for i in range(V)]
    n_acc = 0
    while n_acc < len(drafts) and picks[n_acc] == drafts[n_acc]:
        n_acc += 1
    t1 = picks[n_acc]
    dft.process(DECODE, [Entry(None, T + i, False, feats2[i]) for i in range(V)])
    tgt.drop_from(T + n_acc + 1)
    dft.drop_from(T + n_acc + 1)
    logits2, conf2 = block(t1, T + n_acc + 1)
    return {"version": __version__, "layers": layers, "block_size": B, "mask": mask,
            "per_layer": {str(k): pack(v) for k, v in per_layer.items()},
            "t0": t0, "drafts": drafts, "features2": pack(feats2), "n_acc": n_acc, "t1": t1,
            "logits1": logits1.tolist(), "logits2": logits2.tolist(),
            **({"conf1": conf1, "conf2": conf2} if conf else {})}


# ---------------------------------------------------------------- project side
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-python", help="an interpreter that can import llama_cpp")
    ap.add_argument("--probe", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe:
        target, drafter, first, conf = args.probe
        print(json.dumps(probe(target, drafter, PROMPT_IDS, int(first), conf == "1")))
        return 0
    if not args.llama_python:
        ap.error("--llama-python is required")
    sys.path.insert(0, str(ROOT))
    from service.gguf.reader import GGUFFile
    from service.tools.synth_dflash import DflashOptions, synthesize_dflash

    target = TINY / f"{TARGET}.gguf"
    out = {"target": target.name, "prompt_ids": PROMPT_IDS, "weight_std": WEIGHT_STD,
           "drafter_flash_attention": False, "layer_inputs": {}, "drafters": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, opts in DRAFTERS.items():
            o = DflashOptions(weight_std=WEIGHT_STD, **opts)
            r = synthesize_dflash(Path(tmp) / f"{name}.gguf", target, o)
            s = r.spec
            res = run_probe(args.llama_python, __file__, str(target), str(r.path),
                            str(s.first_draft_row), str(int(s.confidence)))
            out["llama_cpp"] = res.pop("version")
            if res.pop("layers") != list(o.layers):
                raise SystemExit(f"{name}: llama.cpp read other target layers")
            for k, rows in res.pop("per_layer").items():      # one target run: equal rows
                if out["layer_inputs"].setdefault(k, rows) != rows:
                    raise SystemExit(f"{name}: layer {k}'s rows differ between runs")
            cols = GGUFFile(r.path).index_tensor("d2t") if r.spec.has_d2t else slice(None)
            logits = {k: np.array(res.pop(k), np.float32)[:, cols]             # (B, Vd)
                      for k in ("logits1", "logits2")}
            sha = hashlib.sha256(r.path.read_bytes()).hexdigest()
            out["drafters"][name] = {"options": {**opts, "layers": list(o.layers)},
                                     "sha256": sha, **res,
                                     **{k: pack(v) for k, v in logits.items()}}
            print(f"{name}: {r.n_bytes / 1e6:.2f} MB, t0 {res['t0']}, drafts {res['drafts']}, "
                  f"accepted {res['n_acc']}, t1 {res['t1']}, logit std "
                  f"{np.median(logits['logits1'].std(axis=1)):.2f}"
                  + (f", confidences {np.round(res['conf1'], 3).tolist()}" if "conf1" in res
                     else ""))
    OUT.write_text(json.dumps(out, separators=(",", ":")) + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size / 1e3:.0f} kB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
