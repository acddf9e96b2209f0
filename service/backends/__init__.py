"""Backends, looked up by name and imported lazily (only the CUDA backend imports CuPy)."""

from __future__ import annotations

import importlib

from service.backends.base import Backend

_REGISTRY = {
    "cpu": ("service.backends.cpu", "CpuBackend"),
    "cuda": ("service.backends.cuda", "CudaBackend"),
}


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
    return getattr(mod, cls)(**kwargs)
