"""KV blocks for the engine's sequences (a mixin of scheduler.Engine): admission when the pool
has a sequence's blocks (prefix cache included), blocks before each step, preemption when the
pool runs out, and returning blocks at the end. The bookkeeping itself is blocks.BlockPool."""

from __future__ import annotations

import structlog

from service.engine.scheduler.sequence import Sequence

log = structlog.get_logger("specstream.engine")


class PagedKV:
    """Engine methods over its pool, runner, drafter, slots, queue and lock."""

    def _upload_table(self, table) -> None:
        """The block table, to the target model and the draft model (which shares it)."""
        self.runner.set_block_table(table)
        share = getattr(self.drafter, "set_block_table", None)
        if share is not None:
            share(table)

    def _free_blocks(self, seq: Sequence) -> None:
        """Return `seq`'s slot and KV blocks (its full committed blocks stay cached)."""
        self.pool.register(seq.slot, seq.history, seq.n_past)
        self.pool.release(seq.slot)
        self._free_slots.append(seq.slot)
        if self.drafter is not None:
            self.drafter.release(seq)

    def _admit(self, seq: Sequence) -> bool:
        """Start `seq` (the queue's head) in a free slot when the pool has the blocks for its
        whole context plus one token, counting the blocks a cached prefix gives it; else
        False (it keeps waiting: admission is FIFO). Holds the lock."""
        ctx = seq.context_ids
        # a new prompt computes at least its last token (its logits choose the first one)
        limit = len(ctx) - (1 if seq.seed is None else 0)
        cached = self.pool.match(ctx, limit)
        idle = sum(1 for b in cached if self.pool.ref[b] == 0)   # cached, counted as available
        if self.pool.blocks_for(len(ctx) + 1) - len(cached) > self.pool.available - idle:
            return False
        slot = self._free_slots.pop()
        self.pool.attach(slot, cached)
        n = len(cached) * self.pool.block_size
        if n:
            self.runner.write_history(slot, ctx[:n])   # the penalty window reads it
            self.stats.cached_tokens += n
        seq.start(slot, n)
        if self.drafter is not None:
            self.drafter.start(seq)
        self._active.append(seq)
        return True

    def _room(self, seq: Sequence, n_positions: int) -> bool:
        """Blocks for positions [0, n_positions) of `seq`, preempting the most recently
        submitted other sequences while the pool lacks them; False when `seq` itself had to
        go (it waits again at the head of the queue)."""
        while not self.pool.ensure(seq.slot, n_positions):
            with self._lock:
                victim = max((s for s in self._active if s.slot >= 0 and not s.finished),
                             key=lambda s: s.t_submit)
                self._preempt(victim)
            if victim is seq:
                return False
        self.pool.sync()
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Take `seq`'s blocks back; it recomputes its context when admitted again (its
        emitted tokens stand: sampling is keyed by token index, so it goes on as before).
        Holds the lock."""
        log.info("preempted", request_id=seq.request.request_id, n_past=seq.n_past,
                 generated=len(seq.generated), blocks_used=self.pool.used_blocks)
        self._active.remove(seq)
        self._free_blocks(seq)
        seq.preempt()
        self._waiting.appendleft(seq)
        self.stats.preemptions += 1

