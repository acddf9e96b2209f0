"""GPU test fixtures. Without CuPy or a CUDA device nothing here is collected (the CPU CI
never imports CuPy); `make test-gpu` then reports that no GPU test ran."""

from __future__ import annotations

import pytest


def _have_gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


collect_ignore_glob = [] if _have_gpu() else ["test_*.py"]


@pytest.fixture(scope="session")
def cuda():
    """An eager CUDA backend whose matmuls are GEMVs at every width (the kernel tests address
    the GEMV with prefill-sized steps too; the GEMM path has test_prefill_gemm.py); tests run
    on its stream, so their own copies and fills are ordered with its kernels."""
    from service.backends.cuda.backend import CudaBackend

    be = CudaBackend(graphs=False, prefill_gemm_min_tokens=None)
    with be.stream:
        yield be
