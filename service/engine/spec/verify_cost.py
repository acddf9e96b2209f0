"""The step costs the width policy (spec/width.py) weighs drafts with, measured on the target's
runner (slot 0, every row choosing a token; the first prefill that uses the slot rewrites its
rows).

measure_verify_alpha: a verify step of w rows costs about 1 + alpha * (w - 1) plain steps. With
t_1 and t_w the best of a few timings of a plain step and of a full-width verify step:

    alpha = clip((t_w / t_1 - 1) / (w - 1), 0, 1)

measure_row_costs: on a backend that replays captured steps (their launch is cheap, the
timings steady), the time of a step of every padded size up to the rows a step can hold, as
cost[R] = t(padded(R)) / t(1) for R = 0..max_rows (a step of R rows runs padded(R) rows), so
a step of many sequences weighs its drafts at its own size (width.allocate_drafts).
"""

from __future__ import annotations

import time

import structlog

from service.engine.runner.model_runner import ModelRunner
from service.engine.runner.step import GREEDY, StepInput

log = structlog.get_logger("specstream.engine")


def _best(runner: ModelRunner, t: int, reps: int) -> float:
    """The best of `reps` timings of a step of t rows, each a logits row, at slot 0."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        runner.step(StepInput(list(range(1, t + 1)), list(range(t)), [0] * t,
                              list(range(t)), [GREEDY] * t))
        times.append(time.perf_counter() - t0)
    return min(times)


def measure_row_costs(runner: ModelRunner, max_rows: int, reps: int = 3
                      ) -> tuple[list[float], float]:
    """cost[R] for R = 0..max_rows (cost[0] = cost[1] = 1; max_rows within what a step and
    the context hold) and the seconds of a one-row step (the drafting cost's unit): per padded
    size, its widest step of at most max_rows rows run once untimed, then the best of `reps`."""
    max_rows = max(1, min(max_rows, runner.model.max_logits, runner.model.max_tokens,
                          runner.n_ctx))
    widest = {runner.padded(r): r for r in range(1, max_rows + 1)}     # padded size -> rows
    t = {}
    for size, rows in widest.items():
        _best(runner, rows, 1)
        t[size] = _best(runner, rows, reps)
    one = t[runner.padded(1)]
    cost = [1.0] + [t[runner.padded(r)] / one for r in range(1, max_rows + 1)]
    log.info("step_costs", rows=list(widest.values()),
             ms=[round(v * 1e3, 3) for v in t.values()],
             relative=[round(v / one, 3) for v in t.values()])
    return cost, one


def alpha_of(relative: float, width: int) -> float:
    """alpha of a verify step of `width` >= 2 rows costing `relative` plain steps."""
    return min(1.0, max(0.0, (relative - 1.0) / (width - 1)))


def measure_verify_alpha(runner: ModelRunner, width: int, reps: int = 3
                         ) -> tuple[float, float]:
    """alpha for verify steps of `width` >= 2 rows (one untimed full-width step first) and the
    seconds of a plain step (the drafting cost's unit)."""
    _best(runner, width, reps)
    t1, tw = _best(runner, 1, reps), _best(runner, width, reps)
    alpha = alpha_of(tw / t1, width)
    log.info("verify_cost", width=width, plain_ms=round(t1 * 1e3, 2),
             verify_ms=round(tw * 1e3, 2), alpha=round(alpha, 3))
    return alpha, t1
