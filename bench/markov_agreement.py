"""Teacher-forced top-1 agreement of a drafter with SmolLM2-135M, with and without Markov heads.

At every position of a token sequence the target and the drafter (no head) run over the same
prefix (chunked prefill, CPU backend); a position agrees when argmax(draft logits, plus the
head's W2 @ W1[input id] when a head is given) equals the target's argmax. Two sets:
    corpus     the fitting corpus (bench/corpus/markov_fit.txt): in-sample
    held-out   the fixture prompts of tests/data/llamacpp_smollm2_greedy.json followed by the
               target's own greedy continuation (48 tokens): what drafting sees
This is the cheap proxy of acceptance (bench/draft_acceptance.py measures the real thing).

    python bench/markov_agreement.py DRAFT.gguf [HEADED.gguf ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from service.config import models_dir_from_env  # noqa: E402
from service.engine.spec.markov_head import W1_NAME, W2_NAME  # noqa: E402
from service.gguf.fetch import fetch_model  # noqa: E402
from service.gguf.quants import dequantize  # noqa: E402
from service.gguf.reader import GGUFFile  # noqa: E402
from service.logging import configure_logging  # noqa: E402
from service.tools.fit_markov import load_cpu_model, window_logits  # noqa: E402

CASES = json.loads((ROOT / "tests/data/llamacpp_smollm2_greedy.json").read_text())["cases"]
CORPUS = ROOT / "bench/corpus/markov_fit.txt"


def head_of(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """W1, W2 (V, R) f32 of a headed draft file."""
    f = GGUFFile(path)
    return tuple(dequantize(f.tensors[n].raw, f.tensors[n].qtype, f.tensors[n].shape)
                 for n in (W1_NAME, W2_NAME))


def agreement(target, draft, heads: list, seqs: list[list[int]]) -> tuple[int, list[int]]:
    """(positions, agreeing positions per head; heads[0] None = no head)."""
    n, agree = 0, [0] * len(heads)
    for ids in seqs:
        for (chunk, t), (_, d) in zip(window_logits(target, ids), window_logits(draft, ids),
                                      strict=True):
            want = t.argmax(axis=1)                                     # (n,)
            n += len(chunk)
            for i, h in enumerate(heads):
                x = d if h is None else d + h[0][chunk] @ h[1].T        # (n, V) f32
                agree[i] += int((x.argmax(axis=1) == want).sum())
    return n, agree


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("draft", help="the drafter without a head")
    ap.add_argument("headed", nargs="*", help="the same drafter with fitted heads")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    configure_logging("warning", fmt="console")
    *_, target = load_cpu_model(fetch_model("smollm2-135m", models_dir_from_env()), args.threads)
    *_, tok, draft = load_cpu_model(Path(args.draft), args.threads)
    heads = [None] + [head_of(Path(p)) for p in args.headed]
    labels = [Path(args.draft).name] + [Path(p).name for p in args.headed]
    sets = {"corpus": [tok.encode(CORPUS.read_text(encoding="utf-8"))],
            "held-out": [c["prompt_ids"] + c["greedy_ids"][:48] for c in CASES]}
    width = max(len(s) for s in labels) + 2
    print(f"{'drafter':<{width}}" + "".join(f"{s:>22}" for s in sets))
    results = {name: agreement(target, draft, heads, seqs) for name, seqs in sets.items()}
    for i, label in enumerate(labels):
        cells = [f"{a[i]}/{n} {a[i] / n:.1%}" for n, a in results.values()]
        print(f"{label:<{width}}" + "".join(f"{c:>22}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
