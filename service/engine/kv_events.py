"""The prefix cache's changes as events, for routers that place requests where their prefix is
cached (the vLLM engine protocol's SubscribeKvEvents, service/vllm_service.py).

The block pool (scheduler/blocks.py) reports each full block it enters in the prefix cache
(`stored`: its hash, the previous block's hash, its token ids) and each cached block it evicts
(`removed`). Both calls come on the engine thread and only append under a short lock; a
subscriber gets the blocks cached when it subscribed (a snapshot, taken under the same lock, so
nothing is lost or repeated between the snapshot and the live events) and then every later event
through its listener, which must not block (the server's schedules a callback on its loop).

A block's hash here is the first 8 bytes of the pool's chained blake2b digest as a signed
64-bit integer (the protocol's int64): equal hashes mean the same tokens after the same prefix
(computed by the same prefill chunks, with `prefix_cache_exact`: scheduler/chunks.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass


def hash64(digest: bytes) -> int:
    """A pool digest as the protocol's signed 64-bit block hash."""
    return int.from_bytes(digest[:8], "little", signed=True)


@dataclass(frozen=True)
class KvEvent:
    event_id: int                    # 1, 2, ... in the order the pool reported them
    stored: bool                     # True: the block entered the cache; False: evicted
    block_hash: int
    parent_hash: int | None = None   # stored: the previous block's hash (None for block 0)
    token_ids: tuple[int, ...] = ()  # stored: the block's tokens (block_size of them)


Listener = Callable[[KvEvent], None]


class KvEventLog:
    """The observer a BlockPool reports to, and the subscribers it fans out to."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._lock = threading.Lock()
        self._next_id = 1
        self._live: dict[int, KvEvent] = {}       # hash -> the stored event of a cached block
        self._listeners: list[Listener] = []

    # ---- the pool's side (engine thread)
    def stored(self, digest: bytes, parent: bytes | None, tokens: Sequence[int]) -> None:
        h = hash64(digest)
        with self._lock:
            ev = KvEvent(self._next_id, True, h, hash64(parent) if parent else None,
                         tuple(int(t) for t in tokens))
            self._live[h] = ev
            self._publish(ev)

    def removed(self, digest: bytes) -> None:
        h = hash64(digest)
        with self._lock:
            self._live.pop(h, None)
            self._publish(KvEvent(self._next_id, False, h))

    def _publish(self, ev: KvEvent) -> None:
        self._next_id += 1
        for listener in self._listeners:
            listener(ev)

    # ---- the subscribers' side
    def subscribe(self, listener: Listener) -> list[KvEvent]:
        """Adds `listener`; returns the stored events of the blocks cached now (in the order
        they were stored, so a block's parent comes before it)."""
        with self._lock:
            self._listeners.append(listener)
            return sorted(self._live.values(), key=lambda e: e.event_id)

    def unsubscribe(self, listener: Listener) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    @property
    def cached_blocks(self) -> int:
        with self._lock:
            return len(self._live)
