"""The suffix drafter: prompt lookup generalized to a suffix index with continuation counts,
over the request's own history and a bounded cache of other requests' histories.

For every position i of a history and every context length n = 1..max_depth, the index counts
how often the token h[i] followed the context h[i-n:i]. That is the suffix tree of the history
cut at depth max_depth, each node holding the counts of its continuations; adding a token is
O(max_depth) (incremental: a sequence's index extends by the tokens its history gained since).

A proposal walks forward from the history's end: at each drafted position it takes the longest
context (down to min_match tokens) seen before, in the request's own index or in the cache, and
drafts its most frequent continuation (the request's own counts weigh `own_weight` times the
cache's; ties go to the smaller token id). Drafting stops at the first position with no match.

The cache holds the histories (prompt + output) of recently finished requests, at most
`cache_tokens` tokens in all, evicting the least recently added whole history first (LRU by
tokens). Workloads that share prefixes (code edits, agents re-sending a transcript) repeat long
spans of earlier requests; the cache lets a request draft them from its first step.

Drafts never change what a request emits (the target verifies each), so neither the cache nor
other requests can change a request's tokens; they change only how many drafts are accepted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from service.engine.spec.drafters import Drafter, DraftState

Counts = dict[tuple[int, ...], dict[int, int]]


def _add(index: Counts, h: Sequence[int], start: int, depth: int, sign: int = 1) -> None:
    """Count (context, next) for every next position i >= start of h, context lengths 1..depth."""
    for i in range(max(start, 1), len(h)):
        nxt = h[i]
        for n in range(1, min(depth, i) + 1):
            ctx = tuple(h[i - n:i])
            c = index.get(ctx)
            if c is None:
                if sign < 0:
                    continue
                c = index[ctx] = {}
            v = c.get(nxt, 0) + sign
            if v > 0:
                c[nxt] = v
            else:
                c.pop(nxt, None)
                if not c:
                    del index[ctx]


class SuffixCache:
    """Histories of finished requests, LRU by tokens, with their pooled suffix index."""

    def __init__(self, max_tokens: int, depth: int):
        self.max_tokens = max_tokens
        self.depth = depth
        self.index: Counts = {}
        self.entries: OrderedDict[tuple[int, ...], None] = OrderedDict()
        self.tokens = 0

    def clear(self) -> None:
        self.index.clear()
        self.entries.clear()
        self.tokens = 0

    def add(self, history: Sequence[int]) -> None:
        h = tuple(history)
        if len(h) < 2 or len(h) > self.max_tokens:
            return
        if h in self.entries:                       # seen again: most recently used
            self.entries.move_to_end(h)
            return
        self.entries[h] = None
        self.tokens += len(h)
        _add(self.index, h, 1, self.depth)
        while self.tokens > self.max_tokens:
            old, _ = self.entries.popitem(last=False)
            self.tokens -= len(old)
            _add(self.index, old, 1, self.depth, sign=-1)


class SuffixDrafter(Drafter):
    name = "suffix"
    pure = True      # a function of the history and of the cache, which changes only between steps

    def __init__(self, max_depth: int = 8, min_match: int = 2, cache_tokens: int = 65536,
                 own_weight: int = 4):
        if not 1 <= min_match <= max_depth:
            raise ValueError("suffix drafter: need 1 <= min_match <= max_depth")
        self.max_depth = max_depth
        self.min_match = min_match
        self.own_weight = own_weight
        self.cache = SuffixCache(cache_tokens, max_depth) if cache_tokens > 0 else None
        self._own: dict[int, tuple[list[int], Counts]] = {}   # slot -> (indexed history, index)

    def start(self, seq: DraftState) -> None:
        self._own.pop(seq.slot, None)

    def release(self, seq: DraftState) -> None:
        self._own.pop(seq.slot, None)
        if self.cache is not None:
            self.cache.add(seq.history)

    def _index(self, seq: DraftState) -> Counts:
        """seq's own index, extended by the tokens its history gained since the last call."""
        h = seq.history
        seen, index = self._own.get(seq.slot, (None, None))
        if seen is None or len(seen) > len(h) or h[:len(seen)] != seen:
            seen, index = [], {}
        _add(index, h, len(seen), self.max_depth)
        self._own[seq.slot] = (list(h), index)
        return index

    def propose(self, seq: DraftState, k: int) -> list[int]:
        if k <= 0 or len(seq.history) < self.min_match:
            return []
        return self.lookup(seq.history, k, self._index(seq))

    def lookup(self, history: Sequence[int], k: int, own: Counts) -> list[int]:
        ctx = list(history[-self.max_depth:])
        shared = self.cache.index if self.cache is not None else {}
        out: list[int] = []
        while len(out) < k:
            best = self._next(ctx, own, shared)
            if best is None:
                break
            out.append(best)
            ctx = (ctx + [best])[-self.max_depth:]
        return out

    def _next(self, ctx: list[int], own: Counts, shared: Counts) -> int | None:
        for n in range(min(self.max_depth, len(ctx)), self.min_match - 1, -1):
            key = tuple(ctx[-n:])
            a, b = own.get(key), shared.get(key)
            if not a and not b:
                continue
            score: dict[int, int] = {}
            for t, c in (b or {}).items():
                score[t] = c
            for t, c in (a or {}).items():
                score[t] = score.get(t, 0) + self.own_weight * c
            return min(score, key=lambda t: (-score[t], t))
        return None
