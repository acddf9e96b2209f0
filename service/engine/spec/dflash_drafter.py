"""The `dflash` drafter: a DFlash block decoder (service/model/dflash.py) drafts from the target's
own hidden states, on the target's backend (service/model/dflash_model.py).

With history h = [h_0 .. h_{H-1}] (h_{H-1} the seed, whose target row is not written):

    extend:  after every target step that computed rows of a drafting sequence (prefill chunks,
             verify and plain decode steps), its rows at positions p whose token h_p is
             committed (the engine passes the rows with a committed next token: p <= H - 2,
             the prompt's rows, the seed's and the accepted drafts'; not a rejected draft's)
             are fused and injected as the drafter's context K/V rows at p, in the drafter's
             own cache (slot = the sequence's slot). llama.cpp injects every verify row and
             then removes the rejected positions; injecting only the committed ones leaves the
             same rows.
    propose: the block [h_{H-1}, mask x k] at positions H-1 .. H-1+k attends to the context
             rows [0, H - 1) and to itself (non-causally unless the file says causal); the
             drafts are the argmax of block rows 1..k, all from one forward (llama.cpp's
             `draft-dflash` with n_max = k; its drafting sampler takes the most probable
             candidate). k is at most the trained block size - 1 and MAX_BLOCK - 1.
    candidates (tree verify): the same block, each row's logits brought to the host for its
             top n; the chain is the rows' argmax.

A DSpark drafter (llama.cpp's `draft-dspark`) reads the block through its Markov head
(service/model/dspark_heads.py): each draft row's logits get W2 W1[previous draft] (the anchor
for the first), chained on the backend, and the drafts are the chain's picks. Anchor-first
(dflash.sample_from_anchor, llama.cpp's default) the block is [h_{H-1}, mask x (k - 1)] and the
drafts are rows 0..k-1, up to the trained block size; otherwise DFlash's layout. With
`p_min` > 0 (EngineConfig.draft_p_min; the file must have the confidence head) the drafts stop
at the first whose confidence is below it, as common/speculative.cpp does; the tree's
candidates are the chain rows' biased logits, cut the same way.

The block writes its K/V at positions >= H - 1, where the next extend writes the target's real
rows (llama.cpp removes them instead; the block reads only its own rows there, so the two agree).
A slot whose context is not extended up to H - 2 (a step that was not tapped: a prompt's cached
prefix, or a failed step retried apart) proposes nothing until a tapped step catches it up;
positions never extended hold stale rows, which only make drafts worse, never outputs different:
every draft is verified by the target. With a reduced draft vocabulary (d2t) the argmax is over
the Vd draft rows and row i is target id d2t[i]; the argmax runs on the backend (the lowest id
on ties) and k int32 come back per draft.

On a backend that captures its steps (the CUDA backend's graphs; graph_block, which a test may
turn on on the CPU) propose's block is ONE backend step keyed (T, 1, "dflash-block", k): the
block's ids, positions, slots and attention bounds go up in one int32 upload, then the block
forward and the argmax (or the DSpark Markov chain) run as one captured graph per (T, k), and
the k picks come back in one read (the confidence cut, when asked, after the step). The ops and
their order are the eager block's, so the drafts are the same. Tree candidates stay eager
(each row's logits come to the host).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np

from service.engine.spec.drafters import Drafter, DraftState
from service.engine.spec.tree import candidates_from_logits, check_n_top, no_candidates
from service.model.dflash import DflashSpec
from service.model.dflash_model import DflashModel
from service.model.hidden import HiddenTap


class DflashDrafter(Drafter):
    name = "dflash"

    def __init__(self, model: DflashModel, model_name: str, p_min: float = 0.0,
                 graph_block: bool | None = None):
        """graph_block: propose's block as one backend step (module docstring); None: where
        the backend captures its steps (CUDA with graphs)."""
        self.model, self.model_name = model, model_name
        s, be, M = model.spec, model.backend, model.max_tokens
        if p_min and not (s.confidence and 0 < p_min <= 1):
            raise ValueError(f"p_min {p_min}: needs a DSpark drafter with a confidence head "
                             "and a value in (0, 1]")
        self.spec: DflashSpec = s
        self.p_min, self.first = p_min, s.first_draft_row
        self.n_ctx, self.n_slots = model.cache.n_ctx, model.cache.n_slots
        self._done: dict[int, int] = {}           # slot -> context rows written, [0, n)
        self._ids = be.zeros((M,), "int32")                           # (M,) i32
        self._pos = be.zeros((M,), "int32")                           # (M,) i32
        self._slot_ids = be.zeros((M,), "int32")                      # (M,) i32
        self._best = be.zeros((model.max_block,), "int32")            # (B,) i32 row picks
        self.steps = 0                                                # block forwards
        if graph_block is None:
            graph_block = bool(getattr(be, "graphs", False))
        self.graph_block = graph_block
        B = model.max_block               # ids | positions | slots | attn_lo | attn_mask
        self._bhost = be.host_buffer(5 * B) if graph_block else None
        self._bdev = be.zeros((5 * B,), "int32") if graph_block else None   # (5B,) i32

    @property
    def tap(self) -> HiddenTap:
        return self.spec.tap

    @property
    def max_drafts(self) -> int:
        return self.model.max_block - self.first

    # ---------------------------------------------------------------- sequence lifecycle
    @property
    def slots_in_use(self) -> frozenset[int]:
        return frozenset(self._done)

    def start(self, seq: DraftState) -> None:
        self._done[seq.slot] = 0

    def release(self, seq: DraftState) -> None:
        self._done.pop(seq.slot, None)

    # ---------------------------------------------------------------- the target's rows
    def extend(self, seq: DraftState, rows: Seq[int], positions: Seq[int], hidden) -> None:
        """Rows `rows` (indices into `hidden`, the tapped step's (n, P E) f32 rows) computed
        positions `positions` (ascending, consecutive) of seq, each of a committed token with a
        committed next token in seq.history: inject them as the drafter's context rows."""
        n = len(rows)
        if n == 0:
            return
        p0 = int(positions[0])
        if list(positions) != list(range(p0, p0 + n)) or p0 + n >= len(seq.history):
            raise ValueError(f"DFlash extend: positions {list(positions)} of a history of "
                             f"{len(seq.history)} (consecutive positions with a next token "
                             "expected)")
        o, M = 0, self.model.max_tokens
        while o < n:                      # runs of consecutive rows, at most M per call
            e = o + 1
            while e < n and e - o < M and rows[e] == rows[e - 1] + 1:
                e += 1
            r0 = int(rows[o])
            self._upload(None, p0 + o, e - o, seq.slot)
            self.model.inject(hidden[r0:r0 + e - o], self._pos[:e - o],
                              self._slot_ids[:e - o])
            o = e
        self._done[seq.slot] = p0 + n

    def check(self) -> None:
        """Run the drafter once (a context row at position 0 of slot 0, which any sequence's
        first extend rewrites, and a block of two after it): a backend that cannot run its
        shapes fails here, at load, instead of on the first request."""
        s, be = self.spec, self.model.backend
        self._upload(None, 0, 1, 0)
        self.model.inject(be.zeros((1, s.n_points * s.n_embd)), self._pos[:1],
                          self._slot_ids[:1])
        self._drafts(self._block([0], 1, 0, 1), 1)
        if s.confidence:
            self.model.heads.confidence(self.model.hidden(1 + self.first), 1 + self.first)

    def _upload(self, ids: Seq[int] | None, start: int, T: int, slot: int) -> None:
        be = self.model.backend
        if ids is not None:
            be.upload_ints(np.asarray(ids, np.int32), self._ids[:T])
        be.upload_ints(np.arange(start, start + T, dtype=np.int32), self._pos[:T])
        be.upload_ints(np.full(T, slot, np.int32), self._slot_ids[:T])

    def _block(self, seed: Seq[int], n: int, slot: int, k: int):
        """Logits (first + k, Vd) of the block [seed, mask x (first + k - 1)] at positions n..
        of `slot` (draft rows first .. first + k - 1), through the Markov chain when DSpark's
        (which leaves each draft row's pick in _best)."""
        T = k + self.first
        self._upload([*seed, *[self.spec.mask_token] * (T - 1)], n, T, slot)
        self.steps += 1
        logits = self.model.block(self._ids[:T], self._pos[:T], self._slot_ids[:T], n)
        if self.model.heads is not None:
            self.model.heads.chain(self._ids[:T], logits, self._best)
        return logits

    def _cut(self, k: int) -> int:
        """How many of the block's k drafts pass the confidence cut (all without one)."""
        if not self.p_min:
            return k
        T = k + self.first
        conf = self.model.heads.confidence(self.model.hidden(T), T)     # (k,) f32
        low = np.flatnonzero(conf < self.p_min)
        return int(low[0]) if low.size else k

    def _drafts(self, logits, k: int) -> list[int]:
        """The target ids of the block's k draft rows' picks (argmax; the chain's with the
        Markov head), cut by the confidence."""
        be, rows = self.model.backend, self._best[self.first:self.first + k]
        if self.model.heads is None and logits is not None:    # None: picked in the step
            be.argmax(logits[self.first:self.first + k], rows)
        best = np.asarray(be.to_host(rows)).astype(np.int64)[:self._cut(k)]
        d2t = self.model.d2t
        return [int(i) for i in (d2t[best] if d2t is not None else best)]

    # ---------------------------------------------------------------- drafting
    def _ready(self, seq: DraftState, k: int) -> int:
        """How many drafts seq can have now (0: none)."""
        H = len(seq.history)
        if self._done.get(seq.slot) != H - 1:
            return 0
        return max(0, min(k, self.max_drafts, self.n_ctx - H))

    def propose(self, seq: DraftState, k: int) -> list[int]:
        k = self._ready(seq, k)
        if k == 0:
            return []
        H = len(seq.history)
        if self.graph_block:
            self._captured_block(seq.history[-1], H - 1, seq.slot, k)
            return self._drafts(None, k)
        return self._drafts(self._block([seq.history[-1]], H - 1, seq.slot, k), k)

    def _captured_block(self, seed: int, n: int, slot: int, k: int) -> None:
        """_block and the picks (_drafts' argmax) as one backend step, its inputs uploaded
        in one copy; the picks are left in _best."""
        m, be, B, first = self.model, self.model.backend, self.model.max_block, self.first
        T = k + first
        c, d = self._bhost, self._bdev
        c[:T] = [seed, *[self.spec.mask_token] * (T - 1)]
        c[B:B + T] = np.arange(n, n + T, dtype=np.int32)
        c[2 * B:2 * B + T] = slot
        c[3 * B:3 * B + T], c[4 * B:4 * B + T] = m.block_bounds(T, n)
        be.upload_step(c, d)
        ids, pos, slots = d[:T], d[B:B + T], d[2 * B:2 * B + T]
        lo, mask, best = d[3 * B:3 * B + T], d[4 * B:4 * B + T], self._best

        def step():
            logits = m.block(ids, pos, slots, n, lo, mask)                 # (T, Vd)
            if m.heads is not None:
                m.heads.chain(ids, logits, best)
            else:
                be.argmax(logits[first:first + k], best[first:first + k])
            return best

        self.steps += 1
        be.run_step((T, 1, "dflash-block", k), (d, best), step)

    def candidates(self, seq: DraftState, k: int, n_top: int
                   ) -> tuple[list[int], np.ndarray, np.ndarray]:
        """For tree drafting (tree_verify.draft_tree): the top-1 chain of up to k tokens and,
        per chain position, its n_top most likely target ids (k', n_top) int64 with their
        log-probabilities (float64, log-softmax over the draft vocabulary), best first; the
        chain's token is each row's first. The block's logits rows come to the host."""
        check_n_top(n_top, self.spec.draft_vocab)
        k = self._ready(seq, k)
        if k == 0:
            return no_candidates(n_top)
        H = len(seq.history)
        logits = self._block([seq.history[-1]], H - 1, seq.slot, k)
        k = self._cut(k)
        if k == 0:
            return no_candidates(n_top)
        rows, logp = candidates_from_logits(
            np.asarray(self.model.backend.to_host(logits))[self.first:self.first + k],
            n_top)                                                       # (k, n_top) x2
        d2t = self.model.d2t
        ids = (d2t[rows] if d2t is not None else rows).astype(np.int64)
        return [int(t) for t in ids[:, 0]], ids, np.asarray(logp, np.float64)
