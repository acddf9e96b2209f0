"""The step ABI: what one model step holds (StepInput), how each of its logits rows chooses a
token (RowSampling), and what comes back (StepOutput).

The scheduler's plan and the drafters describe their steps in these types; the model runner
(model_runner.py) pads, packs, runs and reads them back. A row chooses its token with a
request's SamplingParams, its seed resolved, the draw's counter (the index of the token the row
produces), the log-probabilities asked, where its generated tokens start in the token history
(the frequency / presence penalties count them there) and its sparse logit adjustments
(`Adjustment`: logit_bias, and the bans of min_tokens); its parameter record is
step_format.param_record's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from operator import attrgetter

import numpy as np

from service.backends.step_format import TOP_MAX, Param, param_record, read_output
from service.engine.types import SamplingParams, TokenLogprob


@dataclass(frozen=True, eq=False)
class Adjustment:
    """One row's sparse additive logit adjustments: pairs (n, 2) int32 of [token id, delta f32
    bits], unique ids ascending (the sample op adds delta to the id's logit after the
    penalties). Compared by identity: rows of one sequence share theirs in a step's list."""

    pairs: np.ndarray             # (n, 2) int32

    @classmethod
    def of(cls, bias: Sequence[tuple[int, float]], banned: Sequence[int] = ()
           ) -> Adjustment | None:
        """bias (token id, delta) with the banned ids' deltas -inf; None when both are empty."""
        deltas = {int(t): np.float32(b) for t, b in bias}
        deltas.update((int(t), np.float32(-np.inf)) for t in banned)
        if not deltas:
            return None
        ids = np.array(sorted(deltas), np.int32)                          # (n,) i32
        pairs = np.empty((ids.size, 2), np.int32)                         # (n, 2) i32
        pairs[:, 0] = ids
        pairs[:, 1] = np.array([deltas[int(i)] for i in ids], np.float32).view(np.int32)
        return cls(pairs)


@dataclass(frozen=True)
class RowSampling(SamplingParams):
    """How one logits row chooses its token: the request's sampling (temperature 0 = greedy
    argmax) with `seed` resolved (an int; None reads as 0), and the draw's place."""

    token_index: int = 0          # the draw's counter: tokens generated before this one
    n_top: int = -1               # -1: no log-probabilities; else chosen + n_top alternatives
    gen_start: int = 0            # position of the first generated token (the prompt length)
    adjust: Adjustment | None = None   # logit_bias and min_tokens bans; None: none
    score_id: int = -1            # >= 0: report this token's log-probability (a prompt token's)
    # structured output: allowed tokens, (MASK_WORDS,) int32 bits; None: all
    mask: np.ndarray | None = field(default=None, compare=False)

    @classmethod
    def of(cls, p: SamplingParams, seed: int, token_index: int, n_top: int,
           gen_start: int = 0, adjust: Adjustment | None = None) -> RowSampling:
        """Request sampling `p` with its resolved `seed`, for the draw `token_index`."""
        given = {name: getattr(p, name) for name in _SAMPLING_FIELDS}
        return cls(**{**given, "seed": seed}, token_index=token_index, n_top=n_top,
                   gen_start=gen_start, adjust=adjust)

    def at(self, token_index: int, adjust: Adjustment | None, mask: np.ndarray | None = None
           ) -> RowSampling:
        """This row for the draw `token_index` with `adjust` and `mask`: a copy of its fields
        without dataclass construction (a sequence's rows of every step are copies of one
        template, built once per request)."""
        row = object.__new__(RowSampling)
        d = row.__dict__
        d.update(self.__dict__)
        d["token_index"], d["adjust"], d["mask"] = token_index, adjust, mask
        return row

    def static_record(self) -> np.ndarray:
        """The words of this row's parameter record that depend on the request alone, (N_PARAMS,)
        int32 with TOKEN_INDEX, SLOT, POSITION, ADJ_START, ADJ_COUNT and MASK 0 (`record`
        sets them; the runner packs a step's rows from these, ModelRunner._pack). Built once
        per distinct set of the fields it reads (a bounded cache shared by every row); do not
        write into it."""
        key = _static_key(self)
        rec = _STATIC.get(key)
        if rec is None:
            rec = np.array(replace(self, token_index=0, adjust=None, mask=None).record(0, 0),
                           np.int32)                                     # (N_PARAMS,) i32
            rec.flags.writeable = False
            if len(_STATIC) >= STATIC_CACHE_MAX:
                _STATIC.clear()
            _STATIC[key] = rec
        return rec

    def record(self, slot: int, position: int, adj_start: int = 0, mask_row: int = -1
               ) -> list[int]:
        """The sample op's parameter record (N_PARAMS int32) of this row, whose token history
        is row `slot` of the history, whose own token is at `position` and whose adjustment
        pairs start at `adj_start` of the step's list."""
        return param_record(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
            min_p=self.min_p, penalty=self.repetition_penalty,
            repeat_last_n=self.repeat_last_n, seed=self.seed or 0,
            token_index=self.token_index, n_top=min(self.n_top, TOP_MAX), slot=slot,
            position=position, frequency=self.frequency_penalty,
            presence=self.presence_penalty, gen_start=self.gen_start, adj_start=adj_start,
            adj_count=0 if self.adjust is None else len(self.adjust.pairs),
            score=self.score_id, mask=mask_row if self.mask is not None else -1)


_SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))
# the fields RowSampling.record reads but for the draw's and place's words (DYNAMIC_WORDS):
# the key of the static records' cache (0.0 and -0.0 share an entry: the sample op only
# compares and multiplies these floats, where the two are alike)
_static_key = attrgetter("temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                         "repeat_last_n", "seed", "n_top", "frequency_penalty",
                         "presence_penalty", "gen_start", "score_id")
_STATIC: dict[tuple, np.ndarray] = {}
STATIC_CACHE_MAX = 1 << 14      # distinct requests' records kept (then the cache starts over)
# the record words a row's draw and place set (the rest: RowSampling.static_record)
DYNAMIC_WORDS = (Param.TOKEN_INDEX, Param.SLOT, Param.POSITION, Param.ADJ_START, Param.ADJ_COUNT,
                 Param.MASK)

# every filter off: the argmax, the lowest id on ties
GREEDY = RowSampling(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                     repeat_last_n=0, seed=0)


@dataclass(frozen=True)
class StepInput:
    """One step: n rows (1 <= n <= max tokens) and the rows that need a token chosen.

    logit_rows must be the last rows, in order (the transformer computes logits for the last
    rows of a step); sampling holds one RowSampling per logits row. kv_positions, attn_lo and
    attn_mask (all three or none) describe tree verify rows (service/engine/spec/
    tree_verify.py); None: ordinary causal rows.

    segments: the step is several runs of consecutive rows (segments[j] rows each, in order:
    prompts' chunks) that the runner pads and the model computes each as a step of its own
    (model/transformer.Segmented); logit_rows are then runs' last rows, in order, at most one
    per run. Ordinary rows only; None: one run."""

    token_ids: Sequence[int]
    positions: Sequence[int]
    slots: Sequence[int]          # -1 = padding row
    logit_rows: Sequence[int] = ()
    sampling: Sequence[RowSampling] = ()
    kv_positions: Sequence[int] | None = None     # KV row each row writes (default: position)
    attn_lo: Sequence[int] | None = None          # sees rows [0, attn_lo) (default: position+1)
    attn_mask: Sequence[int] | None = None        # ... and attn_lo + bit for each set bit
    hidden: bool = False          # copy the runner's hidden-state tap rows (model/hidden.py)
    segments: Sequence[int] | None = None         # rows of each run of a segmented step

    def check(self, max_tokens: int, max_logits: int) -> None:
        n = len(self.token_ids)
        if not 1 <= n <= max_tokens or len(self.positions) != n or len(self.slots) != n:
            raise ValueError(f"step of {n} ids / {len(self.positions)} positions / "
                             f"{len(self.slots)} slots (max {max_tokens})")
        L = len(self.logit_rows)
        if self.segments is not None:
            self._check_segments(n, L, max_logits)
        elif L > max_logits or list(self.logit_rows) != list(range(n - L, n)):
            raise ValueError(f"logits rows {list(self.logit_rows)} must be the last rows of "
                             f"the step (at most {max_logits})")
        if len(self.sampling) != L:
            raise ValueError(f"{len(self.sampling)} sampling records for {L} logits rows")
        tree = (self.kv_positions, self.attn_lo, self.attn_mask)
        if any(a is not None for a in tree) and any(a is None or len(a) != n for a in tree):
            raise ValueError("kv_positions, attn_lo and attn_mask: all three, one per row")

    def _check_segments(self, n: int, L: int, max_logits: int) -> None:
        runs = list(self.segments)
        if not runs or min(runs) < 1 or sum(runs) != n:
            raise ValueError(f"segments {runs} must be positive row counts adding up to {n}")
        ends = set(np.cumsum(runs) - 1)
        rows = list(self.logit_rows)
        if L > max_logits or not set(rows) <= ends or rows != sorted(set(rows)):
            raise ValueError(f"logits rows {rows} of a segmented step must be runs' last rows, "
                             f"in order (at most {max_logits})")
        if self.kv_positions is not None or self.hidden:
            raise ValueError("a segmented step holds ordinary rows and copies no hidden states")


@dataclass(frozen=True)
class StepOutput:
    token_ids: np.ndarray                      # (L,) int32, one per logits row
    logprobs: tuple[TokenLogprob | None, ...]  # per row; None where not asked

    @classmethod
    def from_records(cls, rec: np.ndarray, rows: Sequence[RowSampling]) -> StepOutput:
        """The output records (L, OUT_WORDS) int32 of rows chosen as `rows`."""
        return cls(rec[:, 0].copy(), tuple(_logprob(r, s.n_top) for r, s in zip(rec, rows,
                                                                                 strict=True)))


def _logprob(rec: np.ndarray, n_top: int) -> TokenLogprob | None:
    if n_top < 0:
        return None
    token, logprob, top = read_output(rec, n_top)
    return TokenLogprob(token_id=token, logprob=logprob, top=top)
