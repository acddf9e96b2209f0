"""Frozen configuration dataclasses. The only module that reads argv, env vars or config files.

`EngineConfig.problems()` lists every invalid value at once as (field, message) pairs, so the
CLI, startup and the ValidateConfig RPC report the same problems with the same words.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# Every KV cache element type a GGUF engine may name; SUPPORTED_KV_PAIRS is what our kernels do.
KV_TYPES = ("f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0")
KV_IMPLEMENTED = ("f16", "q8_0", "q4_0")
SUPPORTED_KV_PAIRS: tuple[tuple[str, str], ...] = tuple(
    (k, v) for k in KV_IMPLEMENTED for v in KV_IMPLEMENTED
)
MIN_VERIFY_WIDTH = 1
MAX_VERIFY_WIDTH = 16            # one step processes 1..16 tokens (decode, verify, batching)
BACKENDS = ("auto", "cpu", "cuda")
DRAFTERS = ("none", "ngram")


def supported_pairs_listing() -> str:
    """A header line and one line per supported (K, V) pair, for errors and --help."""
    lines = [f"supported KV cache type pairs (K, V): {len(SUPPORTED_KV_PAIRS)}"]
    lines += [f"  {k} {v}" for k, v in SUPPORTED_KV_PAIRS]
    return "\n".join(lines)


@dataclass(frozen=True)
class EngineConfig:
    kv_cache_type_k: str = "f16"
    kv_cache_type_v: str = "f16"
    verify_width: int = 4            # tokens verified per speculative step (1 = no speculation)
    drafter: str = "ngram"           # "none" | "ngram" (prompt-lookup drafting)
    ngram_size: int = 3              # n-gram length the lookup drafter matches
    backend: str = "auto"
    n_ctx: int = 4096                # context per sequence; capped at the model's trained length
    n_slots: int = 4                 # sequences held in the KV cache at once
    prefill_chunk: int = 64          # prompt tokens per prefill step
    max_queue: int = 64              # requests waiting for a slot before RESOURCE_EXHAUSTED
    threads: int = 0                 # CPU backend threads; 0 = all cores

    def problems(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        for name in ("kv_cache_type_k", "kv_cache_type_v"):
            value = getattr(self, name)
            if value not in KV_TYPES:
                out.append((name, f"unknown KV cache type {value!r}; known types: "
                                  + ", ".join(KV_TYPES)))
        pair = (self.kv_cache_type_k, self.kv_cache_type_v)
        if all(p in KV_TYPES for p in pair) and pair not in SUPPORTED_KV_PAIRS:
            out.append(("kv_cache_type_k,kv_cache_type_v",
                        f"unsupported KV cache type pair (K={pair[0]}, V={pair[1]}); "
                        + supported_pairs_listing()))
        if not MIN_VERIFY_WIDTH <= self.verify_width <= MAX_VERIFY_WIDTH:
            out.append(("verify_width", f"{self.verify_width} is out of range; allowed range "
                                        f"is {MIN_VERIFY_WIDTH}..{MAX_VERIFY_WIDTH}"))
        if self.drafter not in DRAFTERS:
            out.append(("drafter", f"unknown drafter {self.drafter!r}; one of "
                                   + ", ".join(DRAFTERS)))
        if not 1 <= self.ngram_size <= 8:
            out.append(("ngram_size", f"{self.ngram_size} is out of range; allowed 1..8"))
        if self.backend not in BACKENDS:
            out.append(("backend", f"unknown backend {self.backend!r}; one of "
                                   + ", ".join(BACKENDS)))
        if not 16 <= self.n_ctx <= 1 << 20:
            out.append(("n_ctx", f"{self.n_ctx} is out of range; allowed 16..1048576"))
        if not 1 <= self.n_slots <= 256:
            out.append(("n_slots", f"{self.n_slots} is out of range; allowed 1..256"))
        if not 1 <= self.prefill_chunk <= 1024:
            out.append(("prefill_chunk", f"{self.prefill_chunk} is out of range; allowed 1..1024"))
        if not 0 <= self.max_queue <= 100_000:
            out.append(("max_queue", f"{self.max_queue} is out of range; allowed 0..100000"))
        if not 0 <= self.threads <= 1024:
            out.append(("threads", f"{self.threads} is out of range; allowed 0..1024"))
        return out


# ---------------------------------------------------------------- model directory
MODELS_DIR_ENV = "SPECSTREAM_MODELS_DIR"


def models_dir_from_env() -> Path:
    """Where fetched models live: $SPECSTREAM_MODELS_DIR, else `models/` at the repository root."""
    value = os.environ.get(MODELS_DIR_ENV, "").strip()
    if value:
        return Path(value).expanduser()
    return Path(__file__).resolve().parent.parent / "models"
