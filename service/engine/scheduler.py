"""The engine: one thread that owns the model and interleaves requests step by step.

Requests wait in a bounded FIFO until a KV slot is free. Each loop iteration runs ONE step for
ONE active sequence (round-robin): a prefill chunk of up to `prefill_chunk` prompt tokens, or a
decode step of 1..verify_width tokens (the seed plus drafted tokens, verified at once). A
cancelled request is dropped before its next step, so its slot is free within one step.
Events go to each request's sink on this thread; sinks must not block.

The scheduler decides what a step holds (service/engine/runner.py's StepInput); the model
runner packs, uploads, runs and samples it, and hands back token ids (and log-probabilities):
the engine never sees logits. Loading lives in service/engine/loader.py.
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

from service.config import EngineConfig
from service.engine.drafters import Drafter, create_drafter
from service.engine.loader import ModelInfo, load_model, phase
from service.engine.runner import GREEDY, ModelRunner, RowSampling, StepInput, StepOutput
from service.engine.sampling import resolve_seed
from service.engine.sequence import Sequence
from service.engine.speculative import accept_chain, draft_length
from service.engine.textstream import TextStream
from service.engine.types import (
    Event,
    Finished,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    StoppingCriteria,
)
from service.errors import CapacityError, InvalidRequestError, UnavailableError
from service.gguf.reader import GGUFFile
from service.model.chat import chat_prompt_ids, chat_prompt_text, template_for
from service.model.spec import ModelSpec
from service.model.tokenizer import Tokenizer
from service.model.transformer import Transformer

log = structlog.get_logger("specstream.engine")
PROBE_EVERY = 8   # plain steps after which a sequence that stopped drafting tries one draft


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
        self._rr = 0
        self.runner = ModelRunner(model, config.n_slots, config.n_ctx)
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
        seed = resolve_seed(request.sampling.seed)
        p = request.sampling
        applicable = p.greedy and p.repetition_penalty == 1.0
        if request.speculative and not applicable:
            raise InvalidRequestError(
                "speculative.enabled", "speculative decoding verifies greedy choices: it needs "
                "sampling.temperature = 0 and sampling.repetition_penalty = 1 (leave it unset "
                "to let the engine decide)")
        spec_on = request.speculative if request.speculative is not None else True
        spec_on = bool(spec_on and applicable and self.drafter is not None
                       and self.config.verify_width > 1)
        return Sequence(request=request, sink=sink, seed_value=seed,
                        text=TextStream(self.tokenizer, request.stopping.stop_sequences),
                        eog_ids=frozenset(self.tokenizer.eog_ids), n_ctx=self.config.n_ctx,
                        speculative=spec_on)

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
                while self._waiting and self._free_slots:
                    seq = self._waiting.popleft()
                    seq.start(self._free_slots.pop())
                    if self.drafter is not None:
                        self.drafter.start(seq)
                    self._active.append(seq)
                if not self._active:
                    if self._stopping:
                        return
                    self._lock.wait(0.5)
                    continue
                self._rr = (self._rr + 1) % len(self._active)
                seq = self._active[self._rr]
            try:
                self._step(seq)
            except Exception as exc:   # one request's failure must not stop the engine
                log.exception("step_failed", request_id=seq.request.request_id)
                seq.finish(FinishReason.ERROR, error=f"{type(exc).__name__}: {exc}")
            if seq.finished:
                self._release(seq)

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
            self._free_slots.append(seq.slot)
            if self.drafter is not None:
                self.drafter.release(seq)

    def _forward(self, seq: Sequence, tokens: list[int], start: int,
                 rows: list[RowSampling]) -> StepOutput:
        """Run `tokens` of `seq` from position `start`; the last len(rows) rows choose a token."""
        T, L = len(tokens), len(rows)
        return self.runner.step(StepInput(tokens, range(start, start + T), [seq.slot] * T,
                                          range(T - L, T), rows))

    def _choice(self, seq: Sequence) -> RowSampling:
        """How `seq` chooses its next token (the draw's counter: tokens generated so far)."""
        n_top = seq.request.top_logprobs or -1
        return RowSampling.of(seq.request.sampling, seq.seed_value, len(seq.generated), n_top)

    def _step(self, seq: Sequence) -> None:
        if seq.cancelled:
            return
        if seq.prefill_left:
            n = min(seq.prefill_left, self.config.prefill_chunk)
            chunk = list(seq.request.prompt_ids[seq.n_past:seq.n_past + n])
            last = n == seq.prefill_left
            out = self._forward(seq, chunk, seq.n_past, [self._choice(seq)] if last else [])
            seq.n_past += n
            if last:
                seq.t_prefill_done = time.perf_counter()
                seq.emit([int(out.token_ids[0])], out.logprobs)
            return
        draft = [seq.seed]
        if seq.speculative:
            room = min(self.config.verify_width - 1, self.config.n_ctx - seq.n_past - 1,
                       seq.request.stopping.max_new_tokens - len(seq.generated) - 1)
            k = draft_length(seq.accept_rate, self.verify_alpha, room)
            if k == 0 and seq.steps_without_draft >= PROBE_EVERY:
                k = min(1, room)            # keep measuring: the text may turn repetitive
            seq.steps_without_draft = 0 if k else seq.steps_without_draft + 1
            draft += self.drafter.propose(seq, k)
        T = len(draft)
        if T == 1:
            out = self._forward(seq, draft, seq.n_past, [self._choice(seq)])
            seq.n_past += 1
            seq.emit([int(out.token_ids[0])], out.logprobs)
            return
        # speculation only runs for greedy requests without a penalty: every row's choice is
        # the argmax, with log-probabilities of the raw logits when asked
        choice = replace(GREEDY, n_top=seq.request.top_logprobs or -1)
        out = self._forward(seq, draft, seq.n_past, [choice] * T)
        n_acc, emitted = accept_chain(draft, [int(t) for t in out.token_ids])
        seq.n_past += n_acc
        seq.record_verify(T - 1, n_acc - 1)
        seq.emit(emitted, out.logprobs[:n_acc])
