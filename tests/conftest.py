"""Shared fixtures: test data, the real models (fetched on first use), loaded GGUF files."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"
TINY = DATA / "tiny"


@cache
def load_json(name: str) -> dict:
    return json.loads((DATA / name).read_text())


@cache
def real_model_path(name: str) -> Path:
    """A known model's path, fetched into the models directory the first time."""
    from service.config import models_dir_from_env
    from service.gguf.fetch import fetch_model

    return fetch_model(name, models_dir_from_env())


@cache
def open_gguf(path: str):
    from service.gguf.reader import GGUFFile

    return GGUFFile(path)


REAL_MODELS = {"smollm2": "smollm2-135m", "gemma3": "gemma3-270m"}


@pytest.fixture(scope="session", params=sorted(REAL_MODELS))
def real_model(request):
    """(short name, GGUFFile) for each real model."""
    return request.param, open_gguf(str(real_model_path(REAL_MODELS[request.param])))
