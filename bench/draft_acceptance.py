"""Acceptance of model drafters for SmolLM2-135M: full and layer-truncated q8_0 copies.

Each drafter file is made with service.tools.quantize (`--layers N` keeps blocks 0..N-1) in a
temporary directory. For each drafter and verify width, every fixture prompt
(tests/data/llamacpp_smollm2_greedy.json) is decoded greedily with drafting in full (the
engine's adaptive draft length is told verification is free), and the table gives:
    acceptance   accepted / drafted tokens
    tokens/step  tokens committed per target forward of the decode (each step commits the
                 accepted drafts plus one token of the target's own)
    identical    whether every output equals plain greedy decoding of the same run
No timings: the draft model's cost is not in the table (see bench/cpu_decode.py for speed).
`--drafts A.gguf,B.gguf` measures given draft files as well (e.g. the same truncated copy with
and without a DSpark Markov head from `specstream fit-markov`); `--layers ""` skips the copies
made here and `--no-full` the full q8_0 one.

    python bench/draft_acceptance.py [--layers 4,15,22,28] [--widths 2,6,16] [--tokens 48]
        [--drafts FILE,...] [--no-full]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from cpu_decode import decode  # noqa: E402

from service.config import EngineConfig, models_dir_from_env  # noqa: E402
from service.engine.engine import Engine  # noqa: E402
from service.gguf.fetch import fetch_model  # noqa: E402
from service.logging import configure_logging  # noqa: E402
from service.tools.quantize import requantize  # noqa: E402

CASES = json.loads((ROOT / "tests/data/llamacpp_smollm2_greedy.json").read_text())["cases"]


def load(target: Path, threads: int, **cfg) -> Engine:
    eng = Engine.load(target, EngineConfig(backend="cpu", n_ctx=512, n_slots=1,
                                           threads=threads, **cfg))
    eng.start()
    eng.verify_alpha = 0.0          # draft in full: acceptance, not the cost model, is measured
    return eng


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", default="4,15,22,28", help="truncated copies to measure")
    ap.add_argument("--widths", default="2,6,16")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--drafts", default="", help="draft GGUF files to measure as well")
    ap.add_argument("--no-full", action="store_true", help="skip the full q8_0 copy")
    args = ap.parse_args()
    configure_logging("warning", fmt="console")
    target = fetch_model("smollm2-135m", models_dir_from_env())
    widths = [int(w) for w in args.widths.split(",")]
    plain_eng = load(target, args.threads, drafter="none", verify_width=1)
    plain = [decode(plain_eng, c["prompt_ids"], args.tokens, False).token_ids for c in CASES]
    plain_eng.stop(10)
    print(f"SmolLM2-135M (Q4_1) target, {len(CASES)} fixture prompts x {args.tokens} greedy "
          "tokens, CPU")
    with tempfile.TemporaryDirectory() as tmp:
        drafts = [] if args.no_full else [("q8_0, 30 layers", None)]
        drafts += [(f"q8_0, {n} layers", n) for n in map(int, filter(None,
                                                                   args.layers.split(",")))]
        drafts += [(Path(p).name, Path(p)) for p in filter(None, args.drafts.split(","))]
        width = max(22, *(len(label) + 1 for label, _ in drafts))
        print(f"{'drafter':<{width}}{'width':>6}{'acceptance':>20}{'tokens/step':>13}"
              f"{'identical':>11}")
        for label, n in drafts:
            path = n if isinstance(n, Path) else requantize(
                target, Path(tmp) / f"draft-{n or 'all'}.gguf", "q8_0", n).path
            eng = load(target, args.threads, drafter="model", draft_model=str(path),
                       verify_width=max(widths))
            for w in widths:
                eng.config = replace(eng.config, verify_width=w)   # bounds drafts per step
                drafted = accepted = tokens = 0
                same = True
                for case, ref in zip(CASES, plain, strict=True):
                    out = decode(eng, case["prompt_ids"], args.tokens, True)
                    same &= out.token_ids == ref
                    u = out.finished.usage
                    drafted += u.draft_tokens
                    accepted += u.accepted_draft_tokens
                    tokens += u.completion_tokens - 1     # the first token comes from prefill
                steps = tokens - accepted
                rate = f"{accepted}/{drafted} {accepted / drafted:.1%}"
                print(f"{label:<{width}}{w:>6}{rate:>20}"
                      f"{tokens / steps:>13.2f}{'yes' if same else 'NO':>11}", flush=True)
            eng.stop(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
