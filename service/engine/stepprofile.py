"""Step accounting: the engine's step counts (StepStats) and the step profiler
(EngineConfig.step_profile): where a decode step's wall time goes.

A decode step runs in order: plan (which sequences, how many drafts) -> draft (each
speculating sequence's drafter.propose) -> heads (build the verify candidates: chain rows, or
the candidate tree and its mask) -> verify (the target step: upload, forward, sampling,
readback) -> other (accept, commit, emit). `StepTimer.lap(part)` charges the time since the
previous lap to `part`; planning and committing are charged to OTHER. One perf_counter call per
lap, and only when profiling is on: with it off the engine holds no timer at all.

Per step: one debug log line `step_profile` with the four parts in ms. Per request: every
decode step that held it adds the step's four parts (each step in full: the request waited for
all of it) into Sequence.step_ms, reported as Finished timings draft_ms / heads_ms / verify_ms /
other_ms. The parts are charged just before the step commits (`charge`), so the step that
finishes a request is in its timings; the commit itself is then added to the requests still
running (`finish`): the finishing step's commit, which builds the Finished event, is the one
part a request's timings leave out.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import structlog

log = structlog.get_logger("specstream.engine")

DRAFT, HEADS, VERIFY, OTHER = range(4)
PARTS = ("draft_ms", "heads_ms", "verify_ms", "other_ms")


class StepStats:
    """Counts of the engine's steps (read by tests and benchmarks; written by its thread)."""

    def __init__(self) -> None:
        self.decode_steps = 0           # steps holding decode rows (prefill chunks may ride)
        self.prefill_steps = 0          # steps holding prefill chunks only
        self.mixed_steps = 0            # steps holding decode rows and prefill chunks
        self.prefill_chunks = 0         # chunks computed, in either kind of step
        self.segmented_steps = 0        # steps of several wide chunks (each as its own step)
        self.decode_rows = 0
        self.max_sequences = 0          # most sequences one decode step held
        self.kv_moves = 0               # KV rows moved by tree compaction
        self.preemptions = 0            # sequences whose KV blocks were taken back
        self.cached_tokens = 0          # prompt positions served from the prefix cache
        self.steps = 0                  # target model steps of every kind
        self.step_tokens = 0            # tokens (rows, padding left out) those steps computed
        self.last_rows = 0              # decode rows of the last step (0 once idle)
        self.last_tokens = 0            # tokens of the last step (0 once idle)
        self.mask_refusals = 0          # overlapped unmasked choices a constraint refused
        self.profile: IterationProfile | None = None   # set by a benchmark: where time goes

    def count_step(self, n_sequences: int, n_rows: int, n_chunks: int = 0,
                   chunk_rows: int = 0) -> None:
        """One target step: n_rows decode rows of n_sequences sequences, and n_chunks prefill
        chunks of chunk_rows rows in all (beside the decode rows, or alone)."""
        if n_rows:
            self.decode_steps += 1
            self.decode_rows += n_rows
            self.max_sequences = max(self.max_sequences, n_sequences)
        if n_chunks:
            self.prefill_chunks += n_chunks
            self.mixed_steps += int(n_rows > 0)
            self.prefill_steps += int(n_rows == 0)
        self.steps += 1
        self.step_tokens += n_rows + chunk_rows
        self.last_rows, self.last_tokens = n_rows, n_rows + chunk_rows
        if self.profile is not None:
            self.profile.steps += 1

    def count_decode(self, n_sequences: int, n_rows: int) -> None:
        self.count_step(n_sequences, n_rows)

    def idle(self) -> None:
        """Nothing is running: the last-step gauges read 0."""
        self.last_rows = self.last_tokens = 0


class StepTimer:
    """The parts of one decode step, in ms (a fresh timer per step)."""

    __slots__ = ("ms", "_t", "_charged")

    def __init__(self) -> None:
        self.ms = [0.0, 0.0, 0.0, 0.0]
        self._charged = 0.0
        self._t = time.perf_counter()

    def lap(self, part: int) -> None:
        """Charge the time since the previous lap (or the start) to `part`."""
        now = time.perf_counter()
        self.ms[part] += (now - self._t) * 1e3
        self._t = now

    def charge(self, seqs: Iterable) -> None:
        """Before the step commits: add the parts so far to each sequence's step_ms (a
        sequence that finishes while committing reports its timings at once)."""
        self.lap(OTHER)
        for seq in seqs:
            acc = seq.step_ms
            for i in range(4):
                acc[i] += self.ms[i]
        self._charged = self.ms[OTHER]

    def finish(self, seqs: Iterable, step: int, rows: int) -> None:
        """After the step committed: charge the commit to OTHER (of the sequences still
        running) and log the step."""
        self.lap(OTHER)
        seqs = list(seqs)
        rest = self.ms[OTHER] - self._charged
        for seq in seqs:
            if not seq.finished:
                seq.step_ms[OTHER] += rest
        log.debug("step_profile", step=step, sequences=len(seqs), rows=rows,
                  **{name: round(v, 3) for name, v in zip(PARTS, self.ms, strict=True)})


# ---------------------------------------------------------------- the iteration profile
SCHEDULE, DRAFTING, STEP, READBACK, EMIT, LOOP, IDLE, PACK = range(8)
ITERATION_PARTS = ("schedule", "draft", "step", "readback", "emit", "other", "idle", "pack")
HOST_PARTS = (SCHEDULE, DRAFTING, PACK, EMIT, LOOP)   # the host's own work (not the model's)


class IterationProfile:
    """The engine thread's wall time, iteration by iteration, summed per part (seconds), for
    bench/concurrency.py (StepStats.profile; None: the engine takes no timestamps):

        schedule   admission, the plan, its slot changes (under the engine's lock); in the
                   overlapped loop, planning the next step
        draft      the drafters' proposals
        pack       the step's rows as a StepInput (sampling records included), packed into
                   the runner's host buffer and uploaded (ModelRunner.on_packed laps it)
        step       running the model step (on the CPU backend the whole forward pass and the
                   sample op; on an asynchronous backend only the launch)
        readback   waiting for the step's choices and copying them back (an asynchronous
                   backend's device time shows here)
        emit       committing: stop checks, detokenization, the Delta events handed to the
                   streams (the server's sinks), releasing finished sequences
        other      the rest of an iteration (block-table uploads, bookkeeping)
        idle       waiting for work

    Each `lap(part)` charges the time since the previous lap to `part`: the wall time, and the
    engine thread's own CPU time (time.thread_time: what the part costs the host, without the
    time the thread waited for the GIL or for a core on a busy machine; the first lap only
    starts the CPU clock, since the profile is made on another thread).
    """

    def __init__(self) -> None:
        self.seconds = [0.0] * len(ITERATION_PARTS)
        self.cpu_seconds = [0.0] * len(ITERATION_PARTS)
        self.iterations = 0
        self.steps = 0
        self._t = time.perf_counter()
        self._c: float | None = None

    def lap(self, part: int) -> None:
        now, cpu = time.perf_counter(), time.thread_time()
        self.seconds[part] += now - self._t
        if self._c is not None:
            self.cpu_seconds[part] += cpu - self._c
        self._t, self._c = now, cpu

    def summary(self) -> dict[str, float]:
        """Milliseconds per engine iteration: each part's wall time, the host's (HOST_PARTS) in
        all, wall and CPU, the model step's CPU, and the counts."""
        n = max(self.iterations, 1)
        return {**{p: s * 1e3 / n for p, s in zip(ITERATION_PARTS, self.seconds, strict=True)},
                "host": sum(self.seconds[i] for i in HOST_PARTS) * 1e3 / n,
                "host_cpu": sum(self.cpu_seconds[i] for i in HOST_PARTS) * 1e3 / n,
                "step_cpu": self.cpu_seconds[STEP] * 1e3 / n,
                "iterations": self.iterations, "steps": self.steps}

