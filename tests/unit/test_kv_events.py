"""The prefix cache's events (service/engine/kv_events.py) as the block pool reports them:
each full block entered with its tokens and its parent's hash, each evicted block removed, a
subscriber's snapshot plus its live events always equal to what the pool holds."""

from __future__ import annotations

import random

from service.engine.kv_events import KvEvent, KvEventLog, hash64
from service.engine.scheduler.blocks import BlockPool, block_hashes

BS = 4


def observed(n_blocks=8, n_slots=4, max_blocks=4) -> tuple[BlockPool, KvEventLog, list]:
    log = KvEventLog(BS)
    pool = BlockPool(n_blocks, BS, n_slots, max_blocks, True, observer=log)
    seen: list[KvEvent] = []
    assert log.subscribe(seen.append) == []
    return pool, log, seen


def test_stored_blocks_carry_their_tokens_and_parent():
    pool, _, seen = observed()
    toks = list(range(100, 111))                    # 2 full blocks + 3 positions
    pool.ensure(0, len(toks))
    pool.register(0, toks, len(toks))
    hashes = [hash64(h) for h in block_hashes(toks, BS, 2)]
    assert [(e.stored, e.block_hash, e.parent_hash, e.token_ids) for e in seen] == [
        (True, hashes[0], None, tuple(toks[:4])), (True, hashes[1], hashes[0], tuple(toks[4:8]))]
    assert [e.event_id for e in seen] == [1, 2]
    pool.register(0, toks, len(toks))               # nothing new: no event
    assert len(seen) == 2


def test_evicted_blocks_are_removed_in_lru_order():
    pool, log, seen = observed()
    seqs = [[s * 10 + j for j in range(4)] for s in range(3)]
    for slot, toks in enumerate(seqs):
        pool.ensure(slot, 4)
        pool.register(slot, toks, 4)
    for slot in (1, 0, 2):
        pool.release(slot)
    assert log.cached_blocks == 3 and all(e.stored for e in seen)
    pool.ensure(3, 4 * 4)
    pool.ensure(0, 4)                               # the free blocks first: no eviction
    assert len(seen) == 3
    pool.ensure(1, 4)
    pool.ensure(2, 4)                               # then seqs 1 and 0, least recent first
    removed = [e.block_hash for e in seen[3:]]
    assert removed == [hash64(block_hashes(seqs[s], BS, 1)[0]) for s in (1, 0)]
    assert all(not e.stored for e in seen[3:]) and log.cached_blocks == 1
    late: list[KvEvent] = []
    snapshot = log.subscribe(late.append)
    assert [e.token_ids for e in snapshot] == [tuple(seqs[2])]


def test_a_subscriber_view_always_equals_the_cache():
    """Random mixes: the snapshot taken midway plus the live events after it give exactly the
    hashes the pool has registered, at every step."""
    rng = random.Random(3)
    log = KvEventLog(BS)
    pool = BlockPool(24, BS, 5, 8, True, observer=log)
    vocab = [list(range(b * 4, b * 4 + 4)) for b in range(6)]
    live: dict[int, list[int]] = {}
    view: set[int] | None = None

    def apply(ev: KvEvent) -> None:
        if view is not None:
            (view.add if ev.stored else view.discard)(ev.block_hash)

    for step in range(1500):
        if step == 300:
            view = {e.block_hash for e in log.subscribe(apply)}
        slot = rng.randrange(5)
        if slot in live:
            pool.register(slot, live[slot], len(live[slot]))
            pool.release(slot)
            del live[slot]
            continue
        toks = [t for _ in range(rng.randrange(1, 8)) for t in rng.choice(vocab)]
        hit = pool.match(toks, len(toks) - 1)
        idle = sum(1 for b in hit if pool.ref[b] == 0)
        if pool.blocks_for(len(toks)) - len(hit) <= pool.available - idle:
            pool.attach(slot, hit)
            if pool.ensure(slot, len(toks)):
                live[slot] = toks
            else:
                pool.release(slot)
        if view is not None:
            assert view == {hash64(h) for h in pool._hash_of.values()}
    assert pool.evictions > 0 and view
