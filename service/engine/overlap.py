"""The overlapped decode loop: plain decode steps, each submitted before the previous one is read
back, so the host's work (reading back, emitting, detokenizing, planning, packing) runs while
the device computes the next step instead of between steps.

While the device runs step k + 1, whose rows' ids the runner feeds on the device from step k's
choices (ModelRunner.submit with `feed`), the host commits step k. Step k + 1 holds the
sequences of step k that the scheduler lets go on (Scheduler.continuing: the same rows in the
same order, less those whose in-flight token ends them for certain by length or context, and
only while nothing else wants a step). Each row chooses its token exactly as the one-step loop
would (its own sampling keyed by request seed and token index; the repetition penalty reads
the token history the step itself records on the device), so the streams are the same.

A sequence's n_past counts a row when it is submitted. A sequence that step k ends (a stop id,
a stop text, the end token) while its row of step k + 1 is in flight has that row discarded,
never streamed, and its n_past set back to its committed rows before its slot and blocks go
back (the row's KV, written by a step queued before any later owner's, is simply overwritten).
A cancel or a new request ends the overlap at the next step: the loop reads back what is in
flight and the engine plans afresh, so a cancelled stream's slot is free within one step.

Speculating sequences take part when their drafter reads no target hidden states (the n-gram
and suffix lookups, a draft model; not EAGLE-3 or DFlash, which must see every step's rows): a
step planned before its seed is known cannot carry drafts, so after committing each step the
loop asks the width policy whether a sequence would draft in the next one (its draft length,
and for a pure drafter, a cheap function of the history on the host, whether it proposes
anything), and the scheduler whether a probe is due (a sequence whose drafts stopped paying
tries one every probe_every() plain steps); when either holds for any sequence, the overlap
ends after the step in flight and the engine's next plan drafts with the history as it then
is. A draft model catches up on the tokens of the overlapped steps when it next drafts, and
gets each block table the loop takes. Speculation stays exact (a plain step is what
speculation's output equals); drafts only start one step later than without the overlap, and
a speculating sequence whose drafter finds nothing runs one step in probe_every()
unoverlapped.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from service.backends.step_format import mask_words
from service.engine.constraint import allowed
from service.engine.runner.model_runner import ModelRunner
from service.engine.runner.step import StepInput, StepOutput
from service.engine.scheduler.policy import Scheduler
from service.engine.scheduler.sequence import Sequence, advance_constrained
from service.engine.spec.decode import Speculator, choice, verify_input
from service.engine.stepprofile import EMIT, READBACK, SCHEDULE, STEP, StepStats
from service.engine.types import FinishReason


class OverlappedDecode:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, speculator: Speculator,
                 lock: Any, stats: Callable[[], StepStats],
                 release: Callable[[Sequence], None]):
        self.runner, self.scheduler, self.speculator = runner, scheduler, speculator
        self._lock, self._stats, self._release = lock, stats, release

    def run(self, seqs: list[Sequence]) -> None:
        """Decode `seqs` (plain rows, their seeds on the host) until the scheduler stops
        letting them go on or one of them would draft; returns with nothing in flight."""
        runner, lap = self.runner, self._lap
        pending = runner.submit(verify_input([(s, [s.seed]) for s in seqs]))
        lap(STEP)
        drafting = False
        self._void: set[int] = set()        # sequences whose row in flight was fed a refusal
        masked: set[int] = set()            # sequences whose row being read chose masked later
        redo: set[int] = set()              # sequences whose last row's choice was refused
        try:
            for seq in seqs:
                seq.n_past += 1
            while True:
                with self._lock:
                    nxt = None if drafting else self.scheduler.continuing(seqs)
                    table = self.scheduler.kv.take_table() if nxt else None
                lap(SCHEDULE, iteration=bool(nxt))   # a step planned here
                later: list[int] = []           # rows of nxt sampled once their masks come
                if nxt:
                    if table is not None:
                        runner.set_block_table(table)
                        self.speculator.set_block_table(table)   # a draft model's KV too
                    at = {id(s): r for r, s in enumerate(seqs)}
                    later = [r for r, s in enumerate(nxt)
                             if masks_later(s) and id(s) not in redo]
                    ahead = runner.submit(fed_input(nxt, redo, self._void),
                                          [-1 if id(s) in redo else at[id(s)] for s in nxt],
                                          later)
                    for seq in nxt:
                        seq.n_past += 1
                    lap(STEP)
                out = runner.collect(pending)
                lap(READBACK)
                self._stats().count_decode(len(seqs), len(seqs))
                nxt_masked = {id(nxt[r]) for r in later} | {id(s) for s in nxt or []
                                                           if id(s) in redo}
                # the masks after step k's tokens, once filled: step k + 1 samples with them
                sample_later = (partial(self._sample_later, ahead, [nxt[r] for r in later])
                                if later else None)
                redo = self._commit(seqs, out, nxt or [], masked, nxt_masked, sample_later)
                lap(EMIT)
                if not nxt:
                    return
                drafting = self._would_draft(nxt)
                seqs, pending, masked = nxt, ahead, nxt_masked
        except Exception:
            runner.abandon()
            raise

    def _lap(self, part: int, iteration: bool = False) -> None:
        """The iteration profile's lap (Engine._lap): each overlapped step is an iteration."""
        p = self._stats().profile
        if p is not None:
            p.lap(part)
            p.iterations += iteration

    def _would_draft(self, seqs: list[Sequence]) -> bool:
        """Whether a speculating sequence wants its next step planned afresh: a probe is due
        (the plan drafts with the history as it then is), or its drafter has drafts now."""
        return any(s.speculative and not s.finished
                   and (self.scheduler.probe_due(s)
                        or self.speculator.would_draft(s, self.scheduler.draft_length(s)))
                   for s in seqs)

    def _sample_later(self, pending, seqs: list[Sequence]) -> None:
        """The sample op of the step in flight (`pending`), for its rows of `seqs` (masks_later)
        with their masks, now filled."""
        self.runner.sample(pending, [self._next_mask(s) for s in seqs])

    def _next_mask(self, seq: Sequence):
        """The token mask of `seq`'s row in flight, sampled once the mask is known (after the
        commit of the token before it); every token for a row that will be dropped (its
        sequence ended, it was fed a refused token, or its constraint ends at the commit
        under way: complete, past its stop token or at a dead end), so the sample op always
        has a choice (a complete constraint's mask allows only the end token, which min_tokens
        may ban: an empty draw)."""
        mask = None if seq.finished or id(seq) in self._void else seq.row_mask(0)
        if mask is None or seq.constraint_end(mask) is not None:    # the row is dropped
            return np.full(mask_words(self.runner.model.spec.vocab_size), -1, np.int32)
        return mask

    def _commit(self, seqs: list[Sequence], out: StepOutput, ahead: list[Sequence],
                masked: set[int] = frozenset(), ahead_masked: set[int] = frozenset(),
                filled: Callable[[], None] | None = None) -> set[int]:
        """Each sequence's token of a plain step (its row already counted in n_past); a
        sequence that ends here while a later row of it is in flight gives that row back.
        A constrained row in `masked` (ids) chose with its mask (sampled after this loop filled
        it, masks_later, or a row run again with it). Any other constrained row chose without
        its mask (fed_input): a token its mask refuses is dropped with the row in flight after
        it (fed that token, void), and the returned ids name those sequences: the next step
        runs the refused row again, at the same position with its committed token and its
        mask (then its next few rows masked, Sequence.refused_unmasked). The sequences of
        `ahead_masked` get their next masks filled now (their rows in flight wait for them);
        the other constrained rows in flight are checked when committed instead. `filled`
        runs once those masks are filled and before the tokens are emitted (the rows in flight
        sample without waiting for the detokenization and the streams' events)."""
        later = {id(s) for s in ahead}
        tokens = [int(t) for t in out.token_ids[:len(seqs)]]
        refused: set[int] = set()
        live: list[tuple[int, Sequence, int]] = []
        for r, (seq, tok) in enumerate(zip(seqs, tokens, strict=True)):
            if seq.finished:            # cancelled or failed while its row was in flight
                continue
            if id(seq) in self._void:   # fed a refused token: its row is void
                self._void.discard(id(seq))
                seq.n_past -= 1
                continue
            if seq.matcher is not None and id(seq) not in masked:
                try:
                    ok, end = _check_unmasked(seq, tok)
                except Exception as exc:    # its matcher failed: its request ends, not the step
                    seq.n_past -= 1 + (id(seq) in later)    # this row and the one after it
                    seq.constraint_failed(exc)
                    self._release(seq)
                    continue
                if end is not None:     # the previous token ended the constraint (lazy check)
                    seq.n_past -= 1 + (id(seq) in later)    # this row and the one after it
                    seq.end_after_commits(end)
                    self._release(seq)
                    continue
                if not ok:
                    seq.n_past -= 1     # computed its KV row, but chose without its mask
                    if id(seq) in later:
                        self._void.add(id(seq))
                    refused.add(id(seq))
                    self._stats().mask_refusals += 1
                    seq.refused_unmasked()
                    continue
                seq.kept_unmasked()
            live.append((r, seq, tok))
        # next masks in one batch; a sequence whose next row is in flight unmasked skips its
        # fill: that row's choice is checked by accepting it (_check_unmasked)
        advance_constrained([(seq, tok) for _, seq, tok in live], later - ahead_masked)
        if filled is not None:
            filled()
        for r, seq, tok in live:
            if not seq.finished:        # (its constraint failed in advance_constrained)
                seq.count_step(1)
                seq.emit([tok], out.logprobs[r:r + 1])
            if seq.finished:
                if id(seq) in later:
                    seq.n_past -= 1     # that row is not part of its committed context
                self._release(seq)
        return refused


def _check_unmasked(seq: Sequence, tok: int) -> tuple[bool, FinishReason | None]:
    """Whether the constraint allows `tok`, chosen without its mask, as the sequence's next
    token; and the finish the previous token's commit left to this check, if any. With the
    mask filled, the mask says. With its fill skipped (row_masks [None]), the matcher accepts
    `tok` (kept `ahead`, not accepted twice): a token it takes shows that the previous token
    neither ended the constraint nor reached a dead end. An end token, or one it refuses,
    fills the mask now (the previous token's) and checks as the eager commit would have:
    CONSTRAINT or CONSTRAINT_DEAD_END end the sequence before `tok`, as they would have
    after the previous token."""
    m, mask = seq.matcher, seq.row_masks[0]
    if mask is not None:
        return allowed(mask, tok), None
    if seq.advances(tok) and not m.is_stop(tok) and m.accept(tok):
        m.ahead = tok
        return True, None
    mask = seq.row_mask(0)
    end = seq.constraint_end(mask)
    if end is not None:
        return False, end
    return allowed(mask, tok), None


def masks_later(seq: Sequence) -> bool:
    """Whether `seq`'s fed row samples once its mask is filled (ModelRunner.submit's
    masks_later) rather than choosing without it and being checked: a constrained row whose
    unmasked choice could differ from the masked one (sampled, or with log-probabilities), or
    one whose unmasked choices were refused lately (Sequence.mask_wait)."""
    return seq.matcher is not None and (not seq.unmasked_exact or seq.mask_wait > 0)


def fed_input(seqs: list[Sequence], redo: set[int] = frozenset(),
              void: set[int] = frozenset()) -> StepInput:
    """A plain step whose ids the previous step chooses on the device (fed): each sequence's
    row at its next position, choosing the token after the one still in flight; a constrained
    row without its mask (it needs that token on the host), checked when committed. A
    sequence in `redo` (ids) whose last choice its mask refused runs that row again instead:
    its committed last token (the host's id, not fed) at the refused row's position (its
    n_past, less the void row fed the refusal while that is in flight: the refused row was
    taken off at its commit, the void one is at its own), choosing with the mask its commit
    filled."""
    ids, pos, rows = [], [], []
    for s in seqs:
        if id(s) in redo:
            ids.append(s.seed)
            pos.append(s.n_past - (id(s) in void))
            rows.append(choice(s, 0))
        else:
            ids.append(0)
            pos.append(s.n_past)
            rows.append(choice(s, 1, masked=False))
    return StepInput(ids, pos, [s.slot for s in seqs], range(len(seqs)), rows)
