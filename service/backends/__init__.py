"""Backends, looked up by name and imported lazily (only the CUDA backend imports CuPy)."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator

from service.backends.base import Backend

_REGISTRY = {
    "cpu": ("service.backends.cpu.backend", "CpuBackend"),
    "cuda": ("service.backends.cuda.backend", "CudaBackend"),
}
_OPTIONS: dict[str, dict] = {}   # extra constructor arguments per backend name (backend_options)


@contextlib.contextmanager
def backend_options(name: str, **options) -> Iterator[None]:
    """Extra constructor arguments for every `name` backend `create_backend` makes inside the
    block, e.g. `backend_options("cpu", capture_rules=True)` around `Engine.load`: a switch for
    tests that no configuration file or flag should expose."""
    saved = _OPTIONS.get(name)
    _OPTIONS[name] = {**(saved or {}), **options}
    try:
        yield
    finally:
        if saved is None:
            _OPTIONS.pop(name, None)
        else:
            _OPTIONS[name] = saved


def cuda_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        cupy = importlib.import_module("cupy")
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def resolve_backend_name(name: str) -> str:
    """'auto' picks 'cuda' when a GPU and its backend are present, else 'cpu'."""
    if name != "auto":
        return name
    if cuda_available():
        try:
            importlib.import_module(_REGISTRY["cuda"][0])
            return "cuda"
        except ImportError:
            pass
    return "cpu"


def create_backend(name: str, **kwargs) -> Backend:
    from service.errors import ConfigError

    name = resolve_backend_name(name)
    if name not in _REGISTRY:
        raise ConfigError([("backend", f"unknown backend {name!r}; known: "
                                       + ", ".join(_REGISTRY))])
    module, cls = _REGISTRY[name]
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError([("backend", f"the {name} backend is not available here ({exc}); "
                                       "use --backend cpu or auto")]) from exc
    return getattr(mod, cls)(**{**_OPTIONS.get(name, {}), **kwargs})
