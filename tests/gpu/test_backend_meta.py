"""What the CUDA backend declares about itself matches what it implements."""

from __future__ import annotations

import pytest

pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


def test_cuda_kv_types_are_the_declared_ones():
    from service.backends import resolve_backend_name
    from service.backends.cuda.backend import CudaBackend
    from service.formats import BACKEND_KV_TYPES as KV_TYPES

    assert tuple(CudaBackend.kv_types) == KV_TYPES["cuda"]
    assert resolve_backend_name("auto") == "cuda"     # a GPU host serves from the GPU by default
