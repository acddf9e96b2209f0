"""Engines for tests: loaded on a model with test defaults, started, and stopped on exit; and one
request run through an engine to its end."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from service.config import EngineConfig
from service.engine.engine import Engine, StepStats
from service.engine.types import (
    Collected,
    Delta,
    GenerationRequest,
    SamplingParams,
    StoppingCriteria,
)
from tests.support.models import model_path
from tests.support.near_ties import logprob_gap

__all__ = ["GREEDY", "Engine", "Result", "StepStats", "engine_config", "greedy_with_gaps",
           "run", "running_engine", "wait_idle"]

GREEDY = SamplingParams(temperature=0.0)
STOPPING_FIELDS = ("max_new_tokens", "stop_sequences", "stop_token_ids", "ignore_eos",
                   "min_tokens")


def engine_config(**overrides) -> EngineConfig:
    """The tests' engine config: the CPU backend, a 256-token context, one slot, unless
    overridden."""
    return EngineConfig(**{"backend": "cpu", "n_ctx": 256, "n_slots": 1, **overrides})


@contextmanager
def running_engine(model: str | Path, *, start: bool = True, draft_in_full: bool = False,
                   fetch: bool = True, config: EngineConfig | None = None,
                   **overrides) -> Iterator[Engine]:
    """An Engine of `model` (tests.support.models.model_path's names or a path) with `config`,
    or else engine_config(**overrides), started unless `start` is false, stopped on exit.

    draft_in_full: take verification and drafting as free (verify_alpha 0, which sets the
    drafting cost to 0 too), so every speculating request drafts as much as its width allows.
    How much the engine drafts otherwise follows the verify cost it measured at start and the
    drafting cost it learns, which depend on the machine's speed and load (on a loaded 2-core
    machine, wide verify steps cost enough that it almost stops drafting): a test that counts
    drafts must not depend on that."""
    eng = Engine.load(model_path(model, fetch=fetch), config or engine_config(**overrides))
    try:
        if start:
            eng.start()
        if draft_in_full:
            eng.verify_alpha = 0.0
        yield eng
    finally:
        eng.stop(10)


class Result(Collected):
    """Collected plus the log-probability records (TokenLogprob) and the number of Deltas; the
    events must come as Started, Deltas, Finished."""

    def __init__(self) -> None:
        super().__init__()
        self.logprobs: list = []
        self.deltas = 0

    def add(self, event) -> None:
        assert self.finished is None, f"{event!r} after Finished"
        first = self.started is None
        super().add(event)
        assert (self.started is event) == first, f"{event!r}: Started comes first, once"
        if isinstance(event, Delta):
            self.logprobs += event.logprobs
            self.deltas += 1


def run(engine: Engine, prompt_ids, sampling: SamplingParams = GREEDY, timeout: float = 300,
        **kw) -> Result:
    """One request to its end: the stopping fields (max_new_tokens, stop_sequences,
    stop_token_ids, ignore_eos) and GenerationRequest's own keywords from `kw`."""
    stopping = StoppingCriteria(**{k: kw.pop(k) for k in list(kw) if k in STOPPING_FIELDS})
    out = Result()
    for ev in engine.generate(GenerationRequest("t", tuple(prompt_ids), sampling, stopping, **kw),
                              timeout=timeout):
        out.add(ev)
    assert out.finished is not None
    return out


def greedy_with_gaps(engine: Engine, prompt_ids, max_new_tokens: int
                     ) -> tuple[list[int], list[float]]:
    """Greedy ids (speculation on, the default) and the top-1/top-2 logit gap of the row that
    chose each of them."""
    out = run(engine, prompt_ids, max_new_tokens=max_new_tokens, top_logprobs=2)
    assert out.finished.error is None, out.finished
    gaps = [logprob_gap(lp) for lp in out.logprobs]
    assert len(gaps) == len(out.token_ids)
    return out.token_ids, gaps


def wait_idle(engine, timeout: float = 30.0) -> None:
    """Returns once no request holds a slot or waits for one; fails after `timeout` seconds
    (a request that never ends)."""
    deadline = time.monotonic() + timeout
    while engine.active or engine.queue_depth:
        if time.monotonic() > deadline:
            raise AssertionError(f"engine still busy after {timeout} s: "
                                 f"active={engine.active} queued={engine.queue_depth}")
        time.sleep(0.01)
