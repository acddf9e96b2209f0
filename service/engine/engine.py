"""The engine: one thread that owns the model and batches every running request into its steps.

Scheduling policy (continuous batching over a paged KV cache). Requests wait in a bounded FIFO
(`max_queue` beyond the free slots, then RESOURCE_EXHAUSTED). The queue's head is admitted
between steps when one of `n_slots` slots is free AND the KV block pool (service/engine/
blocks.py) can give it the blocks of its whole prompt plus one token, counting the blocks its
longest cached prefix already holds (prefix cache: whole blocks of identical earlier prompts,
taken by reference; it computes only the rest); admission is strictly in arrival order. Each
loop iteration then runs, under the step budget `max_step_tokens` (config.step_budget: decode
rows R = min(64, B - 16), prefill chunk min(prefill_chunk, B - R); B = 0 means 64 rows and
prefill_chunk):

1. ONE decode step for the decoding sequences, decode first: every sequence's seed token plus
   its drafted tokens (each sequence keeps its own draft length) are the rows of one
   StepInput, at most R rows in all. Steps of up to 64 rows are the backends' step-size-
   invariant path: each row's logits are bit-identical whatever else is in the step, so a
   request gives the same tokens alone and in any batch. When the rows wanted exceed R, draft
   lengths shrink first (the longest draft loses a token, the youngest sequence's on a tie);
   only when the sequences alone exceed R does a sequence sit a step out, in turns: the
   sequences that waited longest since their last step go first, FIFO by start among equals.
   Before drafting, every chosen sequence gets the KV blocks its rows write; when the pool
   lacks them, the most recently submitted running sequence is PREEMPTED: its full committed
   blocks go to the prefix cache, the rest back to the pool, and it waits again at the head
   of the queue; readmitted, it recomputes its context (the prompt in the same chunks, its
   generated tokens in decode-sized steps, choosing nothing) and goes on: its emitted tokens
   stand and, sampling being keyed by token index, it continues exactly as it would have.
   Each sequence's segment is verified on its own with speculative.accept_chain, or, for a
   sequence with a tree budget, as a draft tree (service/engine/tree_verify.py: its rows, path
   following and the KV compaction after the step). Every row chooses its token with the
   request's own sampling (greedy or seeded sampling, penalties included) keyed by the index
   of the token it would produce (a tree node: by its depth), so a sampled request speculates
   too and its output equals plain seeded sampling token for token (speculative.py: why this
   is rejection sampling). A request with a repetition penalty verifies chains only (its
   penalty window reads the token history by position, which a tree's siblings share). With
   EngineConfig.step_profile each step's parts are timed (stepprofile.py).
2. then at most ONE prefill chunk of the oldest sequence still prefilling (or recomputing
   after a preemption), as its own step: a fixed chunk size, so a prompt's KV rows never
   depend on the load, and its own step, because a step wider than 64 rows takes another
   numeric path and would change the batched rows' bits. A long prompt therefore delays
   running streams by at most one chunk per token they receive, and running streams never
   starve a waiting prompt.

A cancelled request leaves the batch before the next step (its slot and blocks are free
within one step). Events go to each request's sink on this thread; sinks must not block.

The scheduler decides what a step holds (service/engine/runner.py's StepInput); the model
runner packs, uploads, runs and samples it, and hands back token ids (and log-probabilities):
the engine never sees logits. Sampling is keyed by (request seed, token index), never by the
row a request takes in a step. Loading lives in service/engine/loader.py.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import structlog

from service.config import EngineConfig, step_budget
from service.engine.loader import ModelInfo, load_model, phase
from service.engine.runner import GREEDY, ModelRunner, RowSampling, StepInput, StepOutput
from service.engine.sampling import resolve_seed
from service.engine.scheduler.blocks import BlockPool
from service.engine.scheduler.kv import PagedKV
from service.engine.scheduler.policy import BatchedDecode, StepStats
from service.engine.scheduler.sequence import Sequence
from service.engine.spec.drafters import Drafter, create_drafter
from service.engine.spec.options import resolve as resolve_speculation
from service.engine.textstream import TextStream
from service.engine.types import (
    Event,
    Finished,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    StoppingCriteria,
)
from service.errors import CapacityError, UnavailableError
from service.gguf.reader import GGUFFile
from service.model.chat import chat_prompt_ids, chat_prompt_text, template_for
from service.model.spec import ModelSpec
from service.model.tokenizer import Tokenizer
from service.model.transformer import Transformer

log = structlog.get_logger("specstream.engine")


class RequestHandle:
    def __init__(self, engine: Engine, seq: Sequence):
        self._engine, self._seq = engine, seq
        self.request_id = seq.request.request_id

    def cancel(self) -> None:
        """Stop this request within one engine step; its sink gets Finished(CANCELLED)."""
        self._seq.cancelled = True
        self._engine._wake()


class Engine(PagedKV, BatchedDecode):
    def __init__(self, path: Path, gguf: GGUFFile, spec: ModelSpec, tokenizer: Tokenizer,
                 model: Transformer, config: EngineConfig, backend_name: str,
                 chat_template: str | None = None, drafter: Drafter | None = None):
        self.path, self.spec, self.tokenizer, self.model = path, spec, tokenizer, model
        self.config = config
        self.drafter = drafter or create_drafter(config.drafter, config.ngram_size)
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
        self._lock = threading.Condition()
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._active: list[Sequence] = []
        self._free_slots = list(range(config.n_slots - 1, -1, -1))
        self._thread: threading.Thread | None = None
        self.failure: str | None = None   # why the engine thread died, if it did
        self._ready = threading.Event()
        self._stopping = False
        self.runner = ModelRunner(model, config.n_slots, config.n_ctx)
        # rows of one decode step (the backends' step-size-invariant width, within the model's
        # workspace) and the fixed prefill chunk, under config.max_step_tokens
        rows, self.prefill_chunk = step_budget(config)
        self.step_rows = min(rows, model.max_tokens, model.max_logits)
        cache = model.cache
        self.pool = BlockPool(cache.n_blocks, cache.block_size, config.n_slots,
                              cache.max_blocks, config.prefix_cache, self._upload_table)
        self.stats = StepStats()
        # Cost of each extra verified token relative to a plain step (see draft_length);
        # measured on the engine thread before it serves anything.
        self.verify_alpha = 0.0

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
        return len(self._waiting)

    @property
    def active(self) -> int:
        return len(self._active)

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
            for seq in [*self._waiting, *self._active]:
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
            if len(self._waiting) >= self.config.max_queue + max(0, len(self._free_slots)):
                raise CapacityError(f"{len(self._waiting)} requests are already waiting",
                                    retry_after_s=1.0)
            self._waiting.append(seq)
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

    def chat_prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Messages rendered with the chat template, then tokenized as llama.cpp does;
        ChatTemplateMissingError when there is none."""
        return chat_prompt_ids(self.tokenizer, self.chat_template, messages)

    def chat_prompt_text(self, messages: list[dict[str, str]]) -> str:
        """The text chat_prompt_ids tokenizes."""
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

    # ------------------------------------------------------------------ engine thread
    def _new_sequence(self, request: GenerationRequest, sink) -> Sequence:
        spec = resolve_speculation(request.speculative, request.speculative_options,
                                   self.config, self.drafter is not None,
                                   request.sampling.repetition_penalty)
        return Sequence(request=request, sink=sink,
                        seed_value=resolve_seed(request.sampling.seed),
                        text=TextStream(self.tokenizer, request.stopping.stop_sequences),
                        eog_ids=frozenset(self.tokenizer.eog_ids), n_ctx=self.config.n_ctx,
                        speculative=spec.on, verify_width=spec.verify_width,
                        tree_budget=spec.tree_budget)

    def _wake(self) -> None:
        with self._lock:
            self._lock.notify_all()

    @property
    def healthy(self) -> bool:
        """False once the engine thread has died (health checks turn NOT_SERVING)."""
        return self.failure is None and (self._thread is None or self._thread.is_alive()
                                         or self._stopping)

    def _calibrate(self, reps: int = 3) -> None:
        """Time plain steps against full-width verify steps on slot 0 (its rows are rewritten
        by the first prefill that uses the slot). alpha = (t_w / t_1 - 1) / (w - 1)."""
        w = self.config.verify_width
        if w < 2 or self.drafter is None:
            return

        def best(t: int) -> float:
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                self.runner.step(StepInput(list(range(1, t + 1)), list(range(t)), [0] * t,
                                           list(range(t)), [GREEDY] * t))
                times.append(time.perf_counter() - t0)
            return min(times)

        best(w)
        t1, tw = best(1), best(w)
        self.verify_alpha = min(1.0, max(0.0, (tw / t1 - 1.0) / (w - 1)))
        log.info("verify_cost", width=w, plain_ms=round(t1 * 1e3, 2),
                 verify_ms=round(tw * 1e3, 2), alpha=round(self.verify_alpha, 3))

    def _run(self) -> None:
        try:
            try:
                self._calibrate()
            finally:
                self._ready.set()
            self._loop()
        except BaseException as exc:   # the loop itself failed: fail every request, loudly
            self.failure = f"{type(exc).__name__}: {exc}"
            log.exception("engine_failed")
            with self._lock:
                doomed = [*self._waiting, *self._active]
                self._waiting.clear()
                self._active.clear()
            for seq in doomed:
                seq.finish(FinishReason.ERROR, error="the engine stopped: " + self.failure)

    def _loop(self) -> None:
        while True:
            with self._lock:
                self._reap_cancelled()
                while self._waiting and self._free_slots and self._admit(self._waiting[0]):
                    self._waiting.popleft()
                if not self._active:
                    if self._stopping:
                        return
                    self._lock.wait(0.5)
                    continue
                # _active is in start order (FIFO admission)
                decoding = [s for s in self._active if s.seed is not None and not s.cancelled
                            and not s.prefill_left]
                prefilling = next((s for s in self._active if s.prefill_left
                                   and not s.cancelled), None)
            if decoding:
                try:
                    self._decode(decoding)
                except Exception as exc:   # planning failed (e.g. a drafter): fail its batch
                    for seq in decoding:
                        self._fail(seq, exc)
            if prefilling is not None and not prefilling.cancelled and prefilling.slot >= 0:
                try:
                    self._prefill(prefilling)
                except Exception as exc:   # one request's failure must not stop the engine
                    self._fail(prefilling, exc)
            for seq in [*decoding, *([prefilling] if prefilling else [])]:
                if seq.finished:
                    self._release(seq)

    def _fail(self, seq: Sequence, exc: Exception) -> None:
        log.error("step_failed", request_id=seq.request.request_id, exc_info=exc)
        seq.finish(FinishReason.ERROR, error=f"{type(exc).__name__}: {exc}")

    def _reap_cancelled(self) -> None:
        for seq in [s for s in self._waiting if s.cancelled]:
            self._waiting.remove(seq)
            seq.finish(FinishReason.CANCELLED)
        for seq in [s for s in self._active if s.cancelled]:
            seq.finish(FinishReason.CANCELLED)
            self._release_locked(seq)

    def _release(self, seq: Sequence) -> None:
        with self._lock:
            self._release_locked(seq)

    def _release_locked(self, seq: Sequence) -> None:
        if seq in self._active:
            self._active.remove(seq)
            self._free_blocks(seq)

    def _forward(self, seq: Sequence, tokens: list[int], start: int,
                 rows: list[RowSampling]) -> StepOutput:
        """Run `tokens` of `seq` from position `start`; the last len(rows) rows choose a token."""
        T, L = len(tokens), len(rows)
        return self.runner.step(StepInput(tokens, range(start, start + T), [seq.slot] * T,
                                          range(T - L, T), rows))

    def _choice(self, seq: Sequence, ahead: int = 0) -> RowSampling:
        """How `seq` chooses the token `ahead` tokens after its next one (the draw's counter:
        the index of the token the row produces, as plain decoding would count it)."""
        n_top = seq.request.top_logprobs or -1
        return RowSampling.of(seq.request.sampling, seq.seed_value,
                              len(seq.generated) + ahead, n_top)

    def _prefill(self, seq: Sequence) -> None:
        """One chunk of `seq`'s prompt (chunks of prefill_chunk from where its prefill began);
        the prompt's last chunk chooses its first token. A preempted sequence recomputes its
        prompt the same way, then its generated tokens in decode-sized steps (the step-size-
        invariant path, so their KV rows get the bits decoding gave them) choosing nothing."""
        n_prompt = len(seq.request.prompt_ids)
        if seq.n_past < n_prompt:
            n = min(self.prefill_chunk, n_prompt - seq.n_past)
        else:
            n = min(self.step_rows, seq.prefill_left)
        chunk = list(seq.history[seq.n_past:seq.n_past + n])
        last = seq.seed is None and seq.n_past + n == n_prompt
        if not self._room(seq, seq.n_past + n):
            return
        out = self._forward(seq, chunk, seq.n_past, [self._choice(seq)] if last else [])
        self.stats.prefill_steps += 1
        seq.n_past += n
        self.pool.register(seq.slot, seq.history, min(seq.n_past, n_prompt))
        if last:
            seq.t_prefill_done = time.perf_counter()
            seq.emit([int(out.token_ids[0])], out.logprobs)
