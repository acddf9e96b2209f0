"""The kernel registry (service/backends/cuda/kernels.py): names, sources and signatures the
launcher checks every launch against, and `make check-cuda` compares with the compiled PTX."""

from __future__ import annotations

import numpy as np
import pytest

from service.backends.cuda import kernels, sources
from service.backends.cuda.types import NULL, gemv_choice


class Dev:
    """A stand-in device array (the launcher's pointer arguments have `.data`)."""

    data = None


def test_every_family_lives_in_a_compiled_source():
    assert {k.source for k in kernels.registry().values()} == set(sources.SOURCES)


def test_the_names_the_launchers_build_are_registered():
    reg = kernels.registry()
    for t in kernels.QUANT_TYPES:
        for n in range(1, 41):
            nc, r = gemv_choice(n, 2)
            assert f"gemv_{t}_c{nc}r{r}" in reg
        for v in ("e", "p", "n"):
            assert f"gemv_{t}_c1r1{v}" in reg
        assert f"dequant_{t}" in reg and f"embed_{t}" in reg
    for t in kernels.GEMV_PREFETCH_TYPES:
        assert f"gemv_{t}_c1r1pn" in reg
    kv = ("f16", "q8_0", "q4_0")
    assert {f"rope_kv_{k}_{v}" for k in kv for v in kv} <= set(reg)
    assert {f"attn_{k}_{v}_d{d}" for k in kv for v in kv for d in (128, 256)} <= set(reg)
    assert all(k.keeps_blocks == k.name.startswith("gemv_") for k in reg.values())


def test_unknown_name_is_a_key_error_naming_the_registry():
    with pytest.raises(KeyError, match="no kernel gemv_q4_k_c3r1 in the registry"):
        kernels.kernel("gemv_q4_k_c3r1")


def test_arguments_are_checked_against_the_signature():
    k = kernels.kernel("add_rows")         # a:ptr lda:i32 b:ptr ldb,N:i32 out:ptr ldo:i32
    ok = [Dev(), np.int32(1), NULL, np.int32(0), np.int32(8), Dev(), np.int32(8)]
    k.check(ok)
    for bad in (ok[:-1],                                        # too few
                [*ok[:1], np.int64(1), *ok[2:]],                # i64 where i32 is wanted
                [*ok[:1], 1, *ok[2:]],                          # a Python int
                [*ok[:2], np.int32(0), *ok[3:]],                # a scalar where a pointer is
                [*ok[:2], np.uint64(5), *ok[3:]]):              # a u64 that is not NULL
        with pytest.raises(TypeError, match=r"add_rows: arguments .* do not match add_rows\("
                                            r"a: ptr, lda: i32, b: ptr, ldb: i32"):
            k.check(bad)
