"""Comparing rows of logits (positions, V) with a reference's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from service.backends.cpu.backend import CpuBackend


def relative_errors(ours: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Per row: the mean |difference| after removing the row's mean difference (a common shift
    does not change the softmax), relative to the spread (std) of the reference's row."""
    d = ours - ref
    d -= d.mean(axis=1, keepdims=True)
    return np.abs(d).mean(axis=1) / ref.std(axis=1)


def against_llamacpp(logits_of: Callable, name: str, spec: Callable | None = None
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ours and llama.cpp's logits (T, V) of fixture model `name` from `logits_of`
    (tests.support.models.tiny_logits or moe_oracle_logits), ours on the CPU backend rounding
    activations as llama.cpp does (spec: as in build_model), and relative_errors per row (T,)."""
    ours, ref = logits_of(name, CpuBackend(act_quant=True), spec)
    return ours, ref, relative_errors(ours, ref)


@dataclass(frozen=True)
class ErrorBounds:
    """Bounds on the median and the 75th percentile of relative_errors' rows."""

    median: float
    p75: float

    def assert_within(self, rel: np.ndarray) -> None:
        """Both bounds hold."""
        assert np.median(rel) <= self.median, rel
        assert np.percentile(rel, 75) <= self.p75, rel

    def assert_exceeded(self, rel: np.ndarray) -> None:
        """At least one bound fails (a negative control: the bounds catch the mistake)."""
        assert np.median(rel) > self.median or np.percentile(rel, 75) > self.p75
