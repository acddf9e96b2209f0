"""Kernel launches of the CUDA backend, and the activation blocks' bookkeeping they update.

`Launcher` owns the module cache (one CuPy RawModule per source file, compiled at the first
launch of one of its kernels, with sources.OPTIONS), looks kernels up by their registry name
(kernels.py), checks each launch's arguments against the registered signature, opts a kernel
into dynamic shared memory past 48 KiB, and launches on the backend's stream: through CuPy, or,
while a step is being captured, with programmatic dependent launch (PDL, below).

`ActivationBlocks` owns the 8-bit activation blocks scratch of the GEMVs and knows which matrix
view's blocks it holds; the launcher, the fused producers and the GEMVs update it (its
docstring). The facade makes one of each and hands them to the parts that launch.

PDL: CuPy's launcher sets no launch attributes, so the kernels of a step being captured go
through `cuLaunchKernelEx` (cuda-bindings) with the programmatic-stream-serialization
attribute: inside the captured graph each kernel then hangs off its predecessor by a
programmatic edge, so it is launched and its blocks scheduled while the predecessor still runs,
and its PDL_ENTRY (cuda/pdl.cuh) waits for the predecessor's completion before touching memory.
What a kernel computes does not change; only when its launch overhead is paid. Arguments are
marshalled as the kernels declare them: device arrays as pointers, numpy int32 / float32 /
int64 / uint64 scalars as those C types (the registry's kinds; nothing else passes the check).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import cupy as cp
import numpy as np

from service.backends.cuda import kernels, sources
from service.backends.cuda.types import ViewKey, matrix_key, overlaps

try:
    from cuda.bindings import driver as _cu
except ImportError:                     # the backend then launches through CuPy only
    _cu = None

_CTYPES = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.float32): ctypes.c_float,
           np.dtype(np.int64): ctypes.c_int64, np.dtype(np.uint64): ctypes.c_uint64}
_SMEM_DEFAULT = 48 << 10               # dynamic shared memory a kernel may use without opting in


class ActivationBlocks:
    """The 8-bit blocks of a GEMV input in scratch (sized by `allocate` at prepare time) and the
    matrix view they were made from.

    A fused producer (rms_norm_quant, glu_quant, attention with blocks, the fused-norm GEMV)
    writes a view and its blocks in one launch and records the view with `made`; a GEMV whose
    input is exactly that view reads the blocks instead of quantizing again (`holds`). The view
    is host state that follows the op sequence alone, so a captured step records the launches
    of its eager run: it is forgotten at the launch of any kernel that is not a GEMV (the
    registry's keeps_blocks; Launcher.run), when a GEMV's output overlaps it (`wrote`), at an
    allocation or host upload, and at the start and end of every step (`forget`).
    """

    def __init__(self) -> None:
        self.qa: Any = None                 # (rows * K,) int8 codes
        self.ads: Any = None                # (rows * K / 32, 2) f32: (d, sum of codes) per 32
        self._view: ViewKey | None = None

    def allocate(self, qa: Any, ads: Any) -> None:
        self.qa, self.ads = qa, ads

    def room(self, rows: int, k: int) -> bool:
        """Whether rows x k activations fit the scratch as whole 32-groups."""
        return self.qa is not None and k % 32 == 0 and rows * k <= self.qa.size

    def args(self, rows: int, k: int) -> list[Any]:
        """The kernels' (qa, ads) arguments for rows x k activations."""
        return [self.qa[: rows * k], self.ads[: rows * k // 32]]

    @property
    def view(self) -> ViewKey | None:
        """The view whose blocks the scratch holds; None when none."""
        return self._view

    def holds(self, x: Any) -> bool:
        return self._view == matrix_key(x)

    def made(self, view: ViewKey) -> None:
        self._view = view

    def wrote(self, out: Any) -> None:
        """`out` was written by a GEMV: its blocks, if it overlaps the held view, are stale."""
        if self._view is not None and overlaps(out, self._view):
            self._view = None

    def forget(self) -> None:
        self._view = None


class Launcher:
    """Launches registered kernels on one stream (module docstring)."""

    def __init__(self, stream: Any, blocks: ActivationBlocks, pdl: bool) -> None:
        self.stream = stream
        self.blocks = blocks
        self.pdl = bool(pdl and pdl_available())    # read at every launch while capturing
        self._pdl = PdlLauncher() if self.pdl else None
        self.capturing = False        # kernels launched now are recorded into a graph
        self.functions: dict[str, Any] = {}         # loaded kernels by name
        self._modules: dict[str, Any] = {}          # RawModule per source file
        self._smem_opt_in: dict[str, int] = {}      # dynamic shared memory allowed per kernel
        # A callable that takes every launch in place of `run` (tests count launches,
        # benchmarks time them; it calls `run` itself): (name, grid, block, args), plus
        # shared_mem= when the launch has dynamic shared memory.
        self.intercept: Callable[..., None] | None = None

    def function(self, name: str) -> Any:
        """The loaded kernel `name` (its file compiled at the first use of one of its kernels)."""
        fn = self.functions.get(name)
        if fn is None:
            src = kernels.kernel(name).source
            mod = self._modules.get(src)
            if mod is None:
                mod = cp.RawModule(code=sources.source_text(src), options=sources.OPTIONS)
                self._modules[src] = mod
            fn = self.functions[name] = mod.get_function(name)
        return fn

    def launch(self, name: str, grid: tuple[int, ...], block: tuple[int, ...], args: list[Any],
               shared_mem: int = 0) -> None:
        if self.intercept is not None:
            kw = {"shared_mem": shared_mem} if shared_mem else {}
            self.intercept(name, grid, block, args, **kw)
            return
        self.run(name, grid, block, args, shared_mem)

    def run(self, name: str, grid: tuple[int, ...], block: tuple[int, ...], args: list[Any],
            shared_mem: int = 0) -> None:
        """Check and launch one kernel."""
        spec = kernels.kernel(name)
        spec.check(args)
        if not spec.keeps_blocks:
            self.blocks.forget()
        fn = self.function(name)
        if shared_mem > self._smem_opt_in.get(name, _SMEM_DEFAULT):
            fn.max_dynamic_shared_size_bytes = shared_mem
            self._smem_opt_in[name] = shared_mem
        if self.capturing and self.pdl and self._pdl is not None:
            self._pdl.launch(fn.kernel.ptr, grid, block, tuple(args), self.stream.ptr,
                             shared_mem)
            return
        with self.stream:
            fn(grid, block, tuple(args), shared_mem=shared_mem)


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
