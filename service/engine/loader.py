"""Loading a model for the engine: header, tokenizer, backend, weights and KV cache, each phase
logged with its duration; with drafter 'model', the draft model too, after its vocabulary is
compared with the target's (check_draft_vocabulary) and before any weights are read; with
drafter 'eagle3' or 'dflash', the drafter reading the target's hidden states, its file checked
against the target first (HIDDEN_DRAFTERS: eagle3_header, dflash_header)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import structlog

from service.backends import create_backend, resolve_backend_name
from service.config import MAX_STEP_ROWS, EngineConfig, parse_memory, step_budget
from service.engine.spec.draft_model import ModelDrafter
from service.engine.spec.drafters import Drafter
from service.engine.spec.markov_head import load_markov_head
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
    draft_model: str = ""         # drafter 'model': the draft model's name


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
    drafter: Drafter | None = None    # the model drafter; None: the engine builds its own


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
    tokenizer = _tokenizer(gguf, spec)
    t = phase("tokenizer", t, vocab_size=tokenizer.vocab_size, kind=tokenizer.kind.value)
    draft = None
    if config.drafter == "model":
        draft = _draft_header(config.draft_model)
        check_draft_vocabulary(gguf, spec, tokenizer, *draft,
                               n_ctx=min(config.n_ctx, spec.n_ctx_train))
    hidden_drafter = HIDDEN_DRAFTERS.get(config.drafter)
    head = hidden_drafter[0](config, spec) if hidden_drafter is not None else None
    backend_name = resolve_backend_name(config.backend)
    backend = new_backend(backend_name, config)
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
    specs = [spec] + ([draft[1]] if draft is not None else [])
    model = Transformer(spec, gguf, backend, n_ctx=n_ctx, n_slots=config.n_slots,
                        max_tokens=max_tokens(config), type_k=config.kv_cache_type_k,
                        type_v=config.kv_cache_type_v, max_logits=MAX_STEP_ROWS,
                        kv_blocks=lambda: pool_blocks(config, backend, specs),
                        block_size=config.kv_block_size)
    t = _log_model(model, config, specs, t_model)
    log.info("model_loaded", path=str(path), arch=spec.arch, backend=backend_name,
             kv_type_k=config.kv_cache_type_k, kv_type_v=config.kv_cache_type_v,
             n_ctx=n_ctx, n_slots=config.n_slots, verify_width=config.verify_width,
             seconds=round(t - t0, 2))
    pool = (model.cache.n_blocks, model.cache.block_size)
    drafter = (_load_drafter(draft, config, backend_name, spec.vocab_size, pool)
               if draft is not None else None)
    if head is not None:
        drafter = hidden_drafter[1](head, config, model)
    return LoadedModel(path, gguf, spec, tokenizer, model, config, backend_name, template,
                       drafter)


def _tokenizer(f: GGUFFile, spec: ModelSpec) -> Tokenizer:
    """The file's tokenizer, or ids only when it has no vocabulary texts."""
    if f.get("tokenizer.ggml.tokens"):
        return Tokenizer.from_metadata(f.metadata)
    return Tokenizer.ids_only(spec.vocab_size)


def new_backend(backend_name: str, config: EngineConfig):
    """A backend instance of kind `backend_name` with the configured options."""
    extra = ({"graphs": config.cuda_graphs, "gemv_mma": config.gemv_mma}
             if backend_name == "cuda" else {})
    return create_backend(backend_name, threads=config.threads,
                          invariant_tokens=MAX_STEP_ROWS, **extra)


def _log_model(model: Transformer, config: EngineConfig, specs: list[ModelSpec],
               t_model: float) -> float:
    """Log the KV pool and the weights and KV cache phases of a Transformer whose construction
    began at `t_model`; returns the time now."""
    c, backend = model.cache, model.backend
    log.info("kv_pool", blocks=c.n_blocks, block_size=c.block_size,
             positions=c.n_blocks * c.block_size,
             full_contexts=round(c.n_blocks / c.max_blocks, 1),
             mib=round(c.n_blocks * c.block_size * kv_bytes(backend, specs, config) / 2**20, 1),
             prefix_cache=config.prefix_cache)
    # the Transformer loads the weights, then allocates the KV cache and its workspace
    weights_s = model.weights.load_seconds
    log.info("load_phase", phase="weights", seconds=round(weights_s, 3), backend=config.backend,
             n_layer=model.spec.n_layer)
    return phase("kv_cache", t_model + weights_s, n_ctx=config.n_ctx, n_slots=config.n_slots,
                 kv_blocks=c.n_blocks, kv_type_k=config.kv_cache_type_k,
                 kv_type_v=config.kv_cache_type_v)


# ---------------------------------------------------------------- the KV pool
def max_tokens(config: EngineConfig) -> int:
    """Rows of the model's workspace: the prefill chunk, a verify step or a decode step."""
    rows, chunk = step_budget(config)
    return max(chunk, config.verify_width, rows)


def kv_bytes(backend, specs: list[ModelSpec], config: EngineConfig) -> int:
    """Bytes one position takes in the KV caches of `specs` (the target and a draft model,
    which shares the target's block table and so its pool size)."""
    return sum(backend.kv_position_bytes(s.n_layer, s.n_head_kv, s.head_dim, s.head_dim_v,
                                         config.kv_cache_type_k, config.kv_cache_type_v)
               for s in specs)


def pool_blocks(config: EngineConfig, backend, specs: list[ModelSpec]) -> int:
    """Blocks of the KV pool per config.kv_cache_memory: bytes, or a fraction of the memory free
    once the target's weights are loaded; ConfigError when they cannot hold one full context.
    '' (the default): a full context for every slot, so n_slots streams of any length run at
    once without preemption, within backend.kv_pool_share of the free memory (0.8 of a GPU's,
    0.25 of the host's), at least one full context."""
    bs = config.kv_block_size
    n_ctx = min(config.n_ctx, specs[0].n_ctx_train)
    per_block = bs * kv_bytes(backend, specs, config)
    full = -(-n_ctx // bs)
    most = ((1 << 31) - 1) // bs                                 # int32 row indices
    kind, value = parse_memory(config.kv_cache_memory)
    if kind == "default":
        room = int(backend.kv_pool_share * backend.memory_free() // per_block)
        return max(full, min(config.n_slots * full, room, most))
    budget = value if kind == "bytes" else value * backend.memory_free()
    n = min(int(budget // per_block), most)
    if n < full:
        raise ConfigError([("kv_cache_memory", f"{config.kv_cache_memory!r} gives "
                            f"{budget / 2**20:.1f} MiB, room for {n * bs} positions at "
                            f"{per_block // bs} bytes each; one full context (n_ctx {n_ctx}) "
                            f"needs {full * per_block / 2**20:.1f} MiB: raise kv_cache_memory "
                            "or lower n_ctx")])
    return n


# ---------------------------------------------------------------- the draft model
def _draft_header(path_text: str) -> tuple[GGUFFile, ModelSpec, Tokenizer]:
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise ConfigError([("draft_model", f"{path_text!r} is not a file (a known model name "
                                           "is resolved to its file before loading)")])
    f = GGUFFile(path)
    spec = ModelSpec.from_gguf(f)
    return f, spec, _tokenizer(f, spec)


def check_draft_vocabulary(target: GGUFFile, spec: ModelSpec, tok: Tokenizer,
                           draft: GGUFFile, dspec: ModelSpec, dtok: Tokenizer, n_ctx: int) -> None:
    """Refuse a draft model whose token ids mean something else than the target's: token texts
    (the first differing id is named with both texts), vocabulary and head sizes, BOS, EOS and
    end-of-generation ids; and one trained on a shorter context than the one served."""
    problems: list[tuple[str, str]] = []
    where = f"draft model {draft.path.name} against target {target.path.name}"
    texts = list(target.get("tokenizer.ggml.tokens") or ())
    dtexts = list(draft.get("tokenizer.ggml.tokens") or ())
    pairs = enumerate(zip(texts, dtexts, strict=False))      # the shorter list decides
    first = next((i for i, (a, b) in pairs if a != b), None)
    if first is None and len(texts) != len(dtexts):
        first = min(len(texts), len(dtexts))
    if first is not None:
        a = repr(texts[first]) if first < len(texts) else "(none)"
        b = repr(dtexts[first]) if first < len(dtexts) else "(none)"
        problems.append(("draft_model", f"{where}: the vocabularies differ first at token id "
                                        f"{first}: {a} in the target, {b} in the draft model "
                                        f"({len(texts)} vs {len(dtexts)} token texts)"))
    if spec.vocab_size != dspec.vocab_size:
        problems.append(("draft_model", f"{where}: vocabulary size {spec.vocab_size} vs "
                                        f"{dspec.vocab_size}"))
    for what, a, b in (("BOS id", tok.bos_id, dtok.bos_id), ("EOS id", tok.eos_id, dtok.eos_id),
                       ("end-of-generation ids", sorted(tok.eog_ids), sorted(dtok.eog_ids))):
        if a != b:
            problems.append(("draft_model", f"{where}: {what} {a} vs {b}"))
    if dspec.n_ctx_train < n_ctx:
        problems.append(("draft_model", f"{where}: the draft model was trained on "
                                        f"{dspec.n_ctx_train} tokens of context, less than the "
                                        f"{n_ctx} served (lower n_ctx)"))
    if problems:
        raise ConfigError(problems)


def _load_drafter(draft: tuple[GGUFFile, ModelSpec, Tokenizer], config: EngineConfig,
                  backend_name: str, target_vocab: int, pool: tuple[int, int]) -> ModelDrafter:
    """The draft Transformer on its own backend instance of the target's kind and options
    (service/engine/spec/draft_model.py says why), same n_slots, n_ctx, KV types and KV pool
    geometry `pool` = (blocks, block size) as the target (one block table serves both); with
    the file's DSpark Markov head when it has one of the target's vocabulary size, loaded first (the
    Transformer's `prepare` ends the backend's loading)."""
    f, dspec, _ = draft
    t = time.perf_counter()
    backend = new_backend(backend_name, config)
    head = load_markov_head(f, target_vocab, backend)
    model = Transformer(dspec, f, backend, n_ctx=config.n_ctx, n_slots=config.n_slots,
                        max_tokens=max_tokens(config), type_k=config.kv_cache_type_k,
                        type_v=config.kv_cache_type_v, max_logits=1, kv_blocks=pool[0],
                        block_size=pool[1])
    phase("draft_model", t, path=str(f.path), model=dspec.name, n_layer=dspec.n_layer,
          file_type=dspec.file_type, markov_rank=head.rank if head else 0)
    name = f"{dspec.name} ({f.path.name}" + (f", Markov head rank {head.rank})" if head else ")")
    return ModelDrafter(model, name, head)


# ---------------------------------------------------------------- the EAGLE-3 head
def eagle3_header(config: EngineConfig, target: ModelSpec):
    """(file, Eagle3Spec) of config.draft_model, read and checked against the target before
    any weights are loaded: ConfigError naming draft_model when it is not an EAGLE-3 drafter
    made for this target (format, width, vocabulary, layers)."""
    from service.errors import ModelFormatError
    from service.model.eagle3 import Eagle3Spec

    def read(f: GGUFFile) -> Eagle3Spec:
        spec = Eagle3Spec.from_gguf(f)
        if spec.has_rope_freqs:
            raise ModelFormatError("rope_freqs (Llama-3 RoPE scaling) in an EAGLE-3 drafter "
                                   "is not supported yet")
        return spec

    return _hidden_drafter_file(config, target, "an EAGLE-3", read)


def load_eagle3(header, config: EngineConfig, target: Transformer) -> Drafter:
    """The eagle3 drafter (eagle3_header's file and spec) on the target's backend: it reads the
    target's hidden states and may share its embeddings and output."""
    from service.engine.spec.eagle3_drafter import Eagle3Drafter
    from service.model.eagle3_model import Eagle3Model

    f, spec = header
    t = time.perf_counter()

    def build() -> Drafter:
        model = Eagle3Model(spec, f, target, **_target_geometry(config, target), max_logits=1)
        return Eagle3Drafter(model, _drafter_name(f, "EAGLE-3"))

    drafter = _checked_on_backend(f, config, build)
    phase("draft_model", t, path=str(f.path), kind="eagle3", layers=list(spec.target_layers),
          width=spec.n_embd, draft_vocab=spec.draft_vocab)
    return drafter


# ---------------------------------------------------------------- the DFlash drafter
def dflash_header(config: EngineConfig, target: ModelSpec):
    """(file, DflashSpec) of config.draft_model, read and checked against the target before
    any weights are loaded: ConfigError naming draft_model when it is not a DFlash drafter
    (of the supported kind) made for this target (format, width, vocabulary, layers)."""
    from service.model.dflash import DflashSpec

    f, spec = _hidden_drafter_file(config, target, "a DFlash", DflashSpec.from_gguf)
    if config.draft_p_min > 0 and not spec.confidence:
        raise ConfigError([("draft_p_min", f"{config.draft_p_min}: {f.path.name} has no DSpark "
                                           "confidence head to cut drafts with; leave it 0")])
    return f, spec


def _hidden_drafter_file(config: EngineConfig, target: ModelSpec, kind: str, read):
    """(file, spec) of config.draft_model read by `read` (a spec's from_gguf, ModelFormatError
    on a bad file) and checked against the target; ConfigError naming draft_model otherwise.
    kind: "an EAGLE-3", "a DFlash"."""
    from service.errors import ModelFormatError

    path = Path(config.draft_model).expanduser()
    if not path.is_file():
        raise ConfigError([("draft_model", f"{config.draft_model!r} is not a file ({kind} "
                                           "drafter in llama.cpp's GGUF format)")])
    try:
        f = GGUFFile(path)
        spec = read(f)
        spec.check_target(target, f"{kind.split()[1]} drafter {path.name}")
    except (ModelFormatError, ValueError, OSError) as e:
        raise ConfigError([("draft_model", f"{path.name} cannot draft for {target.name}: "
                                           f"{e}")]) from e
    return f, spec


def load_dflash(header, config: EngineConfig, target: Transformer) -> Drafter:
    """The dflash drafter (dflash_header's file and spec) on the target's backend: it reads the
    target's hidden states and may share its embeddings and output."""
    from service.engine.spec.dflash_drafter import DflashDrafter
    from service.model.dflash_model import DflashModel

    f, spec = header
    t = time.perf_counter()

    def build() -> Drafter:
        model = DflashModel(spec, f, target, **_target_geometry(config, target))
        kind = "DSpark" if spec.dspark else "DFlash"
        return DflashDrafter(model, _drafter_name(f, kind), p_min=config.draft_p_min)

    drafter = _checked_on_backend(f, config, build)
    phase("draft_model", t, path=str(f.path), kind="dflash", layers=list(spec.target_layers),
          n_layer=spec.n_layer, block_size=spec.block_size, draft_vocab=spec.draft_vocab,
          markov_rank=spec.markov_rank, confidence_head=spec.confidence)
    return drafter


def _target_geometry(config: EngineConfig, target: Transformer) -> dict:
    """The context, slots, step rows and KV types a hidden-state drafter's model shares with
    the target it reads (its model's keywords)."""
    return dict(n_ctx=config.n_ctx, n_slots=config.n_slots, max_tokens=target.max_tokens,
                type_k=config.kv_cache_type_k, type_v=config.kv_cache_type_v)


def _drafter_name(f: GGUFFile, kind: str) -> str:
    """A hidden-state drafter's name in logs and responses: "<general.name> (<file>, <kind>)"."""
    return f"{f.get('general.name', f.path.stem)} ({f.path.name}, {kind})"


def _checked_on_backend(f: GGUFFile, config: EngineConfig, build: Callable[[], Drafter]
                        ) -> Drafter:
    """build()'s drafter once its check() has run one step on the target's backend:
    ConfigError naming draft_model when the backend cannot run the drafter's shapes or types
    (at load, instead of on the first request)."""
    try:
        drafter = build()
        drafter.check()
    except Exception as e:      # the backend cannot run the drafter's shapes or types
        raise ConfigError([("draft_model", f"{f.path.name} cannot run on the "
                                           f"{config.backend} backend: {type(e).__name__}: "
                                           f"{e}")]) from e
    return drafter


# drafter name -> (header: read and check the file before any weights load, loader: build it
# on the target's backend) for the drafters that read the target's hidden states
HIDDEN_DRAFTERS = {"eagle3": (eagle3_header, load_eagle3),
                   "dflash": (dflash_header, load_dflash)}
