"""A fake CuPy over a FakeDevice (fake_gpu.py): what the CUDA backend imports, nothing more.

`install(kernels)` puts a fake `cupy` (arrays, RawModule, streams with graph capture, events,
pinned memory, runtime), a fake `cupy_backends.cuda.libs.cublas` and a fake
`cuda.bindings.driver` (fake_cuda_libs.py) into `sys.modules` for the duration of a `with`
block, and re-imports the CUDA backend modules under them, so `create_backend("cuda")` builds a
backend that runs every launcher on the CPU, with each launch checked against the compiled
kernels and recorded in the FakeDevice it yields. Nothing of `service` is patched: the fake
stops at the libraries' surface. The objects it hands out are in fake_cupy_objects.py.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

import numpy as np

from tests.support.fake_cupy_objects import (
    CapturedGraph,
    CUDADriverError,
    CUDARuntimeError,
    Event,
    Function,
    MemoryPointer,
    PinnedMemory,
    RawModule,
    Stream,
    UnmodelledCupyOp,
    ndarray,
    pinned_pointer,
)
from tests.support.fake_gpu import Arg, FakeDevice, KernelCheckError, OutOfMemoryError
from tests.support.kernel_signatures import CompiledKernels

__all__ = ["CUDADriverError", "CUDARuntimeError", "CapturedGraph", "OutOfMemoryError",
           "UnmodelledCupyOp", "install", "ndarray"]

MEMCPY_KINDS = {0: "h2h", 1: "h2d", 2: "d2h", 3: "d2d", 4: "default"}


# ---------------------------------------------------------------- the library
class _Cupy:
    """One fake CuPy bound to one FakeDevice: its state, and what goes in sys.modules."""

    def __init__(self, dev: FakeDevice):
        self.dev = dev
        self.functions: dict[int, Function] = {}        # Function.ptr -> Function
        self._local = threading.local()
        self.null = Stream(null=True, _cp=self)

    def stack(self) -> list[Stream]:
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack

    def current(self) -> Stream:
        s = self.stack()
        return s[-1] if s else self.null

    def stream_ptr(self, stream) -> int:
        if stream is None:
            return self.current().ptr
        return int(getattr(stream, "ptr", stream))

    def classify(self, a: Any, kernel: str, i: int) -> Arg:
        """How CuPy passes one kernel argument: arrays by pointer, numpy scalars as their C
        type, Python ints and floats as int64 / float64."""
        if isinstance(a, ndarray):
            if a._cp is not self:
                raise KernelCheckError(f"kernel {kernel}: argument {i} belongs to another device")
            return Arg("ptr", a.data.ptr, a.shape, a.dtype.name)
        if isinstance(a, np.ndarray):
            raise TypeError(f"kernel {kernel}: argument {i} is a host numpy array "
                            f"{a.dtype}{a.shape}; CuPy passes device arrays only")
        if isinstance(a, np.generic):
            return Arg(a.dtype.name, a.item())
        if isinstance(a, bool):
            return Arg("bool", a)
        if isinstance(a, int):
            return Arg("int64", a)
        if isinstance(a, float):
            return Arg("float64", a)
        raise TypeError(f"kernel {kernel}: unsupported argument {i} of type {type(a).__name__}")

    # ------------------------------------------------------------ allocation
    def empty(self, shape, dtype=np.float32, order: str = "C") -> ndarray:
        dt = np.dtype(dtype)
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        buf = self.dev.allocate(n, shape, dt.name)
        return ndarray(buf.view(dt).reshape(shape, order=order), self)

    def _device_copy(self, host: np.ndarray) -> ndarray:
        """A new device array holding host's values (a copy made on the device)."""
        out = self.empty(host.shape, host.dtype)
        out._a[...] = host
        return out

    def asarray(self, a, dtype=None) -> ndarray:
        if isinstance(a, ndarray):
            return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
        host = np.ascontiguousarray(np.asarray(a, dtype=dtype))
        out = self.empty(host.shape, host.dtype)
        s = self.current().ptr
        self.dev.copy(out.data.ptr, host.ctypes.data, host.nbytes, "h2d", s, "cupy.asarray")
        self.dev.sync("cupy.asarray from pageable memory", s)
        return out

    def asnumpy(self, a, stream=None, order: str = "C") -> np.ndarray:
        return a.get(stream=stream) if isinstance(a, ndarray) else np.asarray(a)

    def memcpy_async(self, dst: int, src: int, size: int, kind: int, stream: int) -> None:
        direction = MEMCPY_KINDS.get(kind)
        if direction == "default":
            direction = ("d" if self.dev.is_device(src) else "h") + "2" + \
                ("d" if self.dev.is_device(dst) else "h")
        if direction not in ("h2d", "d2h", "d2d"):
            raise CUDARuntimeError(f"cudaErrorInvalidMemcpyDirection: kind {kind}")
        self.dev.copy(int(dst), int(src), int(size), direction, int(stream),
                      "cudaMemcpyAsync")

    def modules_dict(self) -> dict[str, types.ModuleType]:
        from tests.support import fake_cuda_libs

        return {**_cupy_modules(self), **fake_cuda_libs.cublas_modules(self)}


def _module(name: str, **attrs) -> types.ModuleType:
    m = types.ModuleType(name, f"fake {name} (tests/support/fake_cupy.py)")
    m.__dict__.update(attrs)
    return m


def _cupy_modules(cp: _Cupy) -> dict[str, types.ModuleType]:
    dev = cp.dev

    def bound(cls):
        return lambda *a, **k: cls(*a, **k, _cp=cp)

    def mem_info() -> tuple[int, int]:
        return dev.total_memory - dev.used, dev.total_memory

    runtime = _module(
        "cupy.cuda.runtime", CUDARuntimeError=CUDARuntimeError,
        getDeviceCount=lambda: 1, getDevice=lambda: 0, setDevice=lambda i: _device_id(i),
        memGetInfo=mem_info, memcpyAsync=cp.memcpy_async,
        deviceSynchronize=lambda: dev.sync("cudaDeviceSynchronize"),
        getDeviceProperties=lambda i: {"name": b"fake NVIDIA H200", "major": 9, "minor": 0,
                                       "totalGlobalMem": dev.total_memory,
                                       "multiProcessorCount": 132,
                                       "sharedMemPerBlockOptin": 227 << 10},
        runtimeGetVersion=lambda: 12080, driverGetVersion=lambda: 12080,
        memcpyHostToHost=0, memcpyHostToDevice=1, memcpyDeviceToHost=2,
        memcpyDeviceToDevice=3, memcpyDefault=4, streamCaptureModeGlobal=0,
        streamCaptureModeThreadLocal=1, streamCaptureModeRelaxed=2)
    driver = _module("cupy.cuda.driver", CUDADriverError=CUDADriverError)
    memory = _module("cupy.cuda.memory", OutOfMemoryError=OutOfMemoryError,
                     MemoryPointer=MemoryPointer)
    pinned = _module("cupy.cuda.pinned_memory", PinnedMemory=bound(PinnedMemory),
                     PinnedMemoryPointer=pinned_pointer)

    class Device:
        def __init__(self, device: int | None = None):
            self.id = _device_id(0 if device is None else device)
            self.compute_capability = "90"

        def use(self) -> None:
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            pass

        def synchronize(self) -> None:
            dev.sync("Device.synchronize")

        mem_info = property(lambda self: mem_info())

    pool = types.SimpleNamespace(free_bytes=lambda: 0, used_bytes=lambda: dev.used,
                                 total_bytes=lambda: dev.used, free_all_blocks=lambda: None)
    cuda = _module(
        "cupy.cuda", runtime=runtime, driver=driver, memory=memory, pinned_memory=pinned,
        Device=Device, Stream=bound(Stream), Event=bound(Event), Function=Function,
        PinnedMemory=bound(PinnedMemory), PinnedMemoryPointer=pinned_pointer,
        alloc_pinned_memory=lambda size: pinned_pointer(PinnedMemory(size, _cp=cp), 0),
        get_current_stream=cp.current, get_elapsed_time=lambda a, b: 0.0,
        is_available=lambda: True, MemoryPointer=MemoryPointer)
    cuda.Stream.null = cp.null
    dtypes = {n: getattr(np, n) for n in ("float16", "float32", "float64", "int8", "int16",
                                          "int32", "int64", "uint8", "uint16", "uint32",
                                          "uint64", "bool_", "dtype")}
    for m in (cuda, runtime, driver, memory, pinned):
        m.__path__ = []
    cupy = _module(
        "cupy", __path__=[], __version__="13.0.0+fake", cuda=cuda, ndarray=ndarray,
        RawModule=bound(RawModule), zeros=cp.empty, empty=cp.empty, asarray=cp.asarray,
        array=cp.asarray, asnumpy=cp.asnumpy, get_default_memory_pool=lambda: pool,
        get_default_pinned_memory_pool=lambda: pool, **dtypes)
    return {"cupy": cupy, "cupy.cuda": cuda, "cupy.cuda.runtime": runtime,
            "cupy.cuda.driver": driver, "cupy.cuda.memory": memory,
            "cupy.cuda.pinned_memory": pinned}


def _device_id(i: int) -> int:
    if i != 0:
        raise CUDARuntimeError("cudaErrorInvalidDevice: invalid device ordinal")
    return 0


# ---------------------------------------------------------------- installing
BACKEND_PREFIX = "service.backends.cuda"     # every module of the CUDA backend, before or after
                                             # it becomes a package


@contextlib.contextmanager
def install(kernels: CompiledKernels, *, driver: bool = True,
            total_memory: int = 8 << 30) -> Iterator[FakeDevice]:
    """Within the block, `import cupy` (and cuBLAS, and cuda.bindings.driver unless driver is
    False: the backend then has no programmatic dependent launch) gives the fakes over a new
    FakeDevice; the CUDA backend's modules are imported afresh under them, and everything is
    put back afterwards."""
    from tests.support import fake_cuda_libs

    dev = FakeDevice(kernels, total_memory)
    cp = _Cupy(dev)
    fakes: dict[str, Any] = cp.modules_dict()
    fakes.update(fake_cuda_libs.driver_modules(cp) if driver else
                 {"cuda.bindings.driver": None})      # None in sys.modules: ImportError
    saved = {n: m for n, m in sys.modules.items() if n.startswith(BACKEND_PREFIX)}
    before = {n: sys.modules.get(n, _MISSING) for n in fakes}
    parents = _parent_attrs(set(fakes) | set(saved))
    for n in saved:
        del sys.modules[n]
    sys.modules.update(fakes)
    _set_parent_attrs(fakes)
    try:
        yield dev
    finally:
        now = [n for n in sys.modules if n.startswith(BACKEND_PREFIX)]
        for key in _parent_attrs(now):          # imported in the block: no attribute before
            parents.setdefault(key, _MISSING)
        for n in now:
            del sys.modules[n]
        sys.modules.update(saved)
        for n, m in before.items():
            if m is _MISSING:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m
        for (parent, attr), value in parents.items():
            _put_attr(parent, attr, value)


_MISSING = object()


def _parent_attrs(names) -> dict[tuple[Any, str], Any]:
    """(parent module, attribute) -> its value now, for each name's entry in its parent."""
    out = {}
    for n in names:
        head, _, attr = n.rpartition(".")
        parent = sys.modules.get(head)
        if head and parent is not None and not head.startswith("cupy"):
            out[(parent, attr)] = getattr(parent, attr, _MISSING)
    return out


def _put_attr(parent: Any, attr: str, value: Any) -> None:
    if value is _MISSING or value is None:
        with contextlib.suppress(AttributeError):
            delattr(parent, attr)
    else:
        setattr(parent, attr, value)


def _set_parent_attrs(fakes: dict[str, Any]) -> None:
    """`from cuda.bindings import driver` reads the package's attribute before sys.modules."""
    for n, m in fakes.items():
        head, _, attr = n.rpartition(".")
        parent = sys.modules.get(head)
        if head and parent is not None and not head.startswith("cupy"):
            _put_attr(parent, attr, m)
