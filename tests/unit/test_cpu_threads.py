"""The CPU backend's thread pools stay inside its `threads`, on whichever thread runs the step.

A step runs numba kernels (quantized matmuls of up to 16 tokens) and BLAS sgemm (prefill tiles).
Both pools are sampled from inside the kernels while a step runs on a thread other than the one
that built the backend (the engine thread, in the server); their sizes must add up to at most
`threads` + 1, the calling thread counted once in each pool.
"""

from __future__ import annotations

import os
import threading

import numba
import numpy as np
import pytest
from threadpoolctl import threadpool_info, threadpool_limits

from service.backends.cpu import backend as cpu
from service.backends.cpu import kernels as cpu_kernels
from service.gguf import quants
from service.gguf.quants import QuantType
from service.gguf.reader import TensorInfo

RNG = np.random.default_rng(3)
CORES = numba.config.NUMBA_NUM_THREADS


def _blas_threads() -> int:
    return max(p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas")


def _q8_matrix(be: cpu.CpuBackend) -> tuple[cpu.CpuMatrix, np.ndarray]:
    w = RNG.standard_normal((64, 128)).astype(np.float32)
    raw = quants.quantize(w, QuantType.Q8_0).reshape(-1)
    return be.load_matrix([TensorInfo("w", QuantType.Q8_0, w.shape, raw)]), raw


def _pools_during(monkeypatch, threads: int, n_tokens: int) -> list[tuple[str, int, int]]:
    """(kernel, numba threads, BLAS threads) seen inside each kernel one matmul of `n_tokens`
    tokens calls, the matmul run on a fresh thread."""
    seen: list[tuple[str, int, int]] = []
    for name in ("dequantize_rows", "matmul_q8"):
        kernel = getattr(cpu_kernels, name)

        def probe(*args, kernel=kernel, name=name):
            seen.append((name, numba.get_num_threads(), _blas_threads()))
            return kernel(*args)

        monkeypatch.setattr(cpu_kernels, name, probe)
    be = cpu.CpuBackend(threads=threads)
    m, raw = _q8_matrix(be)
    x = RNG.standard_normal((n_tokens, 128)).astype(np.float32)
    out = np.empty((n_tokens, 64), np.float32)
    errors: list[BaseException] = []

    def step():
        try:
            be.matmul(x, m, out)
        except BaseException as exc:   # re-raised on the test thread
            errors.append(exc)

    t = threading.Thread(target=step)
    t.start()
    t.join()
    if errors:
        raise errors[0]
    np.testing.assert_allclose(out, x @ quants.dequantize(raw, QuantType.Q8_0, (64, 128)).T,
                               rtol=1e-4, atol=1e-4)
    return seen


@pytest.mark.parametrize("n_tokens", [1, 64])
def test_one_thread_bounds_both_pools(monkeypatch, n_tokens):
    seen = _pools_during(monkeypatch, 1, n_tokens)
    assert seen, "no kernel ran"
    assert all(numba_n == 1 and blas_n == 1 for _, numba_n, blas_n in seen), seen


@pytest.mark.skipif(CORES < 2 or (os.cpu_count() or 1) < 2, reason="needs 2 cores")
@pytest.mark.parametrize("n_tokens", [1, 64])
def test_pools_never_oversubscribe(monkeypatch, n_tokens):
    seen = _pools_during(monkeypatch, 2, n_tokens)
    assert seen, "no kernel ran"
    for kernel, numba_n, blas_n in seen:
        assert numba_n + blas_n <= 2 + 1, (kernel, numba_n, blas_n)
        # the pool that does the work of the step gets all the threads
        busy = blas_n if kernel == "dequantize_rows" else numba_n
        assert busy == 2, (kernel, numba_n, blas_n)


@pytest.mark.skipif(CORES < 2 or (os.cpu_count() or 1) < 2, reason="needs 2 cores")
def test_budget_applies_after_main_thread_set(monkeypatch):
    """Steps run on the main thread first (as in tests and CLIs), and OpenBLAS's count is
    also set there by other code; a later engine thread still gets its budget."""
    be = cpu.CpuBackend(threads=1)
    m, _ = _q8_matrix(be)
    x = RNG.standard_normal((64, 128)).astype(np.float32)
    be.matmul(x, m, np.empty((64, 64), np.float32))       # a prefill step on the main thread
    threadpool_limits(1, user_api="blas")                  # what other code may do, kept
    seen = _pools_during(monkeypatch, 2, 64)
    assert ("dequantize_rows", 1, 2) in seen, seen
