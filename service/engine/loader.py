"""Loading a model for the engine: header, tokenizer, backend, weights and KV cache, each phase
logged with its duration."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

import structlog

from service.backends import create_backend, resolve_backend_name
from service.config import MAX_VERIFY_WIDTH, EngineConfig
from service.errors import ConfigError
from service.gguf.reader import GGUFFile
from service.model.chat import load_template
from service.model.spec import ModelSpec
from service.model.tokenizer import Tokenizer
from service.model.transformer import Transformer

log = structlog.get_logger("specstream.engine")


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


def phase(name: str, since: float, **fields) -> float:
    """Log one model-load phase that began at perf_counter() `since`; returns the time now."""
    now = time.perf_counter()
    log.info("load_phase", phase=name, seconds=round(now - since, 3), **fields)
    return now


@dataclass(frozen=True)
class LoadedModel:
    path: Path
    gguf: GGUFFile
    spec: ModelSpec
    tokenizer: Tokenizer
    model: Transformer
    config: EngineConfig          # n_ctx clipped to the model's, backend resolved
    backend_name: str
    chat_template: str | None


def load_model(model_path: str | Path, config: EngineConfig,
               chat_template: str = "") -> LoadedModel:
    """`chat_template`: a built-in template's name or a Jinja file ('' = the model's own)."""
    problems = config.problems()
    if problems:
        raise ConfigError(problems)
    template = load_template(chat_template) if chat_template else None
    path = Path(model_path)
    t0 = time.perf_counter()
    gguf = GGUFFile(path)
    spec = ModelSpec.from_gguf(gguf)
    t = phase("header", t0, path=str(path), n_tensors=len(gguf.tensors),
              n_metadata=len(gguf.metadata))
    tokenizer = Tokenizer.from_metadata(gguf.metadata) if gguf.get(
        "tokenizer.ggml.tokens") else Tokenizer.ids_only(spec.vocab_size)
    t = phase("tokenizer", t, vocab_size=tokenizer.vocab_size, kind=tokenizer.kind.value)
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
    phase("backend", t, backend=backend_name, threads=config.threads)
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
    t = phase("kv_cache", t_model + weights_s, n_ctx=n_ctx, n_slots=config.n_slots,
              kv_type_k=config.kv_cache_type_k, kv_type_v=config.kv_cache_type_v)
    log.info("model_loaded", path=str(path), arch=spec.arch, backend=backend_name,
             kv_type_k=config.kv_cache_type_k, kv_type_v=config.kv_cache_type_v,
             n_ctx=n_ctx, n_slots=config.n_slots, verify_width=config.verify_width,
             seconds=round(t - t0, 2))
    return LoadedModel(path, gguf, spec, tokenizer, model, config, backend_name, template)
