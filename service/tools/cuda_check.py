"""Compile every CUDA kernel source with NVRTC for the H200, on a machine without a GPU.

    python -m service.tools.cuda_check [--cuda-dir DIR] [--sources a.cu b.cu]

Each name in `cuda_sources.SOURCES` is expanded by `cuda_sources.source_text` and compiled to a
CUBIN for `cuda_sources.ARCH` with `cuda_sources.OPTIONS` plus `--ptxas-options=-v`, so ptxas
reports the registers, stack, spills and shared memory of every function; those go out as one
table. The exit status is 1 when a source is missing, does not compile, or has a function that
spills (spill stores or loads above 0 bytes: values kept in local memory, which lives in device
memory behind the caches, instead of registers), or when the kernels compiled from a source of
the kernel registry differ from it (`service/backends/cuda/kernels.py` compiled_mismatches: a
registered name not compiled, an `extern "C"` kernel not registered, a parameter list that is
not the registered signature, read from the PTX's `.entry` lines). NVRTC comes from the
`nvidia-cuda-nvrtc` and `cuda-bindings` wheels (the `dev` extra); neither CuPy nor a driver is
needed, and `cuda.bindings` is imported in `main`, not at import time.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from service.backends.cuda import kernels
from service.backends.cuda import sources as cuda_sources

PTXAS_VERBOSE = "--ptxas-options=-v"

# ---- ptxas -v log ----------------------------------------------------------------------------

# ptxas info    : Compiling entry function 'add' for 'sm_90'
_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
# ptxas info    : Function properties for add
_PROPS = re.compile(r"Function properties for (\S+)")
# ptxas         .     344 bytes stack frame, 348 bytes spill stores, 468 bytes spill loads
_FRAME = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
# ptxas info : Used 32 registers, used 1 barriers, 256 bytes cumulative stack size, 1024 bytes smem
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


@dataclass
class FunctionUsage:
    """What ptxas reports for one function of a CUBIN (byte counts per thread, smem per block)."""

    name: str                      # as ptxas prints it: mangled unless declared extern "C"
    entry: bool = False            # a __global__ kernel; else a device function not inlined
    registers: int | None = None   # only reported for entry functions
    stack: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    smem: int = 0                  # static __shared__ bytes

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


def parse_ptxas_log(log: str) -> list[FunctionUsage]:
    """Every function named in a `ptxas -v` log, kernels first, each in the order ptxas met it."""
    funcs: dict[str, FunctionUsage] = {}
    entry: FunctionUsage | None = None   # the kernel a "Used N registers" line belongs to
    props: FunctionUsage | None = None   # the function a stack-frame line belongs to
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            entry = funcs.setdefault(m.group(1), FunctionUsage(m.group(1)))
            entry.entry = True
        elif m := _PROPS.search(line):
            props = funcs.setdefault(m.group(1), FunctionUsage(m.group(1)))
        elif (m := _FRAME.search(line)) and props is not None:
            props.stack, props.spill_stores, props.spill_loads = map(int, m.groups())
        elif (m := _USED.search(line)) and entry is not None:
            entry.registers = int(m.group(1))
            if s := _SMEM.search(line):
                entry.smem = int(s.group(1))
    return sorted(funcs.values(), key=lambda f: not f.entry)


def compiler_messages(log: str) -> str:
    """The log without ptxas's report lines: the front end's errors and warnings."""
    return "\n".join(ln for ln in log.splitlines() if not ln.startswith("ptxas")).strip()


# ---- where a line of an expanded source came from ----------------------------------------------

_BEGIN = re.compile(r"^// ---- begin (.+)$")
_END = re.compile(r"^// ---- end (.+)$")


def line_origins(text: str, name: str) -> list[tuple[str, int]]:
    """(file, 1-based line) for each line of `source_text(name)`.

    `source_text` replaces an `#include "h"` line by a begin marker, h's text and an end marker:
    both markers stand for the include line, the lines between them are h's own.
    """
    stack = [[name, 0]]
    out: list[tuple[str, int]] = []
    for line in text.split("\n"):
        if m := _BEGIN.match(line):
            stack[-1][1] += 1
            out.append((stack[-1][0], stack[-1][1]))
            stack.append([m.group(1), 0])
        elif _END.match(line) and len(stack) > 1:
            stack.pop()
            out.append((stack[-1][0], stack[-1][1]))
        else:
            stack[-1][1] += 1
            out.append((stack[-1][0], stack[-1][1]))
    return out


def map_log(log: str, name: str, text: str, where: Path) -> str:
    """NVRTC's `name(N): ...` lines renamed to the file and line they came from, under `where`."""
    origins = line_origins(text, name)
    at = re.compile(rf"^{re.escape(name)}\((\d+)\)(?=: )", re.M)

    def origin(m: re.Match) -> str:
        n = int(m.group(1))
        file, line = origins[n - 1] if 0 < n <= len(origins) else (name, n)
        return f"{_shown(where / file)}({line})"

    return at.sub(origin, log)


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


# ---- NVRTC ---------------------------------------------------------------------------------------


def load_nvrtc() -> Any:
    """`cuda.bindings.nvrtc`, with libnvrtc found; SystemExit with the install line if not."""
    hint = 'install the dev extra: pip install -e ".[dev]" (nvidia-cuda-nvrtc, cuda-bindings)'
    try:
        from cuda.bindings import nvrtc
    except ImportError as e:
        raise SystemExit(f"cuda_check: cuda.bindings is not installed ({e}); {hint}") from None
    try:
        _checked(nvrtc, nvrtc.nvrtcVersion(), "nvrtcVersion")
    except RuntimeError as e:   # cuda-bindings present, libnvrtc not found
        raise SystemExit(f"cuda_check: libnvrtc cannot be loaded ({e}); {hint}") from None
    return nvrtc


def _checked(nvrtc: Any, ret: tuple, call: str) -> Any:
    """The values after the status of a cuda.bindings call; RuntimeError on a bad status."""
    if ret[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"{call}: {ret[0].name}")
    return ret[1] if len(ret) == 2 else ret[1:]


@dataclass
class Compiled:
    status: str          # NVRTC_SUCCESS or the nvrtcResult name of the failure
    log: str
    cubin: bytes = b""
    ptx: str = ""        # the PTX on the way to the CUBIN (the kernels' parameter lists)


def compile_cubin(nvrtc: Any, name: str, text: str, options: Sequence[str]) -> Compiled:
    """One translation unit compiled to a CUBIN (the architecture is among `options`)."""
    prog = _checked(nvrtc, nvrtc.nvrtcCreateProgram(text.encode(), name.encode(), 0, [], []),
                    "nvrtcCreateProgram")
    try:
        opts = [o.encode() for o in options]
        (result,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        size = _checked(nvrtc, nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        buf = b" " * size
        _checked(nvrtc, nvrtc.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
        log = buf.rstrip(b"\0 ").decode(errors="replace")
        if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            return Compiled(result.name, log)
        size = _checked(nvrtc, nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = b" " * size
        _checked(nvrtc, nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        size = _checked(nvrtc, nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
        ptx = b" " * size
        _checked(nvrtc, nvrtc.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
        return Compiled(result.name, log, cubin, ptx.rstrip(b"\0 ").decode(errors="replace"))
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


# ---- the check -----------------------------------------------------------------------------------


@contextmanager
def _cuda_dir(path: Path) -> Iterator[None]:
    """`source_text` reads from `path` for the duration (it reads the module's CUDA_DIR)."""
    saved = cuda_sources.CUDA_DIR
    cuda_sources.CUDA_DIR = path
    try:
        yield
    finally:
        cuda_sources.CUDA_DIR = saved


@dataclass
class Report:
    rows: list[tuple[str, FunctionUsage]] = field(default_factory=list)   # (source, function)
    failed: list[str] = field(default_factory=list)                        # one line per failure


def check(nvrtc: Any, names: Sequence[str], cuda_dir: Path, out: TextIO,
          named_in: str = "--sources") -> Report:
    """Compile each of `names` under `cuda_dir`; compiler messages go to `out` as they come.

    `named_in` says where the names came from, for the message about missing files.
    """
    options = (f"--gpu-architecture={cuda_sources.ARCH}", *cuda_sources.OPTIONS, PTXAS_VERBOSE)
    report = Report()
    missing = [n for n in names if not (cuda_dir / n).is_file()]
    texts: dict[str, str] = {}
    with _cuda_dir(cuda_dir):
        for name in (n for n in names if n not in missing):
            try:
                texts[name] = cuda_sources.source_text(name)
            except (OSError, ValueError) as e:   # a missing header, an include cycle
                report.failed.append(f"{_shown(cuda_dir / name)}: cannot expand its "
                                     f"includes: {e}")
    # NVRTC releases the GIL: the sources compile side by side, the longest texts first (the
    # time goes roughly with the length; a long one started last would finish alone), and are
    # reported in the order named
    with ThreadPoolExecutor(max_workers=max(1, min(len(texts), os.cpu_count() or 1))) as pool:
        done = {n: pool.submit(compile_cubin, nvrtc, n, texts[n], options)
                for n in sorted(texts, key=lambda n: -len(texts[n]))}
        for name, text in texts.items():
            shown = _shown(cuda_dir / name)
            res = done[name].result()
            messages = map_log(compiler_messages(res.log), name, text, cuda_dir)
            if res.status != "NVRTC_SUCCESS":
                print(f"{shown}: compile failed ({res.status})\n{messages}\n", file=out)
                report.failed.append(f"{shown}: does not compile ({res.status})")
                continue
            if messages:
                print(f"{shown}: compiled with messages\n{messages}\n", file=out)
            funcs = parse_ptxas_log(res.log)
            report.rows += [(name, f) for f in funcs]
            report.failed += [
                f"{shown}: {f.name} spills ({f.spill_stores} bytes stores, "
                f"{f.spill_loads} bytes loads)" for f in funcs if f.spills]
            if name in kernels.registered_sources():
                report.failed += [f"{shown}: {m}" for m in kernels.compiled_mismatches(name,
                                                                                     res.ptx)]
    if missing:
        report.failed.append(
            f"missing from {_shown(cuda_dir)}/: {', '.join(missing)} (named in {named_in})")
    return report


_COLUMNS = ("source", "function", "regs", "spill st", "spill ld", "stack", "smem", "")


def format_table(rows: Sequence[tuple[str, FunctionUsage]]) -> str:
    """One line per function: registers per thread, bytes of spills and stack, smem per block."""
    cells = [_COLUMNS]
    for source, f in rows:
        note = "SPILLS" if f.spills else ("" if f.entry else "device function")
        regs = "-" if f.registers is None else str(f.registers)
        cells.append((source, f.name, regs, str(f.spill_stores), str(f.spill_loads),
                      str(f.stack), str(f.smem), note))
    widths = [max(len(r[i]) for r in cells) for i in range(len(_COLUMNS))]
    lines = []
    for r in cells:
        left = [r[i].ljust(widths[i]) for i in (0, 1)]
        right = [r[i].rjust(widths[i]) for i in range(2, 7)]
        lines.append("  ".join([*left, *right, r[7]]).rstrip())
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, out: TextIO = sys.stdout) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m service.tools.cuda_check",
        description=f"Compile the CUDA kernels with NVRTC for {cuda_sources.ARCH}; "
                    "fail on a compile error, a spill or a missing source.")
    ap.add_argument("--cuda-dir", type=Path, default=cuda_sources.CUDA_DIR,
                    help="directory of the .cu/.cuh files (default: the repository's cuda/)")
    ap.add_argument("--sources", nargs="+", metavar="FILE",
                    help="file names under --cuda-dir (default: SOURCES)")
    args = ap.parse_args(argv)
    names = args.sources or list(cuda_sources.SOURCES)
    named_in = "--sources" if args.sources else "SOURCES in service/backends/cuda/sources.py"
    nvrtc = load_nvrtc()
    major, minor = _checked(nvrtc, nvrtc.nvrtcVersion(), "nvrtcVersion")
    flags = " ".join((*cuda_sources.OPTIONS, PTXAS_VERBOSE))
    print(f"NVRTC {major}.{minor}, {cuda_sources.ARCH}, {flags}: "
          f"{len(names)} source(s) in {_shown(args.cuda_dir)}/", file=out)
    report = check(nvrtc, names, args.cuda_dir, out, named_in)
    if report.rows:
        print(format_table(report.rows), file=out)
    for line in report.failed:
        print(f"FAIL {line}", file=out)
    n_kernels = sum(f.entry for _, f in report.rows)
    verdict = "failed" if report.failed else "ok"
    print(f"cuda_check {verdict}: {n_kernels} kernel(s), {len(report.failed)} failure(s)",
          file=out)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
