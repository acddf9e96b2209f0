"""Every CUDA kernel's parameter list, as NVRTC compiles it (no GPU, no CuPy).

Each source of `cuda_sources.SOURCES` is expanded by `cuda_sources.source_text` (the text the
CUDA backend hands CuPy's RawModule) and compiled to PTX for the virtual architecture of
`cuda_sources.ARCH` with `cuda_sources.OPTIONS`. The PTX of an `extern "C"` kernel reads

    .visible .entry rms_norm(
        .param .u64 rms_norm_param_0,      a pointer or a 64-bit integer
        .param .u32 rms_norm_param_1,      int / unsigned
        .param .f32 rms_norm_param_6,      float
        ...
    )
    .maxntid 128, 1, 1                     __launch_bounds__(128): threads per block at most

so the compiler, not a reading of the source, says how many arguments a kernel takes, of which
size, and how many threads a block may have. Compiling every source takes ~30 s on two cores;
the parsed lists are kept in pytest's cache (`.pytest_cache`, per source, keyed by the text,
the options and the NVRTC version), so a later run with unchanged kernels does not compile.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from service.backends.cuda import sources as cuda_sources
from service.tools import cuda_check

CACHE_PREFIX = "specstream/kernel-signatures/"

# One `.entry name( params ) directives {` of a PTX module.
_ENTRY = re.compile(r"\.entry\s+(\w+)\s*\(([^)]*)\)([^{]*)\{")
# .param .u64 name | .param .align 8 .b8 name[16] (a struct passed by value)
_PARAM = re.compile(r"\.param\s+(?:\.align\s+\d+\s+)?\.(\w+)\s+(?:\.ptr[\w.\s]*?\s)?\w+"
                    r"(\[\d+\])?")
_BOUNDS = re.compile(r"\.(maxntid|reqntid)\s+(\d+)(?:\s*,\s*(\d+))?(?:\s*,\s*(\d+))?")


class NvrtcUnavailable(RuntimeError):
    """cuda.bindings or libnvrtc is missing (the dev extra is not installed)."""


@dataclass(frozen=True)
class KernelSignature:
    name: str
    source: str                       # file name under cuda/
    params: tuple[str, ...]           # PTX parameter types in order: "u64", "u32", "f32", ...
    max_threads: int | None           # threads per block allowed by __launch_bounds__

    def describe(self) -> str:
        bound = "" if self.max_threads is None else f" [at most {self.max_threads} threads]"
        return f"{self.name}({', '.join('.' + p for p in self.params)}){bound}"


@dataclass(frozen=True)
class CompiledKernels:
    """The kernels of every source, as compiled for the compile check's architecture."""

    nvrtc_version: tuple[int, int]
    arch: str                                        # e.g. compute_90
    options: tuple[str, ...]                         # what RawModule must be given
    sources: dict[str, str]                          # file name -> expanded text (source_text)
    texts: dict[str, str]                            # sha256 of an expanded text -> file name
    by_source: dict[str, dict[str, KernelSignature]]  # file name -> kernel name -> signature

    @property
    def kernels(self) -> dict[str, KernelSignature]:
        return {k: s for per in self.by_source.values() for k, s in per.items()}

    def source_of(self, text: str) -> str | None:
        return self.texts.get(text_hash(text))


def text_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def parse_ptx(ptx: str, source: str) -> dict[str, KernelSignature]:
    """Every `.entry` of a PTX module with its parameter types and launch bound."""
    out = {}
    for m in _ENTRY.finditer(ptx):
        name, params, directives = m.groups()
        types = []
        for p in (p for p in params.split(",") if p.strip()):
            pm = _PARAM.search(p)
            if pm is None:
                raise ValueError(f"{source}: cannot read parameter {p.strip()!r} of {name}")
            types.append(pm.group(1) + (pm.group(2) or ""))
        bound = None
        if b := _BOUNDS.search(directives):
            bound = 1
            for d in b.groups()[1:]:
                bound *= int(d or 1)
        out[name] = KernelSignature(name, source, tuple(types), bound)
    return out


def _ptx(nvrtc: Any, name: str, text: str, options: Iterable[str]) -> str:
    check = cuda_check._checked
    prog = check(nvrtc, nvrtc.nvrtcCreateProgram(text.encode(), name.encode(), 0, [], []),
                 "nvrtcCreateProgram")
    try:
        opts = [o.encode() for o in options]
        (result,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            size = check(nvrtc, nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
            log = b" " * size
            check(nvrtc, nvrtc.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
            raise RuntimeError(f"cuda/{name} does not compile ({result.name}):\n"
                               + log.rstrip(b"\0 ").decode(errors="replace"))
        size = check(nvrtc, nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
        buf = b" " * size
        check(nvrtc, nvrtc.nvrtcGetPTX(prog, buf), "nvrtcGetPTX")
        return buf.rstrip(b"\0 ").decode()
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def load_nvrtc() -> Any:
    """cuda.bindings.nvrtc with libnvrtc loadable, else NvrtcUnavailable (with the reason)."""
    try:
        return cuda_check.load_nvrtc()
    except SystemExit as e:                      # cuda_check's message names the install line
        raise NvrtcUnavailable(str(e)) from None


def compile_kernels(cache: Any = None) -> CompiledKernels:
    """Compile (or take from `cache`, a pytest Cache) the signatures of every source."""
    nvrtc = load_nvrtc()
    version = tuple(cuda_check._checked(nvrtc, nvrtc.nvrtcVersion(), "nvrtcVersion"))
    arch = cuda_sources.ARCH.replace("sm_", "compute_")
    options = (f"--gpu-architecture={arch}", *cuda_sources.OPTIONS)
    sources, texts, by_source = {}, {}, {}
    for name in cuda_sources.SOURCES:
        sources[name] = text = cuda_sources.source_text(name)
        key = text_hash("\0".join((text, *options, repr(version))))
        texts[text_hash(text)] = name
        hit = cache.get(CACHE_PREFIX + name, None) if cache is not None else None
        if hit and hit.get("key") == key:
            by_source[name] = {k: KernelSignature(k, name, tuple(p), b)
                               for k, (p, b) in hit["kernels"].items()}
            continue
        by_source[name] = parse_ptx(_ptx(nvrtc, name, text, options), name)
        if cache is not None:
            cache.set(CACHE_PREFIX + name, {"key": key, "kernels": {
                k: [list(s.params), s.max_threads] for k, s in by_source[name].items()}})
    return CompiledKernels(version, arch, tuple(cuda_sources.OPTIONS), sources, texts,
                           by_source)
