"""The CUDA compile check: ptxas log parsing, line mapping through includes, and NVRTC runs on
small kernels written here (a clean one, one with a syntax error, one that spills)."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from service.backends.cuda import sources as cuda_sources
from service.tools import cuda_check
from service.tools.cuda_check import FunctionUsage, line_origins, parse_ptxas_log

ROOT = Path(__file__).resolve().parents[2]

# ptxas -v as NVRTC 13.5 logs it for sm_90 (one spilling kernel, one clean kernel using shared
# memory, one device function kept out of line), with a front-end warning before it.
PTXAS_LOG = """\
k.cu(2): warning #177-D: variable "unused" was declared but never referenced

ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_Z5spillPKfPfi' for 'sm_90'
ptxas info    : Function properties for _Z5spillPKfPfi
ptxas         .     344 bytes stack frame, 348 bytes spill stores, 468 bytes spill loads
ptxas info    : Used 32 registers, used 0 barriers, 344 bytes cumulative stack size
ptxas info    : Compile time = 48.922 ms
ptxas info    : Compiling entry function 'sm' for 'sm_90'
ptxas info    : Function properties for sm
ptxas         .     256 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 256 bytes cumulative stack size, 1024 bytes smem
ptxas info    : Compile time = 29.504 ms
ptxas info    : Function properties for _Z1fPfi
ptxas         .     8 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
"""


def test_parse_ptxas_log_reads_every_function():
    funcs = {f.name: f for f in parse_ptxas_log(PTXAS_LOG)}
    assert list(funcs) == ["_Z5spillPKfPfi", "sm", "_Z1fPfi"]
    assert funcs["_Z5spillPKfPfi"] == FunctionUsage(
        "_Z5spillPKfPfi", entry=True, registers=32, stack=344, spill_stores=348,
        spill_loads=468, smem=0)
    assert funcs["sm"] == FunctionUsage(
        "sm", entry=True, registers=40, stack=256, spill_stores=0, spill_loads=0, smem=1024)
    assert funcs["_Z1fPfi"] == FunctionUsage("_Z1fPfi", entry=False, registers=None, stack=8)
    assert [f.spills for f in funcs.values()] == [True, False, False]


def test_parse_ptxas_log_lists_kernels_before_device_functions():
    # a device function reported before the kernels still comes after them
    log = PTXAS_LOG.split("ptxas info    : 0 bytes gmem\n")[1]
    head, dev = log.split("ptxas info    : Function properties for _Z1fPfi\n")
    funcs = parse_ptxas_log("ptxas info    : Function properties for _Z1fPfi\n" + dev + head)
    assert [f.name for f in funcs] == ["_Z5spillPKfPfi", "sm", "_Z1fPfi"]
    assert funcs[2].stack == 8 and funcs[0].stack == 344


def test_compiler_messages_drop_the_ptxas_report():
    assert cuda_check.compiler_messages(PTXAS_LOG) == (
        'k.cu(2): warning #177-D: variable "unused" was declared but never referenced')


def test_format_table_marks_spills_and_device_functions():
    table = cuda_check.format_table([("k.cu", f) for f in parse_ptxas_log(PTXAS_LOG)])
    header, spill, sm, dev = table.splitlines()
    assert header.split() == ["source", "function", "regs", "spill", "st", "spill", "ld",
                              "stack", "smem"]
    assert spill.split() == ["k.cu", "_Z5spillPKfPfi", "32", "348", "468", "344", "0", "SPILLS"]
    assert sm.split() == ["k.cu", "sm", "40", "0", "0", "256", "1024"]
    assert dev.split() == ["k.cu", "_Z1fPfi", "-", "0", "0", "8", "0", "device", "function"]


# ---- include expansion keeps the lines NVRTC reports --------------------------------------------


@pytest.fixture
def cuda_dir(tmp_path, monkeypatch):
    """A kernel directory that `cuda_sources.source_text` reads, with helpers to write files."""
    monkeypatch.setattr(cuda_sources, "CUDA_DIR", tmp_path)
    return tmp_path


def write(d: Path, name: str, text: str) -> None:
    (d / name).write_text(textwrap.dedent(text))


def test_line_origins_follow_includes_and_the_blank_lines_around_them(cuda_dir):
    write(cuda_dir, "inner.cuh", "int inner1;\nint inner2;\n")
    write(cuda_dir, "outer.cuh", '#include "inner.cuh"\n\nint outer3;\n')
    write(cuda_dir, "k.cu", 'int k1;\n\n#include "outer.cuh"\n\n#include "inner.cuh"\n\nint k7;\n')
    text = cuda_sources.source_text("k.cu")
    at = dict(zip(text.split("\n"), line_origins(text, "k.cu"), strict=True))
    assert at["int k1;"] == ("k.cu", 1)
    assert at["int inner1;"] == ("inner.cuh", 1)
    assert at["int inner2;"] == ("inner.cuh", 2)
    assert at["int outer3;"] == ("outer.cuh", 3)
    assert at["int k7;"] == ("k.cu", 7)


# ---- lazy imports and missing wheels -------------------------------------------------------------


def test_import_loads_neither_nvrtc_nor_cupy():
    code = ("import sys, service.tools.cuda_check; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('cupy', 'cuda')))")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    assert run.stdout.strip() == "[]"


def test_missing_bindings_exit_with_the_install_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)   # import raises ImportError
    with pytest.raises(SystemExit) as exc:
        cuda_check.main(["--sources", "k.cu"])
    assert "cuda.bindings is not installed" in str(exc.value)
    assert "nvidia-cuda-nvrtc" in str(exc.value) and ".[dev]" in str(exc.value)


def test_bindings_without_libnvrtc_exit_with_the_install_line(monkeypatch):
    def version():   # what cuda-bindings raises when cuda-pathfinder finds no libnvrtc
        raise RuntimeError('Failure finding "libnvrtc.so.13"')

    fake = types.ModuleType("cuda.bindings")
    fake.nvrtc = types.SimpleNamespace(nvrtcVersion=version)
    monkeypatch.setitem(sys.modules, "cuda", types.ModuleType("cuda"))
    monkeypatch.setitem(sys.modules, "cuda.bindings", fake)
    with pytest.raises(SystemExit) as exc:
        cuda_check.main(["--sources", "k.cu"])
    assert "libnvrtc cannot be loaded" in str(exc.value) and "libnvrtc.so.13" in str(exc.value)
    assert "nvidia-cuda-nvrtc" in str(exc.value)


# ---- NVRTC ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def nvrtc():
    pytest.importorskip("cuda.bindings.nvrtc")
    return cuda_check.load_nvrtc()


GOOD = """\
#include "twice.cuh"

extern "C" __global__ void add_twice(const float* a, float* b, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) b[i] += twice(a[i]);
}
"""
TWICE = "__device__ inline float twice(float x) { return 2.0f * x; }\n"
# the ";" missing at the end of line 4 is reported at line 5, where the next statement starts
SYNTAX_ERROR = """\
#include "twice.cuh"

extern "C" __global__ void broken(float* b) {
    b[0] = twice(1.0f)
    b[1] = 2.0f;
}
"""
# 128 live floats per thread against the 32 registers that 2 blocks of 1024 threads leave each
SPILL = """\
extern "C" __global__ void __launch_bounds__(1024, 2) spill(const float* a, float* b) {
    float t[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) t[i] = a[i * 1024 + threadIdx.x];
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < 128; ++j) s += t[j] * t[(j * 37) % 128];
    b[threadIdx.x] = s;
}
"""


def run_main(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    rc = cuda_check.main(list(argv), out=out)
    return rc, out.getvalue()


@pytest.fixture
def kernels(tmp_path):
    write(tmp_path, "twice.cuh", TWICE)
    write(tmp_path, "good.cu", GOOD)
    write(tmp_path, "syntax.cu", SYNTAX_ERROR)
    write(tmp_path, "spill.cu", SPILL)
    return tmp_path


def test_clean_kernel_passes_with_its_registers(nvrtc, kernels):
    report = cuda_check.check(nvrtc, ["good.cu"], kernels, io.StringIO())
    assert report.failed == []
    [(source, f)] = report.rows
    assert source == "good.cu" and f.name == "add_twice" and f.entry
    assert f.registers is not None and 0 < f.registers <= 255
    assert not f.spills
    rc, out = run_main("--cuda-dir", str(kernels), "--sources", "good.cu")
    assert rc == 0
    row = next(ln for ln in out.splitlines() if "add_twice" in ln).split()
    assert row == ["good.cu", "add_twice", str(f.registers), "0", "0", str(f.stack), "0"]
    assert out.splitlines()[-1] == "cuda_check ok: 1 kernel(s), 0 failure(s)"


def test_arch_and_options_come_from_the_contract(nvrtc, kernels, monkeypatch):
    write(kernels, "flags.cu", """\
        #if __CUDA_ARCH__ != 900 || !defined(FROM_OPTIONS)
        #error not compiled for sm_90 with OPTIONS
        #endif
        extern "C" __global__ void k(float* b) { b[0] = 1.0f; }
        """)
    rc, out = run_main("--cuda-dir", str(kernels), "--sources", "flags.cu")
    assert rc == 1 and "not compiled for sm_90 with OPTIONS" in out
    monkeypatch.setattr(cuda_sources, "OPTIONS", (*cuda_sources.OPTIONS, "-DFROM_OPTIONS"))
    assert run_main("--cuda-dir", str(kernels), "--sources", "flags.cu")[0] == 0
    monkeypatch.setattr(cuda_sources, "ARCH", "sm_80")
    assert run_main("--cuda-dir", str(kernels), "--sources", "flags.cu")[0] == 1


def test_syntax_error_fails_naming_file_line_and_caret(nvrtc, kernels):
    rc, out = run_main("--cuda-dir", str(kernels), "--sources", "good.cu", "syntax.cu")
    assert rc == 1
    shown = cuda_check._shown(kernels / "syntax.cu")
    lines = out.splitlines()
    i = lines.index(f"{shown}(5): error: expected a \";\"")
    assert lines[i + 1].strip() == "b[1] = 2.0f;"
    assert lines[i + 2].strip() == "^"
    assert f"FAIL {shown}: does not compile (NVRTC_ERROR_COMPILATION)" in lines
    assert any("add_twice" in ln for ln in lines)   # the other source is still checked


def test_error_in_a_header_names_the_header(nvrtc, kernels):
    write(kernels, "twice.cuh", "\n__device__ inline float twice(float x) { return 2.0f * y; }\n")
    rc, out = run_main("--cuda-dir", str(kernels), "--sources", "good.cu")
    assert rc == 1
    assert f'{cuda_check._shown(kernels / "twice.cuh")}(2): error: identifier "y" is undefined' \
        in out.splitlines()


def test_spilling_kernel_fails(nvrtc, kernels):
    rc, out = run_main("--cuda-dir", str(kernels), "--sources", "spill.cu", "good.cu")
    assert rc == 1
    row = next(ln for ln in out.splitlines() if ln.startswith("spill.cu")).split()
    assert row[1] == "spill" and row[-1] == "SPILLS"
    assert int(row[3]) > 0 or int(row[4]) > 0
    fails = [ln for ln in out.splitlines() if ln.startswith("FAIL ")]
    assert len(fails) == 1 and "spill spills" in fails[0]


def test_missing_sources_are_listed(nvrtc, kernels):
    rc, out = run_main("--cuda-dir", str(kernels), "--sources", "good.cu", "a.cu", "b.cu")
    assert rc == 1
    assert f"FAIL missing from {cuda_check._shown(kernels)}/: a.cu, b.cu (named in --sources)" \
        in out.splitlines()
    assert any("add_twice" in ln for ln in out.splitlines())


def test_default_sources_come_from_the_contract(nvrtc, kernels, monkeypatch):
    monkeypatch.setattr(cuda_sources, "SOURCES", ("good.cu", "absent.cu"))
    rc, out = run_main("--cuda-dir", str(kernels))
    assert rc == 1
    assert any("add_twice" in ln for ln in out.splitlines())
    assert "absent.cu (named in SOURCES in service/backends/cuda/sources.py)" in out
    assert "good.cu" not in next(ln for ln in out.splitlines() if "missing" in ln)


def test_missing_header_fails(nvrtc, kernels):
    (kernels / "twice.cuh").unlink()
    rc, out = run_main("--cuda-dir", str(kernels), "--sources", "good.cu")
    assert rc == 1
    assert "cannot expand its includes" in out and "twice.cuh" in out
