"""The step profiler (EngineConfig.step_profile): where a decode step's wall time goes.

A decode step runs in order: plan (which sequences, how many drafts) -> draft (each
speculating sequence's drafter.propose) -> heads (build the verify candidates: chain rows, or
the candidate tree and its mask) -> verify (the target step: upload, forward, sampling,
readback) -> other (accept, commit, emit). `StepTimer.lap(part)` charges the time since the
previous lap to `part`; planning and committing are charged to OTHER. One perf_counter call per
lap, and only when profiling is on: with it off the scheduler holds no timer at all.

Per step: one debug log line `step_profile` with the four parts in ms. Per request: every
decode step that held it adds the step's four parts (each step in full: the request waited for
all of it) into Sequence.step_ms, reported as Finished timings draft_ms / heads_ms / verify_ms /
other_ms.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import structlog

log = structlog.get_logger("specstream.engine")

DRAFT, HEADS, VERIFY, OTHER = range(4)
PARTS = ("draft_ms", "heads_ms", "verify_ms", "other_ms")


class StepTimer:
    """The parts of one decode step, in ms (a fresh timer per step)."""

    __slots__ = ("ms", "_t")

    def __init__(self) -> None:
        self.ms = [0.0, 0.0, 0.0, 0.0]
        self._t = time.perf_counter()

    def lap(self, part: int) -> None:
        """Charge the time since the previous lap (or the start) to `part`."""
        now = time.perf_counter()
        self.ms[part] += (now - self._t) * 1e3
        self._t = now

    def finish(self, seqs: Iterable, step: int, rows: int) -> None:
        """Charge the rest to OTHER, log the step, add it to each sequence's step_ms."""
        self.lap(OTHER)
        seqs = list(seqs)
        for seq in seqs:
            acc = seq.step_ms
            for i in range(4):
                acc[i] += self.ms[i]
        log.debug("step_profile", step=step, sequences=len(seqs), rows=rows,
                  **{name: round(v, 3) for name, v in zip(PARTS, self.ms, strict=True)})
