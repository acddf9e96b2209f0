"""The CPU backend's thread budget: numba's and BLAS's pools sized per step so that together
they never use more than the backend's `threads`."""

from __future__ import annotations

import threading
from collections.abc import Callable

_NUMBA_SET = threading.local()   # .n: numba's pool size last set on this thread
_BLAS_SET = [0]                  # the BLAS pool size last set here (0: not yet); per process


def _blas_setters() -> list[Callable[[int], object]]:
    """One pool-size setter per loaded BLAS library. For OpenBLAS, openblas_set_num_threads
    called from a thread other than the main one has no effect once the main thread has
    called it (test_cpu_threads.py::test_budget_applies_after_main_thread_set shows it with
    numpy's OpenBLAS); openblas_set_num_threads_local takes effect from any thread."""
    from threadpoolctl import ThreadpoolController

    setters = []
    for lib in ThreadpoolController().select(user_api="blas").lib_controllers:
        local = None
        if lib.internal_api == "openblas":
            names = ("openblas_set_num_threads_local", "scipy_openblas_set_num_threads_local",
                     "openblas_set_num_threads_local64_")
            local = next((getattr(lib.dynlib, n) for n in names if hasattr(lib.dynlib, n)), None)
        setters.append(local or lib.set_num_threads)
    return setters


class ThreadBudget:
    """The backend's `threads` given to one pool at a time, so the two never oversubscribe.

    Steps of up to `invariant_tokens` tokens run numba kernels on `threads` threads while BLAS
    (float32 weights' row products) runs on the calling thread alone; longer steps (prefill) run
    sgemm on `threads` BLAS threads while numba (tile dequantization) runs on the calling thread
    alone. Either way at most `threads` threads compute at once: pools sized to all cores each
    compete with each other and with any other busy process for the cores, and sgemm waits for
    its slowest thread (bench/prefill_contention.py times prefill beside a busy neighbour).
    numba's count is per calling thread and BLAS's per process, so the budget is applied by the
    thread that runs the step, whenever the size it needs differs from the last one set.
    """

    def __init__(self, threads: int, invariant_tokens: int):
        import numba

        self.threads = min(threads or numba.config.NUMBA_NUM_THREADS,
                           numba.config.NUMBA_NUM_THREADS)
        self.invariant_tokens = invariant_tokens
        self._set_numba = numba.set_num_threads
        self._set_blas = _blas_setters()

    def enter(self, n_tokens: int) -> None:
        """Size both pools for a step of `n_tokens` tokens on the calling thread."""
        sgemm = n_tokens > self.invariant_tokens
        n_numba, n_blas = (1, self.threads) if sgemm else (self.threads, 1)
        if getattr(_NUMBA_SET, "n", 0) != n_numba:
            self._set_numba(n_numba)
            _NUMBA_SET.n = n_numba
        if _BLAS_SET[0] != n_blas:
            for set_blas in self._set_blas:
                set_blas(n_blas)
            _BLAS_SET[0] = n_blas
