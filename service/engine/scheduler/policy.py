"""The scheduling policy: continuous batching over a paged KV cache. `schedule()` returns the
StepPlan of one engine iteration (plan.py); it runs on the engine thread with the engine's lock
held, and does host bookkeeping only.

Requests wait in a bounded queue (`max_queue` beyond the free slots, then RESOURCE_EXHAUSTED)
ordered by the request's priority (lower first) and, within a level, by arrival (FIFO). The
queue's head is admitted when one of `n_slots` slots is free AND the KV block pool (blocks.py)
can give it the blocks of its whole prompt plus one token, counting the blocks its longest
cached prefix already holds (prefix cache: whole blocks of identical earlier prompts, taken by
reference; it computes only the rest); admission is strictly in queue order, and priority
orders the queue only (a running sequence is never preempted for a waiting one). Each
iteration then runs, under the step budget `max_step_tokens` (config.step_budget: a step of
R = min(64, B - 16) rows, prefill chunk min(prefill_chunk, B - R); B = 0 means 64 rows and
prefill_chunk):

1. ONE step (a mixed step, engine/mixed.py) holding the decode rows and the prefill chunks
   that fit beside them, at most R rows in all. Steps of up to 64 rows are the backends'
   step-size-invariant path: each row's logits and KV row are bit-identical whatever else is
   in the step, so a request gives the same tokens alone and in any batch, and a prompt's chunk
   the same KV rows and first token in a shared step as in one of its own.
   - decode rows first: every decoding sequence's seed token plus its drafted tokens (each
     sequence keeps its own draft length). When the rows wanted (counting the rows of the
     chunks that would ride) exceed R, draft lengths shrink first (the longest draft loses a
     token, the youngest sequence's on a tie); only when the sequences alone exceed R does a
     sequence sit a step out, in turns: the sequences that waited longest since their last
     step go first, FIFO by start among equals. Every chosen sequence gets the KV blocks its
     rows write (the drafter writes them too); when the pool lacks them, a running sequence is
     PREEMPTED (the lowest priority's, the most recently submitted within it): its full
     committed blocks go to the prefix cache, the rest back to the pool, and it waits again in
     its arrival place (first of its priority level, in practice); readmitted,
     it recomputes its context (the prompt in the same chunks, its generated tokens in chunks
     of R, choosing nothing) and goes on: its emitted tokens stand and, sampling being keyed by
     token index, it continues exactly as it would have. How many tokens a sequence drafts:
     `allocate_drafts` (spec/width.py) for the step's chains together, from each one's
     per-depth acceptance, the measured cost of a step of each size (`row_costs`, else
     1 + verify_alpha * (rows - 1)) and of making a draft (`draft_cost`), so drafts are taken
     only where they pay at this batch size; a tree takes its budget while it pays (its
     running accepted nodes per tree step, plus the bonus token, per the time of the step with
     its rows and of drafting its nodes, against one token per plain step), else the
     sequence decodes plainly and tries a whole tree every probe_every() steps.
   - then the prefill chunks: each prefilling (or recomputing) sequence's next chunk, in start
     order, that fits the rows left (a later, smaller chunk may fit where an earlier one did
     not; none is cut to fit). A chunk's size never depends on the load: the prompt in chunks
     of prefill_chunk from position 0 (chunks.py, also after a prefix-cache hit), so a
     prompt's chunk boundaries are the same alone, among many and with a cached prefix.
     A chunk is a run of one sequence's consecutive positions; only a prompt's final chunk
     chooses a token (its last row: the first token).
2. then at most ONE wide step: the oldest prefilling sequence's chunk, when it did not ride
   in the step (wider than 64 rows, MIX_ROWS: such a step takes another numeric path, or
   wider than the rows left), and after it, when it is wider than MIX_ROWS itself, the chunks
   wider than MIX_ROWS of later prefilling sequences, FIFO, while the wide step's rows, each
   chunk padded as a step of its own, stay within `wide_rows` (the engine's prefill chunk).
   The runner computes such a step as segments (runner/step.py StepInput.segments), each
   chunk exactly as in a step of its own, sharing each weight tile's dequantization, so
   joining prompts are prefilled several at a time without changing any chunk's bits. A long
   prompt therefore delays running streams by at most one wide step per token they receive,
   and running streams never starve a waiting prompt. Chunks take their blocks after the
   decode rows' (one may preempt a decode row's sequence, which then sits this step out).
"""

from __future__ import annotations

import bisect
import collections
import math
from collections.abc import Callable

import structlog

from service.config import MAX_STEP_ROWS
from service.engine.scheduler.chunks import PromptChunks
from service.engine.scheduler.kv import KVManager
from service.engine.scheduler.plan import DecodeRow, PrefillChunk, SlotChange, StepPlan
from service.engine.scheduler.sequence import Sequence
from service.engine.spec.width import allocate_drafts, shrink_drafts
from service.errors import CapacityError

log = structlog.get_logger("specstream.engine")

PROBE_EVERY = 8   # plain steps after which a sequence that stopped drafting tries one draft
# ... at least: a probe whose drafting costs c plain steps waits c / PROBE_SHARE steps, so
# probing a dear drafter (a model drafter catching up on the plain steps' tokens) costs about
# 2% of the time
PROBE_SHARE = 0.02
MIX_ROWS = MAX_STEP_ROWS   # chunks up to this wide ride in the decode step (the invariant path)


class Scheduler:
    def __init__(self, kv: KVManager, *, n_ctx: int, max_queue: int, step_rows: int,
                 prefill_chunk: int, wide_rows: int = 0,
                 padded: Callable[[int], int] = lambda n: n):
        self.kv = kv
        self.n_ctx, self.max_queue = n_ctx, max_queue
        self.step_rows, self.prefill_chunk = step_rows, prefill_chunk
        # the wide step: its chunks' rows, each padded as the runner pads a step (`padded`),
        # add up to at most wide_rows (0: one chunk a step)
        self.wide_rows, self._padded = wide_rows, padded
        self.chunks = PromptChunks(prefill_chunk, MIX_ROWS)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []       # in start order (FIFO admission)
        # Cost of each extra verified token relative to a plain step (draft_length); the
        # engine measures it before it serves anything.
        self.verify_alpha = 0.0
        # Measured time of a step of R rows relative to one row, cost[R] for R = 0..step rows
        # (spec/verify_cost.measure_row_costs); empty: 1 + verify_alpha * (R - 1)
        self.row_costs: list[float] = []
        # Time of making one draft relative to a plain step (width.allocate_drafts); the engine
        # measures it as its drafter drafts (Engine.draft_cost)
        self.draft_cost = 0.0
        # ... and of a sequence's first drafting step after plain steps (a probe), whole
        self.probe_cost = 0.0
        # accepted nodes per tree step over the sequences seen (a new sequence's estimate
        # until its own trees give one); None until a tree was verified
        self.tree_gain: float | None = None
        self._turn = 0                          # decode steps planned so far
        self._changes: list[SlotChange] = []
        self._preempted = 0
        self._tickets = 0                       # requests queued so far (arrival order)

    # ------------------------------------------------------------------ the queue
    def add(self, seq: Sequence) -> None:
        """Queue a new request in its priority's place; CapacityError when the queue is full."""
        if len(self.waiting) >= self.max_queue + len(self.kv.free_slots):
            raise CapacityError(f"{len(self.waiting)} requests are already waiting",
                                retry_after_s=1.0)
        self._tickets += 1
        seq.ticket = self._tickets
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        """Into the queue ordered by (priority, arrival): behind every request of its level that
        arrived before it, ahead of every later one and of every lower level."""
        i = bisect.bisect_right(self.waiting, _place(seq), key=_place)
        self.waiting.insert(i, seq)

    @property
    def sequences(self) -> list[Sequence]:
        """Every sequence waiting or running."""
        return [*self.waiting, *self.running]

    def drain(self) -> list[Sequence]:
        """Take every sequence out (the engine failed: none will run)."""
        out = self.sequences
        self.waiting.clear()
        self.running.clear()
        return out

    def drop_cancelled(self) -> list[Sequence]:
        """The cancelled sequences still waiting, taken out of the queue."""
        cancelled = [s for s in self.waiting if s.cancelled]
        for seq in cancelled:
            self.waiting.remove(seq)
        return cancelled

    def release(self, seq: Sequence) -> None:
        """`seq` ended (finished, failed or cancelled): its slot and blocks go back."""
        if seq in self.running:
            self.running.remove(seq)
            self.kv.release(seq)

    def prefilled(self, seq: Sequence) -> None:
        """A prefill chunk of `seq` was committed: its full prompt blocks can be shared."""
        self.kv.committed(seq, min(seq.n_past, len(seq.request.prompt_ids)))

    # ------------------------------------------------------------------ planning
    def schedule(self) -> StepPlan | None:
        """Admit what fits, then plan the step: its decode rows and the prefill chunks that
        ride in it, a chunk too wide for it as a step of its own, and their KV blocks; None
        when nothing is running."""
        cached = self._admit()
        if not self.running:
            return None
        decoding = [s for s in self.running if s.seed is not None and not s.cancelled
                    and not s.prefill_left]
        prefilling = [s for s in self.running if s.prefill_left and not s.cancelled]
        # drafts shrink before a waiting chunk is left out (a prompt's rows are needed work)
        wanted = [n for n in map(self._chunk_rows, prefilling) if n <= MIX_ROWS]
        rows = self._decode_rows(decoding, sum(wanted)) if decoding else []
        room = self.step_rows - sum(r.n_draft + 1 for r in rows)
        chunks, wide = self._prefill_chunks(prefilling, room) if prefilling else ([], [])
        # none preempted for a later chunk's blocks
        rows = [r for r in rows if r.seq.slot >= 0]
        chunks = [c for c in chunks if c.seq.slot >= 0]
        wide = [c for c in wide if c.seq.slot >= 0]
        for r in rows:
            if r.seq.speculative:
                r.seq.steps_without_draft = 0 if r.n_draft else r.seq.steps_without_draft + 1
        if rows:
            self._turn += 1
        plan = StepPlan(tuple(rows), tuple(chunks), tuple(wide), self.kv.take_table(),
                        tuple(self._changes), self._preempted, cached)
        self._changes, self._preempted = [], 0
        return plan

    def _admit(self) -> int:
        """FIFO admission; returns the positions taken from the prefix cache."""
        cached = 0
        while self.waiting:
            n = self.kv.admit(self.waiting[0], self.chunks)
            if n is None:
                break
            seq = self.waiting.popleft()
            self.running.append(seq)
            self._changes.append(SlotChange(seq.slot, seq, True, n))
            cached += n
        return cached

    def _decode_rows(self, decoding: list[Sequence], reserve: int = 0) -> list[DecodeRow]:
        """Which sequences step now and how many tokens each drafts, <= step_rows rows, the
        drafts within what `reserve` rows of prefill chunks leave."""
        # Turns: the sequences that waited longest go first; sorted() keeps start order on ties.
        chosen = sorted(decoding, key=lambda s: s.last_turn)[:self.step_rows]
        for seq in chosen:
            seq.last_turn = self._turn
        want = self._draft_lengths(chosen, reserve)
        spare = max(0, self.step_rows - len(chosen) - reserve)
        want = shrink_drafts(want, spare)   # the longest lose a token, the later on a tie
        for i, seq in enumerate(chosen):     # blocks for every row; the drafter writes them too
            if seq.slot >= 0 and not self._room(seq, seq.n_past + want[i] + 1):
                want[i] = -1
        return [DecodeRow(seq, k) for seq, k in zip(chosen, want, strict=True)
                if k >= 0 and seq.slot >= 0]     # the others were preempted to make room

    def continuing(self, seqs: list[Sequence]) -> list[Sequence] | None:
        """The rows of the next plain decode step, planned while the current one (`seqs`, each
        with one row in flight: its n_past already counts that row) still runs (the overlapped
        loop, engine/overlap.py): `seqs` again in the same order, less those the in-flight
        token ends for certain (their length or context limit). None, and the loop reads back
        and plans afresh, when anything else wants this iteration: a queued request, a running
        sequence outside `seqs` (prefilling or sitting out), a cancelled one, or a row whose
        next KV block the pool cannot give without preempting. (Whether a speculating row
        would rather draft is the loop's to ask its drafter.)"""
        live = [s for s in seqs if not s.finished]
        if self.waiting:
            return None
        if (any(s.cancelled or s.slot < 0 for s in live)
                or {id(s) for s in live} != {id(s) for s in self.running}):
            return None
        nxt = [s for s in live if self._continues(s)]
        if not nxt or not all(self.kv.ensure(s, s.n_past + 1) for s in nxt):
            return None
        self._turn += 1
        for seq in nxt:
            seq.last_turn = self._turn
            if seq.speculative:
                seq.steps_without_draft += 1
        return nxt

    def probe_due(self, seq: Sequence) -> bool:
        """Whether `seq` has gone probe_every() plain steps without a draft (its next planned
        step tries one, whatever its acceptance says)."""
        return seq.speculative and seq.steps_without_draft >= self.probe_every()

    def probe_every(self) -> int:
        """Plain steps between probes: PROBE_EVERY, or more for a drafter whose probe (or
        draft) costs more than PROBE_SHARE * PROBE_EVERY plain steps."""
        return max(PROBE_EVERY,
                   math.ceil(max(self.draft_cost, self.probe_cost) / PROBE_SHARE))

    def _continues(self, seq: Sequence) -> bool:
        """Whether `seq` may still decode after the token in flight (not yet emitted)."""
        stop = seq.request.stopping
        n = len(seq.generated) + 1
        return (n < stop.max_new_tokens and len(seq.request.prompt_ids) + n < self.n_ctx
                and seq.n_past < self.n_ctx)

    def draft_length(self, seq: Sequence) -> int:
        """How many tokens `seq` would like drafted this step (0: plain decoding), beside one
        row of every other running sequence."""
        room = self._draft_room(seq)
        base = max(1, len(self.running))
        if not seq.speculative:
            return room
        if seq.tree_budget:                 # spec/tree_verify.py
            return self._tree_nodes(seq, room, base)
        k = allocate_drafts([seq.depth_accept.rates(room)], [room], base, base,
                            self._costs(base + room), self.draft_cost)[0]
        return self._probe(seq, k, room)

    def _draft_lengths(self, chosen: list[Sequence], reserve: int) -> list[int]:
        """The draft lengths of one step's sequences, chosen together (width.allocate_drafts):
        a tree takes its budget, the chains' drafts are weighed at the step's size (its
        sequences' rows, the trees' and the `reserve` rows of prefill chunks)."""
        rooms = [self._draft_room(seq) for seq in chosen]
        chains = [i for i, seq in enumerate(chosen) if seq.speculative and not seq.tree_budget]
        want = [0] * len(chosen)            # trees: their budget while it pays; chains below
        for i, seq in enumerate(chosen):
            if seq.speculative and seq.tree_budget:
                want[i] = self._tree_nodes(seq, rooms[i], len(chosen) + reserve)
        if chains:
            base = len(chosen) + reserve + sum(want)
            k = allocate_drafts([chosen[i].depth_accept.rates(rooms[i]) for i in chains],
                                [rooms[i] for i in chains], base, len(chosen),
                                self._costs(base + sum(rooms[i] for i in chains)),
                                self.draft_cost)
            for i, ki in zip(chains, k, strict=True):
                want[i] = self._probe(chosen[i], ki, rooms[i])
        return want

    def _draft_room(self, seq: Sequence) -> int:
        """The most tokens `seq` may draft (its width or tree budget less one, the context and
        max_new_tokens left); 0 when it does not speculate."""
        if not seq.speculative:
            return 0
        return max(0, min((seq.tree_budget or seq.verify_width) - 1, self.n_ctx - seq.n_past - 1,
                          seq.request.stopping.max_new_tokens - len(seq.generated) - 1))

    def _tree_nodes(self, seq: Sequence, room: int, base: int) -> int:
        """A tree sequence's drafted nodes this step in a step of `base` other rows: its whole
        room while the tree pays, (1 + g) / (cost[base + room] + draft_cost * room) at least
        1 / cost[base] with g its tree_gain (a sequence without trees yet: the scheduler's,
        trees_verified), else 0; the room again every probe_every() plain
        steps (a probe of a tree is a whole tree: fewer nodes would measure something else).
        The first tree the scheduler sees is always tried."""
        gain = self.tree_gain if seq.tree_gain is None else seq.tree_gain
        if room <= 0 or gain is None:
            return room
        cost = self._costs(base + room)
        pays = ((1.0 + gain) * cost[base]     # a tie (free drafts) drafts
                >= cost[base + room] + self.draft_cost * room)
        return room if pays or seq.steps_without_draft >= self.probe_every() else 0

    def trees_verified(self, seqs: list[Sequence]) -> None:
        """After a step's commits: fold the tree_gain of each sequence whose tree it verified
        into the scheduler's (weight 0.1 each), a new sequence's estimate."""
        for seq in seqs:
            if seq.tree_gain is not None:
                g = self.tree_gain
                self.tree_gain = seq.tree_gain if g is None else 0.9 * g + 0.1 * seq.tree_gain

    def _probe(self, seq: Sequence, k: int, room: int) -> int:
        """k, or one draft when `seq` went probe_every() plain steps without one (keep measuring:
        the text may turn repetitive)."""
        if k == 0 and seq.steps_without_draft >= self.probe_every():
            return min(1, room)
        return k

    def _costs(self, rows: int) -> list[float]:
        """cost[R] for R = 0..rows: the measured table, else 1 + verify_alpha * (R - 1); past
        the table's end, its last step's cost per row goes on."""
        cost = self.row_costs or [1.0 + self.verify_alpha * (r - 1) for r in range(rows + 1)]
        if len(cost) <= rows:
            last = cost[-1] - cost[-2] if len(cost) > 2 else self.verify_alpha
            cost = [*cost, *(cost[-1] + last * (r + 1) for r in range(rows + 1 - len(cost)))]
        return cost

    def _prefill_chunks(self, prefilling: list[Sequence], room: int
                        ) -> tuple[list[PrefillChunk], list[PrefillChunk]]:
        """The next chunk of each prefilling sequence, in start order, that fits the `room`
        the decode rows left in the step (FIFO; a later, smaller chunk may still fit), and the
        wide step: the oldest sequence's chunk when it does not ride (wider than the room, or
        than MIX_ROWS, or scoring its prompt), so running streams never starve a waiting
        prompt, then, when that chunk is wider than MIX_ROWS, later sequences' chunks wider
        than MIX_ROWS while the wide step's padded rows stay within wide_rows (a scoring chunk
        runs alone; so every chunk of a segmented step takes the wide path)."""
        mixed: list[PrefillChunk] = []
        wide: list[PrefillChunk] = []
        left = self.wide_rows
        oldest = True
        for seq in prefilling:
            if seq.slot < 0:            # preempted for an earlier chunk's blocks
                continue
            n = self._chunk_rows(seq)
            # a prompt whose rows all report log-probabilities (prompt_logprobs) runs alone
            fits = n <= min(room, MIX_ROWS) and not seq.scoring_prompt
            if not fits and not oldest and not (
                    wide and n > MIX_ROWS and len(wide[0].tokens) > MIX_ROWS
                    and not seq.scoring_prompt and not wide[0].seq.scoring_prompt
                    and self._padded(n) <= left):
                continue
            oldest = False
            chunk = self._prefill_chunk(seq, n)
            if chunk is None:
                continue
            if fits:
                mixed.append(chunk)
                room -= n
            else:
                wide.append(chunk)
                left -= self._padded(n)
        return mixed, [c for c in wide if c.seq.slot >= 0]

    def _chunk_rows(self, seq: Sequence) -> int:
        """The size of `seq`'s next chunk, whatever the load: the prompt in chunks of
        prefill_chunk from position 0 (after a cached prefix too: chunks.py), or a preempted
        sequence's generated tokens in decode-sized steps, so their KV rows get the bits
        decoding gave them."""
        n_prompt = len(seq.request.prompt_ids)
        if seq.n_past < n_prompt:
            return self.chunks.next_rows(seq.n_past, n_prompt)
        return min(self.step_rows, seq.prefill_left)

    def _prefill_chunk(self, seq: Sequence, n: int) -> PrefillChunk | None:
        """The next n positions of `seq` with their blocks; None when `seq` was preempted."""
        if not self._room(seq, seq.n_past + n):
            return None
        n_prompt = len(seq.request.prompt_ids)
        return PrefillChunk(seq, seq.n_past, list(seq.history[seq.n_past:seq.n_past + n]),
                            seq.seed is None and seq.n_past + n == n_prompt)

    def _room(self, seq: Sequence, n_positions: int) -> bool:
        """Blocks for positions [0, n_positions) of `seq`, preempting running sequences while
        the pool lacks them, the lowest priority (the highest value) first and the most
        recently submitted within a level; False when `seq` itself had to go (it waits again in
        its arrival place)."""
        while not self.kv.ensure(seq, n_positions):
            victim = max((s for s in self.running if s.slot >= 0 and not s.finished),
                         key=lambda s: (s.request.priority, s.t_submit))
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Take `seq`'s blocks back; it recomputes its context when admitted again (its
        emitted tokens stand: sampling is keyed by token index, so it goes on as before)."""
        log.info("preempted", request_id=seq.request.request_id, n_past=seq.n_past,
                 generated=len(seq.generated), blocks_used=self.kv.pool.used_blocks)
        self._changes.append(SlotChange(seq.slot, seq, False))
        self.running.remove(seq)
        self.kv.release(seq)
        seq.preempt()
        self._enqueue(seq)              # back in its arrival place: first of its level
        self._preempted += 1


def _place(seq: Sequence) -> tuple[int, int]:
    """A sequence's place in the queue: lower priority values first, then arrival order."""
    return seq.request.priority, seq.ticket
