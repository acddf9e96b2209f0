"""Session fixtures over tests/support: re-quantized copies of models, made once."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.models import model_path


@pytest.fixture(scope="session")
def requantized(tmp_path_factory) -> Callable[..., Path]:
    """requantized(model, mode, layers=None): the path of `model` (model_path's names)
    re-encoded by service.tools.quantize to `mode`, cut to its first `layers` blocks; each copy
    is written once per session."""
    from service.tools.quantize import requantize

    made: dict[tuple, Path] = {}
    directory = tmp_path_factory.mktemp("requantized")

    def copy(model: str | Path, mode: str, layers: int | None = None) -> Path:
        src = model_path(model)
        key = (src, mode, layers)
        if key not in made:
            name = f"{src.stem}-{mode}" + (f"-{layers}l" if layers else "") + ".gguf"
            made[key] = requantize(src, directory / name, mode, layers).path
        return made[key]

    return copy
