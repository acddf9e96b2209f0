"""Human-readable summary of a GGUF file, for `specstream inspect MODEL`.

Scalars are printed; arrays (a vocabulary may hold 262144 tokens) are summarized by length and
element type, and long strings such as the chat template by their length, so the summary stays a
screenful whatever the model.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

from service.errors import ModelFormatError
from service.gguf.reader import GGUFFile
from service.model.spec import ModelSpec

MAX_STRING_CHARS = 72            # longer strings are cut and their length shown
KEY_WIDTH = 44

TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.bos_token_id",
                  "tokenizer.ggml.eos_token_id", "tokenizer.chat_template")


def _human_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n:,} bytes ({n / scale:.1f} {unit})"
    return f"{n:,} bytes"


def _human_count(n: int) -> str:
    for unit, scale in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            return f"{n:,} ({n / scale:.1f} {unit})"
    return f"{n:,}"


def format_value(value: Any) -> str:
    """A metadata value on one line: arrays by length and element type, long strings cut."""
    if isinstance(value, list | tuple):
        kinds = sorted({type(v).__name__ for v in value})
        return f"[array of {len(value):,} {'/'.join(kinds) or 'items'}]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, str):
        if len(value) > MAX_STRING_CHARS:
            return repr(value[:MAX_STRING_CHARS]) + f"... ({len(value):,} chars)"
        return repr(value)
    return str(value)


def _kv_lines(items: list[tuple[str, Any]]) -> list[str]:
    return [f"  {k:<{KEY_WIDTH}} {format_value(v)}" for k, v in items]


def _token(tokens: Any, token_id: Any) -> str:
    if token_id is None:
        return "none"
    if isinstance(tokens, list) and isinstance(token_id, int) and 0 <= token_id < len(tokens):
        return f"{token_id} {tokens[token_id]!r}"
    return str(token_id)


def _tokenizer_lines(g: GGUFFile) -> list[str]:
    tokens = g.get("tokenizer.ggml.tokens")
    template = g.get("tokenizer.chat_template")
    vocab = f"{len(tokens):,}" if isinstance(tokens, list) else "none"
    chat = (f"present ({len(template):,} chars)" if isinstance(template, str) and template
            else "absent")
    return [
        "tokenizer",
        f"  {'model':<{KEY_WIDTH}} {g.get('tokenizer.ggml.model', 'none')}",
        f"  {'vocab size':<{KEY_WIDTH}} {vocab}",
        f"  {'bos':<{KEY_WIDTH}} {_token(tokens, g.get('tokenizer.ggml.bos_token_id'))}",
        f"  {'eos':<{KEY_WIDTH}} {_token(tokens, g.get('tokenizer.ggml.eos_token_id'))}",
        f"  {'chat template':<{KEY_WIDTH}} {chat}",
    ]


def _tensor_lines(g: GGUFFile) -> tuple[list[str], int]:
    """The per-quant-type table and the total parameter count."""
    counts: Counter[str] = Counter()
    sizes: Counter[str] = Counter()
    params = 0
    for info in g.tensors.values():
        counts[info.qtype.name] += 1
        sizes[info.qtype.name] += int(info.raw.size)
        params += info.n_elements
    lines = [f"tensors       {len(g.tensors):,}", f"  {'type':<8} {'tensors':>8} {'bytes':>16}"]
    for name, n in sorted(counts.items(), key=lambda kv: -sizes[kv[0]]):
        lines.append(f"  {name:<8} {n:>8,} {sizes[name]:>16,}")
    lines.append(f"  {'total':<8} {len(g.tensors):>8,} {sum(sizes.values()):>16,}")
    return lines, params


def _drafter_formats() -> dict:
    """architecture -> (reader, name) of the drafter formats: files that draft for a target and
    never serve."""
    from service.model.dflash import ARCH as DFLASH
    from service.model.dflash import DflashSpec
    from service.model.eagle3 import ARCH as EAGLE3
    from service.model.eagle3 import Eagle3Spec

    return {EAGLE3: (Eagle3Spec.from_gguf, "an EAGLE-3"),
            DFLASH: (DflashSpec.from_gguf, "a DFlash")}


def serving_problem(g: GGUFFile) -> str | None:
    """Why `generate` and `serve` would refuse this file's hyperparameters (the same check,
    ModelSpec.from_gguf, first problem), or None. A drafter file (EAGLE-3, DFlash) gets its own
    format check and is named as one: it drafts for a target, never serves."""
    try:
        drafter = _drafter_formats().get(g.get("general.architecture"))
        if drafter is not None:
            read, name = drafter
            read(g)
            return f"{name} drafter file (its format checks pass), not a target model"
        ModelSpec.from_gguf(g)
    except ModelFormatError as exc:
        return str(exc).removeprefix(f"{g.path}: ")
    return None


def describe(path: str | os.PathLike) -> str:
    """A multi-line summary of the GGUF file at `path` (raises ModelFormatError if unreadable)."""
    g = GGUFFile(path)
    arch = g.get("general.architecture")
    arch_prefix = f"{arch}." if isinstance(arch, str) else None
    hyper = sorted((k, v) for k, v in g.metadata.items()
                   if arch_prefix and k.startswith(arch_prefix))
    shown = {"general.architecture", "general.name", *TOKENIZER_KEYS, *(k for k, _ in hyper)}
    other = sorted((k, v) for k, v in g.metadata.items() if k not in shown)
    tensor_lines, params = _tensor_lines(g)
    lines = [
        f"file          {Path(path)}",
        f"size          {_human_bytes(Path(path).stat().st_size)}",
        f"architecture  {arch if arch is not None else 'unknown'}",
        f"name          {g.get('general.name', 'unnamed')}",
        f"parameters    {_human_count(params)}",
        "",
        f"hyperparameters ({arch_prefix or '?'}*)",
        *(_kv_lines(hyper) or ["  none"]),
        "",
        "serving check",
        f"  {'hyperparameters and tensors':<{KEY_WIDTH}} {_verdict(serving_problem(g))}",
        "",
        *_tokenizer_lines(g),
        "",
        "other metadata",
        *(_kv_lines(other) or ["  none"]),
        "",
        *tensor_lines,
    ]
    return "\n".join(lines)


def _verdict(problem: str | None) -> str:
    return "ok" if problem is None else f"refused: {problem}"
