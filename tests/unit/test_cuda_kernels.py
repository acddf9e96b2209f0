"""The kernel registry (service/backends/cuda/kernels.py): names, sources and signatures the
launcher checks every launch against, and `make check-cuda` compares with the compiled PTX."""

from __future__ import annotations

import re

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


# ---- the numbers Python and the kernels share: written once (kernels.py), passed as -D --------

SHARED = kernels.cuda_defines()
_DEFINE = re.compile(r"^[ \t]*#[ \t]*define[ \t]+(\w+)", re.M)
_IF = re.compile(r"^[ \t]*#[ \t]*if\b.*$", re.M)
_COMMENT = re.compile(r"//[^\n]*")


def restated(text: str) -> set[str]:
    """Shared names a kernel file #defines itself."""
    return SHARED.keys() & set(_DEFINE.findall(text))


def unguarded(text: str) -> set[str]:
    """Shared names a kernel file uses in code without an `#if !defined(NAME) #error` guard."""
    code = _COMMENT.sub("", text)
    used = {n for n in SHARED if re.search(rf"\b{n}\b", code)}
    guarded = {n for line in _IF.findall(code) for n in re.findall(r"defined\((\w+)\)", line)}
    return used - guarded


def missing_options(options) -> set[str]:
    """Shared names the compile options do not define with their value."""
    defines = dict(o[2:].split("=", 1) for o in options if o.startswith("-D"))
    return {n for n, v in SHARED.items() if defines.get(n) != str(v)}


def kernel_files():
    return sorted(sources.CUDA_DIR.glob("*.cu*"))


def test_compile_options_carry_every_shared_number():
    assert missing_options(sources.OPTIONS) == set()


def test_no_kernel_file_defines_a_shared_number_itself():
    for path in kernel_files():
        assert not restated(path.read_text()), f"cuda/{path.name}: take them from -D"


def test_kernel_files_stop_without_the_shared_numbers_they_use():
    used = set()
    for path in kernel_files():
        text = path.read_text()
        assert not unguarded(text), f"cuda/{path.name} needs an #error guard"
        used |= {n for n in SHARED if re.search(rf"\b{n}\b", _COMMENT.sub("", text))}
    assert used == SHARED.keys()                     # no number passed that nothing uses


def test_the_drift_checks_catch_a_restated_unguarded_or_missing_number():
    restating = "#define GEMV_WARPS 4\n__global__ void k(int* o) { o[0] = GEMV_WARPS; }\n"
    assert restated(restating) == {"GEMV_WARPS"} and unguarded(restating) == {"GEMV_WARPS"}
    guarded = ("#if !defined(GEMV_WARPS) || !defined(AT_ROWS)\n#error \"-D\"\n#endif\n"
               "__global__ void k(int* o) { o[0] = GEMV_WARPS * AT_ROWS; }  // SAMPLE_THREADS\n")
    assert restated(guarded) == set() and unguarded(guarded) == set()
    short = [o for o in sources.OPTIONS if not o.startswith("-DAT_KEYS=")]
    assert missing_options(short) == {"AT_KEYS"}
    assert missing_options([*short, "-DAT_KEYS=16"]) == {"AT_KEYS"}
