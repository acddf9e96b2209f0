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
log-probabilities) come back; no logits row is copied to the host.

Each catch-up chunk goes through one packed int32 upload as in the model runner
(service/engine/runner.py), padded to the backend's step sizes with padding rows first, so a
capturing backend sees the same few step shapes every time; its choice d1 stays on the device
(row 0 of the output records). The chain d2..dk is ONE backend step (Transformer.forward_chain,
one captured graph per k): one upload of its k - 1 positions and slots and the sampling record,
then per draft position the forward of one token whose id the previous choice wrote on the
device (`chosen_ids`), the head and the sample op into the next output row. The last catch-up
chunk and the chain end with one readback of the k ids (or, for candidates, the k output
records) and one host wait, whatever k (at most max_tokens drafts per propose: the output
records). `one_step_chain=False` runs the chain as k - 1 steps of their own, each read back
(the earlier way, kept as the reference the one-step chain is tested against).

The draft model gets its own backend instance of the target's kind and options: a backend sizes
its step scratch (`prepare`) for one model and keys its captured steps by shape, so a second
model on the same instance would resize the first one's scratch under its captured steps.

Its paged KV cache has the target's pool geometry (blocks, block size; loader.py), so the
engine gives both models the same block table (`set_block_table`): a sequence's draft rows live
in the same block ids of the draft model's own pool as its target rows in the target's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from service.backends.step_format import N_PARAMS, OUT_WORDS, TOP_MAX, param_record
from service.engine.spec.drafters import Drafter, DraftState
from service.engine.spec.markov_head import MarkovHead
from service.model.transformer import Transformer


@dataclass
class _SlotState:
    n_cached: int = 0                                   # history rows written and confirmed
    pending: list[int] = field(default_factory=list)    # drafts with rows past n_cached


class ModelDrafter(Drafter):
    name = "model"

    def __init__(self, model: Transformer, model_name: str, head: MarkovHead | None = None,
                 one_step_chain: bool = True):
        self.model, self.model_name, self.head = model, model_name, head
        self.one_step_chain = one_step_chain
        be, M = model.backend, model.max_tokens
        self.sizes = be.step_sizes(M)
        # (3M + N_PARAMS,) i32: ids | positions | slots | one sampling record (candidates)
        self._host = be.host_buffer(3 * M + N_PARAMS)
        self._dev = be.zeros((3 * M + N_PARAMS,), "int32")  # (3M + N_PARAMS,) i32
        # up to k <= M drafts per propose: output record i chooses d_{i+1}
        self._out_dev = be.zeros((M, OUT_WORDS), "int32")   # (M, OUT_WORDS) i32 chosen id first
        self._out_host = be.host_buffer(M * OUT_WORDS)      # (M * OUT_WORDS,) i32
        # the one-step chain: (2M + N_PARAMS,) i32 positions | slots | one sampling record,
        # its own host buffer (the catch-up's stays untouched until the chain's readback)
        self._chain_host = be.host_buffer(2 * M + N_PARAMS)
        self._chain_dev = be.zeros((2 * M + N_PARAMS,), "int32")   # (2M + N_PARAMS,) i32
        self._chain_ids = be.zeros((M,), "int32")           # (M,) i32 d1..dk, written on device
        self._hist = be.zeros((1, 1), "int32")              # (1, 1) i32: no penalty reads it
        be.prepare_sampling(1, model.spec.vocab_size)
        self._slots: dict[int, _SlotState] = {}
        self.steps = 0                                      # draft forwards run (profiling)

    def set_block_table(self, host) -> None:
        """The draft model's KV block table (n_slots, max_blocks) int32: the target's."""
        self.model.set_block_table(host)

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
        h, H, M = seq.history, len(seq.history), self.model.max_tokens
        # rows written up to position H + k - 2; at most M drafts (the output records)
        k = min(k, self.model.n_ctx - H + 1, M)
        if k <= 0 or H == 0:
            return [], []
        st = self._slots.setdefault(seq.slot, _SlotState())
        n = st.n_cached
        for t in st.pending:
            if n >= H or h[n] != t:
                break
            n += 1
        n = min(n, H - 1)                       # the seed's row is never written yet
        while True:                             # catch up; the last chunk chooses d1
            chunk = h[n:min(H, n + M)]
            last = n + len(chunk) == H
            self._step(chunk, n, seq.slot, choose=last, n_top=n_top)
            n += len(chunk)
            if last:
                break
            self._read(0, 0)                    # the next chunk rewrites the upload buffer
        if self.one_step_chain and k > 1:
            self._chain(H, k - 1, seq.slot, n_top)
            out, tops = self._read(k, n_top, chain=True)
        else:
            out, tops = self._read(1, n_top)
            for i in range(1, k):
                self._step([out[-1]], H - 1 + i, seq.slot, True, n_top)
                d, top = self._read(1, n_top)
                out, tops = out + d, tops + top
        st.n_cached, st.pending = H, out[:-1]
        return out, tops

    @staticmethod
    def _record(n_top: int) -> list[int]:
        """The sampling record of every draft choice: greedy (the argmax, the lowest id on
        ties), with n_top log-probabilities when n_top > 0. Every choice goes through the
        sample op, log-probabilities or not: a captured step of one shape runs the same ops."""
        return param_record(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, penalty=1.0,
                            repeat_last_n=0, seed=0, token_index=0,
                            n_top=n_top if n_top > 0 else -1, slot=0, position=0)

    def _choose(self, ids, logits, params, out) -> None:
        """The Markov head (logits (1, V) += W2 @ W1[ids[-1]]) and the sample op into the
        output record out (1, OUT_WORDS), on the backend."""
        if self.head is not None:
            self.head.apply(ids, logits)
        self.model.backend.sample(logits, params, self._hist, out)

    def _step(self, tokens: list[int], start: int, slot: int, choose: bool, n_top: int) -> None:
        """Queue `tokens` of `slot` from position `start`; when `choose`, the choice after the
        last row goes into output record 0 (read by `_read`)."""
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
        h[3 * M:] = self._record(n_top)
        be.upload_step(h, self._dev)
        ids, pos = self._dev[:T], self._dev[M:M + T]                    # (T,) i32 each
        slots = self._dev[2 * M:2 * M + T]                              # (T,) i32
        params = self._dev[3 * M:].reshape(1, N_PARAMS)                 # (1, N_PARAMS) i32
        out = self._out_dev[:1]                                         # (1, OUT_WORDS) i32

        def choose_token(logits) -> None:                               # logits (1, V) f32
            self._choose(ids, logits, params, out)

        model.forward(ids, pos, slots, start + n, 1 if choose else 0,
                      epilogue=choose_token if choose else None)
        self.steps += 1

    def _chain(self, H: int, n: int, slot: int, n_top: int) -> None:
        """Queue d2..d_{n+1} after d1 (output record 0, on the device) as one backend step:
        forward i (0..n-1) runs d_{i+1} at position H + i and chooses d_{i+2} into output
        record i + 1, whose id it copies to the next forward's input."""
        model, be, M = self.model, self.model.backend, self.model.max_tokens
        c = self._chain_host
        c[:n] = np.arange(H, H + n, dtype=np.int32)
        c[M:M + n] = slot
        c[2 * M:] = self._record(n_top)
        be.upload_step(c, self._chain_dev)
        pos, slots = self._chain_dev[:n], self._chain_dev[M:M + n]     # (n,) i32 each
        params = self._chain_dev[2 * M:].reshape(1, N_PARAMS)           # (1, N_PARAMS) i32
        ids, out = self._chain_ids, self._out_dev                       # (M,), (M, OUT_WORDS)

        def first() -> None:
            be.chosen_ids(out[:1], ids[:1])                             # d1

        def choose(i: int, logits) -> None:                             # logits (1, V) f32
            self._choose(ids[i:i + 1], logits, params, out[i + 1:i + 2])
            be.chosen_ids(out[i + 1:i + 2], ids[i + 1:i + 2])           # d_{i+2}

        model.forward_chain(ids[:n], pos, slots, range(H + 1, H + n + 1), choose, first)
        self.steps += n

    def _read(self, rows: int, n_top: int, chain: bool = False
              ) -> tuple[list[int], list[list[tuple[int, float]]]]:
        """Wait for the queued steps and read the choices of output records 0..rows-1 (rows 0:
        only wait): with n_top > 0 the whole records (ids and each one's n_top most likely (id,
        log-probability) pairs), else only ids: after a chain the k it wrote on the device,
        else record 0's (rows <= 1)."""
        if n_top > 0:
            src = self._out_dev[:rows].reshape(-1)                      # (rows * OUT_WORDS,) i32
        elif chain:
            src = self._chain_ids[:rows]                                # (rows,) i32
        elif rows <= 1:
            src = self._out_dev.reshape(-1)[:rows]                      # (rows,) i32
        else:
            raise ValueError(f"{rows} ids without a chain: only record 0 holds one")
        host = self._out_host[:src.size]
        self.model.backend.download_step(src, host)
        if n_top <= 0:
            return [int(t) for t in host], []
        rec = host.reshape(rows, OUT_WORDS)                             # (rows, OUT_WORDS) i32
        lp = rec.view(np.float32)                                       # (rows, OUT_WORDS) f32
        tops = [[(int(r[2 + i]), float(p[2 + TOP_MAX + i])) for i in range(n_top)
                 if r[2 + i] >= 0] for r, p in zip(rec, lp, strict=True)]
        return [int(r[0]) for r in rec], tops
