"""Target hidden states as step outputs: which residual rows a step copies out, and where.

A drafter that reads the target's hidden states (EAGLE-3, DFlash) names capture points by
llama.cpp's `target_layers` convention: point k is the residual stream entering layer k, i.e.
after k layers (k = 0: the scaled token embeddings; k = n_layer: the final residual, before the
output norm). A step with a tap copies those rows, for every point in the order named, into
one buffer (R, P * E) f32: row r holds [x_{k0}[r] | x_{k1}[r] | ...], each E wide, which is
exactly EAGLE-3's feature-projection input (fc: 3 E -> E_draft; llama.cpp's encoder input
interleaves its three layers the same way).

Rows: ALL copies every row of the step (padding rows included; a runner pads with rows placed
first, so a step of n real rows padded to T has them at rows T - n .. T - 1), which a drafter
needs to extend its own KV over a prefill or over accepted verify rows; LOGITS copies the last
n_logits rows only (rows 0 .. n_logits - 1 of the buffer), for a drafter that conditions on the
rows whose tokens are chosen. The copies are ops inside the step (a captured CUDA graph holds
them); a step without a tap does no extra work.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class HiddenRows(enum.Enum):
    ALL = "all"               # every row of the step
    LOGITS = "logits"         # the step's logits rows (its last n_logits rows)


@dataclass(frozen=True)
class HiddenTap:
    """Capture points (llama.cpp target_layers: k = the residual entering layer k) and rows."""

    points: tuple[int, ...]
    rows: HiddenRows = HiddenRows.ALL

    def check(self, n_layer: int) -> None:
        """Refuse points outside [0, n_layer], repeated ones, or none (ValueError)."""
        if not self.points:
            raise ValueError("a hidden-state tap needs at least one capture point")
        bad = [k for k in self.points if not 0 <= int(k) <= n_layer]
        if bad:
            raise ValueError(f"hidden-state capture points {bad} outside [0, {n_layer}] (the "
                             f"residual entering layer k; {n_layer} = the final residual)")
        if len(set(self.points)) != len(self.points):
            raise ValueError(f"hidden-state capture points {list(self.points)} repeat")

    def width(self, n_embd: int) -> int:
        """Columns of the capture buffer: P * E."""
        return len(self.points) * n_embd

    def capacity(self, max_tokens: int, max_logits: int) -> int:
        """Rows of the capture buffer: the most rows a step copies."""
        return max_tokens if self.rows is HiddenRows.ALL else max(1, max_logits)


@dataclass(frozen=True)
class HiddenOut:
    """One step's tap: the points and rows, and the buffer (R, P * E) f32 the rows go to."""

    tap: HiddenTap
    buf: Any                  # (R, P * E) f32 backend array

    def rows(self, T: int, n_logits: int) -> tuple[int, int]:
        """[lo, hi) of the step's T rows that are copied (into buffer rows 0 .. hi - lo)."""
        return (0, T) if self.tap.rows is HiddenRows.ALL else (T - n_logits, T)
