"""An EAGLE-3 draft chain as ONE backend step (one captured CUDA graph per (rows, k)).

The eager drafter (eagle3_drafter.py) decodes an extend's last rows at once (the boundary:
d1 = argmax of its last row, read to the host) and later drafts d2..dk as k - 1 decoder calls,
each with its upload, argmax read-back and row copy launched from Python. Here the boundary is
held back instead (`hold`: its g rows encoded into the slot's rows of a per-slot buffer, its ids
and positions kept on the host) and run by `run` inside one `Backend.run_step`, keyed
(r, 1, "eagle3-chain", k), with the chain behind it:

    logits = decode(boundary ids, positions pa.., g rows)      r rows, the last one's logits
    best[0] = argmax(logits); g1 = y[r - 1]                    d1 (a draft row), its y
    for i in 1..k-1:
        logits = decode(best[i - 1], position pa + r - 1 + i, g1) (by draft row: embedding_draft)
        best[i] = argmax(logits); g1 = y[0]                    d_{i+1}, its y

Before the step: one int32 upload (ids | positions | slots, packed as the model runner packs a
step) and one row copy of the held g rows into the step's fixed g buffer; after it: one read of
best[:k]. The ops and their order are the eager path's (the same decode, argmax and copies on
rows of the same shapes; the d2t lookup moved into a table gathered at load), so the chain
proposes the eager chain's tokens bit for bit. Every buffer is allocated here, at load: the
step only slices (the capture rules, service/backends/capture_rules.py).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np

from service.model.eagle3_model import Eagle3Model

HELD_ROWS = 32     # boundary rows a slot may hold back (a verify step's accepted rows fit)


@dataclass(frozen=True)
class Boundary:
    """A slot's held-back boundary rows: target ids at positions start.., the g rows in the
    chain's per-slot buffer."""

    ids: tuple[int, ...]          # (r,) the tokens after the rows' positions
    start: int                    # the first row's position


class CapturedChain:
    def __init__(self, model: Eagle3Model, n_slots: int):
        be, E, M = model.backend, model.spec.n_embd, model.max_tokens
        self.model, self.rows = model, min(HELD_ROWS, M)
        R = self.rows
        self.max_k = M - R + 1                  # r + k - 1 rows of positions and slots <= M
        self._held = be.zeros((n_slots, R, E))                           # (S, R, E) f32 g rows
        self._g = be.zeros((R, E))                                       # (R, E) f32 step's g
        self._g1 = be.zeros((1, E))                                      # (1, E) f32 fed-back y
        self._host = be.host_buffer(R + 2 * M)                           # ids | pos | slots
        self._dev = be.zeros((R + 2 * M,), "int32")                      # (R + 2M,) i32
        self._best = be.zeros((M,), "int32")                             # (M,) i32 draft rows
        self.steps = 0                                                   # chains run

    def held_rows(self, slot: int, r: int):
        """The view (r, E) f32 that slot's boundary g rows are encoded into."""
        return self._held[slot, :r]

    def fits(self, r: int, k: int) -> bool:
        return 1 <= r <= self.rows and 1 <= k <= self.max_k

    def run(self, slot: int, b: Boundary, k: int) -> list[int]:
        """Decode slot's held boundary b and chain k - 1 drafts after it, as one backend step;
        returns the k drafts' draft rows (d2t maps them to target ids)."""
        m, be, R, M = self.model, self.model.backend, self.rows, self.model.max_tokens
        r = len(b.ids)
        if not self.fits(r, k):
            raise ValueError(f"a chain of {r} boundary rows and {k} drafts (at most {R} / "
                             f"{self.max_k})")
        n = r + k - 1                                   # rows of positions and slots
        c = self._host
        c[:r] = b.ids
        c[R:R + n] = np.arange(b.start, b.start + n, dtype=np.int32)
        c[R + M:R + M + n] = slot
        be.upload_step(c, self._dev)
        be.copy_rows(self._held[slot, :r], self._g[:r])                  # (r, E)
        ids, pos, slots = self._dev[:r], self._dev[R:R + n], self._dev[R + M:R + M + n]
        best, g, g1, kv0 = self._best, self._g[:r], self._g1, b.start + r

        def chain():
            logits = m.decode(ids, pos[:r], slots[:r], kv0, g, 1)          # (1, Vd)
            be.argmax(logits, best[0:1])                                   # d1
            be.copy_rows(m.ws_y[r - 1:r], g1)                              # (1, E) y_1
            for i in range(1, k):
                j = r + i - 1
                logits = m.decode(best[i - 1:i], pos[j:j + 1], slots[j:j + 1], kv0 + i, g1,
                                  1, by_row=True)                          # (1, Vd)
                be.argmax(logits, best[i:i + 1])                           # d_{i+1}
                be.copy_rows(m.ws_y[:1], g1)                               # (1, E) y_{i+1}
            return best

        be.run_step((r, 1, "eagle3-chain", k), (self._dev, self._g, self._g1, best), chain)
        self.steps += 1
        return [int(x) for x in np.asarray(be.to_host(best[:k]))]

    def boundary(self, ids: Seq[int], start: int) -> Boundary:
        return Boundary(tuple(int(t) for t in ids), int(start))
