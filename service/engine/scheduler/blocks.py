"""The KV block pool: which fixed-size blocks of the paged KV cache each sequence holds, and the
prefix cache over full blocks.

The backends store K/V as a pool of `n_blocks` blocks of `block_size` positions; a sequence in
slot s finds position p at row table[s, p // block_size] * block_size + p % block_size
(service/backends/base.py). This module owns the host copy of that table and decides it:

- A sequence holds the blocks that cover its positions [0, n), allocated on demand
  (`ensure(slot, n)`) before each step that writes them; memory follows actual lengths.
- Prefix cache: a FULL block whose KV rows are written is registered under a hash of its tokens
  chained with the previous block's hash (blake2b of the previous digest, the block's token
  ids and the wide steps that computed its rows: `span_tag`), so equal hashes mean the same
  tokens at the same positions after the same prefix, computed the same way (chunks.py).
  `match(tokens)` returns the cached blocks of the longest registered prefix; a new sequence
  takes them by reference (`attach`) and computes only the rest. A block is written only by the
  sequence that allocated it, at positions it has not committed yet, and registered only once
  every row in it is committed, so shared blocks are never written again.
- Reference counts: a block referenced by no sequence but registered stays cached (its rows
  survive) in least-recently-released order; allocation takes never-registered free blocks
  first, then evicts the least recently released cached block (dropping its hash).
- `release(slot)` drops the slot's references (blocks with none left return to the free list,
  or to the cached LRU when registered). After every sequence has ended,
  `free_blocks + cached_blocks == n_blocks` (tests check this after random mixes).

All methods run on the engine thread and touch no device: `take_table()` hands the table over
when it changed, and the engine uploads it (to the target's and the draft model's runners)
before the next step.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

ROOT_HASH = b"specstream-kv-root"


def span_tag(spans: Sequence[tuple[int, int]], lo: int, hi: int) -> bytes:
    """What computed positions [lo, hi), for a block's hash: the wide steps' spans (first
    position, rows) that cover any of them (scheduler/chunks.py); empty when every row came
    from the step-size-invariant path (such hashes are the plain ones)."""
    hit = [(s, n) for s, n in spans if s < hi and s + n > lo]
    return b"" if not hit else b"wide" + np.asarray(hit, np.int64).tobytes()


def block_hash(prev: bytes, tokens: Sequence[int], block_size: int, i: int,
               spans: Sequence[tuple[int, int]] = ()) -> bytes:
    """The hash of full block i of `tokens`, chained with `prev` (the hash of block i - 1, or
    ROOT_HASH for block 0), and of the wide steps among `spans` that computed its rows."""
    ids = np.asarray(tokens[i * block_size:(i + 1) * block_size], np.int64)      # (bs,)
    if len(ids) != block_size:
        raise ValueError(f"block {i}: {len(ids)} tokens, not {block_size}")
    tag = span_tag(spans, i * block_size, (i + 1) * block_size)
    return hashlib.blake2b(prev + ids.tobytes() + tag, digest_size=16).digest()


def block_hashes(tokens: Sequence[int], block_size: int, n_blocks: int,
                 start: list[bytes] | None = None,
                 spans: Sequence[tuple[int, int]] = ()) -> list[bytes]:
    """The chained hashes of the first n_blocks full blocks of `tokens` (`start`: hashes of
    a leading run already known, extended rather than recomputed)."""
    out = list(start or [])
    for i in range(len(out), n_blocks):
        out.append(block_hash(out[-1] if out else ROOT_HASH, tokens, block_size, i, spans))
    return out


class BlockPool:
    def __init__(self, n_blocks: int, block_size: int, n_slots: int, max_blocks: int,
                 prefix_cache: bool = True, observer: Any = None, exact_prefix: bool = False):
        """exact_prefix: a block's hash includes the wide steps that computed it, and a lookup
        names the ones it would take (chunks.py); False: tokens alone (every matching block
        is reused, whatever computed it)."""
        if n_blocks < max_blocks:
            raise ValueError(f"{n_blocks} KV blocks cannot hold one full context "
                             f"({max_blocks} blocks of {block_size})")
        self.n_blocks, self.block_size = n_blocks, block_size
        self.max_blocks, self.prefix_cache = max_blocks, prefix_cache
        self.exact_prefix = exact_prefix
        self.table = np.zeros((n_slots, max_blocks), np.int32)      # (n_slots, max_blocks)
        self._dirty = True
        self.ref = np.zeros(n_blocks, np.int32)                      # (n_blocks,) references
        self._free: collections.deque[int] = collections.deque(range(n_blocks))
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self.owned: dict[int, list[int]] = {}                        # slot -> its blocks
        self._hashes: dict[int, list[bytes]] = {}                    # slot -> hashed prefix
        self.hits = self.lookups = self.evictions = 0
        # told of every block entered in and evicted from the prefix cache
        # (service/engine/kv_events.py: stored(digest, parent digest, tokens), removed(digest))
        self.observer = observer

    # ---------------------------------------------------------------- accounting
    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def cached_blocks(self) -> int:
        """Registered blocks no sequence references (reusable, evictable)."""
        return len(self._lru)

    @property
    def available(self) -> int:
        """Blocks an allocation may take now."""
        return len(self._free) + len(self._lru)

    @property
    def used_blocks(self) -> int:
        return self.n_blocks - self.available

    def blocks_for(self, n_positions: int) -> int:
        return -(-n_positions // self.block_size)

    def need(self, slot: int, n_positions: int) -> int:
        """New blocks `slot` needs to cover positions [0, n_positions)."""
        return max(0, self.blocks_for(n_positions) - len(self.owned.get(slot, ())))

    # ---------------------------------------------------------------- prefix cache
    def match(self, tokens: Sequence[int], limit: int,
              spans: Sequence[tuple[int, int]] = ()) -> list[int]:
        """Cached blocks holding the longest registered prefix of `tokens`, at most `limit`
        positions (whole blocks only), computed by the wide steps `spans` (those a cold
        prefill of `tokens` would take; scheduler/chunks.py) and otherwise on the invariant
        path."""
        if not self.prefix_cache:
            return []
        self.lookups += 1
        spans = spans if self.exact_prefix else ()
        out: list[int] = []
        prev = ROOT_HASH
        for i in range(limit // self.block_size):
            prev = block_hash(prev, tokens, self.block_size, i, spans)
            b = self._by_hash.get(prev)
            if b is None:
                break
            out.append(b)
        if out:
            self.hits += 1
        return out

    def attach(self, slot: int, blocks: list[int]) -> None:
        """Give a new sequence in `slot` the cached blocks `blocks` (from match) as its first."""
        if self.owned.get(slot):
            raise ValueError(f"slot {slot} already holds blocks")
        for b in blocks:
            if self.ref[b] == 0:
                self._lru.pop(b, None)
            self.ref[b] += 1
        self.owned[slot] = list(blocks)
        self._hashes[slot] = [self._hash_of[b] for b in blocks]
        self.table[slot, :len(blocks)] = blocks
        self._dirty = True

    def register(self, slot: int, tokens: Sequence[int], n_committed: int,
                 spans: Sequence[tuple[int, int]] = ()) -> None:
        """Enter the slot's full blocks whose rows [0, n_committed) are all committed, with
        `tokens` the sequence's tokens at those positions and `spans` the wide steps that
        computed any of them. A block whose hash another block already holds stays private (it
        is freed, not cached, when released)."""
        if not self.prefix_cache:
            return
        blocks = self.owned.get(slot, [])
        n_full = min(n_committed // self.block_size, len(blocks))
        known = self._hashes.setdefault(slot, [])
        if n_full <= len(known):
            return
        spans = spans if self.exact_prefix else ()
        hashes = block_hashes(tokens, self.block_size, n_full, known, spans)
        for i in range(len(known), n_full):
            b, h = blocks[i], hashes[i]
            if h not in self._by_hash and b not in self._hash_of:
                self._by_hash[h] = b
                self._hash_of[b] = h
                if self.observer is not None:
                    bs = self.block_size
                    self.observer.stored(h, hashes[i - 1] if i else None,
                                         tokens[i * bs:(i + 1) * bs])
        self._hashes[slot] = hashes

    # ---------------------------------------------------------------- allocation
    def ensure(self, slot: int, n_positions: int) -> bool:
        """Allocate blocks so `slot` covers positions [0, n_positions); False (and nothing
        allocated) when the pool lacks them."""
        want = self.need(slot, n_positions)
        if want == 0:
            return True
        if want > self.available:
            return False
        mine = self.owned.setdefault(slot, [])
        for _ in range(want):
            b = self._take()
            self.ref[b] = 1
            self.table[slot, len(mine)] = b
            mine.append(b)
        self._dirty = True
        return True

    def _take(self) -> int:
        if self._free:
            return self._free.popleft()
        b, _ = self._lru.popitem(last=False)        # the least recently released cached block
        h = self._hash_of.pop(b)
        del self._by_hash[h]
        self.evictions += 1
        if self.observer is not None:
            self.observer.removed(h)
        return b

    def release(self, slot: int) -> None:
        """Drop `slot`'s references; its table row is left pointing at block 0 (never read)."""
        for b in self.owned.pop(slot, []):
            self.ref[b] -= 1
            if self.ref[b] < 0:
                raise AssertionError(f"block {b} released twice")
            if self.ref[b] == 0:
                if b in self._hash_of:
                    self._lru[b] = None
                else:
                    self._free.append(b)
        self._hashes.pop(slot, None)
        self.table[slot] = 0
        self._dirty = True

    def take_table(self) -> np.ndarray | None:
        """A copy of the table when it changed since the last take (to upload before the next
        step), else None."""
        if not self._dirty:
            return None
        self._dirty = False
        return self.table.copy()

    def check(self) -> None:
        """Every block is either referenced, cached or free, exactly once (tests)."""
        held = collections.Counter(b for bs in self.owned.values() for b in bs)
        for b in range(self.n_blocks):
            if held[b] != self.ref[b]:
                raise AssertionError(f"block {b}: {self.ref[b]} references, {held[b]} holders")
        free, lru = set(self._free), set(self._lru)
        if len(free) != len(self._free) or free & lru or any(self.ref[b] for b in free | lru):
            raise AssertionError("a free or cached block is referenced or listed twice")
        if len(free) + len(lru) + int((self.ref > 0).sum()) != self.n_blocks:
            raise AssertionError("blocks lost: "
                                 f"{len(free)} free + {len(lru)} cached + "
                                 f"{int((self.ref > 0).sum())} held != {self.n_blocks}")
