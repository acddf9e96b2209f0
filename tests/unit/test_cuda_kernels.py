"""The contract with the kernels (service/backends/cuda/kernels.py): the registry of names,
sources and signatures the launcher checks every launch against and `make check-cuda` compares
with the compiled PTX, and the numbers Python and the kernels share, written once and passed as
-D defines (the step format's records have tests/unit/test_step_format.py)."""

from __future__ import annotations

import io
import re

import numpy as np
import pytest

from service.backends.cuda import kernels, sources
from service.backends.cuda.types import MOEG_NC, NULL, gemv_choice
from service.tools import cuda_check


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
    for t in kernels.QUANT_TYPES + kernels.FLOAT_TYPES:      # moe.py's grouped GEMVs
        for nc in MOEG_NC:
            assert f"moeg_{t}_c{nc}r{kernels.MOEG_ROWS[nc]}" in reg
            assert f"moeg_glu_{t}_c{nc}r{kernels.MOEG_GLU_ROWS[nc]}" in reg
    assert "moe_group" in reg
    kv = kernels.KV_TYPES
    assert {f"rope_kv_{k}_{v}" for k in kv for v in kv} <= set(reg)
    readers = {kernels.KV_READ[t][0] for t in kv}      # attention.py's names
    assert {f"attn{s}_{k}_{v}_d{d}" for s in ("", "t") for k in readers for v in readers
            for d in (128, 256)} <= set(reg)
    # GEMVs (the expert-grouped moeg_ too) read the blocks; copy_rows (a hidden-state tap)
    # writes a buffer no GEMV reads
    assert all(k.keeps_blocks == (k.name.startswith(("gemv_", "moeg_")) or k.name == "copy_rows")
               for k in reg.values())


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
                [*ok[:2], np.uint64(5), *ok[3:]],               # a u64 that is not NULL
                [*ok[:2], 0, *ok[3:]]):                         # a Python int as a pointer
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


# ---- the registry against the compiled kernels (make check-cuda) --------------------------------

_PTX_TYPE = {kernels.Arg.PTR: "u64", kernels.Arg.I64: "s64", kernels.Arg.U64: "u64",
             kernels.Arg.I32: "u32", kernels.Arg.F32: "f32"}


def ptx_of(entries: dict[str, tuple[str, ...]]) -> str:
    """A PTX text declaring `entries` (name -> parameter types) the way NVRTC writes them."""
    return "\n".join(
        f".visible .entry {name}(\n"
        + ",\n".join(f"\t.param .{t} {name}_param_{i}" for i, t in enumerate(types))
        + "\n)\n.maxntid 128, 1, 1\n{\n\tret;\n}\n" for name, types in entries.items())


def registered(source: str) -> dict[str, tuple[str, ...]]:
    return {k.name: tuple(_PTX_TYPE[a] for a in k.kinds)
            for k in kernels.registry().values() if k.source == source}


def test_ptx_entries_reads_names_and_parameter_types():
    assert kernels.ptx_entries(ptx_of({"a": ("u64", "u32", "f32"), "b": ()})) == {
        "a": ("u64", "u32", "f32"), "b": ()}


def test_the_registered_kernels_as_compiled_have_no_mismatch():
    for source in sources.SOURCES:
        assert kernels.compiled_mismatches(source, ptx_of(registered(source))) == []


def test_a_misspelled_missing_extra_or_misdeclared_kernel_is_reported():
    entries = registered("sampling.cu")
    entries["argmax_rowz"] = entries.pop("argmax_rows")                # misspelled
    entries["chosen_ids"] = entries["chosen_ids"][:-1]                 # an argument short
    entries["record_tokens"] = ("u64", "u64", "u64", "f32", "u32", "u32", "u64")   # T: float
    entries["rms_norm"] = registered("elementwise.cu")["rms_norm"]     # another file's
    entries["helper"] = ("u64",)                                       # not registered
    got = kernels.compiled_mismatches("sampling.cu", ptx_of(entries))
    assert sorted(got) == sorted([
        "argmax_rows is registered but not compiled",
        "argmax_rowz is compiled but not registered",
        "chosen_ids is compiled as (u64, u32, u32), registered as "
        "chosen_ids(records: ptr, ld: i32, L: i32, out: ptr)",
        "record_tokens is compiled as (u64, u64, u64, f32, u32, u32, u64), registered as "
        "record_tokens(ids: ptr, slots: ptr, positions: ptr, T: i32, n_slots: i32, "
        "n_ctx: i32, hist: ptr)",
        "rms_norm is compiled but registered to elementwise.cu",
        "helper is compiled but not registered"])


@pytest.fixture(scope="module")
def nvrtc():
    pytest.importorskip("cuda.bindings.nvrtc")
    return cuda_check.load_nvrtc()


def test_the_compile_check_fails_on_a_source_that_drifted_from_the_registry(nvrtc, tmp_path):
    (tmp_path / "sampling.cu").write_text(
        'extern "C" __global__ void argmax_rowz(const float* l, int ld, int V, int* out) {}\n'
        'extern "C" __global__ void record_tokens(const int* ids, const int* slots,\n'
        '    const int* positions, int T, int n_slots, int n_ctx, int* hist) {}\n'
        'extern "C" __global__ void chosen_ids(const int* records, int ld, int* out) {}\n'
        'extern "C" __global__ void feed_ids(const int* records, int ld, int L,\n'
        '    const int* src, int T, int* ids) {}\n'
        'extern "C" __global__ void sample_rows(const float* logits, int ld, int V,\n'
        '    const int* params, const int* hist, int n_ctx, const int* adj, const int* masks,\n'
        '    int mask_w, float* work, int* counts, int* out) {}\n')
    report = cuda_check.check(nvrtc, ["sampling.cu"], tmp_path, io.StringIO())
    shown = cuda_check._shown(tmp_path / "sampling.cu")
    assert sorted(report.failed) == sorted([
        f"{shown}: argmax_rows is registered but not compiled",
        f"{shown}: argmax_rowz is compiled but not registered",
        f"{shown}: chosen_ids is compiled as (u64, u32, u64), registered as "
        "chosen_ids(records: ptr, ld: i32, L: i32, out: ptr)"])
    # the real file agrees with the registry
    report = cuda_check.check(nvrtc, ["quantize.cu"], sources.CUDA_DIR, io.StringIO())
    assert report.failed == [] and {f.name for _, f in report.rows if f.entry} == {
        k.name for k in kernels.registry().values() if k.source == "quantize.cu"}
