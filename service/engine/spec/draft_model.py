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

With a DSpark Markov head (service/engine/spec/markov_head.py), every row that picks a draft
gets `logits += W2 @ W1[prev]` before the choice, prev being that row's input id (the seed for
d1, d_i for d_{i+1}); it runs inside the step like the argmax (the runner's logits hook).

Rollback is the same position move as the target's: stale rows past n_cached are overwritten
by the next catch-up. The argmax runs on the backend (the sample op with a greedy record, so
chain and tree drafting run the same ops in a step of one shape); only int32 ids (and the asked
log-probabilities) come back; no logits row is copied to the host.

Every step goes through the draft model's own ModelRunner (service/engine/runner/, kind
DRAFT: no token history, ordinary rows only, greedy chains): each catch-up chunk is one packed
int32 upload padded to the backend's step sizes with padding rows first, so a capturing backend
sees the same few step shapes every time; the last chunk's choice d1 stays on the device (output
record 0). The chain d2..dk is ONE backend step (`ModelRunner.chain`, one captured graph per k):
one upload of its k - 1 positions and slots and the sampling record, then per draft position
the forward of one token whose id the previous choice wrote on the device, the head and the
sample op into the next output record. The last catch-up chunk and the chain end with one
readback of the k ids (or, for candidates, the k output records) and one host wait, whatever k
(at most max_tokens drafts per propose: the output records). `one_step_chain=False` runs the
chain as k - 1 steps of their own, each read back (the earlier way, kept as the reference the
one-step chain is tested against).

The draft model gets its own backend instance of the target's kind and options: a backend sizes
its step scratch (`prepare`) for one model and keys its captured steps by shape, so a second
model on the same instance would resize the first one's scratch under its captured steps.

Its paged KV cache has the target's pool geometry (blocks, block size; loader.py), so the
engine gives both models the same block table (`set_block_table`): a sequence's draft rows live
in the same block ids of the draft model's own pool as its target rows in the target's.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from service.backends.step_format import TOP_MAX
from service.engine.runner.model_runner import DRAFT, ModelRunner
from service.engine.runner.step import GREEDY, StepInput
from service.engine.spec.drafters import Drafter, DraftState
from service.engine.spec.markov_head import MarkovHead
from service.engine.spec.tree import check_n_top
from service.engine.types import TokenLogprob
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
        self.runner = ModelRunner(model, model.n_slots, model.n_ctx, DRAFT,
                                  head.apply if head is not None else None)
        self._slots: dict[int, _SlotState] = {}
        self.steps = 0                                      # draft forwards run (profiling)

    def set_block_table(self, host) -> None:
        """The draft model's KV block table (n_slots, max_blocks) int32: the target's."""
        self.runner.set_block_table(host)

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
        check_n_top(n_top, TOP_MAX)
        chain, logprobs = self._draft(seq, k, n_top)
        tops = [lp.top for lp in logprobs if lp is not None]
        ids = np.array([[t for t, _ in row] for row in tops], np.int64).reshape(-1, n_top)
        logp = np.array([[p for _, p in row] for row in tops], np.float64).reshape(-1, n_top)
        return chain, ids, logp

    def _draft(self, seq: DraftState, k: int, n_top: int
               ) -> tuple[list[int], list[TokenLogprob | None]]:
        """Up to k greedy drafts after seq.history and, with n_top > 0, each one's record."""
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
        # every choice is the sample op's greedy record (the argmax, the lowest id on ties),
        # log-probabilities or not: a captured step of one shape runs the same ops
        row = replace(GREEDY, n_top=n_top if n_top > 0 else -1)
        runner = self.runner
        while n < H:                            # catch up; the last chunk chooses d1
            chunk = h[n:min(H, n + M)]
            last = [len(chunk) - 1] if n + len(chunk) == H else []
            runner.launch(StepInput(chunk, range(n, n + len(chunk)), [seq.slot] * len(chunk),
                                    last, [row] * len(last)))
            self.steps += 1
            n += len(chunk)
        if self.one_step_chain and k > 1:
            runner.chain(H, k - 1, seq.slot, row)
            self.steps += k - 1
            out = runner.read([row] * k)
            ids, logprobs = [int(t) for t in out.token_ids], list(out.logprobs)
        else:
            out = runner.read([row])
            ids, logprobs = [int(out.token_ids[0])], list(out.logprobs)
            for i in range(1, k):
                out = runner.step(StepInput([ids[-1]], [H - 1 + i], [seq.slot], [0], [row]))
                self.steps += 1
                ids.append(int(out.token_ids[0]))
                logprobs += out.logprobs
        st.n_cached, st.pending = H, ids[:-1]
        return ids, logprobs
