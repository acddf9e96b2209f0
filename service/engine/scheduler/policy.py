"""The engine's batched decode step (a mixin of scheduler.Engine): which sequences step, how
many tokens each drafts, their rows in ONE StepInput, and committing each sequence's segment
(chain acceptance or a draft tree). The policy is in scheduler.py's docstring."""

from __future__ import annotations

from service.engine.runner import RowSampling, StepInput, StepOutput
from service.engine.scheduler.sequence import Sequence
from service.engine.spec.chain import accept_chain, draft_length
from service.engine.spec.tree import Tree
from service.engine.spec.tree_verify import commit as commit_tree
from service.engine.spec.tree_verify import compact, draft_tree, n_rows, step_fields
from service.engine.spec.tree_verify import rows as rows_of
from service.engine.stepprofile import DRAFT, HEADS, OTHER, VERIFY, StepTimer

PROBE_EVERY = 8   # plain steps after which a sequence that stopped drafting tries one draft


class BatchedDecode:
    """Engine methods for the decode step; they use the engine's runner, drafter, pool, stats,
    config, step_rows, verify_alpha, and its _room / _fail / _choice."""

    def _decode(self, decoding: list[Sequence]) -> None:
        """One step for the decoding sequences; a step that fails is retried one sequence at
        a time (nothing was committed), so a fault fails only the request that causes it."""
        timer = StepTimer() if self.config.step_profile else None
        batch = self._plan(decoding, timer)
        if not batch:                   # every chosen sequence was preempted for room
            return
        try:
            outs: list[StepOutput | None] = self._split(batch, self._verify_step(batch, timer))
        except Exception as exc:
            if len(batch) == 1:
                self._fail(batch[0][0], exc)
                return
            outs = []
            for item in batch:
                try:
                    outs += self._split([item], self._verify_step([item]))
                except Exception as one:
                    self._fail(item[0], one)
                    outs.append(None)
        if timer is not None:           # before committing: a finishing request reports it
            timer.charge([seq for seq, _ in batch])
        moves = []
        for (seq, draft), out in zip(batch, outs, strict=True):
            if out is not None and not seq.finished:
                if isinstance(draft, Tree):
                    moves.append(commit_tree(seq, draft, out))
                else:
                    self._commit(seq, draft, out)
        self.stats.kv_moves += compact(self.runner, moves)
        if timer is not None:
            timer.finish([seq for seq, _ in batch], self.stats.decode_steps,
                         sum(n_rows(d) for _, d in batch))

    def _plan(self, decoding: list[Sequence], timer: StepTimer | None = None
              ) -> list[tuple[Sequence, list[int] | Tree]]:
        """Which sequences step now and the rows of each ([seed, drafts...]), <= step_rows."""
        # Turns: the sequences that waited longest go first; sorted() keeps start order on ties.
        chosen = sorted(decoding, key=lambda s: s.last_turn)[:self.step_rows]
        turn = self.stats.decode_steps
        for seq in chosen:
            seq.last_turn = turn
        want = [self._draft_length(seq) for seq in chosen]
        spare = self.step_rows - len(chosen)
        while sum(want) > spare:        # shrink the longest draft (the later in turn on a tie)
            i = max(range(len(want)), key=lambda j: (want[j], j))
            want[i] -= 1
        batch = []
        for i, seq in enumerate(chosen):     # blocks for every row; the drafter writes them too
            if seq.slot >= 0 and not self._room(seq, seq.n_past + want[i] + 1):
                want[i] = -1
        for seq, k in zip(chosen, want, strict=True):
            if k < 0 or seq.slot < 0:         # preempted to make room
                continue
            draft = [seq.seed]
            if seq.speculative:
                seq.steps_without_draft = 0 if k else seq.steps_without_draft + 1
                if timer is not None:
                    timer.lap(OTHER)
                draft = (draft_tree(self.drafter, seq, k + 1) if seq.tree_budget
                         else draft + self.drafter.propose(seq, k))
                if timer is not None:
                    timer.lap(DRAFT)
            batch.append((seq, draft))
        return batch

    def _draft_length(self, seq: Sequence) -> int:
        """How many tokens `seq` would like drafted this step (0: plain decoding)."""
        if not seq.speculative:
            return 0
        room = min((seq.tree_budget or seq.verify_width) - 1, self.config.n_ctx - seq.n_past - 1,
                   seq.request.stopping.max_new_tokens - len(seq.generated) - 1)
        if seq.tree_budget:             # a tree uses its budget (tree_verify.py)
            return max(0, room)
        k = draft_length(seq.accept_rate, self.verify_alpha, room)
        if k == 0 and seq.steps_without_draft >= PROBE_EVERY:
            k = min(1, room)            # keep measuring: the text may turn repetitive
        return k

    def _verify_step(self, batch: list[tuple[Sequence, list[int] | Tree]],
                     timer: StepTimer | None = None) -> StepOutput:
        """Every row of the batch in one step; every row chooses a token: a row at depth d of
        a sequence's chain or tree exactly as plain decoding chooses the token d after its
        next one (its own sampling, seed and token index; in a chain the penalty window sees
        the drafts before it, recorded into the token history by the same step)."""
        if timer is not None:
            timer.lap(OTHER)            # planning (drafting laps itself)
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        rows: list[RowSampling] = []
        segments = [rows_of(draft, seq.n_past) for seq, draft in batch]
        for (seq, _), seg in zip(batch, segments, strict=True):
            ids += seg.ids
            positions += seg.positions
            slots += [seq.slot] * len(seg.ids)
            rows += [self._choice(seq, p - seq.n_past) for p in seg.positions]
        T = len(ids)
        if timer is not None:
            timer.lap(HEADS)
        out = self.runner.step(StepInput(ids, positions, slots, range(T), rows,
                                         **step_fields(segments)))
        if timer is not None:
            timer.lap(VERIFY)
        self.stats.count_decode(len(batch), T)
        return out

    @staticmethod
    def _split(batch: list[tuple[Sequence, list[int] | Tree]], out: StepOutput
               ) -> list[StepOutput]:
        """The step's output cut into each sequence's segment."""
        parts, o = [], 0
        for _, draft in batch:
            n = n_rows(draft)
            parts.append(StepOutput(out.token_ids[o:o + n], out.logprobs[o:o + n]))
            o += n
        return parts

    def _commit(self, seq: Sequence, draft: list[int], out: StepOutput) -> None:
        if len(draft) == 1:
            seq.n_past += 1
            seq.count_step(1)
            seq.emit([int(out.token_ids[0])], out.logprobs)
            return
        n_acc, emitted = accept_chain(draft, [int(t) for t in out.token_ids])
        seq.n_past += n_acc
        seq.count_step(n_acc)
        seq.record_verify(len(draft) - 1, n_acc - 1)
        seq.emit(emitted, out.logprobs[:n_acc])




class StepStats:
    """Counts of the engine's steps (read by tests and benchmarks; written by its thread)."""

    def __init__(self) -> None:
        self.decode_steps = 0
        self.prefill_steps = 0
        self.decode_rows = 0
        self.max_sequences = 0          # most sequences one decode step held
        self.kv_moves = 0               # KV rows moved by tree compaction
        self.preemptions = 0            # sequences whose KV blocks were taken back
        self.cached_tokens = 0          # prompt positions served from the prefix cache

    def count_decode(self, n_sequences: int, n_rows: int) -> None:
        self.decode_steps += 1
        self.decode_rows += n_rows
        self.max_sequences = max(self.max_sequences, n_sequences)
