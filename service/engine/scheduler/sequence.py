"""Per-request decoding state and the pure bookkeeping around one sequence's tokens.

A `Sequence` knows its prompt, its KV slot, how many positions are committed (KV rows written),
the *seed* (the last chosen token, not yet fed to the model), what it has emitted, and when it
must stop. The engine feeds it model outputs; it turns them into events.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import structlog

from service.engine.constraint import advance_rows, allowed, dead_end
from service.engine.runner.step import Adjustment
from service.engine.spec.width import DepthAcceptance
from service.engine.textstream import TextStream
from service.engine.types import (
    Delta,
    Finished,
    FinishReason,
    GenerationRequest,
    Started,
    Timings,
    TokenLogprob,
    Usage,
)

log = structlog.get_logger("specstream.engine")

# A refused unmasked choice costs two rows (the refused one and the void one fed from it), a
# masked row a few percent of a step: after a refusal a sequence commits MIN_MASK_BACKOFF
# tokens from masked rows, each further refusal multiplies that wait by MASK_BACKOFF_GROWTH (up
# to MAX_MASK_BACKOFF), and each kept unmasked choice eases it back by one.
MIN_MASK_BACKOFF, MAX_MASK_BACKOFF, MASK_BACKOFF_GROWTH = 8, 1024, 4


@dataclass
class Sequence:
    request: GenerationRequest
    sink: object                          # Callable[[Event], None]
    seed_value: int
    text: TextStream
    eog_ids: frozenset[int]
    n_ctx: int
    speculative: bool
    verify_width: int = 1                 # rows a chain verify step may hold (seed + drafts)
    tree_budget: int = 0                  # > 0: tree verify with this many nodes per step
    matcher: Any = None                   # engine/constraint.Matcher of a constrained request
    # after its mask refused an overlapped unmasked choice (engine/overlap.py): tokens to commit
    # from masked rows first, and the next such wait (MASK_BACKOFF_GROWTH times per refusal)
    mask_wait: int = 0
    mask_backoff: int = MIN_MASK_BACKOFF
    slot: int = -1
    n_past: int = 0                       # committed KV rows
    seed: int | None = None               # last chosen token, KV row not yet written
    generated: list[int] = field(default_factory=list)
    history: list[int] = field(default_factory=list)   # prompt + generated (drafting, penalty)
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    accept_rate: float = 0.6              # running acceptance of this sequence's drafts
    steps_without_draft: int = 0
    depth_accept: DepthAcceptance = field(default_factory=DepthAcceptance)  # spec/width.py
    tree_gain: float | None = None        # running accepted nodes per tree step (None: no tree yet)
    decode_steps: int = 0                 # target steps after the prompt that held it
    step_tokens: int = 0                  # tokens those steps committed (accepted drafts + 1)
    step_ms: list[float] = field(default_factory=lambda: [0.0] * 4)  # stepprofile.PARTS
    last_turn: int = -1                   # the decode step that last held this sequence
    cached_prompt_tokens: int = 0         # prompt positions taken from the prefix cache
    preemptions: int = 0                  # times its KV blocks were taken back (recomputed)
    # (first position, rows) of each wide step (more than MAX_STEP_ROWS rows: another numeric
    # path) that computed its KV rows: what its blocks' prefix-cache hashes say (chunks.py)
    wide: list[tuple[int, int]] = field(default_factory=list)
    ticket: int = 0                       # arrival order in the scheduler's queue
    cancelled: bool = False
    finished: bool = False
    t_submit: float = field(default_factory=time.perf_counter)
    t_start: float = 0.0
    t_prefill_done: float = 0.0
    t_first: float = 0.0
    t_last: float = 0.0

    def __post_init__(self) -> None:
        self.history = list(self.request.prompt_ids)
        self._adjust: tuple[Adjustment | None, Adjustment | None] | None = None
        self.row_template: Any = None      # spec/decode.choice's RowSampling, made once
        # prompt position p -> log-probability of prompt token p + 1, while scoring the prompt
        self.prompt_scores: dict[int, TokenLogprob] | None = None
        # constrained: row_masks[i] is the token mask after the committed tokens and the first
        # i tokens of the draft being verified (row_masks[0]: the next token's; None until
        # asked for when an overlapped commit skipped its fill: engine/overlap.py)
        self.row_masks: list = [self.matcher.first_mask()] if self.matcher is not None else []

    def row_mask(self, ahead: int):
        """The token mask of the draw `ahead` tokens after the next one; None: unconstrained."""
        if self.matcher is None:
            return None
        if ahead >= len(self.row_masks):
            raise RuntimeError("a constrained row's mask is not known yet (overlapped step?)")
        if ahead == 0 and self.row_masks[0] is None:    # filled now, at the committed tokens
            self.row_masks[0] = self.matcher.mask()
        return self.row_masks[ahead]

    @property
    def unmasked_exact(self) -> bool:
        """Whether its choice made without the constraint's mask equals the masked choice
        whenever the mask allows it: greedy (the argmax over all tokens, lowest id on ties, is
        the argmax over the allowed ones when allowed) without log-probabilities (they would
        be normalized over all tokens)."""
        return self.request.sampling.greedy and not self.request.top_logprobs

    def refused_unmasked(self) -> None:
        """Its mask refused the choice an overlapped row made without it: a sequence whose
        unmasked choices keep failing (the model writes what the constraint forbids) costs
        three rows per token overlapped, so it commits its next tokens from masked rows (a wait
        of 8, then 32, 128, ... up to 1024 per refusal, easing by 1 with each choice kept)."""
        self.mask_wait = self.mask_backoff
        self.mask_backoff = min(MAX_MASK_BACKOFF, MASK_BACKOFF_GROWTH * self.mask_backoff)

    def kept_unmasked(self) -> None:
        """An overlapped choice made without its mask was allowed."""
        self.mask_backoff = max(MIN_MASK_BACKOFF, self.mask_backoff - 1)

    def constrain_draft(self, drafts: list[int]) -> list[int]:
        """The longest prefix of `drafts` the constraint allows, with row_masks extended along
        it (the matcher advances over the drafts, then rolls back: it stays at the committed
        tokens). A draft after which the constraint allows nothing (a dead end) is cut too:
        its verify row would draw from an empty mask; plain decoding's row before it may still
        choose it, and the commit then ends the sequence (CONSTRAINT_DEAD_END)."""
        m, kept = self.matcher, []
        del self.row_masks[1:]
        self.row_mask(0)
        for d in drafts:
            mask = self.row_masks[-1]
            if d in self.eog_ids or not allowed(mask, d) or not m.accept(d):
                break
            nxt = m.mask()
            if dead_end(nxt):
                m.rollback(1)
                break
            kept.append(d)
            self.row_masks.append(nxt)
            if m.done(nxt):
                break
        m.rollback(len(kept))
        return kept

    def adjustment(self, token_index: int) -> Adjustment | None:
        """The sparse logit adjustment of the draw `token_index`: logit_bias, with the ids that
        would end the generation (EOS unless ignore_eos, stop_token_ids) at -inf while
        token_index < min_tokens. Built once per request (two shared objects)."""
        if self._adjust is None:
            stop, bias = self.request.stopping, self.request.sampling.logit_bias
            banned = sorted(set(stop.stop_token_ids)
                            | (set() if stop.ignore_eos else set(self.eog_ids)))
            self._adjust = (Adjustment.of(bias),
                            Adjustment.of(bias, banned) if stop.min_tokens else None)
        return self._adjust[token_index < self.request.stopping.min_tokens]

    def send(self, event) -> None:
        """Hand an event to the request's sink. A sink that fails means its consumer is gone
        (e.g. the server's event loop closed): the request is cancelled, the engine goes on."""
        try:
            self.sink(event)
        except Exception:
            self.cancelled = True

    def record_verify(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.draft_tokens += drafted
            self.accepted_draft_tokens += accepted
            self.accept_rate = 0.7 * self.accept_rate + 0.3 * (accepted / drafted)
            self.depth_accept.record(drafted, accepted)

    def record_tree(self, nodes: int, accepted: int) -> None:
        """A tree step of `nodes` drafted nodes accepted `accepted` of them (the path)."""
        self.record_verify(nodes, accepted)
        if nodes:
            self.tree_gain = (float(accepted) if self.tree_gain is None
                              else 0.7 * self.tree_gain + 0.3 * accepted)

    def count_step(self, committed: int) -> None:
        """One decode step committed `committed` KV rows (the seed and the accepted drafts)."""
        self.decode_steps += 1
        self.step_tokens += committed

    @property
    def context_ids(self) -> Seq[int]:
        """The tokens whose KV rows must be written before the next decode step: the prompt,
        or after a preemption everything but the seed (the last chosen token)."""
        return self.request.prompt_ids if self.seed is None else self.history[:-1]

    @property
    def prefill_left(self) -> int:
        """Positions still to compute before decoding (the prompt, or a preempted sequence's
        recomputation); 0 while decoding."""
        n = len(self.request.prompt_ids) if self.seed is None else len(self.history) - 1
        return max(0, n - self.n_past)

    @property
    def scoring_prompt(self) -> bool:
        """Whether its prompt's log-probabilities are still to compute (every prompt position
        then runs, none taken from the prefix cache)."""
        return self.request.prompt_logprobs is not None and self.prompt_scores is not None

    def start(self, slot: int, n_cached: int = 0) -> None:
        """Take `slot` with its first `n_cached` positions' KV rows already in place (prefix
        cache). The first start sends Started (with prompt log-probabilities: once they are
        computed, `scored`); a resumption after a preemption sends nothing."""
        self.slot, self.n_past = slot, n_cached
        # rows from n_cached on are computed again: spans reaching them no longer describe them
        self.wide = [(s, n) for s, n in self.wide if s + n <= n_cached]
        if self.t_start:
            return
        self.cached_prompt_tokens = n_cached
        self.t_start = time.perf_counter()
        if self.request.prompt_logprobs is None:
            self.send(Started(prompt_tokens=len(self.request.prompt_ids), seed=self.seed_value))
        else:
            self.prompt_scores = {}

    def scored(self) -> None:
        """Every prompt position's log-probability is in prompt_scores: send Started."""
        scores, self.prompt_scores = self.prompt_scores or {}, None
        self.send(Started(prompt_tokens=len(self.request.prompt_ids), seed=self.seed_value,
                          prompt_logprobs=tuple(scores[p] for p in sorted(scores))))

    def computed(self, start: int, rows: int, wide_rows: int) -> None:
        """A step computed its KV rows [start, start + rows): a wide one (more than wide_rows
        rows) is remembered for its blocks' hashes."""
        if rows > wide_rows:
            self.wide.append((start, rows))

    def preempt(self) -> None:
        """Its KV blocks were taken back: it waits again and recomputes its context."""
        self.slot, self.n_past = -1, 0
        self.preemptions += 1

    # ------------------------------------------------------------------ committing tokens
    def emit(self, tokens: list[int], logprobs: Seq[TokenLogprob | None] = ()) -> None:
        """Commit chosen tokens in order, stopping at the first stop condition. logprobs: the
        model runner's record per token (when the request asked for them)."""
        now = time.perf_counter()
        if not self.generated:
            self.t_first = now
        self.t_last = now
        stop = self.request.stopping
        out_ids: list[int] = []
        out_lp: list[TokenLogprob] = []
        reason, matched = None, None
        text_parts: list[str] = []
        for i, tok in enumerate(tokens):
            # Every generated id is reported (an end token too, as llama.cpp does); only
            # displayable text goes into `text`.
            self.generated.append(tok)
            self.history.append(tok)
            out_ids.append(tok)
            if self.request.top_logprobs and i < len(logprobs) and logprobs[i] is not None:
                out_lp.append(logprobs[i])
            # stop sequences count from token min_tokens on (earlier text is emitted as is)
            self.text.armed = len(self.generated) > stop.min_tokens
            if tok in self.eog_ids and not stop.ignore_eos:
                reason = FinishReason.EOS
                break
            if tok in stop.stop_token_ids:
                reason, matched = FinishReason.STOP_TOKEN, tok
                break
            constraint_end = self._advance(tok) if self.matcher is not None else None
            piece, hit = self.text.push([tok])
            text_parts.append(piece)
            if hit is not None:
                reason, matched = FinishReason.STOP_SEQUENCE, hit
                break
            if constraint_end is not None:
                reason = constraint_end
                break
            if len(self.generated) >= stop.max_new_tokens:
                reason = FinishReason.LENGTH
                break
            if len(self.request.prompt_ids) + len(self.generated) >= self.n_ctx:
                reason = FinishReason.CONTEXT_LIMIT
                break
        if reason is not None and reason is not FinishReason.STOP_SEQUENCE:
            text_parts.append(self.text.finish())
        text = "".join(text_parts)
        if out_ids or text:
            self.send(Delta(tuple(out_ids), text, tuple(out_lp)))
        if reason is not None:
            self.finish(reason, matched)
        else:
            self.seed = tokens[-1]

    def _advance(self, tok: int) -> FinishReason | None:
        """The matcher takes a committed token; CONSTRAINT when the constraint is complete and
        nothing but an end token may follow, CONSTRAINT_DEAD_END when nothing may follow (not
        even an end token), None while it goes on."""
        m = self.matcher
        self.mask_wait = max(0, self.mask_wait - 1)
        if m.ahead == tok:              # accepted with the step's rows (advance_constrained)
            m.ahead = None
            mask = self.row_masks[0]
            if mask is None:            # fill skipped: the next commit checks (overlap.py)
                return FinishReason.CONSTRAINT if m.terminated else None
        else:
            if not m.accept(tok):
                raise RuntimeError(f"token {tok} outside the constraint's mask was committed")
            mask = m.mask()
            self.row_masks = [mask]
        return self.constraint_end(mask)

    def constraint_end(self, mask) -> FinishReason | None:
        """After the committed tokens, whose next-token mask is `mask`: CONSTRAINT when the
        constraint is complete and nothing but an end token may follow, CONSTRAINT_DEAD_END
        when nothing may follow, None while it goes on."""
        m = self.matcher
        if m.terminated or m.done(mask):
            return FinishReason.CONSTRAINT
        return FinishReason.CONSTRAINT_DEAD_END if dead_end(mask) else None

    def advances(self, tok: int) -> bool:
        """Whether committing `tok` as its next token advances its matcher (emit's order: an
        end or stop id ends the sequence before the constraint sees it)."""
        return (self.matcher is not None and not self.finished
                and not (tok in self.eog_ids and not self.request.stopping.ignore_eos)
                and tok not in self.request.stopping.stop_token_ids)

    def constraint_failed(self, exc: Exception) -> None:
        """Its matcher raised (xgrammar): this request ends with ERROR, logged; the others of
        its step go on."""
        log.error("constraint_failed", request_id=self.request.request_id, exc_info=exc)
        self.finish(FinishReason.ERROR, error=f"constraint: {type(exc).__name__}: {exc}")

    def end_after_commits(self, reason: FinishReason) -> None:
        """Finish as emit would have after its last token: the text held back sent first."""
        text = self.text.finish()
        if text:
            self.send(Delta((), text, ()))
        self.finish(reason)

    def finish(self, reason: FinishReason, matched=None, error: str | None = None) -> None:
        if self.finished:
            return
        self.finished = True
        now = time.perf_counter()
        n = len(self.generated)
        started = self.t_start or now
        first = self.t_first or now
        decode_ms = (self.t_last - first) * 1e3 if n > 1 else 0.0
        timings = Timings(
            queue_ms=(started - self.t_submit) * 1e3,
            time_to_first_token_ms=(first - self.t_submit) * 1e3 if self.t_first else 0.0,
            prefill_ms=((self.t_prefill_done or now) - started) * 1e3,
            decode_ms=decode_ms,
            per_token_decode_ms=decode_ms / (n - 1) if n > 1 else 0.0,
            draft_ms=self.step_ms[0], heads_ms=self.step_ms[1], verify_ms=self.step_ms[2],
            other_ms=self.step_ms[3],
        )
        steps = self.decode_steps
        usage = Usage(prompt_tokens=len(self.request.prompt_ids), completion_tokens=n,
                      draft_tokens=self.draft_tokens,
                      accepted_draft_tokens=self.accepted_draft_tokens, decode_steps=steps,
                      mean_tokens_per_step=self.step_tokens / steps if steps else 0.0,
                      cached_prompt_tokens=self.cached_prompt_tokens)
        self.send(Finished(reason, usage, timings, matched, error))


def advance_constrained(commits: list[tuple[Sequence, int]],
                        lazy: frozenset[int] | set[int] = frozenset()) -> None:
    """A step's constrained sequences each about to commit one token (`commits`: sequence, its
    token): their matchers accept the tokens and fill their next masks in one batch
    (constraint.advance_rows), before the emits, which then find their masks ready. The
    sequences whose id() is in `lazy` skip the fill (row_masks [None]): their next token,
    already chosen without a mask, is checked by accepting it (engine/overlap.py). When the
    batch fails, each row is tried alone: a row that fails again ends its request with ERROR
    (finished: its caller commits nothing more of it), the others go on as they would."""
    commits = [(s, t) for s, t in commits if s.advances(t)]
    if not commits:
        return
    try:
        _advance_batch(commits, lazy)
    except Exception:       # one matcher's failure ends its own request, not its step's
        for one in commits:
            try:
                _advance_batch([one], lazy)
            except Exception as exc:
                one[0].constraint_failed(exc)


def _advance_batch(commits: list[tuple[Sequence, int]], lazy: frozenset[int] | set[int]) -> None:
    """advance_constrained's batch (a matcher that accepted its token before a fill failed
    is not asked to accept it again: its `ahead` says so)."""
    masks, filled = advance_rows([s.matcher for s, _ in commits], [t for _, t in commits],
                                 [id(s) not in lazy for s, _ in commits])       # (n, W)
    for (seq, _), mask, full in zip(commits, masks, filled, strict=True):
        if seq.matcher.ahead is not None:
            seq.row_masks = [mask if full else None]
