"""The KV block pool's bookkeeping (service/engine/scheduler/blocks.py): allocation on demand,
the prefix cache (hits on an identical prefix, misses on a changed one, whole blocks only), LRU
eviction of unreferenced cached blocks, and no block lost after random mixes of sequences."""

from __future__ import annotations

import random

import numpy as np
import pytest

from service.engine.scheduler.blocks import BlockPool, block_hashes

BS = 4


def pool(n_blocks=16, n_slots=4, max_blocks=8, prefix=True) -> BlockPool:
    return BlockPool(n_blocks, BS, n_slots, max_blocks, prefix)


def test_blocks_on_demand_and_the_table():
    p = pool()
    assert p.ensure(0, 5) and p.owned[0] == [0, 1] and p.need(0, 8) == 0 and p.need(0, 9) == 1
    assert p.ensure(1, 1) and p.owned[1] == [2]
    table = p.take_table()
    assert table is not None and list(table[0, :2]) == [0, 1] and table[1, 0] == 2
    assert p.take_table() is None                  # unchanged: no upload
    assert not p.ensure(2, 4 * 14) and 2 not in p.owned     # 14 blocks wanted, 13 left
    p.release(0)
    p.release(1)
    assert p.free_blocks == 16
    p.check()


def test_a_pool_smaller_than_one_context_is_refused():
    with pytest.raises(ValueError, match="one full context"):
        BlockPool(7, BS, 2, 8)


def test_prefix_hits_identical_and_misses_changed_prefixes():
    p = pool()
    system = list(range(100, 110))                 # 10 tokens: 2 full blocks + 2
    a = system + [1, 2, 3]
    assert p.match(a, len(a) - 1) == []
    p.ensure(0, len(a))
    p.register(0, a, len(a))                       # 3 full blocks of 13 positions
    assert len(p._by_hash) == 3
    b = system + [7, 8, 9, 10, 11]
    hit = p.match(b, len(b) - 1)
    assert hit == p.owned[0][:2]                   # the system prompt's 2 whole blocks
    changed = [999] + system[1:] + [7, 8, 9]
    assert p.match(changed, len(changed) - 1) == []     # first token differs: nothing
    late = system[:6] + [0] + system[7:] + [7]
    assert p.match(late, len(late) - 1) == p.owned[0][:1]   # differs in block 1: block 0 only
    p.attach(1, hit)
    assert p.ref[hit[0]] == 2
    p.release(0)
    assert p.cached_blocks == 1 and all(p.ref[b] == 1 for b in hit)   # 2 held by slot 1
    p.release(1)
    assert p.cached_blocks == 3 and p.free_blocks == 13
    p.check()


def test_limit_keeps_the_last_token_to_compute():
    p = pool()
    a = list(range(8))                             # exactly 2 blocks
    p.ensure(0, 8)
    p.register(0, a, 8)
    p.release(0)
    assert len(p.match(a, len(a) - 1)) == 1        # a new prompt recomputes its last block
    assert len(p.match(a, len(a))) == 2


def test_uncommitted_rows_are_not_registered():
    p = pool()
    a = list(range(12))
    p.ensure(0, 12)
    p.register(0, a, 7)                            # rows 0..6 committed: one full block
    assert len(p._by_hash) == 1
    p.register(0, a, 12)
    assert len(p._by_hash) == 3


def test_lru_evicts_the_least_recently_released_block_first():
    p = pool(n_blocks=8, max_blocks=4)
    seqs = [[s * 10 + j for j in range(4)] for s in range(3)]
    for slot, toks in enumerate(seqs):
        p.ensure(slot, 4)
        p.register(slot, toks, 4)
    for slot in (1, 0, 2):                         # release order: 1 first
        p.release(slot)
    assert p.cached_blocks == 3 and p.free_blocks == 5
    assert p.ensure(3, 4 * 4) and p.ensure(0, 4) and p.evictions == 0   # the 5 free ones
    assert p.ensure(1, 4) and p.evictions == 1              # then the cached ones, in LRU order
    assert p.ensure(2, 4) and p.evictions == 2
    assert p.match(seqs[1], 4) == [] and p.match(seqs[0], 4) == []   # 1 then 0 evicted
    assert len(p.match(seqs[2], 4)) == 1                     # the most recent survives
    p.check()


def test_without_prefix_cache_nothing_is_shared():
    p = pool(prefix=False)
    a = list(range(12))
    p.ensure(0, 12)
    p.register(0, a, 12)
    p.release(0)
    assert p.match(a, 12) == [] and p.free_blocks == 16 and p.cached_blocks == 0


def test_hashes_chain_over_the_prefix():
    x = block_hashes(list(range(8)), 4, 2)
    y = block_hashes([9] + list(range(1, 8)), 4, 2)
    assert x[0] != y[0] and x[1] != y[1]           # same second block, other prefix
    assert block_hashes(list(range(8)), 4, 2, x[:1]) == x


def test_random_mixes_lose_no_block():
    rng = random.Random(5)
    p = pool(n_blocks=24, n_slots=5, max_blocks=8)
    vocab = [list(range(b * 4, b * 4 + 4)) for b in range(6)]    # shared block contents
    live: dict[int, tuple[list[int], int]] = {}
    for _ in range(2000):
        slot = rng.randrange(5)
        if slot in live:
            toks, n = live[slot]
            if rng.random() < 0.3:                  # finish or cancel
                p.register(slot, toks, n)
                p.release(slot)
                del live[slot]
            else:                                   # grow by a step
                m = min(len(toks), n + rng.randrange(1, 6))
                if p.ensure(slot, m):
                    live[slot] = (toks, m)
                    if rng.random() < 0.5:
                        p.register(slot, toks, m)
        else:
            toks = [t for _ in range(rng.randrange(1, 8)) for t in rng.choice(vocab)]
            toks = toks[:rng.randrange(1, 4 * 8)]
            hit = p.match(toks, len(toks) - 1)
            idle = sum(1 for b in hit if p.ref[b] == 0)
            if p.blocks_for(len(toks)) - len(hit) <= p.available - idle:
                p.attach(slot, hit)
                live[slot] = (toks, len(hit) * BS)
        p.check()
    for slot in list(live):
        p.release(slot)
    p.check()
    assert p.free_blocks + p.cached_blocks == 24 and not p.ref.any()
    assert p.hits > 0 and p.evictions > 0
    assert np.all(p.table == 0)


def test_blocks_of_wide_steps_match_only_lookups_naming_the_same_steps():
    from service.engine.scheduler.blocks import block_hash

    toks = list(range(12))
    p = BlockPool(16, BS, 4, 8, exact_prefix=True)
    p.ensure(0, 12)
    p.register(0, toks, 12, [(0, 10)])              # rows 0..9 from one wide step of 10 rows
    p.release(0)
    assert p.match(toks, 12) == []                  # the invariant path would not give them
    assert p.match(toks, 12, [(0, 11)]) == []       # nor a wide step of another shape
    assert len(p.match(toks, 12, [(0, 10)])) == 3   # blocks [0, 4), [4, 8), [8, 12)
    # rows 10, 11 from another wide step: block [8, 12) was not computed that way
    assert len(p.match(toks, 12, [(0, 10), (10, 100)])) == 2
    # a block no wide step touched hashes as plainly as before
    assert block_hash(b"x", toks, BS, 2, [(0, 8), (12, 9)]) == block_hash(b"x", toks, BS, 2)
    assert block_hash(b"x", toks, BS, 1, [(0, 5)]) != block_hash(b"x", toks, BS, 1)


def test_without_exact_prefixes_the_steps_do_not_matter():
    toks = list(range(12))
    p = pool()                                      # exact_prefix off: the default
    p.ensure(0, 12)
    p.register(0, toks, 12, [(0, 10)])
    p.release(0)
    assert len(p.match(toks, 12)) == 3 and len(p.match(toks, 12, [(0, 11)])) == 3
