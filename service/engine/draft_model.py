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

For tree verify, `candidates(seq, k, n_top)` drafts the same top-1 chain and also returns, at
each of the k draft positions, the n_top most likely tokens with their log-probabilities (the
backend's sample op with log-probabilities asked, as for top_logprobs: greedy choice, log_softmax
of the raw logits); the chosen token is the first of them.

With a DSpark Markov head (service/engine/markov_head.py), every row that picks a draft gets
`logits += W2 @ W1[prev]` before the choice, prev being that row's input id (the seed for d1,
d_i for d_{i+1}); it runs inside the step like the argmax.

Rollback is the same position move as the target's: stale rows past n_cached are overwritten
by the next catch-up. The argmax runs on the backend (the sample op with a greedy record, so
chain and tree drafting run the same ops in a step of one shape); only int32 ids (and the asked
log-probabilities) come back, one record per draft step; no logits row is copied to the host.

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

from service.backends.cpu_sampling import N_PARAMS, OUT_WORDS, TOP_MAX, param_record
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
        # (3M + N_PARAMS,) i32: ids | positions | slots | one sampling record (candidates)
        self._host = be.host_buffer(3 * M + N_PARAMS)
        self._dev = be.zeros((3 * M + N_PARAMS,), "int32")  # (3M + N_PARAMS,) i32
        self._out_dev = be.zeros((1, OUT_WORDS), "int32")   # (1, OUT_WORDS) i32 chosen id first
        self._out_host = be.host_buffer(OUT_WORDS)          # (OUT_WORDS,) i32
        self._hist = be.zeros((1, 1), "int32")              # (1, 1) i32: no penalty reads it
        be.prepare_sampling(1, model.spec.vocab_size)
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
        return self._draft(seq, k, 0)[0]

    def candidates(self, seq: DraftState, k: int, n_top: int
                   ) -> tuple[list[int], np.ndarray, np.ndarray]:
        """The top-1 chain of up to k tokens, and per chain position its n_top (<= TOP_MAX)
        most likely tokens (ids (k', n_top) int64) with their log-probabilities (float64),
        best first; the chain's token is each row's first."""
        if not 1 <= n_top <= TOP_MAX:
            raise ValueError(f"n_top must be in 1..{TOP_MAX}, got {n_top}")
        chain, tops = self._draft(seq, k, n_top)
        ids = np.array([[t for t, _ in row] for row in tops], np.int64).reshape(-1, n_top)
        logp = np.array([[lp for _, lp in row] for row in tops], np.float64).reshape(-1, n_top)
        return chain, ids, logp

    def _draft(self, seq: DraftState, k: int, n_top: int
               ) -> tuple[list[int], list[list[tuple[int, float]]]]:
        h, H = seq.history, len(seq.history)
        k = min(k, self.model.n_ctx - H + 1)    # rows written up to position H + k - 2
        if k <= 0 or H == 0:
            return [], []
        st = self._slots.setdefault(seq.slot, _SlotState())
        n = st.n_cached
        for t in st.pending:
            if n >= H or h[n] != t:
                break
            n += 1
        n = min(n, H - 1)                       # the seed's row is never written yet
        M = self.model.max_tokens
        tops: list[list[tuple[int, float]]] = []
        while True:                             # catch up; the last chunk chooses d1
            chunk = h[n:min(H, n + M)]
            last = n + len(chunk) == H
            tok = self._step(chunk, n, seq.slot, choose=last, n_top=n_top, tops=tops)
            n += len(chunk)
            if last:
                break
        out = [tok]
        for i in range(1, k):
            out.append(self._step([out[-1]], H - 1 + i, seq.slot, True, n_top, tops))
        st.n_cached, st.pending = H, out[:-1]
        return out, tops

    def _step(self, tokens: list[int], start: int, slot: int, choose: bool, n_top: int = 0,
              tops: list | None = None) -> int:
        """Run `tokens` of `slot` from position `start`; the argmax after the last row when
        `choose` (else -1). With n_top > 0 the n_top most likely (id, log-probability) pairs
        after the last row are appended to `tops`."""
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
        top = choose and n_top > 0
        # every choice goes through the sample op (greedy: the argmax, the lowest id on ties),
        # log-probabilities or not: a captured step of one shape must run the same ops
        h[3 * M:] = param_record(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, penalty=1.0,
                                 repeat_last_n=0, seed=0, token_index=0,
                                 n_top=n_top if top else -1, slot=0, position=0)
        be.upload_step(h, self._dev)
        ids, pos = self._dev[:T], self._dev[M:M + T]                    # (T,) i32 each
        slots = self._dev[2 * M:2 * M + T]                              # (T,) i32
        out, params = self._out_dev, self._dev[3 * M:].reshape(1, N_PARAMS)

        head = self.head

        def choose_token(logits) -> None:                               # logits (1, V) f32
            if head is not None:
                head.apply(ids, logits)                                 # += W2 @ W1[ids[-1]]
            be.sample(logits, params, self._hist, out)

        model.forward(ids, pos, slots, start + n, 1 if choose else 0,
                      epilogue=choose_token if choose else None)
        words = (OUT_WORDS if top else 1) if choose else 0
        be.download_step(out.reshape(-1)[:words], self._out_host[:max(words, 1)])
        self.steps += 1
        if top:
            rec = self._out_host
            lp = rec.view(np.float32)
            tops.append([(int(rec[2 + i]), float(lp[2 + TOP_MAX + i])) for i in range(n_top)
                         if rec[2 + i] >= 0])
        return int(self._out_host[0]) if choose else -1
