"""The model runner: one step in, token ids out.

The scheduler decides *what* runs (a StepInput: rows of token ids, positions, KV slots, which
rows need a token chosen and how); the runner decides *how*:

1. pads the step to the next of the backend's step sizes (`Backend.step_sizes`: 1, 2, 4, 8, 16,
   then the largest step; the CPU backend, which captures nothing, uses multiples of 16 past
   16) with padding rows (slot -1, id 0, position 0) placed FIRST, so the rows that need logits
   stay the last rows, as the transformer computes them;
2. writes everything into one host int32 buffer (pinned on CUDA) and uploads it with ONE copy;
   the device buffer is sliced into the int32 views the model and the sample op read, at offsets
   fixed at load time (so a captured graph finds them at the same addresses every step);
3. runs the transformer, records the step's ids in the token history and samples every logits
   row on the backend, all inside one `run_step` (one graph per (padded T, n_logits));
4. reads back only the int32 output records with ONE copy and one wait.

Layout of the packed step buffer (int32 words; M = max tokens, L = max logits rows):
    [0, M) ids | [M, 2M) positions | [2M, 3M) slots | [3M, 4M) KV rows written | [4M, 5M)
    attn_lo | [5M, 6M) attn_mask (tree verify rows, backends/base.py; an ordinary row has KV row
    = position, attn_lo = position + 1, mask 0) | [6M, 6M + L) logits rows (indices into the
    padded step) | [6M + L, 6M + L + L * N_PARAMS) per-row sampling records (step_format.Param)

KV row moves (tree compaction, `move_kv`) go through a second small host buffer of 3M words
(slots | sources | destinations), also uploaded with one copy, then one kv_move op.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from service.backends.step_format import N_PARAMS, OUT_WORDS, TOP_MAX, param_record
from service.engine.types import SamplingParams, TokenLogprob
from service.model.transformer import Transformer


@dataclass(frozen=True)
class RowSampling:
    """How one logits row chooses its token (temperature 0 = greedy argmax)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repeat_last_n: int = 0
    seed: int = 0
    token_index: int = 0          # the draw's counter: tokens generated before this one
    n_top: int = -1               # -1: no log-probabilities; else chosen + n_top alternatives

    @classmethod
    def of(cls, p: SamplingParams, seed: int, token_index: int, n_top: int) -> RowSampling:
        return cls(p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty,
                   p.repeat_last_n, seed, token_index, n_top)


GREEDY = RowSampling()


@dataclass(frozen=True)
class StepInput:
    """One step: n rows (1 <= n <= max tokens) and the rows that need a token chosen.

    logit_rows must be the last rows, in order (the transformer computes logits for the last
    rows of a step); sampling holds one RowSampling per logits row. kv_positions, attn_lo and
    attn_mask (all three or none) describe tree verify rows (service/engine/tree_verify.py);
    None: ordinary causal rows."""

    token_ids: Sequence[int]
    positions: Sequence[int]
    slots: Sequence[int]          # -1 = padding row
    logit_rows: Sequence[int] = ()
    sampling: Sequence[RowSampling] = ()
    kv_positions: Sequence[int] | None = None     # KV row each row writes (default: position)
    attn_lo: Sequence[int] | None = None          # sees rows [0, attn_lo) (default: position+1)
    attn_mask: Sequence[int] | None = None        # ... and attn_lo + bit for each set bit

    def check(self, max_tokens: int, max_logits: int) -> None:
        n = len(self.token_ids)
        if not 1 <= n <= max_tokens or len(self.positions) != n or len(self.slots) != n:
            raise ValueError(f"step of {n} ids / {len(self.positions)} positions / "
                             f"{len(self.slots)} slots (max {max_tokens})")
        L = len(self.logit_rows)
        if L > max_logits or list(self.logit_rows) != list(range(n - L, n)):
            raise ValueError(f"logits rows {list(self.logit_rows)} must be the last rows of "
                             f"the step (at most {max_logits})")
        if len(self.sampling) != L:
            raise ValueError(f"{len(self.sampling)} sampling records for {L} logits rows")
        tree = (self.kv_positions, self.attn_lo, self.attn_mask)
        if any(a is not None for a in tree) and any(a is None or len(a) != n for a in tree):
            raise ValueError("kv_positions, attn_lo and attn_mask: all three, one per row")


@dataclass(frozen=True)
class StepOutput:
    token_ids: np.ndarray                      # (L,) int32, one per logits row
    logprobs: tuple[TokenLogprob | None, ...]  # per row; None where not asked


class ModelRunner:
    def __init__(self, model: Transformer, n_slots: int, n_ctx: int):
        self.model, be = model, model.backend
        M, L = model.max_tokens, model.max_logits
        self.sizes = be.step_sizes(M)
        self._o_rows, self._o_par = 6 * M, 6 * M + L
        n_words = 6 * M + L + L * N_PARAMS
        self._host = be.host_buffer(n_words)                      # (W,) i32 pinned on CUDA
        self._dev = be.zeros((n_words,), "int32")                 # (W,) i32
        self._out_host = be.host_buffer(L * OUT_WORDS)            # (L * OUT_WORDS,) i32
        self._out_dev = be.zeros((L * OUT_WORDS,), "int32")       # (L * OUT_WORDS,) i32
        self.hist = be.zeros((n_slots, n_ctx), "int32")           # (n_slots, n_ctx) i32
        self._params = self._dev[self._o_par:].reshape(L, N_PARAMS)   # (L, N_PARAMS) i32
        self._mv_host = be.host_buffer(3 * M)                     # (3M,) i32 pinned on CUDA
        self._mv_dev = be.zeros((3 * M,), "int32")                # (3M,) i32
        self._out = self._out_dev.reshape(L, OUT_WORDS)               # (L, OUT_WORDS) i32
        be.prepare_sampling(L, model.spec.vocab_size)

    def padded(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def _pack(self, inp: StepInput, T: int) -> None:
        n, h, M = len(inp.token_ids), self._host, self.model.max_tokens
        pad = T - n
        h[:T] = 0
        h[pad:T] = inp.token_ids
        h[M:M + T] = 0
        h[M + pad:M + T] = inp.positions
        h[2 * M:2 * M + T] = -1
        h[2 * M + pad:2 * M + T] = inp.slots
        h[3 * M:3 * M + T] = 0                                    # padding: position 0 rows
        h[4 * M:4 * M + T] = 1
        h[5 * M:5 * M + T] = 0
        if inp.kv_positions is None:
            h[3 * M + pad:3 * M + T] = inp.positions
            h[4 * M + pad:4 * M + T] = h[M + pad:M + T] + 1
        else:
            h[3 * M + pad:3 * M + T] = inp.kv_positions
            h[4 * M + pad:4 * M + T] = inp.attn_lo
            h[5 * M + pad:5 * M + T] = np.asarray(inp.attn_mask, np.int64).astype(np.int32)
        L = len(inp.logit_rows)
        h[self._o_rows:self._o_rows + L] = np.asarray(inp.logit_rows, np.int32) + pad
        for r, (row, s) in enumerate(zip(inp.logit_rows, inp.sampling, strict=True)):
            o = self._o_par + r * N_PARAMS
            h[o:o + N_PARAMS] = param_record(
                temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
                penalty=s.repetition_penalty, repeat_last_n=s.repeat_last_n, seed=s.seed,
                token_index=s.token_index, n_top=min(s.n_top, TOP_MAX),
                slot=int(inp.slots[row]), position=int(inp.positions[row]))

    def step(self, inp: StepInput) -> StepOutput:
        model, be = self.model, self.model.backend
        M = model.max_tokens
        inp.check(M, model.max_logits)
        T, L = self.padded(len(inp.token_ids)), len(inp.logit_rows)
        self._pack(inp, T)
        be.upload_step(self._host, self._dev)
        ids, pos = self._dev[:T], self._dev[M:M + T]                  # (T,) i32 each
        slots = self._dev[2 * M:2 * M + T]                            # (T,) i32
        tree = [self._dev[o * M:o * M + T] for o in (3, 4, 5)]        # 3 x (T,) i32
        params, out, hist = self._params[:L], self._out[:L], self.hist

        def choose(logits) -> None:
            be.record_tokens(ids, slots, pos, hist)
            if L:
                be.sample(logits, params, hist, out)

        kv_rows = inp.kv_positions if inp.kv_positions is not None else inp.positions
        kv_len = max(max(inp.positions), max(kv_rows)) + 1
        model.forward(ids, pos, slots, kv_len, L, choose, *tree)
        be.download_step(self._out_dev[:L * OUT_WORDS], self._out_host)
        res = self._out_host[:L * OUT_WORDS].reshape(L, OUT_WORDS)
        return StepOutput(res[:, 0].copy(), tuple(
            _logprob(res[r], s.n_top) for r, s in enumerate(inp.sampling)))

    def write_history(self, slot: int, tokens: Sequence[int]) -> None:
        """hist[slot, :n] = tokens: the token history of positions whose KV rows a sequence
        took from the prefix cache (the repetition penalty's window reads it)."""
        n = len(tokens)
        self.model.backend.upload_ints(np.asarray(tokens, np.int32), self.hist[slot, :n])

    def set_block_table(self, host) -> None:
        """The model's KV block table (n_slots, max_blocks) int32, for the next steps."""
        self.model.set_block_table(host)

    def move_kv(self, slots: Sequence[int], src: Sequence[int], dst: Sequence[int]) -> None:
        """KV rows src[m] -> dst[m] of slot slots[m], for every layer, in order (one upload,
        one kv_move op). At most max_tokens moves."""
        n, M, h = len(src), self.model.max_tokens, self._mv_host
        if not 0 < n <= M or len(slots) != n or len(dst) != n:
            raise ValueError(f"{n} KV moves (at most {M}), {len(slots)} slots, {len(dst)} dst")
        h[:n], h[M:M + n], h[2 * M:2 * M + n] = slots, src, dst
        be = self.model.backend
        be.upload_step(h, self._mv_dev)
        be.kv_move(self.model.cache, self._mv_dev[:n], self._mv_dev[M:M + n],
                   self._mv_dev[2 * M:2 * M + n])


def _logprob(rec: np.ndarray, n_top: int) -> TokenLogprob | None:
    if n_top < 0:
        return None
    f = rec.view(np.float32)
    n = min(n_top, TOP_MAX)
    top = tuple((int(rec[2 + i]), float(f[2 + TOP_MAX + i])) for i in range(n)
                if rec[2 + i] >= 0)
    return TokenLogprob(token_id=int(rec[0]), logprob=float(f[1]), top=top)
