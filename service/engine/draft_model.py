"""The `model` drafter: a smaller GGUF of the same vocabulary drafts k tokens greedily.

It runs on a backend of the target's kind with its own Transformer and KV cache (same n_slots,
same n_ctx), so each sequence has draft KV rows in its own slot. Per sequence it keeps
`n_cached`, the number of leading history tokens whose draft KV rows are written and known to
match the history, and `pending`, the drafts it wrote rows for beyond them. One propose(seq, k)
with H = len(seq.history) (the seed, history[H-1], is the last):

    confirm:   n = n_cached, then n += 1 for each pending[j] == history[n]  (rows the target
               accepted; the first disagreement ends it, its row and later ones are stale)
    catch up:  history[n:H] in chunks of up to max_tokens rows at positions n..H-1; the last
               chunk's last row gives d1 = argmax(logits)
    chain:     d_{i+1} = argmax(draft(d_i at position H - 1 + i)) for i = 1..k-1
    keep:      n_cached = H, pending = d1..d_{k-1}  (d_k has no row)

With a DSpark Markov head (service/engine/markov_head.py), every row that picks a draft gets
`logits += W2 @ W1[prev]` before the argmax, prev being that row's input id (the seed for d1,
d_i for d_{i+1}); it runs inside the step like the argmax.

Rollback is the same position move as the target's: stale rows past n_cached are overwritten
by the next catch-up. The argmax runs on the backend (Backend.argmax); only int32 ids come back,
one per draft step; no logits row is copied to the host.

Each step goes through one packed int32 upload and one readback as in the model runner
(service/engine/runner.py), padded to the backend's step sizes with padding rows first, so a
capturing backend sees the same few step shapes every time.

The draft model gets its own backend instance of the target's kind and options: a backend sizes
its step scratch (`prepare`) for one model and keys its captured steps by shape, so a second
model on the same instance would resize the first one's scratch under its captured steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from service.engine.drafters import Drafter, DraftState
from service.engine.markov_head import MarkovHead
from service.model.transformer import Transformer


@dataclass
class _SlotState:
    n_cached: int = 0                                   # history rows written and confirmed
    pending: list[int] = field(default_factory=list)    # drafts with rows past n_cached


class ModelDrafter(Drafter):
    name = "model"

    def __init__(self, model: Transformer, model_name: str, head: MarkovHead | None = None):
        self.model, self.model_name, self.head = model, model_name, head
        be, M = model.backend, model.max_tokens
        self.sizes = be.step_sizes(M)
        self._host = be.host_buffer(3 * M)                  # (3M,) i32 ids | positions | slots
        self._dev = be.zeros((3 * M,), "int32")             # (3M,) i32
        self._out_dev = be.zeros((1,), "int32")             # (1,) i32 the argmax of the step
        self._out_host = be.host_buffer(1)                  # (1,) i32
        self._slots: dict[int, _SlotState] = {}
        self.steps = 0                                      # draft forwards run (profiling)

    # ---------------------------------------------------------------- sequence lifecycle
    @property
    def slots_in_use(self) -> frozenset[int]:
        return frozenset(self._slots)

    def start(self, seq: DraftState) -> None:
        self._slots[seq.slot] = _SlotState()    # the slot's old rows are stale from position 0

    def release(self, seq: DraftState) -> None:
        self._slots.pop(seq.slot, None)

    # ---------------------------------------------------------------- drafting
    def propose(self, seq: DraftState, k: int) -> list[int]:
        h, H = seq.history, len(seq.history)
        k = min(k, self.model.n_ctx - H + 1)    # rows written up to position H + k - 2
        if k <= 0 or H == 0:
            return []
        st = self._slots.setdefault(seq.slot, _SlotState())
        n = st.n_cached
        for t in st.pending:
            if n >= H or h[n] != t:
                break
            n += 1
        n = min(n, H - 1)                       # the seed's row is never written yet
        M = self.model.max_tokens
        while True:                             # catch up; the last chunk chooses d1
            chunk = h[n:min(H, n + M)]
            last = n + len(chunk) == H
            tok = self._step(chunk, n, seq.slot, choose=last)
            n += len(chunk)
            if last:
                break
        out = [tok]
        for i in range(1, k):
            out.append(self._step([out[-1]], H - 1 + i, seq.slot, choose=True))
        st.n_cached, st.pending = H, out[:-1]
        return out

    def _step(self, tokens: list[int], start: int, slot: int, choose: bool) -> int:
        """Run `tokens` of `slot` from position `start`; the argmax after the last row when
        `choose` (else -1)."""
        model, be = self.model, self.model.backend
        M, n = model.max_tokens, len(tokens)
        T = next(s for s in self.sizes if s >= n)
        pad, h = T - n, self._host
        h[:T] = 0
        h[pad:T] = tokens
        h[M:M + T] = 0
        h[M + pad:M + T] = np.arange(start, start + n, dtype=np.int32)
        h[2 * M:2 * M + T] = -1
        h[2 * M + pad:2 * M + T] = slot
        be.upload_step(h, self._dev)
        ids, pos = self._dev[:T], self._dev[M:M + T]                    # (T,) i32 each
        slots = self._dev[2 * M:2 * M + T]                              # (T,) i32
        out = self._out_dev

        head = self.head

        def choose_token(logits) -> None:                               # logits (1, V) f32
            if head is not None:
                head.apply(ids, logits)                                 # += W2 @ W1[ids[-1]]
            be.argmax(logits, out)

        model.forward(ids, pos, slots, start + n, 1 if choose else 0,
                      epilogue=choose_token if choose else None)
        be.download_step(out[:1 if choose else 0], self._out_host)
        self.steps += 1
        return int(self._out_host[0]) if choose else -1
