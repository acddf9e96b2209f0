"""Every CUDA kernel source compiled into CuPy's on-disk kernel cache ahead of the first launch.

The backend compiles a source at the first launch of one of its kernels (launcher.Launcher: one
NVRTC compile of the whole file into a CuPy RawModule, with sources.OPTIONS), so a fresh GPU
host compiles the ten files one after another while the engine's warm-up meets them: minutes
before a new server answers. `compile_sources` compiles them side by side, one process per file
(a spawned process each: NVRTC work does not share one interpreter well, and a forked child
must not inherit a CUDA context), with the same code and options, so CuPy's cache (keyed by the
code, the options, the architecture and the NVRTC version; `CUPY_CACHE_DIR`, default
~/.cupy/kernel_cache) then answers every compile the engine makes. `specstream kernels warm`
runs it: on a new host, or in an image or init container that shares the cache directory with
the server.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor

from service.backends.cuda import sources
from service.errors import ConfigError


def compile_source(name: str) -> float:
    """Compile cuda/`name` into CuPy's kernel cache as the launcher would; the seconds taken."""
    import cupy as cp

    t0 = time.perf_counter()
    cp.RawModule(code=sources.source_text(name), options=sources.OPTIONS).compile()
    return time.perf_counter() - t0


def compile_sources(names: Sequence[str] = sources.SOURCES,
                    processes: int = 0) -> list[tuple[str, float]]:
    """(name, seconds) for each of `names`, compiled by compile_source: in this process when
    processes is 1, else in up to `processes` spawned processes (0: one per file, at most the
    CPU count), the longest sources first. A compile error raises (CuPy's CompileException,
    with NVRTC's log); ConfigError without CuPy."""
    if processes < 0:
        raise ValueError(f"processes must be >= 0, got {processes}")
    try:
        import cupy  # noqa: F401
    except ImportError as exc:
        raise ConfigError([("kernels warm", f"needs CuPy ({exc}); install the cuda or cuda13 "
                            "extra: pip install -e \".[cuda13]\"")]) from None
    unknown = sorted(set(names) - set(sources.SOURCES))
    if unknown:
        raise ValueError(f"not CUDA sources of the backend: {unknown} (sources.SOURCES: "
                         f"{', '.join(sources.SOURCES)})")
    if processes == 1 or len(names) <= 1:
        return [(n, compile_source(n)) for n in names]
    longest = sorted(names, key=lambda n: -len(sources.source_text(n)))
    workers = min(len(names), processes or os.cpu_count() or 1)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        done = dict(zip(longest, pool.map(compile_source, longest), strict=True))
    return [(n, done[n]) for n in names]
