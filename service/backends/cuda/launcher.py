"""Kernel launches with programmatic dependent launch (PDL) through the driver API.

CuPy's launcher sets no launch attributes, so the CUDA backend launches the kernels of a step it
captures through `cuLaunchKernelEx` (cuda-bindings) with the programmatic-stream-serialization
attribute: inside the captured graph each kernel then hangs off its predecessor by a
programmatic edge, so it is launched and its blocks scheduled while the predecessor still runs,
and its PDL_ENTRY (cuda/pdl.cuh) waits for the predecessor's completion before touching memory.
What a kernel computes does not change; only when its launch overhead is paid.

Arguments are marshalled as the kernels declare them: device arrays as pointers, numpy int32 /
float32 / int64 / uint64 scalars as those C types (the launchers pass nothing else).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

try:
    from cuda.bindings import driver as _cu
except ImportError:                     # the backend then launches through CuPy only
    _cu = None

_CTYPES = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.float32): ctypes.c_float,
           np.dtype(np.int64): ctypes.c_int64, np.dtype(np.uint64): ctypes.c_uint64}


def pdl_available() -> bool:
    """cuda-bindings is importable (the launch itself needs an sm_90 device)."""
    return _cu is not None


def _arg(a: Any):
    """One kernel argument as a ctypes value (kept alive by the caller)."""
    data = getattr(a, "data", None)
    ptr = getattr(data, "ptr", None)
    if ptr is not None:                 # a device array: its pointer
        return ctypes.c_void_p(int(ptr))
    if isinstance(a, np.generic) and a.dtype in _CTYPES:
        return _CTYPES[a.dtype](a.item())
    raise TypeError(f"kernel argument of type {type(a).__name__} "
                    f"{getattr(a, 'dtype', '')}: pass device arrays or numpy int32/float32/"
                    f"int64/uint64 scalars")


class PdlLauncher:
    """cuLaunchKernelEx with the programmatic-stream-serialization attribute."""

    def __init__(self) -> None:
        if _cu is None:
            raise RuntimeError("programmatic dependent launch needs the cuda-bindings package")
        attr = _cu.CUlaunchAttribute()
        attr.id = _cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        self._attrs = [attr]

    def launch(self, fn_ptr: int, grid: tuple[int, ...], block: tuple[int, ...],
               args: tuple, stream_ptr: int, shared_mem: int = 0) -> None:
        g = (*grid, 1, 1)[:3]
        b = (*block, 1, 1)[:3]
        cfg = _cu.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = (int(v) for v in g)
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = (int(v) for v in b)
        cfg.sharedMemBytes = int(shared_mem)
        cfg.hStream = _cu.CUstream(stream_ptr)
        cfg.attrs = self._attrs
        cfg.numAttrs = 1
        values = [_arg(a) for a in args]
        params = (ctypes.c_void_p * max(1, len(values)))(
            *[ctypes.addressof(v) for v in values])
        (err,) = _cu.cuLaunchKernelEx(cfg, _cu.CUfunction(fn_ptr), ctypes.addressof(params), 0)
        if err != _cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuLaunchKernelEx failed: {err.name}")
