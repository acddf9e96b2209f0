"""Where the CUDA kernels live and how they are compiled (no CuPy import: `make check-cuda`
compiles the same sources with the same options through NVRTC on a machine without a GPU).

Every kernel file is compiled as one translation unit, its local `#include "x.cuh"` lines
expanded here (so CuPy's on-disk cache, keyed by the source text, sees header changes too). The
options here are the only ones: the CUDA backend passes them to CuPy's RawModule, the compile
check passes them to NVRTC, so what CI compiles is what the GPU runs.
"""

from __future__ import annotations

import re
from pathlib import Path

from service.backends import step_format
from service.backends.cuda import kernels

CUDA_DIR = Path(__file__).resolve().parents[3] / "cuda"
ARCH = "sm_90"   # the H200; the compile check targets it, the backend asks the device

# One translation unit per op family (docs/design.md#one-file-per-op-family); each .cu includes
# the headers it needs.
SOURCES = ("gemv.cu", "gemv_mma.cu", "quantize.cu", "elementwise.cu", "rope_kv.cu",
           "attention.cu", "attention_tiled.cu", "sampling.cu", "dequant.cu", "moe.cu")

# -std=c++17 for constexpr/if constexpr in the per-type traits; no fast-math: the kernels must
# round like the CPU reference (fused multiply-add contraction stays on, as nvcc's default).
# Facts shared with Python travel as -D defines, so the kernels never restate them: the step
# format's records (step_format.py) and the kernels' shared numbers (kernels.py).
OPTIONS = ("-std=c++17",
           *(f"-D{name}={value}" for name, value in {**step_format.cuda_defines(),
                                                     **kernels.cuda_defines()}.items()))
# [ \t], not \s: an include line is replaced alone, so NVRTC's line numbers stay the file's.
_INCLUDE = re.compile(r'^[ \t]*#include[ \t]+"([^"]+)"[ \t]*\r?$', re.M)


def source_text(name: str, _seen: frozenset[str] = frozenset()) -> str:
    """The text of one kernel file with its local includes expanded (each header once)."""
    if name in _seen:
        raise ValueError(f"cuda/{name} includes itself")
    text = (CUDA_DIR / name).read_text()
    done: set[str] = set()

    def expand(m: re.Match) -> str:
        inc = m.group(1)
        if inc in done:
            return ""
        done.add(inc)
        return f"// ---- begin {inc}\n{source_text(inc, _seen | {name})}\n// ---- end {inc}"

    return _INCLUDE.sub(expand, text)
