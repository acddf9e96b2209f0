"""Draft chain benchmark: the model drafter's propose(k) with the chain as one backend step (one
captured CUDA graph per k, one readback) against the chain run step by step (k - 1 steps, each
with its own upload, readback and host wait), in the same run on the same draft model.

    python bench/draft_chain.py [--backend auto|cpu|cuda] [--model smollm2-135m] [--layers 28]
                                [--lengths 2,4,8,16] [--reps 40] [--candidates 0]

The draft model is a q8_0 copy of --model keeping its first --layers blocks (0 = all), made on
the fly with service.tools.quantize. Each mode drafts in its own KV slot from the same prompt; after
every propose the whole draft is taken as accepted (history += the k drafts), so each propose
catches up one token and then runs the chain, as in a step where the target accepted every draft.
Both modes must propose the same tokens (checked every time). Per k: the median milliseconds per
propose of each mode (the first 3 of each k untimed: on CUDA the first use of a step shape runs
eagerly and the second is captured) and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from service.backends import create_backend, resolve_backend_name  # noqa: E402
from service.config import models_dir_from_env  # noqa: E402
from service.engine.spec.draft_model import ModelDrafter  # noqa: E402
from service.gguf.fetch import fetch_model  # noqa: E402
from service.gguf.reader import GGUFFile  # noqa: E402
from service.model.spec import ModelSpec  # noqa: E402
from service.model.transformer import Transformer  # noqa: E402
from service.tools.quantize import requantize  # noqa: E402

WARM = 3                         # untimed proposes per k and mode
PROMPT = list(range(100, 164))   # 64 ids: any ids of the vocabulary will do for timing


@dataclass
class _Seq:                      # what a drafter reads of a sequence (DraftState)
    slot: int
    history: list[int]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="draft_chain.py", description=__doc__.split("\n")[0])
    ap.add_argument("--backend", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--layers", type=int, default=28, help="blocks kept (0 = all)")
    ap.add_argument("--lengths", default="2,4,8,16", help="draft lengths k")
    ap.add_argument("--reps", type=int, default=40, help="timed proposes per k and mode")
    ap.add_argument("--candidates", type=int, default=0,
                    help="n_top > 0: time candidates(seq, k, n_top) (tree verify) instead")
    a = ap.parse_args(argv)
    a.k_list = [int(x) for x in a.lengths.split(",") if x.strip()]
    return a


def load_drafter(a, tmp: Path) -> ModelDrafter:
    src = fetch_model(a.model, models_dir_from_env())
    path = requantize(src, tmp / "draft.gguf", "q8_0", a.layers or None).path
    f = GGUFFile(path)
    be = create_backend(resolve_backend_name(a.backend), invariant_tokens=16)
    n_ctx = len(PROMPT) + (WARM + a.reps) * sum(a.k_list) + 64
    model = Transformer(ModelSpec.from_gguf(f), f, be, n_ctx=n_ctx, n_slots=2,
                        max_tokens=max(16, *a.k_list), max_logits=1)
    return ModelDrafter(model, f"{a.model} {a.layers or 'all'} blocks q8_0")


def propose(d: ModelDrafter, seq: _Seq, k: int, one_step: bool, n_top: int) -> list[int]:
    d.one_step_chain = one_step
    t = d.candidates(seq, k, n_top)[0] if n_top else d.propose(seq, k)
    seq.history += t                                 # every draft accepted
    return t


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        return run(a, load_drafter(a, Path(tmp)))


def run(a, d: ModelDrafter) -> int:
    one, ref = _Seq(0, list(PROMPT)), _Seq(1, list(PROMPT))
    d.start(one)
    d.start(ref)
    rows = []
    for k in a.k_list:
        ms: dict[bool, list[float]] = {True: [], False: []}
        for rep in range(WARM + a.reps):
            got = {}
            for mode, seq in ((True, one), (False, ref)):
                d.model.backend.synchronize()
                t0 = time.perf_counter()
                got[mode] = propose(d, seq, k, mode, a.candidates)
                if rep >= WARM:
                    ms[mode].append((time.perf_counter() - t0) * 1e3)
            if got[True] != got[False]:
                raise SystemExit(f"k {k}: the one-step chain proposed {got[True]}, the chain "
                                 f"step by step {got[False]}")
        rows.append((k, statistics.median(ms[True]), statistics.median(ms[False])))
    be = d.model.backend
    print(f"\n{d.model_name} on {be.name}, "
          f"{'candidates n_top ' + str(a.candidates) if a.candidates else 'propose'}, "
          f"median of {a.reps} (every draft identical in both modes)")
    print("| k | one-step chain ms | step by step ms | step by step / one-step |")
    print("|---:|---:|---:|---:|")
    for k, one_ms, ref_ms in rows:
        print(f"| {k} | {one_ms:.3f} | {ref_ms:.3f} | {ref_ms / one_ms:.2f}x |")
    if hasattr(be, "n_graphs"):
        print(f"captured graphs: {be.n_graphs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
