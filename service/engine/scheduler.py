"""The engine: one thread that owns the model and interleaves requests step by step.

Requests wait in a bounded FIFO until a KV slot is free. Each loop iteration runs ONE step for
ONE active sequence (round-robin): a prefill chunk of up to `prefill_chunk` prompt tokens, or a
decode step of 1..verify_width tokens (the seed plus drafted tokens, verified at once). A
cancelled request is dropped before its next step, so its slot is free within one step.
Events go to each request's sink on this thread; sinks must not block.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import structlog

from service.backends import create_backend, resolve_backend_name
from service.config import MAX_VERIFY_WIDTH, EngineConfig
from service.engine.drafters import create_drafter
from service.engine.sampling import Sampler, resolve_seed
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
from service.errors import CapacityError, ConfigError, InvalidRequestError, UnavailableError
from service.gguf.reader import GGUFFile
from service.model.chat import chat_prompt_ids, chat_prompt_text, load_template, template_for
from service.model.spec import ModelSpec
from service.model.tokenizer import Tokenizer
from service.model.transformer import Transformer

log = structlog.get_logger("specstream.engine")
PROBE_EVERY = 8   # plain steps after which a sequence that stopped drafting tries one draft


@dataclass(frozen=True)
class ModelInfo:
    name: str
    path: str
    architecture: str
    file_type: str
    n_params: int
    n_ctx_train: int
    n_ctx: int
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    eog_ids: tuple[int, ...]
    chat_template: str | None
    backend: str
    drafter: str
    kv_cache_type_k: str
    kv_cache_type_v: str
    n_layer: int
    n_embd: int


def _phase(name: str, since: float, **fields) -> float:
    """Log one model-load phase that began at perf_counter() `since`; returns the time now."""
    now = time.perf_counter()
    log.info("load_phase", phase=name, seconds=round(now - since, 3), **fields)
    return now


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
                 chat_template: str | None = None):
        self.path, self.spec, self.tokenizer, self.model = path, spec, tokenizer, model
        self.config = config
        self.drafter = create_drafter(config.drafter, config.ngram_size)
        # (text) the configured template, else the model's own; None: chat input is refused
        self.chat_template = template_for(gguf.metadata, chat_template)
        self.info = ModelInfo(
            name=spec.name, path=str(path), architecture=spec.arch, file_type=spec.file_type,
            n_params=spec.n_params, n_ctx_train=spec.n_ctx_train, n_ctx=config.n_ctx,
            vocab_size=spec.vocab_size, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id,
            eog_ids=tuple(sorted(tokenizer.eog_ids)),
            chat_template=self.chat_template, backend=backend_name,
            drafter=config.drafter, kv_cache_type_k=config.kv_cache_type_k,
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
        be = model.backend
        m = model.max_tokens
        self._ids, self._pos, self._slots = (be.zeros((m,), "int32") for _ in range(3))
        self._argmax = be.zeros((m,), "int32")
        # Cost of each extra verified token relative to a plain step (see draft_length);
        # measured on the engine thread before it serves anything.
        self.verify_alpha = 0.0

    # ------------------------------------------------------------------ construction
    @classmethod
    def load(cls, model_path: str | Path, config: EngineConfig,
             chat_template: str = "") -> Engine:
        """`chat_template`: a built-in template's name or a Jinja file ('' = the model's own)."""
        problems = config.problems()
        if problems:
            raise ConfigError(problems)
        template = load_template(chat_template) if chat_template else None
        path = Path(model_path)
        t0 = time.perf_counter()
        gguf = GGUFFile(path)
        spec = ModelSpec.from_gguf(gguf)
        t = _phase("header", t0, path=str(path), n_tensors=len(gguf.tensors),
                   n_metadata=len(gguf.metadata))
        tokenizer = Tokenizer.from_metadata(gguf.metadata) if gguf.get(
            "tokenizer.ggml.tokens") else Tokenizer.ids_only(spec.vocab_size)
        t = _phase("tokenizer", t, vocab_size=tokenizer.vocab_size, kind=tokenizer.kind.value)
        backend_name = resolve_backend_name(config.backend)
        extra = {"graphs": config.cuda_graphs} if backend_name == "cuda" else {}
        backend = create_backend(backend_name, threads=config.threads,
                                 invariant_tokens=MAX_VERIFY_WIDTH, **extra)
        pair = (config.kv_cache_type_k, config.kv_cache_type_v)
        if any(t not in backend.kv_types for t in pair):
            raise ConfigError([("kv_cache_type_k,kv_cache_type_v",
                                f"the {backend_name} backend does not implement the KV cache "
                                f"type pair (K={pair[0]}, V={pair[1]}); it supports "
                                + ", ".join(backend.kv_types) + " for each")])
        _phase("backend", t, backend=backend_name, threads=config.threads)
        n_ctx = min(config.n_ctx, spec.n_ctx_train)
        config = replace(config, n_ctx=n_ctx, backend=backend_name)
        t_model = time.perf_counter()
        model = Transformer(spec, gguf, backend, n_ctx=n_ctx, n_slots=config.n_slots,
                            max_tokens=max(config.prefill_chunk, config.verify_width),
                            type_k=config.kv_cache_type_k, type_v=config.kv_cache_type_v,
                            max_logits=MAX_VERIFY_WIDTH)
        # the Transformer loads the weights, then allocates the KV cache and its workspace
        weights_s = model.weights.load_seconds
        log.info("load_phase", phase="weights", seconds=round(weights_s, 3), backend=backend_name,
                 n_layer=spec.n_layer)
        t = _phase("kv_cache", t_model + weights_s, n_ctx=n_ctx, n_slots=config.n_slots,
                   kv_type_k=config.kv_cache_type_k, kv_type_v=config.kv_cache_type_v)
        log.info("model_loaded", path=str(path), arch=spec.arch, backend=backend_name,
                 kv_type_k=config.kv_cache_type_k, kv_type_v=config.kv_cache_type_v,
                 n_ctx=n_ctx, n_slots=config.n_slots, verify_width=config.verify_width,
                 seconds=round(t - t0, 2))
        return cls(path, gguf, spec, tokenizer, model, config, backend_name, template)

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
        _phase("warmup", t0)

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
        return Sequence(request=request, sink=sink,
                        sampler=Sampler(p, self.spec.vocab_size, seed), seed_value=seed,
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
                self.model.backend.to_host(self._forward_raw(list(range(1, t + 1)), 0, 0, t)[0])
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

    def _forward(self, seq: Sequence, tokens: list[int], start: int, n_logits: int):
        return self._forward_raw(tokens, seq.slot, start, n_logits)

    def _forward_raw(self, tokens: list[int], slot: int, start: int, n_logits: int):
        be, T = self.model.backend, len(tokens)
        be.upload_ints(np.asarray(tokens, np.int32), self._ids)
        be.upload_ints(np.arange(start, start + T, dtype=np.int32), self._pos)
        be.upload_ints(np.full(T, slot, np.int32), self._slots)
        return self.model.forward(self._ids[:T], self._pos[:T], self._slots[:T],
                                  kv_len=start + T, n_logits=n_logits)

    def _emit_one(self, seq: Sequence, logits) -> None:
        """Choose one token from logits (1, V). A plain greedy choice (no repetition penalty,
        no log-probabilities) is the backend's argmax, and only its int32 id is read back;
        anything else samples on the host from the row."""
        p, be = seq.request.sampling, self.model.backend
        if p.greedy and p.repetition_penalty == 1.0 and not seq.request.top_logprobs:
            be.argmax(logits[:1], self._argmax[:1])
            seq.emit([int(be.to_host(self._argmax[:1])[0])], None)
            return
        row = be.to_host(logits[0])
        seq.emit([seq.choose(row)], [row])

    def _step(self, seq: Sequence) -> None:
        if seq.cancelled:
            return
        if seq.prefill_left:
            n = min(seq.prefill_left, self.config.prefill_chunk)
            chunk = list(seq.request.prompt_ids[seq.n_past:seq.n_past + n])
            last = n == seq.prefill_left
            logits = self._forward(seq, chunk, seq.n_past, 1 if last else 0)
            seq.n_past += n
            if last:
                seq.t_prefill_done = time.perf_counter()
                self._emit_one(seq, logits)
            return
        draft = [seq.seed]
        if seq.speculative:
            room = min(self.config.verify_width - 1, self.config.n_ctx - seq.n_past - 1,
                       seq.request.stopping.max_new_tokens - len(seq.generated) - 1)
            k = draft_length(seq.accept_rate, self.verify_alpha, room)
            if k == 0 and seq.steps_without_draft >= PROBE_EVERY:
                k = min(1, room)            # keep measuring: the text may turn repetitive
            seq.steps_without_draft = 0 if k else seq.steps_without_draft + 1
            draft += self.drafter.propose(seq.history, k)
        T = len(draft)
        logits = self._forward(seq, draft, seq.n_past, T)
        if T == 1:
            seq.n_past += 1
            self._emit_one(seq, logits)
            return
        self.model.backend.argmax(logits, self._argmax[:T])
        target = [int(t) for t in self.model.backend.to_host(self._argmax[:T])]
        n_acc, emitted = accept_chain(draft, target)
        seq.n_past += n_acc
        seq.record_verify(T - 1, n_acc - 1)
        rows = None
        if seq.request.top_logprobs:
            rows = list(self.model.backend.to_host(logits[:n_acc]))
        seq.emit(emitted, rows)
