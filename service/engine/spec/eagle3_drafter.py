"""The `eagle3` drafter: an EAGLE-3 head (service/model/eagle3.py) drafts from the target's own
hidden states, on the target's backend (service/model/eagle3_model.py).

Alignment (EAGLE's): the drafter's row at position p reads the target's features f_p (the
residual rows at the file's three target layers, tapped while the target computed position p,
i.e. while it read token x_p) and the embedding of the NEXT token x_{p+1}; its output predicts
x_{p+2}. With history h = [h_0 .. h_{H-1}] (h_{H-1} the seed, whose target row is not written):

    extend:  after every target step that computed rows of a drafting sequence (prefill chunks,
             verify and plain decode steps), its rows at positions p whose next token h_{p+1}
             is committed (the accepted rows; a rejected draft's row has no committed
             successor) are encoded, g_p = fc(f_p), and decoded as drafter rows (h_{p+1}, g_p)
             at position p into the drafter's own KV cache (slot = the sequence's slot). The
             last such row, p = H - 2 (token h_{H-1} = the seed), gives d1 = argmax(logits) and
             its pre-norm output y, both kept per slot.
    propose: d_{i+1} = argmax(decode(d_i, g = y_i at position H - 2 + i)), y_{i+1} its pre-norm
             output, for i = 1..k-1 (llama.cpp's chain: y feeds back in place of fc's g).
    candidates (tree verify): the same chain, each depth's logits row brought to the host for
             its top n (the first depth's from the kept y through the output layer: the ops
             that chose d1, so the same row); the rows extended after a tree step are its
             accepted path's (spec/decode.committed_rows).

Draft rows at positions >= H - 1 are stale once the target has verified them: the next extend
rewrites those positions with the target's real features (rollback = position move, as for the
model drafter). With a reduced draft vocabulary (d2t) the argmax is over the Vd draft rows and
row i is target id d2t[i]. The argmax runs on the backend (the lowest id on ties); one int32
comes back per draft.

A slot whose rows are not extended up to H - 2 (a step that was not tapped: a prompt's cached
prefix, or a failed step retried apart) proposes nothing until a tapped step catches it up;
positions never extended hold stale rows, which only make drafts worse, never outputs
different: every draft is verified by the target.

On a backend that captures its steps (the CUDA backend's graphs) the chain is captured too
(eagle3_chain.py): extend holds its last rows back (up to HELD_ROWS: the boundary, encoded but
not decoded) and propose runs the boundary and the k - 1 chained steps as ONE backend step, one
graph per (boundary rows, k), reading the k drafts once at the end; the same ops in the same
order, so the same drafts. A held boundary is decoded eagerly before anything else needs its
rows: for the next extend its KV rows alone (`_write_held`: no logits, no readback: what a
sequence that is not drafting pays per step), for tree candidates or a chain too long for the
captured step with its first draft too (`_flush`). The
eager path stays on the CPU backend (graph_chain=False; a test may turn it on there) and for a
boundary of more rows (a prompt's last prefill chunk): one eager first chain per request.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np

from service.engine.spec.drafters import Drafter, DraftState
from service.engine.spec.eagle3_chain import Boundary, CapturedChain
from service.engine.spec.tree import candidates_from_logits, check_n_top
from service.model.eagle3 import Eagle3Spec
from service.model.eagle3_model import Eagle3Model
from service.model.hidden import HiddenTap


@dataclass
class _SlotState:
    n_done: int = 0           # drafter rows written up to position n_done - 1 (0: none)
    d1: int = -1              # the draft after the row at n_done - 1 (target id; -1: none)
    held: Boundary | None = None  # rows up to n_done - 1 held back for the captured chain
    ran: bool = False         # ... and already decoded by a chain (its KV rows are written)


class Eagle3Drafter(Drafter):
    name = "eagle3"

    def __init__(self, model: Eagle3Model, model_name: str, graph_chain: bool | None = None):
        """graph_chain: draft chains as one backend step (eagle3_chain.py); None: where the
        backend captures its steps (CUDA with graphs)."""
        self.model, self.model_name = model, model_name
        s, be, M = model.spec, model.backend, model.max_tokens
        self.spec: Eagle3Spec = s
        self.n_ctx, self.n_slots = model.cache.n_ctx, model.cache.n_slots
        self._slots: dict[int, _SlotState] = {}
        self._y = be.zeros((self.n_slots, s.n_embd))                  # (S, E) f32 per slot y
        self._g = be.zeros((M, s.n_embd))                             # (M, E) f32 encoded rows
        self._ids = be.zeros((M,), "int32")                           # (M,) i32
        self._pos = be.zeros((M,), "int32")                           # (M,) i32
        self._slot_ids = be.zeros((M,), "int32")                      # (M,) i32
        self._best = be.zeros((1,), "int32")                          # (1,) i32 argmax
        self.steps = 0                                                # decoder calls (profiling)
        if graph_chain is None:
            graph_chain = bool(getattr(be, "graphs", False))
        self.chain = CapturedChain(model, self.n_slots) if graph_chain else None

    @property
    def tap(self) -> HiddenTap:
        return self.spec.tap

    # ---------------------------------------------------------------- sequence lifecycle
    @property
    def slots_in_use(self) -> frozenset[int]:
        return frozenset(self._slots)

    def start(self, seq: DraftState) -> None:
        self._slots[seq.slot] = _SlotState()

    def release(self, seq: DraftState) -> None:
        self._slots.pop(seq.slot, None)

    # ---------------------------------------------------------------- the target's rows
    def extend(self, seq: DraftState, rows: Seq[int], positions: Seq[int], hidden) -> None:
        """Rows `rows` (indices into `hidden`, the tapped step's (n, 3 Et) f32 rows) computed
        positions `positions` (ascending, consecutive) of seq, each with a committed next token
        in seq.history: encode and decode them as the drafter's rows there."""
        h, n = seq.history, len(rows)
        if n == 0:
            return
        p0 = int(positions[0])
        if list(positions) != list(range(p0, p0 + n)) or p0 + n >= len(h):
            raise ValueError(f"EAGLE-3 extend: positions {list(positions)} of a history of "
                             f"{len(h)} (consecutive positions with a next token expected)")
        st = self._slots.setdefault(seq.slot, _SlotState())
        if st.held is not None and not st.ran:
            self._write_held(seq.slot, st)        # its rows come before these
        st.held, st.ran = None, False
        M = self.model.max_tokens
        for a in range(0, n, M):                  # at most M rows per decoder call
            b = min(n, a + M)
            pa = p0 + a
            if b == n and self.chain is not None and self.chain.fits(b - a, 1):
                # the boundary: encoded now (the tap's buffer is the next tapped step's),
                # decoded by the captured chain
                self._encode(rows[a:b], hidden, self.chain.held_rows(seq.slot, b - a))
                st.held = self.chain.boundary(h[pa + 1:p0 + b + 1], pa)
                st.n_done, st.d1 = p0 + n, -1
                return
            g = self._g[:b - a]
            self._encode(rows[a:b], hidden, g)
            if b < n:
                self._decode(seq.slot, h[pa + 1:p0 + b + 1], pa, g, 0)
            else:
                st.d1 = self._boundary(seq.slot, h[pa + 1:p0 + b + 1], pa, g)
        st.n_done = p0 + n

    def _boundary(self, slot: int, ids: Seq[int], start: int, g) -> int:
        """Decode the last rows of an extend (target ids `ids` at positions start.., g rows
        (T, E)) and keep the last one's y for the chain; returns d1 (a target id)."""
        m, T = self.model, len(ids)
        logits = self._decode(slot, ids, start, g, 1)
        m.backend.copy_rows(m.ws_y[T - 1:T], self._y[slot:slot + 1])   # (1, E)
        return self._argmax(logits)

    def _decode(self, slot: int, ids: Seq[int], start: int, g, n_logits: int):
        """The head's decoder over rows g (T, E) of target ids `ids` at positions start.. of
        slot (its KV rows written), with the logits of the last n_logits rows."""
        T = len(ids)
        self._upload(ids, start, slot)
        out = self.model.decode(self._ids[:T], self._pos[:T], self._slot_ids[:T], start + T, g,
                                n_logits)
        self.steps += 1
        return out

    def _write_held(self, slot: int, st: _SlotState) -> None:
        """Decode slot's held boundary for its KV rows alone (the extend after it sets the next
        boundary: its logits, argmax and y would be overwritten unread), so a sequence that
        is not drafting costs no logits row and no readback per step."""
        b = st.held
        self._decode(slot, b.ids, b.start, self.chain.held_rows(slot, len(b.ids)), 0)
        st.held, st.ran = None, False

    def _flush(self, slot: int, st: _SlotState) -> None:
        """Decode slot's held boundary eagerly (its g rows where extend encoded them)."""
        b = st.held
        st.d1 = self._boundary(slot, b.ids, b.start, self.chain.held_rows(slot, len(b.ids)))
        st.held, st.ran = None, False

    def check(self) -> None:
        """Run the head once (encode, decode and argmax of one row at position 0 of slot 0,
        which any sequence's first extend rewrites): a backend that cannot run its shapes
        fails here, at load, instead of on the first request."""
        s, be = self.spec, self.model.backend
        feats = be.zeros((1, 3 * s.n_embd_target))                        # (1, 3Et) f32
        self._encode([0], feats, self._g[:1])
        self._upload([0], 0, 0)
        self._argmax(self.model.decode(self._ids[:1], self._pos[:1], self._slot_ids[:1], 1,
                                       self._g[:1], 1))

    def _encode(self, rows: Seq[int], hidden, g) -> None:
        """g (T, E) = fc(hidden[rows]), one encoder call per run of consecutive rows."""
        o, T = 0, len(rows)
        while o < T:
            e = o + 1
            while e < T and rows[e] == rows[e - 1] + 1:
                e += 1
            r0 = int(rows[o])
            self.model.encode(hidden[r0:r0 + e - o], g[o:e])               # (e - o, E)
            o = e

    def _upload(self, ids: Seq[int], start: int, slot: int) -> None:
        T, be = len(ids), self.model.backend
        be.upload_ints(np.asarray(ids, np.int32), self._ids[:T])
        be.upload_ints(np.arange(start, start + T, dtype=np.int32), self._pos[:T])
        be.upload_ints(np.full(T, slot, np.int32), self._slot_ids[:T])

    def _argmax(self, logits) -> int:
        """The target id of the best draft row of logits (1, Vd)."""
        be = self.model.backend
        be.argmax(logits, self._best)
        return self._map([int(np.asarray(be.to_host(self._best))[0])])[0]

    def _map(self, rows: list[int]) -> list[int]:
        """Draft rows -> target ids."""
        d2t = self.model.d2t
        return [int(d2t[i]) for i in rows] if d2t is not None else rows

    # ---------------------------------------------------------------- drafting
    def propose(self, seq: DraftState, k: int) -> list[int]:
        return self._draft(seq, k, 0)[0]

    def candidates(self, seq: DraftState, k: int, n_top: int
                   ) -> tuple[list[int], np.ndarray, np.ndarray]:
        """For tree drafting (tree_verify.draft_tree): the top-1 chain of up to k tokens and,
        per chain position, its n_top most likely target ids (k', n_top) int64 with their
        log-probabilities (float64, log-softmax over the draft vocabulary), best first; the
        chain's token is each row's first. Each position's logits row comes to the host."""
        check_n_top(n_top, self.spec.draft_vocab)
        chain, ids, logp = self._draft(seq, k, n_top)
        return chain, np.asarray(ids, np.int64).reshape(-1, n_top), np.asarray(
            logp, np.float64).reshape(-1, n_top)

    def _draft(self, seq: DraftState, k: int, n_top: int):
        """Up to k greedy drafts after seq.history; with n_top > 0 also each position's top
        n_top (target ids, log-probabilities), the chain's token first."""
        H = len(seq.history)
        st = self._slots.get(seq.slot)
        # rows up to position H - 2 + k - 1 are written (d_k has none)
        k = min(k, self.n_ctx - H + 1)
        if st is None or st.n_done != H - 1 or (st.d1 < 0 and st.held is None) or k <= 0:
            return [], [], []
        if st.held is not None:
            if not n_top and self.chain.fits(len(st.held.ids), k):
                st.ran = True                     # rerunning it rewrites the same rows
                self.steps += k                   # the boundary's decode and k - 1 more
                return self._map(self.chain.run(seq.slot, st.held, k)), [], []
            self._flush(seq.slot, st)
        m, be = self.model, self.model.backend
        g, tops, logps = self._g[:1], [], []
        be.copy_rows(self._y[seq.slot:seq.slot + 1], g)                  # (1, E) y_1
        if n_top:
            ids = [self._top(m.head(g), n_top, tops, logps)]
        else:
            ids = [st.d1]
        for i in range(1, k):
            logits = self._decode(seq.slot, [ids[-1]], H - 2 + i, g, 1)
            ids.append(self._top(logits, n_top, tops, logps) if n_top else self._argmax(logits))
            be.copy_rows(m.ws_y[:1], g)                                  # (1, E) y_{i+1}
        return ids, tops, logps

    def _top(self, logits, n_top: int, tops: list, logps: list) -> int:
        """Append the n_top best target ids of logits (1, Vd) and their log-probabilities;
        returns the best (the lowest draft row on ties, as the argmax)."""
        rows, logp = candidates_from_logits(np.asarray(self.model.backend.to_host(logits)),
                                            n_top)                       # (1, n_top) each
        d2t = self.model.d2t
        ids = d2t[rows[0]] if d2t is not None else rows[0]
        tops.append([int(t) for t in ids])
        logps.append([float(x) for x in logp[0]])
        return tops[-1][0]
