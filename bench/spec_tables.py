"""bench/speculative.py without models or timing: the prompts, the oracle drafter, its pure
simulation, the goals and every table it prints. Pure Python (no CuPy), tested on the CPU
(tests/unit/test_spec_bench.py).

The oracle. A verify step of width w feeds [seed, d1 .. d_k] (k = w - 1) and keeps the drafts up
to the first one that differs from the target's choice, plus the target's own token. The oracle
proposes the target's recorded greedy continuation with each token replaced, independently, by
another one with probability 1 - p. Draft d_i survives when it and every draft before it are
intact, probability p^i, so a step commits on average

    E[tokens / step] = 1 + p + p^2 + ... + p^k = (1 - p^(k+1)) / (1 - p)

tokens (k + 1 at p = 1); `p_for_tokens_per_step` inverts it by bisection. Drafts past the first
corrupted one are verified too but cannot be accepted, so the engine's acceptance (accepted /
drafted) is (E - 1) / k, lower than p.

Results are one JSON-ready dict (`--json` writes it):
    real      [{model, kind, drafter, verify, alpha, drafted, accepted, tokens, decode_s,
               tok_s, speedup, identical}]  (a row with "error" when its engine failed)
    verify    [{shape, kv, width, rows, step_s, ratio}]      (rows: the padded step size)
    oracle    [{shape, width, target, p, tokens_per_step, acceptance, tok_s, speedup,
               identical, plain_tok_s}]
    goals     [{figure, value, target, met}]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from service.engine.spec.chain import accept_chain
from service.engine.spec.drafters import Drafter, DraftState

# ---------------------------------------------------------------- prompts (part a)
PROMPTS: dict[str, tuple[str, ...]] = {
    "code": (
        "def merge_sort(items):\n    \"\"\"Sort a list with merge sort.\"\"\"\n"
        "    if len(items) <= 1:\n        return items\n    mid = len(items) // 2\n",
        "class Stack:\n    def __init__(self):\n        self.items = []\n\n"
        "    def push(self, item):\n        self.items.append(item)\n\n    def pop(self):\n",
    ),
    "prose": (
        "The lighthouse keeper climbed the spiral stairs every evening at dusk. On the night "
        "of the storm, he noticed",
        "Bread has been baked for thousands of years. The simplest loaf needs only flour, "
        "water and salt, but",
    ),
    "repetitive": (
        "Monday: water the plants. Tuesday: water the plants. Wednesday: water the plants. "
        "Thursday: water the plants. Friday:",
        "1. apple\n2. banana\n3. cherry\n4. apple\n5. banana\n6. cherry\n7. apple\n8. banana\n"
        "9.",
    ),
}

# ---------------------------------------------------------------- goals (part b)
REF_WIDTH, REF_TOKENS_PER_STEP = 6, 4.27      # the reference system's operating point
GOAL_VERIFY_WIDTH, GOAL_VERIFY_RATIO = 8, 1.5  # verify at width 8 <= 1.5x one decode step
GOAL_SPEEDUP = 3.0                             # decode at 4.27 tokens/step >= 3x plain


def expected_tokens_per_step(p: float, k: int) -> float:
    """Mean tokens committed per verify step with k drafts, each intact with probability p."""
    return float(sum(p ** i for i in range(k + 1)))


def p_for_tokens_per_step(target: float, k: int) -> float:
    """The per-token probability p at which k drafts give `target` tokens per step."""
    if not 1.0 <= target <= k + 1:
        raise ValueError(f"{target} tokens per step is outside [1, {k + 1}] for {k} drafts")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens_per_step(mid, k) < target else (lo, mid)
    return (lo + hi) / 2


class OracleDrafter(Drafter):
    """Proposes the target's recorded greedy continuation, each token corrupted with
    probability 1 - p (replaced by another id drawn uniformly), from a seeded generator."""

    name = "oracle"

    def __init__(self, vocab_size: int, seed: int = 0):
        self.vocab_size, self.seed = vocab_size, seed
        self.configure([], 0, 1.0)

    def configure(self, recorded: Sequence[int], n_prompt: int, p: float) -> None:
        """recorded: the target's greedy tokens after a prompt of n_prompt tokens."""
        self.recorded, self.n_prompt, self.p = list(recorded), n_prompt, p
        self.rng = np.random.default_rng(self.seed)
        self.proposed = self.corrupted = self.off_record = 0

    def propose(self, seq: DraftState, k: int) -> list[int]:
        g = len(seq.history) - self.n_prompt          # tokens generated, the seed included
        if g < 1 or seq.history[-1] != self.recorded[g - 1]:
            self.off_record += 1                      # the output left the recorded one
        out = self.recorded[g:g + k]
        bad = self.rng.random(len(out)) >= self.p                              # (k,) bool
        other = self.rng.integers(1, self.vocab_size, len(out))                # (k,) int64
        self.proposed += len(out)
        self.corrupted += int(bad.sum())
        return [int((t + o) % self.vocab_size) if b else int(t)
                for t, b, o in zip(out, bad, other, strict=True)]


@dataclass
class _History:
    slot: int = 0
    history: list[int] = field(default_factory=list)


def simulate_chain(drafter: Drafter, prompt: Sequence[int], recorded: Sequence[int],
                   width: int) -> tuple[int, int, int]:
    """(steps, drafted, accepted) of the engine's greedy chain decode of len(recorded) tokens
    when the target's choices are `recorded` and every step drafts as many tokens as the width
    and the remaining length allow (the engine told verification is free), without a model."""
    seq = _History(history=[*prompt, recorded[0]])      # the first token comes from prefill
    n, steps, drafted, accepted = 1, 0, 0, 0
    while n < len(recorded):
        k = min(width - 1, len(recorded) - n - 1)
        draft = [seq.history[-1], *drafter.propose(seq, k)]
        n_acc, emitted = accept_chain(draft, recorded[n:n + len(draft)])
        steps, drafted, accepted = steps + 1, drafted + len(draft) - 1, accepted + n_acc - 1
        seq.history += emitted
        n += len(emitted)
    return steps, drafted, accepted


def first_difference(ref: Sequence[int], out: Sequence[int]) -> int | None:
    """The first index where two token lists differ (a length difference counts), or None."""
    for i, (a, b) in enumerate(zip(ref, out, strict=False)):
        if a != b:
            return i
    return None if len(ref) == len(out) else min(len(ref), len(out))


def identity_text(diffs: Sequence[int | None]) -> str:
    """'identical', or the first differing prompt and token index ('p1@17')."""
    bad = [(j, d) for j, d in enumerate(diffs) if d is not None]
    return "identical" if not bad else f"differs p{bad[0][0]}@{bad[0][1]}"


# ---------------------------------------------------------------- tables
def _num(value: float | None, fmt: str, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:{width}{fmt}}"


def real_table(rows: list[dict], title: str) -> str:
    """Part (a): one line per (model, prompt kind, drafter/verify). alpha: the engine's
    measured cost of each extra verify row relative to a plain step, from which it chooses
    the draft length (0 when told to draft in full)."""
    lines = [title, f"{'model':14} {'kind':10} {'drafter':24} {'verify':10} {'alpha':>5} "
                    f"{'acceptance':>17} {'tok/step':>8} {'tok/s':>8} {'speedup':>7}  "
                    "greedy vs plain"]
    for r in rows:
        head = (f"{r['model']:14} {r['kind']:10} {r['drafter']:24} {r['verify']:10} "
                f"{_num(r.get('alpha'), '.2f', 5)}")
        if "error" in r:
            lines.append(f"{head} error: {r['error']}")
            continue
        acc = (f"{r['accepted']}/{r['drafted']} {r['accepted'] / r['drafted']:5.1%}"
               if r["drafted"] else "-")
        steps = r["tokens"] - r["accepted"]
        lines.append(f"{head} {acc:>17} {r['tokens'] / steps:8.2f} {r['tok_s']:8.1f} "
                     f"{_num(r['speedup'], '.2f', 6)}x  {r['identical']}")
    return "\n".join(lines)


def verify_table(rows: list[dict], shape: str) -> str:
    """Part (b): runner-level verify step time against width, relative to width 1."""
    kv = rows[0]["kv"] if rows else 0
    lines = [f"Verify step of one sequence, {shape}, KV length {kv} (median of the runner's "
             "steps; rows = the padded step)",
             f"{'width':>5} {'rows':>4} {'ms':>8} {'x step':>7}"]
    for r in rows:
        mark = "  <- goal <= 1.5x" if r["width"] == GOAL_VERIFY_WIDTH else ""
        lines.append(f"{r['width']:5d} {r['rows']:4d} {r['step_s'] * 1e3:8.3f} "
                     f"{r['ratio']:6.2f}x{mark}")
    return "\n".join(lines)


def oracle_table(rows: list[dict], shape: str, plain_tok_s: float, tokens: int) -> str:
    """Part (b): end-to-end decode with the oracle drafter against plain decode."""
    lines = [f"Decode with the oracle drafter, {shape}, {tokens} tokens; plain greedy "
             f"{plain_tok_s:.1f} tok/s in the same run",
             f"{'width':>5} {'target':>7} {'p':>6} {'tok/step':>8} {'acceptance':>10} "
             f"{'tok/s':>8} {'vs plain':>8}  greedy vs plain"]
    for r in rows:
        mark = "  <- goal >= 3x" if (r["width"], r["target"]) == (REF_WIDTH,
                                                                   REF_TOKENS_PER_STEP) else ""
        lines.append(f"{r['width']:5d} {r['target']:7.2f} {r['p']:6.3f} "
                     f"{r['tokens_per_step']:8.2f} {r['acceptance']:10.1%} {r['tok_s']:8.1f} "
                     f"{r['speedup']:7.2f}x  {r['identical']}{mark}")
    return "\n".join(lines)


def goals(shape: str, verify: list[dict], oracle: list[dict]) -> list[dict]:
    """Issue 8's two goals for one shape, from its verify and oracle rows (absent: no row)."""
    out = []
    v = next((r for r in verify if r["width"] == GOAL_VERIFY_WIDTH), None)
    if v is not None:
        out.append({"shape": shape, "figure": f"verify at width {GOAL_VERIFY_WIDTH} / one step",
                    "value": v["ratio"], "target": f"<= {GOAL_VERIFY_RATIO}x",
                    "met": v["ratio"] <= GOAL_VERIFY_RATIO})
    o = next((r for r in oracle if (r["width"], r["target"]) == (REF_WIDTH,
                                                                 REF_TOKENS_PER_STEP)), None)
    if o is not None:
        out.append({"shape": shape, "figure": f"decode at width {REF_WIDTH}, "
                                              f"{REF_TOKENS_PER_STEP} tok/step / plain",
                    "value": o["speedup"], "target": f">= {GOAL_SPEEDUP}x",
                    "met": o["speedup"] >= GOAL_SPEEDUP})
    return out


def goals_table(rows: list[dict]) -> str:
    lines = ["Goals (issue 8)", f"{'shape':12} {'figure':40} {'value':>7} {'goal':>8}  met"]
    for g in rows:
        lines.append(f"{g['shape']:12} {g['figure']:40} {g['value']:6.2f}x {g['target']:>8}  "
                     f"{'MET' if g['met'] else 'missed'}")
    return "\n".join(lines)
