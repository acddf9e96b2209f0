"""KV slots and blocks of the running sequences: a slot and the blocks of a sequence's whole
context when it is admitted (the blocks its longest cached prefix holds counted as its own),
more blocks before each step, and both given back at the end, full committed blocks kept in
the prefix cache. The block bookkeeping itself is blocks.BlockPool; which sequence gives its
blocks back when the pool runs out is the policy's (policy.py)."""

from __future__ import annotations

from service.engine.scheduler.blocks import BlockPool
from service.engine.scheduler.chunks import PromptChunks
from service.engine.scheduler.sequence import Sequence


class KVManager:
    def __init__(self, pool: BlockPool, n_slots: int):
        self.pool = pool
        self.free_slots = list(range(n_slots - 1, -1, -1))    # taken from the end: 0 first

    def admit(self, seq: Sequence, chunks: PromptChunks) -> int | None:
        """Start `seq` in a free slot when the pool has the blocks for its whole context plus
        one token, counting the blocks a cached prefix gives it; returns the positions taken
        from the prefix cache, or None (nothing taken: it keeps waiting). The prefix taken is
        one computed as `seq`'s own prefill in `chunks` would compute it (chunks.py)."""
        if not self.free_slots:
            return None
        ctx = seq.context_ids
        # a new prompt computes at least its last token (its logits choose the first one)
        limit = len(ctx) - (1 if seq.seed is None else 0)
        if seq.request.prompt_logprobs is not None and (seq.prompt_scores is not None
                                                        or not seq.t_start):
            limit = 0               # every prompt position computes its logits

        n_prompt = len(seq.request.prompt_ids)
        bs, exact = self.pool.block_size, self.pool.exact_prefix
        cached = self.pool.match(ctx, limit, chunks.cold_spans(n_prompt) if exact else ())
        if exact:
            cached = cached[:chunks.reusable(len(cached) * bs, n_prompt, bs) // bs]
        idle = sum(1 for b in cached if self.pool.ref[b] == 0)   # cached, counted as available
        if self.pool.blocks_for(len(ctx) + 1) - len(cached) > self.pool.available - idle:
            return None
        slot = self.free_slots.pop()
        self.pool.attach(slot, cached)
        n = len(cached) * self.pool.block_size
        seq.start(slot, n)
        return n

    def ensure(self, seq: Sequence, n_positions: int) -> bool:
        """Blocks for positions [0, n_positions) of `seq`; False (none taken) when the pool
        lacks them."""
        return self.pool.ensure(seq.slot, n_positions)

    def committed(self, seq: Sequence, n: int) -> None:
        """Positions [0, n) of `seq` are written: its full blocks there enter the prefix cache."""
        self.pool.register(seq.slot, seq.history, n, seq.wide)

    def release(self, seq: Sequence) -> None:
        """Return `seq`'s slot and blocks (its full committed blocks stay cached)."""
        self.committed(seq, seq.n_past)
        self.pool.release(seq.slot)
        self.free_slots.append(seq.slot)

    def take_table(self):
        """The block table when it changed since the last take (blocks.BlockPool.take_table)."""
        return self.pool.take_table()
