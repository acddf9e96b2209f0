"""Comparing rows of logits (positions, V) with a reference's."""

from __future__ import annotations

import numpy as np


def relative_errors(ours: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Per row: the mean |difference| after removing the row's mean difference (a common shift
    does not change the softmax), relative to the spread (std) of the reference's row."""
    d = ours - ref
    d -= d.mean(axis=1, keepdims=True)
    return np.abs(d).mean(axis=1) / ref.std(axis=1)
