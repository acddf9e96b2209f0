"""The verify cost that chain.draft_length weighs drafts with, measured on the target's runner.

A verify step of w rows costs about 1 + alpha * (w - 1) plain steps. With t_1 and t_w the best
of a few timings of a plain step and of a full-width verify step (slot 0, every row choosing a
token; the first prefill that uses the slot rewrites its rows):

    alpha = clip((t_w / t_1 - 1) / (w - 1), 0, 1)
"""

from __future__ import annotations

import time

import structlog

from service.engine.runner.model_runner import ModelRunner
from service.engine.runner.step import GREEDY, StepInput

log = structlog.get_logger("specstream.engine")


def measure_verify_alpha(runner: ModelRunner, width: int, reps: int = 3) -> float:
    """alpha for verify steps of `width` >= 2 rows (one untimed full-width step first)."""

    def best(t: int) -> float:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            runner.step(StepInput(list(range(1, t + 1)), list(range(t)), [0] * t,
                                  list(range(t)), [GREEDY] * t))
            times.append(time.perf_counter() - t0)
        return min(times)

    best(width)
    t1, tw = best(1), best(width)
    alpha = min(1.0, max(0.0, (tw / t1 - 1.0) / (width - 1)))
    log.info("verify_cost", width=width, plain_ms=round(t1 * 1e3, 2),
             verify_ms=round(tw * 1e3, 2), alpha=round(alpha, 3))
    return alpha
