"""Comparing greedy token ids with a reference only where float rounding cannot decide them.

Two implementations that agree to float32 rounding still pick different tokens wherever the
top-1/top-2 logit gap is smaller than their difference, and so does one implementation on two
CPUs: the last bits of a float32 sum depend on the vector width and FMA use the kernels were
compiled for. Once the picks differ, the two continue from different contexts and nothing after
that position is comparable. So a free-running comparison runs up to the first position where
*either* side's gap is under the threshold; a longer check teacher-forces our model on the
reference's ids and compares every position where both gaps are clear.

A gap of None means that side's gap was not recorded at that position; the other side's gap
alone decides there.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Gaps = Sequence[float | None]

# Real models (SmolLM2, Gemma-3) against llama.cpp: the mean centered top-8 difference of the
# two is about a tenth of a logit and its worst is about one (tests/golden/
# test_llamacpp_logits.py prints both), so a top-1/top-2 gap under half a logit is a near-tie.
REAL_MODEL_GAP = 0.5


def top2_gap(row) -> float:
    """Top-1 minus top-2 logit of one row (V,) (0 when the two are tied)."""
    top = np.partition(np.asarray(row, np.float64), -2)[-2:]
    return float(top[1] - top[0])


def logprob_gap(logprob) -> float:
    """The top-1/top-2 gap of one generated token from its TokenLogprob (top_logprobs >= 2):
    log-probabilities differ from the logits by one constant per row, so their differences are
    the logit differences."""
    return logprob.top[0][1] - logprob.top[1][1]


def _clear(i: int, our_gaps: Gaps, ref_gaps: Gaps, threshold: float) -> bool:
    gaps = [g[i] for g in (our_gaps, ref_gaps) if g[i] is not None]
    return bool(gaps) and min(gaps) >= threshold


def assert_free_running_agrees(label: str, ours: Sequence[int], ref: Sequence[int],
                               our_gaps: Gaps, ref_gaps: Gaps, threshold: float) -> int:
    """Our greedy ids equal the reference's up to the first position where either side's gap is
    under threshold (our_gaps[i], ref_gaps[i]: the gaps of the rows that chose ours[i], ref[i]);
    with no such position, both sequences are equal in full. Returns how many ids were compared.
    """
    n = min(len(ours), len(ref))
    for i in range(n):
        if not _clear(i, our_gaps, ref_gaps, threshold):
            return i
        assert ours[i] == ref[i], (
            f"{label}: position {i}: ours {ours[i]} != reference {ref[i]} with clear gaps "
            f"(ours {our_gaps[i]}, reference {ref_gaps[i]}, threshold {threshold})\n"
            f" ours {list(ours)}\n ref  {list(ref)}")
    assert len(ours) == len(ref), f"{label}: lengths differ\n ours {list(ours)}\n ref {list(ref)}"
    return n


def assert_teacher_forced_agrees(label: str, rows: np.ndarray, ref: Sequence[int],
                                 ref_gaps: Gaps, threshold: float) -> int:
    """rows[i] are our logits teacher-forced on the reference's ids before ref[i]: their argmax
    is ref[i] wherever both sides' gaps are clear. Returns how many positions were checked."""
    our_gaps = [top2_gap(r) for r in rows]
    checked = 0
    for i, want in enumerate(ref):
        if _clear(i, our_gaps, ref_gaps, threshold):
            checked += 1
            got = int(np.argmax(rows[i]))
            assert got == want, (
                f"{label}: position {i}: our argmax {got} != reference {want} with clear gaps "
                f"(ours {our_gaps[i]:.3f}, reference {ref_gaps[i]}, threshold {threshold})")
    return checked


def assert_matches_llamacpp(name: str, case: dict, got: list[int], gaps: Gaps) -> int:
    """Our greedy ids (`got`, with the gap of each one's row) equal those of a llama.cpp fixture
    case (tests/data/llamacpp_*_greedy*.json) up to the first position where either side had a
    near-tie (gap < REAL_MODEL_GAP); returns how many ids were compared."""
    ref_gaps = [t["logits"][0] - t["logits"][1] for t in case["top8"]]
    return assert_free_running_agrees(f"{name} {case['prompt'][:30]!r}", got,
                                      case["greedy_ids"], gaps, ref_gaps, REAL_MODEL_GAP)
