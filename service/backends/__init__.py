"""Backends, looked up by name and imported lazily (only the CUDA backend imports CuPy)."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator

from service.backends.base import Backend

_REGISTRY = {
    "cpu": ("service.backends.cpu", "CpuBackend"),
    "cuda": ("service.backends.cuda", "CudaBackend"),
}
# The KV-cache element types each backend's kernels implement, for K and V independently (each
# backend class's `kv_types` equals its entry; tests check it). Startup validation and the
# ValidateConfig RPC take the supported pairs from here, without importing a backend.
KV_TYPES = {
    "cpu": ("f16", "q8_0", "q4_0"),
    "cuda": ("f16", "q8_0", "q4_0"),
}


def supported_kv_pairs(name: str = "auto") -> tuple[tuple[str, str], ...]:
    """(K, V) pairs the named backend supports; 'auto' (or an unknown name): the pairs every
    backend supports, since either may be picked."""
    kinds = [KV_TYPES[name]] if name in KV_TYPES else list(KV_TYPES.values())
    common = [t for t in kinds[0] if all(t in k for k in kinds)]
    return tuple((k, v) for k in common for v in common)

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
