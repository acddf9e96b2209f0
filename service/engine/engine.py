"""The engine: one thread that owns the model and batches every running request into its steps.

Its parts, each owning its state:
    Scheduler (scheduler/policy.py)   the queue, the running sequences, their KV slots and blocks
                                      (scheduler/kv.py, scheduler/blocks.py), and the policy
    ModelRunner (runner/)             packs, uploads, runs and reads back one step (StepInput)
    Speculator (spec/decode.py)       the drafter: each decode row's drafts; verify rows, commits

One iteration of the engine thread, under its lock until the plan is made:

    cancelled requests leave -> plan = scheduler.schedule() (admission, the decode rows and
    their draft lengths, the prefill chunks riding with them and the wide step's chunks, KV
    blocks and preemptions) -> the plan's slot changes reach the drafter -> [lock released] the
    changed block table goes to the target's and the draft model's runners -> the speculator
    drafts each decode row, ONE runner step verifies every decode row and computes the riding
    chunks (mixed.py), each sequence commits what it accepted (tree paths' KV rows compacted
    with one runner.move_kv) and each chunk what it computed (a prompt's last chunk emits the
    first token) -> the wide step: one chunk as its own runner step, or several prompts' chunks
    as ONE segmented step (each computed as in a step of its own) -> finished sequences give
    their slot back.

When every row of the step is a plain decode row (nothing drafted, no chunk riding),
OverlappedDecode (overlap.py) runs it and the steps after it, each submitted before the
previous one is read back, for as long as nothing else wants a step and no row would draft
(config `overlap`: by default on asynchronous backends; off under the step profiler).

The policy is scheduler/policy.py's docstring. Every row chooses its token with the request's
own sampling keyed by (request seed, token index), never by its row in a step: a request's
tokens do not depend on its batch, and speculative output equals plain output (spec/chain.py).
A step that fails is retried one sequence (and one chunk) at a time (nothing was committed),
so a fault fails only its request. A cancelled request's slot and blocks are free within one
step. Events go to each request's sink on this thread; sinks must not block. Loading lives in
loader.py.
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import structlog

from service.config import MAX_STEP_ROWS, EngineConfig, step_budget
from service.engine.kv_events import KvEventLog
from service.engine.loader import ModelInfo, load_model, phase
from service.engine.mixed import chunk_choices, mixed_input, segmented_input, split_mixed
from service.engine.overlap import OverlappedDecode
from service.engine.runner.model_runner import ModelRunner
from service.engine.runner.step import GREEDY, RowSampling, StepInput, StepOutput
from service.engine.sampling import resolve_seed
from service.engine.scheduler.blocks import BlockPool
from service.engine.scheduler.kv import KVManager
from service.engine.scheduler.plan import DecodeRow, PrefillChunk, StepPlan
from service.engine.scheduler.policy import Scheduler
from service.engine.scheduler.sequence import Sequence
from service.engine.spec.decode import Draft, Speculator, advance_plain, choice, commit
from service.engine.spec.drafters import Drafter, create_drafter
from service.engine.spec.options import resolve as resolve_speculation
from service.engine.spec.tree_verify import compact, n_rows
from service.engine.spec.verify_cost import alpha_of, measure_row_costs, measure_verify_alpha
from service.engine.stepprofile import (
    DRAFTING,
    EMIT,
    HEADS,
    IDLE,
    LOOP,
    OTHER,
    PACK,
    READBACK,
    SCHEDULE,
    STEP,
    VERIFY,
    StepStats,
    StepTimer,
)
from service.engine.textstream import TextStream
from service.engine.types import (
    Event,
    Finished,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    StoppingCriteria,
    TokenLogprob,
)
from service.errors import InvalidRequestError, UnavailableError
from service.gguf.reader import GGUFFile
from service.model.chat import ChatPrompt, chat_prompt, chat_prompt_text, template_for
from service.model.spec import ModelSpec
from service.model.tokenizer import Tokenizer
from service.model.transformer import Transformer

__all__ = ["Engine", "RequestHandle", "StepStats"]

log = structlog.get_logger("specstream.engine")

DRAFT_COST_WEIGHT = 0.3   # weight of each step's drafting time in the running costs
DRAFT_COST_MAX = 8.0      # plain steps per draft a draft_cost sample counts at most
PROBE_COST_MAX = 100.0    # plain steps a probe_cost sample counts at most


def _running(mean: float, sample: float, n: int) -> float:
    """A running mean's next value: the first sample itself, then DRAFT_COST_WEIGHT of each."""
    return sample if n == 0 else (1.0 - DRAFT_COST_WEIGHT) * mean + DRAFT_COST_WEIGHT * sample


class RequestHandle:
    def __init__(self, engine: Engine, seq: Sequence):
        self._engine, self._seq = engine, seq
        self.request_id = seq.request.request_id

    def cancel(self) -> None:
        """Stop this request within one engine step; its sink gets Finished(CANCELLED)."""
        self._seq.cancelled = True
        self._engine._wake()


class Engine:
    def __init__(self, path: Path, gguf: GGUFFile, spec: ModelSpec, tokenizer: Tokenizer,
                 model: Transformer, config: EngineConfig, backend_name: str,
                 chat_template: str | None = None, drafter: Drafter | None = None):
        self.path, self.spec, self.tokenizer, self.model = path, spec, tokenizer, model
        self.config = config
        self.speculator = Speculator(drafter or create_drafter(
            config.drafter, config.ngram_size, config.suffix_cache_tokens))
        # (text) the configured template, else the model's own; None: chat input is refused
        self.chat_template = template_for(gguf.metadata, chat_template)
        self.info = ModelInfo(
            name=spec.name, path=str(path), architecture=spec.arch, file_type=spec.file_type,
            n_params=spec.n_params, n_ctx_train=spec.n_ctx_train, n_ctx=config.n_ctx,
            vocab_size=spec.vocab_size, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id,
            eog_ids=tuple(sorted(tokenizer.eog_ids)),
            chat_template=self.chat_template, backend=backend_name,
            drafter=config.drafter, draft_model=getattr(self.drafter, "model_name", ""),
            kv_cache_type_k=config.kv_cache_type_k,
            kv_cache_type_v=config.kv_cache_type_v, n_layer=spec.n_layer, n_embd=spec.n_embd)
        self._lock = threading.Condition()      # guards the scheduler's queue and sequences
        self._thread: threading.Thread | None = None
        self.failure: str | None = None   # why the engine thread died, if it did
        self._ready = threading.Event()
        self._stopping = False
        # a drafter reading the target's hidden states (EAGLE-3) gets them from tapped steps
        self.runner = ModelRunner(model, config.n_slots, config.n_ctx,
                                  hidden=self.drafter.tap if self.drafter else None)
        self.runner.on_packed = lambda: self._lap(PACK)     # the iteration profile's part
        # rows of one decode step (the backends' step-size-invariant width, within the model's
        # workspace) and the fixed prefill chunk, under config.max_step_tokens
        rows, chunk = step_budget(config)
        cache = model.cache
        self.kv_events = KvEventLog(cache.block_size)   # the prefix cache's changes
        pool = BlockPool(cache.n_blocks, cache.block_size, config.n_slots, cache.max_blocks,
                         config.prefix_cache, observer=self.kv_events,
                         exact_prefix=config.prefix_cache_exact)
        self.scheduler = Scheduler(KVManager(pool, config.n_slots), n_ctx=config.n_ctx,
                                   max_queue=config.max_queue, prefill_chunk=chunk,
                                   step_rows=min(rows, model.max_tokens, model.max_logits),
                                   wide_rows=min(chunk, model.max_tokens),
                                   padded=self.runner.padded)
        self.stats = StepStats()
        # the overlap pays where steps run asynchronously (a GPU); "on" forces it (tests)
        self.overlap = config.overlap == "on" or (config.overlap == "auto"
                                                  and model.backend.asynchronous)
        self._tapped: StepInput | None = None    # the last step run, for Speculator.extend
        # drafting time per drafted token relative to a plain step (scheduler.draft_cost):
        # learned from the drafts unless set (draft_cost, verify_alpha); the plain step's
        # seconds are measured at start
        self._plain_step_s = 0.0
        self._draft_cost_set = False
        self._draft_samples = 0
        self._probe_samples = 0
        self._drafted_last: set[int] = set()     # the sequences the last step drafted for
        self.overlapped = OverlappedDecode(self.runner, self.scheduler, self.speculator,
                                           self._lock, lambda: self.stats, self._release)

    # ------------------------------------------------------------------ construction
    @classmethod
    def load(cls, model_path: str | Path, config: EngineConfig,
             chat_template: str = "") -> Engine:
        """`chat_template`: a built-in template's name or a Jinja file ('' = the model's own)."""
        m = load_model(model_path, config, chat_template)
        return cls(m.path, m.gguf, m.spec, m.tokenizer, m.model, m.config, m.backend_name,
                   m.chat_template, m.drafter)

    # ------------------------------------------------------------------ public API
    @property
    def queue_depth(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def active(self) -> int:
        return len(self.scheduler.running)

    @property
    def pool(self) -> BlockPool:
        """The KV block pool (metrics, tests)."""
        return self.scheduler.kv.pool

    @property
    def _free_slots(self) -> list[int]:
        """The KV slots no sequence holds (tests check that every one comes back)."""
        return self.scheduler.kv.free_slots

    @property
    def drafter(self) -> Drafter | None:
        return self.speculator.drafter

    @drafter.setter
    def drafter(self, drafter: Drafter | None) -> None:
        self.speculator.drafter = drafter

    @property
    def verify_alpha(self) -> float:
        """Cost of each extra verified token relative to a plain step (the draft lengths')."""
        return self.scheduler.verify_alpha

    @verify_alpha.setter
    def verify_alpha(self, alpha: float) -> None:
        """Weigh drafts by 1 + alpha * (rows - 1) from now on, making them taken as free (a
        measured table is dropped, the drafting cost set to 0: alpha 0 drafts in full; set
        draft_cost to None after it to learn the drafting cost again)."""
        self.scheduler.verify_alpha = alpha
        self.scheduler.row_costs = []
        self.draft_cost = 0.0

    @property
    def draft_cost(self) -> float:
        """The time of making one draft relative to a plain step, which the width policy adds
        per draft (learned from the drafter's timings, spec/width.py)."""
        return self.scheduler.draft_cost

    @draft_cost.setter
    def draft_cost(self, cost: float | None) -> None:
        """A fixed drafting cost from now on (per draft and per probe); None: learn both from
        the drafts again."""
        self._draft_cost_set = cost is not None
        if cost is not None:
            self.scheduler.draft_cost = self.scheduler.probe_cost = cost

    @property
    def row_costs(self) -> list[float]:
        """The measured cost of a step of R rows relative to one row, by R (empty: the linear
        model of verify_alpha); set after verify_alpha to share a table between engines."""
        return self.scheduler.row_costs

    @row_costs.setter
    def row_costs(self, cost: list[float]) -> None:
        self.scheduler.row_costs = list(cost)

    @property
    def healthy(self) -> bool:
        """False once the engine thread has died (health checks turn NOT_SERVING)."""
        return self.failure is None and (self._thread is None or self._thread.is_alive()
                                         or self._stopping)

    def start(self) -> None:
        """Start the engine thread; returns once it has measured its verify cost and waits
        for work (so nothing else touches the model while it measures)."""
        if self._thread is None:
            self._stopping = False
            self._ready.clear()
            self._thread = threading.Thread(target=self._run, name="specstream-engine",
                                            daemon=True)
            self._thread.start()
            self._ready.wait()

    def stop(self, timeout: float | None = None) -> None:
        """Cancel everything still queued or running, then join the engine thread."""
        with self._lock:
            self._stopping = True
            for seq in self.scheduler.sequences:
                seq.cancelled = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def submit(self, request: GenerationRequest, sink: Callable[[Event], None]) -> RequestHandle:
        request.validate(self.spec.vocab_size, self.config.n_ctx)
        if not request.request_id:
            request = replace(request, request_id=uuid.uuid4().hex)
        seq = self._new_sequence(request, sink)
        with self._lock:
            if self._stopping or self._thread is None or not self.healthy:
                raise UnavailableError("the engine is not running"
                                       + (f" ({self.failure})" if self.failure else ""))
            self.scheduler.add(seq)
            self._lock.notify_all()
        return RequestHandle(self, seq)

    def generate(self, request: GenerationRequest, timeout: float | None = None
                 ) -> Iterator[Event]:
        """Submit and yield the request's events in order (for CLIs and tests)."""
        q: queue.Queue = queue.Queue()
        handle = self.submit(request, q.put)
        try:
            while True:
                event = q.get(timeout=timeout)
                yield event
                if isinstance(event, Finished):
                    return
        finally:
            handle.cancel()

    def chat_prompt_ids(self, messages: list[dict[str, str]],
                        content_special: bool = False) -> list[int]:
        """Messages rendered with the chat template, then tokenized as llama.cpp does (message
        content as text unless content_special); ChatTemplateMissingError when there is none."""
        return self.chat_prompt(messages, content_special).ids(self.tokenizer)

    def chat_prompt(self, messages: list[dict[str, str]],
                    content_special: bool = False) -> ChatPrompt:
        """The render chat_prompt_ids tokenizes (the server checks its length first)."""
        return chat_prompt(self.tokenizer, self.chat_template, messages, content_special)

    def chat_prompt_text(self, messages: list[dict[str, str]]) -> str:
        """The rendered text, message content as given."""
        return chat_prompt_text(self.tokenizer, self.chat_template, messages)

    def text_prompt_ids(self, text: str) -> list[int]:
        """Plain text tokenized as llama.cpp does: BOS per metadata, special tokens parsed."""
        return self.tokenizer.encode(text, parse_special=True)

    def warmup(self) -> None:
        """One short greedy generation through the whole path (JIT, caches, first pages)."""
        prompt = (self.tokenizer.bos_id or 0, 1, 2, 3)
        req = GenerationRequest("warmup", tuple(t % self.spec.vocab_size for t in prompt),
                                SamplingParams(temperature=0.0),
                                StoppingCriteria(max_new_tokens=2, ignore_eos=True))
        t0 = time.perf_counter()
        for _ in self.generate(req, timeout=600):
            pass
        phase("warmup", t0)

    def _new_sequence(self, request: GenerationRequest, sink) -> Sequence:
        spec = request.speculation or resolve_speculation(
            request.speculative, request.speculative_options, self.config,
            self.drafter is not None, request.sampling.repetition_penalty,
            request.sampling.reads_history)
        matcher = None
        if request.constraint is not None:
            if spec.on and spec.tree_budget:
                raise InvalidRequestError("speculative.mode", "tree speculation cannot be "
                                          "used with a constraint; use chain or off")
            from service.engine.constraint import Matcher, compile_constraint
            compiled = request.compiled_constraint       # the front end's, made once
            if compiled is None or compiled.constraint != request.constraint:
                compiled = compile_constraint(self.tokenizer, request.constraint,
                                              self.spec.vocab_size)
            matcher = Matcher(compiled, self.spec.vocab_size)
        return Sequence(request=request, sink=sink, matcher=matcher,
                        seed_value=resolve_seed(request.sampling.seed,
                                                request.sampling.greedy),
                        text=TextStream(self.tokenizer, request.stopping.stop_sequences),
                        eog_ids=frozenset(self.tokenizer.eog_ids), n_ctx=self.config.n_ctx,
                        speculative=spec.on, verify_width=spec.verify_width,
                        tree_budget=spec.tree_budget)

    def _wake(self) -> None:
        with self._lock:
            self._lock.notify_all()

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            try:
                rows = min(MAX_STEP_ROWS, self.config.n_slots * max(
                    self.config.verify_width, self.config.tree_budget, 1))
                if self.model.backend.captures_steps:
                    t0 = time.perf_counter()
                    # the overlapped loop's masks-later shapes too (constrained rows)
                    n = self.runner.warm_steps(
                        rows, later_rows=self.config.n_slots if self.overlap else 0)
                    phase("step_graphs", t0, steps=n, graphs=self.model.backend.n_graphs)
                if self.config.verify_width >= 2 and self.drafter is not None:
                    width = self.config.verify_width
                    if self.model.backend.captures_steps:   # replayed steps: every size
                        cost, plain_s = measure_row_costs(self.runner, rows)
                        self.verify_alpha = alpha_of(cost[min(width, len(cost) - 1)], width)
                        self.row_costs = cost
                    else:
                        self.verify_alpha, plain_s = measure_verify_alpha(self.runner, width)
                    self._plain_step_s = plain_s
                    self.draft_cost = None          # learned from the drafts
            finally:
                self._ready.set()
            self._loop()
        except BaseException as exc:   # the loop itself failed: fail every request, loudly
            self.failure = f"{type(exc).__name__}: {exc}"
            log.exception("engine_failed")
            with self._lock:
                doomed = self.scheduler.drain()
            for seq in doomed:
                seq.finish(FinishReason.ERROR, error="the engine stopped: " + self.failure)

    def _loop(self) -> None:
        while True:
            timer = StepTimer() if self.config.step_profile else None
            self._lap(LOOP)
            with self._lock:
                self._reap_cancelled()
                plan = self.scheduler.schedule()
                if plan is None:
                    self.stats.idle()
                    if self._stopping:
                        return
                    self._lock.wait(0.5)
                    self._lap(IDLE)
                    continue
                self.stats.preemptions += plan.preempted
                self.stats.cached_tokens += plan.cached_tokens
                for change in plan.slot_changes:
                    if change.cached:       # the penalty window reads the cached positions
                        self.runner.write_history(change.slot,
                                                  change.seq.context_ids[:change.cached])
                    self.speculator.slot_change(change)
            self._lap(SCHEDULE, iteration=True)
            self._execute(plan, timer)

    def _lap(self, part: int, iteration: bool = False) -> None:
        """Charge the engine thread's time since the last lap to `part` of the iteration
        profile, when a benchmark set one (stepprofile.IterationProfile)."""
        p = self.stats.profile
        if p is not None:
            p.lap(part)
            p.iterations += iteration

    def _execute(self, plan: StepPlan, timer: StepTimer | None) -> None:
        if plan.block_table is not None:    # the draft model shares the target's table
            self.runner.set_block_table(plan.block_table)
            self.speculator.set_block_table(plan.block_table)
        chunks = [c for c in plan.prefill if not c.seq.cancelled]
        if plan.decode or chunks:
            try:
                self._step(plan.decode, chunks, timer)
            except Exception as exc:   # drafting or committing failed: fail the step's requests
                for seq in [r.seq for r in plan.decode] + [c.seq for c in chunks]:
                    self._fail(seq, exc)
        wide = [c for c in plan.wide if not c.seq.cancelled]
        seqs = [c.seq for c in wide]
        if len(wide) > 1 and not any(s.scoring_prompt for s in seqs) \
                and not self.speculator.taps(seqs) and self._prefill_segmented(wide):
            wide = []
        # one chunk, chunks whose steps tap hidden states, or a segmented step that failed
        # before anything was committed: each chunk as a step of its own
        for chunk in wide:
            try:
                self._prefill(chunk)
            except Exception as exc:   # one request's failure must not stop the engine
                self._fail(chunk.seq, exc)
        for seq in plan.sequences:
            if seq.finished:
                self._release(seq)

    def _fail(self, seq: Sequence, exc: Exception) -> None:
        log.error("step_failed", request_id=seq.request.request_id, exc_info=exc)
        seq.finish(FinishReason.ERROR, error=f"{type(exc).__name__}: {exc}")

    def _reap_cancelled(self) -> None:
        for seq in self.scheduler.drop_cancelled():
            seq.finish(FinishReason.CANCELLED)
        for seq in [s for s in self.scheduler.running if s.cancelled]:
            seq.finish(FinishReason.CANCELLED)
            self._release_locked(seq)

    def _release(self, seq: Sequence) -> None:
        with self._lock:
            self._release_locked(seq)

    def _release_locked(self, seq: Sequence) -> None:
        if seq in self.scheduler.running:
            self.speculator.release(seq)
            self.scheduler.release(seq)

    # ------------------------------------------------------------------ steps
    def _step(self, rows: tuple[DecodeRow, ...], chunks: list[PrefillChunk],
              timer: StepTimer | None) -> None:
        """The step: the decode rows' drafts, then ONE runner step verifying every decode row
        with the prefill chunks riding along (mixed.py), then each part's commit. A step that
        fails is retried one part at a time (nothing was committed)."""
        t0 = time.perf_counter()
        try:
            batch = self.speculator.draft(rows, timer)
        except Exception as exc:   # drafting failed: fail its rows; the chunks go on
            for row in rows:
                self._fail(row.seq, exc)
            batch = []
        self._learn_draft_cost(batch, time.perf_counter() - t0)
        self._lap(DRAFTING)
        if (not chunks and self.overlap and timer is None
                and all(isinstance(d, list) and len(d) == 1 for _, d in batch)
                and self.speculator.overlaps([seq for seq, _ in batch])):
            self.overlapped.run([seq for seq, _ in batch])     # plain rows (overlap.py)
            return
        try:
            outs, chunk_outs = self._verify(batch, chunks, timer)
        except Exception as exc:
            if len(batch) + len(chunks) == 1:
                self._fail((batch[0][0] if batch else chunks[0].seq), exc)
                return
            outs, chunk_outs = self._one_by_one(batch, chunks)
        timer = timer if batch else None    # the profile is of decode steps
        if timer is not None:           # before committing: a finishing request reports it
            timer.charge([seq for seq, _ in batch])
        advance_plain(batch, outs)      # constrained rows' next masks, in one batch
        moves = [commit(seq, draft, out) for (seq, draft), out in zip(batch, outs, strict=True)
                 if out is not None and not seq.finished]
        self.stats.kv_moves += compact(self.runner, [m for m in moves if m is not None])
        self.scheduler.trees_verified([seq for seq, d in batch
                                       if seq.tree_budget and n_rows(d) > 1])
        for chunk, out in zip(chunks, chunk_outs, strict=True):
            if out is not False and not chunk.seq.finished:
                self._prefilled(chunk, out)
        self._extend([seq for seq, _ in batch] + [c.seq for c in chunks])
        if timer is not None:
            timer.finish([seq for seq, _ in batch], self.stats.decode_steps,
                         sum(n_rows(d) for _, d in batch))
        self._lap(EMIT)

    def _learn_draft_cost(self, batch: list[tuple[Sequence, Draft]], seconds: float) -> None:
        """Fold this step's drafting time, in plain steps, into draft_cost (per drafted token)
        when every sequence drafting in it also drafted in the step before, else into
        probe_cost (the whole drafting time of the step): a model drafter's first draft of a
        sequence, or its first after plain steps (a probe), also runs the tokens its own model
        has not seen yet (the prompt, the tokens of the plain steps), a cost of starting to
        draft, not of drafting on. Samples are capped (DRAFT_COST_MAX, PROBE_COST_MAX): a
        pause of the process is not the drafter's."""
        drafting = {id(seq) for seq, d in batch if n_rows(d) > 1}
        steady, self._drafted_last = drafting <= self._drafted_last, drafting
        if self._draft_cost_set or self._plain_step_s <= 0.0 or not drafting:
            return
        s, steps = self.scheduler, seconds / self._plain_step_s
        if steady:
            drafted = sum(n_rows(d) - 1 for _, d in batch)
            s.draft_cost = _running(s.draft_cost, min(DRAFT_COST_MAX, steps / drafted),
                                    self._draft_samples)
            self._draft_samples += 1
        else:
            s.probe_cost = _running(s.probe_cost, min(PROBE_COST_MAX, steps),
                                    self._probe_samples)
            self._probe_samples += 1

    def _one_by_one(self, batch: list[tuple[Sequence, Draft]], chunks: list[PrefillChunk]
                    ) -> tuple[list[StepOutput | None], list]:
        """Each decode sequence and each chunk as a step of its own (a shared step failed):
        a part that fails again fails its request (its output None, a chunk's False)."""
        outs: list[StepOutput | None] = []
        for item in batch:
            try:
                outs += self._verify([item], [])[0]
            except Exception as one:
                self._fail(item[0], one)
                outs.append(None)
        chunk_outs: list = []
        for chunk in chunks:
            try:
                chunk_outs += self._verify([], [chunk])[1]
            except Exception as one:
                self._fail(chunk.seq, one)
                chunk_outs.append(False)
        return outs, chunk_outs

    def _verify(self, batch: list[tuple[Sequence, Draft]], chunks: list[PrefillChunk],
                timer: StepTimer | None = None
                ) -> tuple[list[StepOutput], list[StepOutput | None]]:
        """Every row of the batch and of the chunks in one runner step, the output cut per
        sequence and per chunk."""
        if timer is not None:
            timer.lap(OTHER)            # planning (drafting laps itself)
        inp = mixed_input(batch, chunks)
        if self.speculator.taps([seq for seq, _ in batch] + [c.seq for c in chunks]):
            inp = replace(inp, hidden=True)
        self._tapped = inp
        if timer is not None:
            timer.lap(HEADS)
        self.runner.launch(inp)
        self._lap(STEP)
        out = self.runner.read(inp.sampling)
        self._lap(READBACK)
        if timer is not None:
            timer.lap(VERIFY)
        n_chunk = sum(len(c.tokens) for c in chunks)
        self.stats.count_step(len(batch), len(inp.token_ids) - n_chunk, len(chunks), n_chunk)
        return split_mixed(batch, chunks, out)

    def _prefill(self, chunk: PrefillChunk) -> None:
        """A chunk as a step of its own (one wider than a shared step takes); the prompt's last
        chunk chooses its first token."""
        seq = chunk.seq
        if seq.scoring_prompt:
            out = self._prefill_scored(chunk)
        else:
            out = self._forward(seq, chunk.tokens, chunk.start, [choice(seq)] if chunk.choose
                                else [])
            seq.computed(chunk.start, len(chunk.tokens), self.scheduler.chunks.wide_rows)
        self.stats.count_step(0, 0, 1, len(chunk.tokens))
        self._lap(STEP)
        self._prefilled(chunk, out if chunk.choose else None)
        self._extend([seq])
        self._lap(EMIT)

    def _prefill_segmented(self, chunks: list[PrefillChunk]) -> bool:
        """Several prompts' chunks as ONE segmented step (runner/step.py StepInput.segments):
        each chunk's rows, KV rows and first token as in a step of its own (_prefill), each
        weight tile dequantized once for all of them. False when the step failed (nothing
        committed: the caller runs the chunks one at a time, so a fault fails only its
        request)."""
        self._tapped = None
        inp = segmented_input(chunks)
        try:
            out = self.runner.step(inp)
        except Exception as exc:
            log.warning("segmented_step_failed", chunks=len(chunks), error=str(exc))
            return False
        for c in chunks:
            c.seq.computed(c.start, len(c.tokens), self.scheduler.chunks.wide_rows)
        self.stats.count_step(0, 0, len(chunks), len(inp.token_ids))
        self.stats.segmented_steps += 1
        self._lap(STEP)
        for c, part in zip(chunks, chunk_choices(chunks, out), strict=True):
            try:
                self._prefilled(c, part)
            except Exception as exc:   # one request's failure must not stop the engine
                self._fail(c.seq, exc)
        self._lap(EMIT)
        return True

    def _prefilled(self, chunk: PrefillChunk, out: StepOutput | None) -> None:
        """Commit a computed chunk; the prompt's last chunk emits its first token (`out`)."""
        seq = chunk.seq
        seq.n_past += len(chunk.tokens)
        self.scheduler.prefilled(seq)
        if chunk.choose and out is not None:
            if seq.scoring_prompt:
                seq.scored()
            seq.t_prefill_done = time.perf_counter()
            seq.emit([int(out.token_ids[0])], out.logprobs)

    def _prefill_scored(self, chunk: PrefillChunk) -> StepOutput:
        """A prompt chunk whose every row reports the log-probability of the prompt token after
        it (GenerationRequest.prompt_logprobs; the op's SCORE word), in steps of at most
        max_logits rows; the prompt's last row chooses the first token as usual."""
        seq, prompt, k = chunk.seq, chunk.seq.request.prompt_ids, chunk.seq.request.prompt_logprobs
        n, step = len(prompt), self.runner.model.max_logits
        out = StepOutput(np.zeros(0, np.int32), ())
        for s in range(0, len(chunk.tokens), step):
            toks, start = chunk.tokens[s:s + step], chunk.start + s
            where = range(start, start + len(toks))
            out = self._forward(seq, toks, start, [
                replace(GREEDY, n_top=k, score_id=prompt[p + 1]) if p + 1 < n else choice(seq)
                for p in where])
            seq.computed(start, len(toks), self.scheduler.chunks.wide_rows)
            if s + step < len(chunk.tokens):    # the last part's rows: after the first token
                self._extend([seq])
            for r, p in enumerate(where):
                if p + 1 < n:
                    lp = out.logprobs[r]
                    seq.prompt_scores[p] = TokenLogprob(prompt[p + 1], lp.logprob, lp.top)
        return StepOutput(out.token_ids[-1:], out.logprobs[-1:])

    def _forward(self, seq: Sequence, tokens: list[int], start: int,
                 rows: list[RowSampling]) -> StepOutput:
        """Run `tokens` of `seq` from position `start`; the last len(rows) rows choose a token."""
        T, L = len(tokens), len(rows)
        inp = self._tapped = StepInput(tokens, range(start, start + T), [seq.slot] * T,
                                       range(T - L, T), rows,
                                       hidden=self.speculator.taps([seq]))
        return self.runner.step(inp)

    def _extend(self, seqs: list[Sequence]) -> None:
        """After the last step's commits: a drafter reading the target's hidden states takes
        the committed rows of `seqs` from that step (Speculator.extend)."""
        inp, self._tapped = self._tapped, None
        if inp is not None and inp.hidden:
            self.speculator.extend(inp, seqs, self.runner.hidden_states(inp))
