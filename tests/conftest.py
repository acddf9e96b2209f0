"""Session fixtures over tests/support: re-quantized copies of models, and the compiled CUDA
kernels' signatures the fake device checks launches against, made once."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.kernel_signatures import CompiledKernels, NvrtcUnavailable, compile_kernels
from tests.support.models import model_path


@pytest.fixture(scope="session")
def compiled(request) -> CompiledKernels:
    """The signatures of every CUDA kernel, compiled by NVRTC (or taken from pytest's cache); the
    calling test is skipped where NVRTC is not available."""
    try:
        return compile_kernels(getattr(request.config, "cache", None))
    except NvrtcUnavailable as e:
        pytest.skip(f"NVRTC is not available, so the kernels' signatures are unknown: {e}")


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
