"""Whether a prefix-cache hit repeats a greedy stream: each prompt of bench/spec_tables.py's
kinds decoded twice on one engine (the second run takes the first's full KV blocks from the
prefix cache), with the prefix cache on and off; prints the cached prompt tokens of the second
run and the first token where the two runs differ. --exact: with --prefix-cache-exact (hits
only on rows computed as the prompt's own prefill would compute them; docs/scheduling.md).

    python bench/prefix_repeat.py MODEL.gguf [--backend cuda] [--tokens 48] [--kinds prose,code]
        [--exact] [--prefill-chunk N]
(`--exact --prefill-chunk 80` on prompts longer than 80 tokens, as the synthetic llama3.2-1b's
code prompts (88, 93 tokens): their first 80 tokens are one wide chunk whose blocks the second
run reuses, the rest a narrow chunk: a check of exact reuse on the wide path.)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import spec_tables as S  # noqa: E402
from cpu_decode import decode  # noqa: E402

from service.config import EngineConfig  # noqa: E402
from service.engine.engine import Engine  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="prefix_repeat.py", description=__doc__.split("\n")[0])
    ap.add_argument("model", help="a GGUF file")
    ap.add_argument("--backend", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--tokens", type=int, default=48, help="greedy tokens per run")
    ap.add_argument("--kinds", default="prose,code", help="prompt kinds of spec_tables.py")
    ap.add_argument("--exact", action="store_true", help="EngineConfig.prefix_cache_exact")
    ap.add_argument("--prefill-chunk", type=int, default=256, help="EngineConfig.prefill_chunk")
    a = ap.parse_args(argv)
    differ = 0
    for cache in (True, False):
        eng = Engine.load(a.model, EngineConfig(backend=a.backend, n_ctx=1024, n_slots=1,
                                                prefix_cache=cache,
                                                prefix_cache_exact=a.exact,
                                                prefill_chunk=a.prefill_chunk))
        eng.start()
        try:
            for kind in [k for k in a.kinds.split(",") if k]:
                for i, text in enumerate(S.PROMPTS[kind]):
                    ids = eng.text_prompt_ids(text)
                    first, second = (decode(eng, ids, a.tokens, False) for _ in range(2))
                    pairs = zip(first.token_ids, second.token_ids, strict=True)
                    at = next((j for j, (x, y) in enumerate(pairs) if x != y), None)
                    differ += at is not None
                    print(f"prefix cache {'on ' if cache else 'off'} {kind}[{i}]: prompt "
                          f"{len(ids)} tokens, second run cached "
                          f"{second.finished.usage.cached_prompt_tokens}: "
                          + ("identical" if at is None else f"differs at token {at}"),
                          flush=True)
        finally:
            eng.stop(10)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
