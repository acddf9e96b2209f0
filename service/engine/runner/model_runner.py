"""The model runner: one step in, token ids out, for the target model and every draft model.

Whoever plans a step decides *what* runs (a StepInput: rows of token ids, positions, KV slots,
which rows need a token chosen and how); the runner decides *how*:

1. pads the step to the next of the backend's step sizes (`Backend.step_sizes`: 1, 2, 4, 8, 16,
   then the largest step; the CPU backend, which captures nothing, uses multiples of 16 past
   16) with padding rows (slot -1, id 0, position 0) placed FIRST, so the rows that need logits
   stay the last rows, as the transformer computes them;
2. writes everything into one host int32 buffer (pinned on CUDA) and uploads it with ONE copy;
   the device buffer is sliced into the int32 views the model and the sample op read, at offsets
   fixed at load time (so a captured graph finds them at the same addresses every step);
3. runs the transformer, records the step's ids in the token history and samples every logits
   row on the backend, all inside one `run_step` (one graph per (padded T, n_logits));
4. reads back only the int32 output records with ONE copy and one wait (`read`; `step` is
   `launch` then `read`): the whole records where log-probabilities are asked or a step chose
   several rows, else only the chosen ids.

The overlapped loop (engine.py) uses `submit` and `collect` instead: `submit` queues the step's
readback right behind it and returns at once, so step k + 1 can be submitted before step k is
collected, its rows' ids fed on the device from step k's choices (`feed`: the output record
each row reads its id from, backends' feed_ids, before the step runs). At most two submitted
steps are outstanding; they alternate between two host input buffers and two host output
buffers, so the host never rewrites a buffer a queued copy still reads. A step submitted with
`masks_later` (logits rows whose structured-output masks depend on the token of the step before
it, still in flight) runs the model without the sample op (its own graph per shape, keyed
"sample later"); `sample(pending, masks)` then uploads those rows' masks and runs the sample op
over the step's logits (a graph per logits count) and queues the readback, while the device
may still be running the step's model: the host fills the masks meanwhile.

Layout of the packed step buffer (int32 words; M = max tokens, L = max logits rows):
    [0, M) ids | [M, 2M) positions | [2M, 3M) slots | [3M, 4M) KV rows written | [4M, 5M)
    attn_lo | [5M, 6M) attn_mask (tree verify rows, backends/base.py; an ordinary row has KV row
    = position, attn_lo = position + 1, mask 0) | [6M, 6M + L) logits rows (indices into the
    padded step) | [6M + L, 6M + L + L * N_PARAMS) per-row sampling records (step_format.Param)
    | then M words: each row's fed id source (written and read only for a fed step; -1 = its id)

A runner's kind (RunnerKind) says what its model's steps need. The target's (TARGET) records
every step's ids in the token history (the repetition penalty's window) and passes every row's
KV row and attention bounds, so its attention takes one path whatever the step holds. A draft
model's (DRAFT) keeps no history, gives the backend ordinary rows only (it may pick its fastest
attention) and runs greedy chains: after a launched step whose last row chose d1, `chain` runs
n single-token forwards as ONE backend step (Transformer.forward_chain), each reading the
previous choice on the device and choosing the next (service/engine/spec/draft_model.py). A
`logits_hook(ids, logits)` (a drafter's Markov head) runs on the logits before every choice.

Rows with logit adjustments (logit_bias, min_tokens bans: RowSampling.adjust) put their pairs
in a separate adjustment list (K, 2) int32 (step_format.py), uploaded with a second copy only
when some row of the step has pairs (rows of one sequence that share an Adjustment share its
pairs), so steps without them pay nothing; it too alternates between two host buffers.
Rows with a structured-output token mask (RowSampling.mask) put it in the step's mask list
(L, MASK_WORDS) int32 at their own row index (record word MASK; -1 for the others), uploaded
with one more copy only when some row has a mask; the list is always passed to the sample op,
so a captured graph serves steps with and without masks.

A runner built with a hidden-state tap (`hidden`, service/model/hidden.py: the residual rows at
the layers a drafter names) owns its device buffer (R, P * E) f32; a step with
StepInput.hidden copies its rows there inside the step (its own graph per shape: steps without
it run their graphs unchanged), and `hidden_states(inp)` is the view of that step's real rows.
There is one buffer: the next step with a tap overwrites it, so its reader runs before that.

KV row moves (tree compaction, `move_kv`) go through a second small host buffer of 3M words
(slots | sources | destinations), also uploaded with one copy, then one kv_move op.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from service.backends.step_format import ADJ_ROW_MAX, N_PARAMS, OUT_WORDS, Param, mask_words
from service.engine.runner.step import GREEDY, RowSampling, StepInput, StepOutput
from service.model.hidden import HiddenOut, HiddenRows, HiddenTap
from service.model.transformer import Segmented, Transformer


@dataclass(frozen=True)
class RunnerKind:
    """What a model's steps need beyond ids, positions and slots."""

    history: bool = True          # record step ids in the token history (the penalty reads it)
    explicit_rows: bool = True    # pass every row's KV row and attention bounds, always
    chains: bool = False          # run greedy chains (`chain`): a draft model


TARGET = RunnerKind()
DRAFT = RunnerKind(history=False, explicit_rows=False, chains=True)


@dataclass
class Pending:
    """A submitted step whose choices are on their way to the host (`collect` them); one
    submitted with `masks_later` is sampled by `sample` first."""

    rows: tuple[RowSampling, ...]
    host: np.ndarray          # its output words (whole records, or the chosen ids)
    src: Any                  # the device words they come from
    ticket: Any = None        # the backend's queued download (once sampled)
    masks_later: tuple[int, ...] = ()   # logits rows whose token masks `sample` brings
    sampled: bool = True      # False until `sample` ran (a step with masks_later)
    n_rows: int = 0           # the padded step's rows (the logits hook reads their ids)


class ModelRunner:
    def __init__(self, model: Transformer, n_slots: int, n_ctx: int, kind: RunnerKind = TARGET,
                 logits_hook: Callable | None = None, hidden: HiddenTap | None = None):
        self.model, self.kind, self.logits_hook = model, kind, logits_hook
        self.n_ctx = n_ctx
        be, M, L = model.backend, model.max_tokens, model.max_logits
        self._hidden: HiddenOut | None = None
        if hidden is not None:
            hidden.check(model.spec.n_layer)
            self._hidden = HiddenOut(hidden, be.zeros(                # (R, P * E) f32
                (hidden.capacity(M, L), hidden.width(model.spec.n_embd))))
        self.sizes = be.step_sizes(M)
        self._o_rows, self._o_par = 6 * M, 6 * M + L
        self._o_feed = 6 * M + L + L * N_PARAMS
        n_words = self._o_feed + M
        # (W,) i32 pinned on CUDA, two of each: a submitted step's and the next one's
        self._hosts = (be.host_buffer(n_words), be.host_buffer(n_words))
        self._dev = be.zeros((n_words,), "int32")                 # (W,) i32
        n_out = max(L, M) if kind.chains else L                   # a chain chooses up to M
        self._out_hosts = (be.host_buffer(n_out * OUT_WORDS),     # (n_out * OUT_WORDS,) i32
                           be.host_buffer(n_out * OUT_WORDS))
        self._flip = 0                # which pair the next submitted step uses
        self._pending: deque[Pending] = deque()
        self._out_dev = be.zeros((n_out * OUT_WORDS,), "int32")   # (n_out * OUT_WORDS,) i32
        self._out = self._out_dev.reshape(n_out, OUT_WORDS)       # (n_out, OUT_WORDS) i32
        # (n_slots, n_ctx) i32 token history; without history one entry no record reads
        self.hist = be.zeros((n_slots, n_ctx) if kind.history else (1, 1), "int32")
        self._params = self._dev[self._o_par:self._o_feed].reshape(L, N_PARAMS)   # (L, N_PARAMS)
        # (K, 2) i32 logit adjustment pairs, K = L * ADJ_ROW_MAX, two host buffers as above
        self._adj_cap = max(1, L) * ADJ_ROW_MAX
        self._adj_hosts = (be.host_buffer(2 * self._adj_cap), be.host_buffer(2 * self._adj_cap))
        self._adj_dev = be.zeros((2 * self._adj_cap,), "int32")          # (2K,) i32
        self._adj = self._adj_dev.reshape(self._adj_cap, 2)               # (K, 2) i32
        # (L, MASK_WORDS) i32 structured-output token masks, two host buffers as above
        self._mask_w = mask_words(model.spec.vocab_size)
        self._mask_hosts = (be.host_buffer(max(1, L) * self._mask_w),
                            be.host_buffer(max(1, L) * self._mask_w))
        self._mask_dev = be.zeros((max(1, L) * self._mask_w,), "int32")
        self._masks = self._mask_dev.reshape(max(1, L), self._mask_w)
        self._mv_host = be.host_buffer(3 * M)                     # (3M,) i32 pinned on CUDA
        self._mv_dev = be.zeros((3 * M,), "int32")                # (3M,) i32
        if kind.chains:
            # positions | slots | one sampling record: its own host buffer, since the launched
            # step's stays in use until the readback
            self._chain_host = be.host_buffer(2 * M + N_PARAMS)           # (2M + N_PARAMS,)
            self._chain_dev = be.zeros((2 * M + N_PARAMS,), "int32")      # (2M + N_PARAMS,)
            self._chain_ids = be.zeros((M,), "int32")    # (M,) i32 d1..dk, written on device
        self._launched = False        # a step not read back yet (its host buffer is in use)
        # called once a step is packed and uploaded, before the model runs (the engine's
        # iteration profile charges the packing to its own part); None: nothing
        self.on_packed: Callable[[], None] | None = None
        self._chained = False         # ... followed by a chain (its ids are in _chain_ids)
        be.prepare_sampling(L, model.spec.vocab_size)

    def padded(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def _explicit(self, inp: StepInput) -> bool:
        return self.kind.explicit_rows or inp.kv_positions is not None

    def _layout(self, inp: StepInput) -> tuple[int, Any, Segmented | None]:
        """The padded step's size T, where its rows go (a slice of the padded rows, or their
        indices in a segmented step) and, for a segmented step, its runs: each run padded to
        its own step size with its padding rows first, as a step of that run alone is."""
        n = len(inp.token_ids)
        if inp.segments is None:
            T = self.padded(n)
            return T, slice(T - n, T), None
        where, runs, T, r = [], [], 0, 0
        kv = np.asarray(inp.positions)
        for k in inp.segments:
            size = self.padded(k)
            where.extend(range(T + size - k, T + size))
            runs.append((T, T + size, int(kv[r:r + k].max()) + 1))
            T, r = T + size, r + k
        where = np.asarray(where, np.int64)                               # (n,) padded rows
        return T, where, Segmented(tuple(runs), tuple(int(where[i]) for i in inp.logit_rows))

    def _pack(self, inp: StepInput, T: int, rows, h, feed: Sequence[int] | None) -> None:
        """The step into host buffer h: its rows at `rows` of the padded T (_layout), the
        padding rows' words around them."""
        M = self.model.max_tokens
        h[:T] = 0
        h[:T][rows] = inp.token_ids
        h[M:M + T] = 0
        h[M:M + T][rows] = inp.positions
        h[2 * M:2 * M + T] = -1
        h[2 * M:2 * M + T][rows] = inp.slots
        if self._explicit(inp):
            h[3 * M:3 * M + T] = 0                                # padding: position 0 rows
            h[4 * M:4 * M + T] = 1
            h[5 * M:5 * M + T] = 0
        if inp.kv_positions is None and self.kind.explicit_rows:
            h[3 * M:3 * M + T][rows] = inp.positions
            h[4 * M:4 * M + T][rows] = h[M:M + T][rows] + 1
        elif inp.kv_positions is not None:
            h[3 * M:3 * M + T][rows] = inp.kv_positions
            h[4 * M:4 * M + T][rows] = inp.attn_lo
            h[5 * M:5 * M + T][rows] = np.asarray(inp.attn_mask, np.int64).astype(np.int32)
        L = len(inp.logit_rows)
        at = np.asarray(inp.logit_rows, np.int64)
        h[self._o_rows:self._o_rows + L] = at + rows.start if isinstance(rows, slice) \
            else rows[at]
        self._pack_records(inp, h[self._o_par:self._o_par + L * N_PARAMS].reshape(L, N_PARAMS))
        if feed is not None:
            f = self._o_feed
            h[f:f + T] = -1
            h[f:f + T][rows] = feed

    def _pack_records(self, inp: StepInput, rec: np.ndarray) -> None:
        """The logits rows' parameter records into `rec` (L, N_PARAMS) int32, as arrays over the
        rows: each row's static words (RowSampling.static_record, built once per request), then
        the words its draw and place set; equal to each row's RowSampling.record."""
        rows = inp.sampling
        if not rows:
            return
        starts = self._pack_adjustments(rows)
        self._pack_masks(rows)
        rec[:] = [s.static_record() for s in rows]
        rec[:, Param.TOKEN_INDEX] = [s.token_index for s in rows]
        if self.kind.history:
            at = np.asarray(inp.logit_rows)                               # (L,) step rows
            rec[:, Param.SLOT] = np.asarray(inp.slots)[at]
            rec[:, Param.POSITION] = np.asarray(inp.positions)[at]
        else:
            rec[:, Param.SLOT] = rec[:, Param.POSITION] = 0
        rec[:, Param.ADJ_START] = starts
        rec[:, Param.ADJ_COUNT] = [0 if s.adjust is None else len(s.adjust.pairs) for s in rows]
        rec[:, Param.MASK] = [-1 if s.mask is None else r for r, s in enumerate(rows)]

    def _pack_adjustments(self, rows: Sequence[RowSampling]) -> list[int]:
        """Write the rows' adjustment pairs into the current host list (each Adjustment once)
        and upload them; returns each row's first pair."""
        h = self._adj_hosts[self._flip]
        starts, placed, n = [0] * len(rows), {}, 0
        for r, s in enumerate(rows):
            if s.adjust is None:
                continue
            key = id(s.adjust)
            if key not in placed:
                k = len(s.adjust.pairs)
                if n + k > self._adj_cap:
                    raise ValueError(f"logit adjustments of {n + k} pairs exceed the step's "
                                     f"{self._adj_cap}")
                h[2 * n:2 * (n + k)] = s.adjust.pairs.reshape(-1)
                placed[key], n = n, n + k
            starts[r] = placed[key]
        if n:
            self.model.backend.upload_step(h[:2 * n], self._adj_dev[:2 * n])
        return starts

    def _pack_masks(self, rows: Sequence[RowSampling]) -> None:
        """Write the masked rows' token masks (row r at mask row r) into the current host list
        and upload them; nothing when no row has one (the others' records say MASK = -1)."""
        if all(s.mask is None for s in rows):
            return
        W, h = self._mask_w, self._mask_hosts[self._flip]
        top = 0
        for r, s in enumerate(rows):
            if s.mask is not None:
                h[r * W:(r + 1) * W] = s.mask
                top = r + 1
        self.model.backend.upload_step(h[:top * W], self._mask_dev[:top * W])

    def warm_steps(self, max_rows: int, later_rows: int = 0) -> int:
        """Run every decode and chain-verify step shape of up to `max_rows` rows (each row a
        logits row: (padded n, n) for n = 1..max_rows; with a hidden-state tap also tapped)
        twice at slot 0, positions 0..n-1, so a backend that captures step graphs has loaded,
        captured and replayed each one before a request needs it (the first prefill that uses
        slot 0 rewrites its rows). `later_rows`: also the shapes of up to that many rows as
        the overlapped loop runs them for rows sampled once their masks come (the model
        without its sample op, then the sample op of n rows: two graphs of their own; one row
        a sequence there, so up to the slots), so constrained streams ending one by one meet
        no new shape either. Returns the steps run."""
        n_max = max(0, min(max_rows, self.model.max_logits, self.model.max_tokens, self.n_ctx))
        taps = (False, True) if self._hidden is not None else (False,)
        every = np.full(self._mask_w, -1, np.int32)         # (W,) i32: every token allowed

        def rows(n: int, hidden: bool = False) -> StepInput:    # slot 0, positions 0..n-1
            return StepInput(list(range(1, n + 1)), list(range(n)), [0] * n, list(range(n)),
                             [GREEDY] * n, hidden=hidden)
        for n in range(1, n_max + 1):
            for hidden in taps:                 # a drafter's tapped steps are shapes of their own
                for _ in range(2):              # first use (eager), then the capture
                    self.step(rows(n, hidden))
            if n <= later_rows:
                inp = rows(n)
                for _ in range(2):
                    pending = self.submit(inp, None, range(n))
                    self.sample(pending, [every] * n)
                    self.collect(pending)
        return 2 * len(taps) * n_max + 2 * min(n_max, max(0, later_rows))

    def step(self, inp: StepInput) -> StepOutput:
        """Run one step and read its choices back."""
        self.launch(inp)
        return self.read(inp.sampling)

    def launch(self, inp: StepInput) -> None:
        """Pack, upload and run one step; its choices stay on the device until `read` (a step
        launched after another waits for it first: both use one host buffer)."""
        if self._pending:
            raise RuntimeError(f"launch with {len(self._pending)} submitted steps not collected")
        if self._launched:
            self.read(())
        self._run(inp, self._hosts[self._flip], None)
        self._launched = True

    def submit(self, inp: StepInput, feed: Sequence[int] | None = None,
               masks_later: Sequence[int] = ()) -> Pending:
        """Run one step and queue its readback; returns at once (`collect` waits). feed[r] >= 0:
        row r's id is the choice of output record feed[r] of the step submitted just before
        (still uncollected or not), taken on the device; -1: inp.token_ids[r]. masks_later:
        logits rows (their RowSampling without a mask) whose token masks `sample` brings: the
        step then runs without its sample op until `sample`."""
        if self._launched:
            raise RuntimeError("submit after a launched step that was not read")
        if len(self._pending) > 1:
            raise RuntimeError("two submitted steps are already outstanding: collect one")
        if feed is not None and len(feed) != len(inp.token_ids):
            raise ValueError(f"{len(feed)} fed rows for a step of {len(inp.token_ids)}")
        later = tuple(masks_later)
        if later and (list(later) != sorted(set(later)) or later[0] < 0
                      or later[-1] >= len(inp.sampling)
                      or any(inp.sampling[r].mask is not None for r in later)):
            raise ValueError(f"masks_later {list(later)}: distinct logits rows in order, "
                             "whose rows carry no mask")
        self._flip ^= 1
        T = self._run(inp, self._hosts[self._flip], feed, later)
        rows = tuple(inp.sampling)
        src, host = self._readback(rows)
        pending = Pending(rows, host, src, masks_later=later, n_rows=T, sampled=not later)
        if not later:
            pending.ticket = self.model.backend.queue_download(src, host)
        self._pending.append(pending)
        return pending

    def sample(self, pending: Pending, masks: Sequence[Any]) -> None:
        """The sample op of a step submitted with masks_later, the newest submitted one:
        masks[i] ((MASK_WORDS,) int32) is logits row masks_later[i]'s token mask; then its
        readback is queued."""
        if not self._pending or self._pending[-1] is not pending or pending.sampled:
            raise RuntimeError("sample the newest submitted step, once, when it waits for masks")
        if len(masks) != len(pending.masks_later):
            raise ValueError(f"{len(masks)} masks for rows {list(pending.masks_later)}")
        be, W, h = self.model.backend, self._mask_w, self._mask_hosts[self._flip]
        for r, m in zip(pending.masks_later, masks, strict=True):
            h[r * W:(r + 1) * W] = m
        top = (pending.masks_later[-1] + 1) * W
        be.upload_step(h[:top], self._mask_dev[:top])
        L, T = len(pending.rows), pending.n_rows
        logits, ids = self.model.ws_logits[:L], self._dev[:T]             # (L, V), (T,)
        params, out, hook = self._params[:L], self._out[:L], self.logits_hook

        def choose() -> None:
            if hook is not None:
                hook(ids, logits)
            be.sample(logits, params, self.hist, self._adj, out, self._masks)

        be.run_step((L, "sample"), (logits, params, out, self.hist, self._adj, self._masks),
                    choose)
        pending.ticket = be.queue_download(pending.src, pending.host)
        pending.sampled = True

    def collect(self, pending: Pending) -> StepOutput:
        """Wait for the oldest submitted step (`pending`) and return its choices."""
        if not self._pending or self._pending[0] is not pending:
            raise RuntimeError("collect the submitted steps in the order they were submitted")
        if not pending.sampled:
            raise RuntimeError("a step submitted with masks_later is collected after `sample`")
        self._pending.popleft()
        self.model.backend.wait_download(pending.ticket)
        return self._output(pending.host, pending.rows)

    def abandon(self) -> None:
        """Forget the submitted steps (a step failed): wait for the queued work, read nothing."""
        while self._pending:
            p = self._pending.popleft()
            if p.sampled:
                self.model.backend.wait_download(p.ticket)
            else:                     # never sampled: wait for the queued work itself
                self.model.backend.synchronize()

    @property
    def outstanding(self) -> int:
        """Submitted steps not collected yet."""
        return len(self._pending)

    def _run(self, inp: StepInput, h, feed: Sequence[int] | None,
             masks_later: tuple[int, ...] = ()) -> int:
        """Pack `inp` into host buffer h, upload it, feed its ids, run the model and sample
        (not the rows' sample op with masks_later: `sample` runs it). Returns the padded
        step's rows."""
        model, be = self.model, self.model.backend
        M = model.max_tokens
        inp.check(M, model.max_logits)
        T, rows, segments = self._layout(inp)
        L = len(inp.logit_rows)
        if T > M:
            raise ValueError(f"a segmented step of {T} padded rows exceeds the model's {M}")
        self._pack(inp, T, rows, h, feed)
        for r in masks_later:           # their masks come with `sample`, at their own rows
            h[self._o_par + r * N_PARAMS + Param.MASK] = r
        be.upload_step(h, self._dev)
        if self.on_packed is not None:
            self.on_packed()
        ids, pos = self._dev[:T], self._dev[M:M + T]                  # (T,) i32 each
        if feed is not None:
            be.feed_ids(self._out, self._dev[self._o_feed:self._o_feed + T], ids)
        slots = self._dev[2 * M:2 * M + T]                            # (T,) i32
        tree = ([self._dev[o * M:o * M + T] for o in (3, 4, 5)]       # 3 x (T,) i32
                if self._explicit(inp) else [])
        params, out, hist, adj = self._params[:L], self._out[:L], self.hist, self._adj
        masks = self._masks      # always passed (a captured graph keeps its arguments)
        history, hook = self.kind.history, self.logits_hook
        sampled = L and not masks_later

        def choose(logits) -> None:                                   # logits (L, V) f32
            if history:
                be.record_tokens(ids, slots, pos, hist)
            if sampled:
                if hook is not None:
                    hook(ids, logits)
                be.sample(logits, params, hist, adj, out, masks)

        kv_rows = inp.kv_positions if inp.kv_positions is not None else inp.positions
        kv_len = max(max(inp.positions), max(kv_rows)) + 1
        model.forward(ids, pos, slots, kv_len, L, choose if history or sampled else None,
                      *tree, hidden=self._tap(inp), segments=segments,
                      tag="sample later" if masks_later else None)
        return T

    def _tap(self, inp: StepInput) -> HiddenOut | None:
        if not inp.hidden:
            return None
        if self._hidden is None:
            raise ValueError("a step asks for hidden states of a runner built without a tap")
        return self._hidden

    @property
    def hidden_tap(self) -> HiddenTap | None:
        """The runner's hidden-state tap (None: its steps copy no hidden states)."""
        return None if self._hidden is None else self._hidden.tap

    def hidden_states(self, inp: StepInput):
        """The device rows (R, P * E) f32 that step `inp` (run with hidden=True, the last such
        step) copied: one per row of inp (ALL) or per logits row (LOGITS), in row order."""
        if self._hidden is None:
            raise ValueError("a runner built without a hidden-state tap has no hidden states")
        n, buf = len(inp.token_ids), self._hidden.buf
        if self._hidden.tap.rows is HiddenRows.LOGITS:
            return buf[:len(inp.logit_rows)]
        T = self.padded(n)                # padding rows come first
        return buf[T - n:T]

    def chain(self, start: int, n: int, slot: int, row: RowSampling) -> None:
        """After a launched step whose last row chose d1 (output record 0, on the device): n
        single-token forwards as ONE backend step; forward i (0..n-1) runs d_{i+1} at position
        start + i of `slot` and chooses d_{i+2} with `row` into output record i + 1, whose id
        the next forward reads on the device. `read` then returns d1..d_{n+1}."""
        model, be, M = self.model, self.model.backend, self.model.max_tokens
        if not self.kind.chains or not self._launched or not 1 <= n < M:
            raise ValueError(f"a chain of {n} needs a runner of kind DRAFT, a launched step "
                             f"and n < {M}")
        c = self._chain_host
        c[:n] = np.arange(start, start + n, dtype=np.int32)
        c[M:M + n] = slot
        c[2 * M:] = row.record(0, 0)
        be.upload_step(c, self._chain_dev)
        pos, slots = self._chain_dev[:n], self._chain_dev[M:M + n]     # (n,) i32 each
        params = self._chain_dev[2 * M:].reshape(1, N_PARAMS)           # (1, N_PARAMS) i32
        ids, out, hook = self._chain_ids, self._out, self.logits_hook   # (M,), (n_out, W)

        def first() -> None:
            be.chosen_ids(out[:1], ids[:1])                             # d1

        def choose(i: int, logits) -> None:                             # logits (1, V) f32
            if hook is not None:
                hook(ids[i:i + 1], logits)
            be.sample(logits, params, self.hist, self._adj, out[i + 1:i + 2])
            be.chosen_ids(out[i + 1:i + 2], ids[i + 1:i + 2])           # d_{i+2}

        model.forward_chain(ids[:n], pos, slots, range(start + 1, start + n + 1), choose, first)
        self._chained = True

    def read(self, rows: Sequence[RowSampling]) -> StepOutput:
        """Wait for what was launched and read the choices of output records 0..n-1, row r
        chosen as rows[r] (no rows: only wait)."""
        src, host = self._readback(rows)
        self.model.backend.download_step(src, host)
        self._launched = self._chained = False
        return self._output(host, rows)

    def _readback(self, rows: Sequence[RowSampling]) -> tuple[Any, np.ndarray]:
        """The device words holding the choices of output records 0..n-1 and the host buffer
        of the current pair they go to: whole records where log-probabilities are asked or
        several rows chose (a chain's ids instead after a chain), else record 0's id."""
        n = len(rows)
        if any(r.n_top >= 0 for r in rows) or (n > 1 and not self._chained):
            src = self._out_dev[:n * OUT_WORDS]                       # (n * OUT_WORDS,) i32
        elif n > 1:
            src = self._chain_ids[:n]                                 # (n,) i32 the chain's
        else:
            src = self._out_dev[:n]                                   # (n,) i32 record 0's id
        return src, self._out_hosts[self._flip][:src.size]

    @staticmethod
    def _output(host, rows: Sequence[RowSampling]) -> StepOutput:
        n = len(rows)
        if host.size == n:
            return StepOutput(host.copy(), (None,) * n)
        return StepOutput.from_records(host.reshape(n, OUT_WORDS), rows)

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
