"""CuPy's objects as the fake CuPy (fake_cupy.py) hands them out: arrays, streams with graph
capture, events, loaded kernels and pinned memory, each over the library state `_Cupy` and its
FakeDevice.

Arrays: `ndarray` wraps a numpy view of a device buffer, so slicing, reshape and views behave
as in CuPy (a copy where CuPy copies counts as an allocation) and `get` returns the buffer's
bytes: what copies put there, zeros where only kernels would have written. What CuPy would run
as its own elementwise kernels (arithmetic, comparison, item assignment, fill) is not modelled
and raises: the backend launches raw kernels only. Implicit conversion to numpy raises as in
CuPy.
"""

from __future__ import annotations

import ctypes
import mmap
from functools import cache
from typing import TYPE_CHECKING

import numpy as np

from tests.support.fake_gpu import SMEM_OPTIN_MAX, Allocation, CaptureError, KernelCheckError

if TYPE_CHECKING:
    from tests.support.fake_cupy import _Cupy


class CUDARuntimeError(RuntimeError):
    """cupy_backends.cuda.api.runtime.CUDARuntimeError."""


class CUDADriverError(RuntimeError):
    """cupy.cuda.driver.CUDADriverError."""


class UnmodelledCupyOp(NotImplementedError):
    """A CuPy feature the fake does not model (CuPy's own kernels, files, other backends)."""


# ---------------------------------------------------------------- arrays
class MemoryPointer:
    def __init__(self, ptr: int):
        self.ptr = ptr

    def __int__(self) -> int:
        return self.ptr

    def __add__(self, offset: int) -> MemoryPointer:
        return MemoryPointer(self.ptr + offset)


class ndarray:  # noqa: N801 - CuPy's name
    __slots__ = ("_a", "_cp", "__weakref__")
    __hash__ = None                      # CuPy arrays are unhashable

    def __init__(self, a: np.ndarray, cp: _Cupy):
        self._a, self._cp = a, cp

    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    strides = property(lambda self: self._a.strides)
    size = property(lambda self: self._a.size)
    ndim = property(lambda self: self._a.ndim)
    itemsize = property(lambda self: self._a.itemsize)
    nbytes = property(lambda self: self._a.nbytes)
    flags = property(lambda self: self._a.flags)
    data = property(lambda self: MemoryPointer(self._a.ctypes.data))
    T = property(lambda self: self._wrap(self._a.T))

    def __repr__(self) -> str:
        return f"<fake cupy.ndarray {self.shape} {self.dtype} at {self.data.ptr:#x}>"

    def __len__(self) -> int:
        return len(self._a)

    def _wrap(self, r: np.ndarray) -> ndarray:
        """A numpy result of indexing or reshaping self: a view, or a new allocation when it
        left the buffer (CuPy copies there too)."""
        region = self._cp.dev.region(self.data.ptr)
        inside = r.size == 0 or (region is not None and region.start <= r.ctypes.data
                                 and r.ctypes.data + r.nbytes <= region.start + region.nbytes)
        if inside and r.base is not None:
            return ndarray(r, self._cp)
        return self._cp._device_copy(r)

    def __getitem__(self, key) -> ndarray:
        k = key if isinstance(key, tuple) else (key,)
        if any(isinstance(x, ndarray) for x in k):
            raise UnmodelledCupyOp("indexing with a device array (a CuPy gather kernel)")
        if not any(x is Ellipsis for x in k):
            k = (*k, Ellipsis)                    # a 0-d view, not a numpy scalar
        return self._wrap(self._a[k])

    def reshape(self, *shape, order: str = "C") -> ndarray:
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        return self._wrap(self._a.reshape(shape, order=order))

    def view(self, dtype=None) -> ndarray:
        return ndarray(self._a.view(dtype) if dtype is not None else self._a.view(), self._cp)

    def ravel(self) -> ndarray:
        return self._wrap(self._a.ravel())

    def copy(self) -> ndarray:
        return self._cp._device_copy(self._a)

    def astype(self, dtype, copy: bool = True) -> ndarray:
        if not copy and np.dtype(dtype) == self.dtype:
            return self
        return self._cp._device_copy(self._a.astype(dtype))

    # ------------------------------------------------------------ host transfers
    def set(self, arr, stream=None) -> None:
        if not isinstance(arr, np.ndarray) or isinstance(arr, ndarray):
            raise TypeError("Only numpy.ndarray can be set to cupy.ndarray")
        if self.dtype != arr.dtype:
            raise TypeError(f"{arr.dtype} array cannot be set to {self.dtype} array")
        if self.shape != arr.shape:
            raise ValueError(f"Shape mismatch. Old shape: {self.shape}, new shape: {arr.shape}")
        if not self.flags.c_contiguous:
            raise RuntimeError("Cannot set to non-contiguous array")
        arr = np.ascontiguousarray(arr)
        s = self._cp.stream_ptr(stream)
        self._cp.dev.copy(self.data.ptr, arr.ctypes.data, self.nbytes, "h2d", s,
                          "ndarray.set")

    def get(self, stream=None) -> np.ndarray:
        s = self._cp.stream_ptr(stream)
        self._cp.dev.no_capture("ndarray.get (a copy to pageable host memory)", s)
        out = np.empty(self.shape, self.dtype)
        src = self._a if self.flags.c_contiguous else np.ascontiguousarray(self._a)
        if src is not self._a:                    # CuPy makes a contiguous device copy first
            self._cp.dev.no_capture("ndarray.get of a non-contiguous array")
        self._cp.dev.copy(out.ctypes.data, src.ctypes.data, out.nbytes, "d2h", s,
                          "ndarray.get")
        if stream is None:
            self._cp.dev.sync("ndarray.get", s)
        return out

    def _host_value(self):
        if self.size != 1:
            raise TypeError("only size-1 arrays can be converted to Python scalars")
        return self.get()[()] if self.ndim == 0 else self.get().reshape(())[()]

    def __int__(self) -> int:
        return int(self._host_value())

    def __float__(self) -> float:
        return float(self._host_value())

    def __bool__(self) -> bool:
        return bool(self._host_value())

    def item(self):
        return self._host_value().item()

    def tolist(self):
        return self.get().tolist()

    def __array__(self, dtype=None, copy=None):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use "
                        "`.get()` to construct a NumPy array explicitly.")

    # ------------------------------------------------------------ CuPy's own kernels
    def _elementwise(self, *_):
        raise UnmodelledCupyOp("a CuPy elementwise kernel (arithmetic, comparison, item "
                               "assignment or fill on a device array): the backend launches "
                               "raw kernels only, which the fake checks")

    __setitem__ = fill = _elementwise
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _elementwise
    __truediv__ = __floordiv__ = __neg__ = __iadd__ = __imul__ = _elementwise
    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _elementwise  # type: ignore[assignment]


# ---------------------------------------------------------------- streams, events, graphs
class Stream:
    _count = 0

    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False,
                 *, _cp: _Cupy):
        self._cp = _cp
        if null:
            self.ptr = 0
        else:
            Stream._count += 1
            self.ptr = 0x5000_0000 + 0x100 * Stream._count
        self.non_blocking = non_blocking

    def __enter__(self) -> Stream:
        self._cp.stack().append(self)
        return self

    def __exit__(self, *exc) -> None:
        self._cp.stack().pop()

    def use(self) -> Stream:
        self._cp.stack()[:] = [self]
        return self

    def synchronize(self) -> None:
        self._cp.dev.sync("Stream.synchronize", self.ptr)

    def wait_event(self, event: Event) -> None:
        g = self._cp.dev.capturing.get(self.ptr)
        if g is not None and event._graph != g.id:
            raise CaptureError(f"stream {self.ptr:#x} waits, while capturing, on an event "
                               "recorded outside the capture")

    def record(self, event: Event | None = None) -> Event:
        event = event or Event(_cp=self._cp)
        event.record(self)
        return event

    def begin_capture(self, mode=None) -> None:
        self._cp.dev.begin_capture(self.ptr)

    def end_capture(self) -> CapturedGraph:
        return CapturedGraph(self._cp.dev.end_capture(self.ptr), self._cp)

    def is_capturing(self) -> bool:
        return self.ptr in self._cp.dev.capturing

    @property
    def done(self) -> bool:
        return True


class Event:
    def __init__(self, block: bool = False, disable_timing: bool = False,
                 interprocess: bool = False, *, _cp: _Cupy):
        self._cp, self._graph = _cp, None
        self._stream: int | None = None

    def record(self, stream: Stream | None = None) -> None:
        s = self._cp.stream_ptr(stream)
        g = self._cp.dev.capturing.get(s)
        self._graph, self._stream = (None if g is None else g.id), s

    def synchronize(self) -> None:
        if self._graph is not None or (self._stream is not None
                                       and self._stream in self._cp.dev.capturing):
            self._cp.dev.no_capture("Event.synchronize on a captured event", self._stream)
        self._cp.dev.syncs.append("event")

    def query(self) -> bool:
        return True

    done = property(query)


class CapturedGraph:
    """cupy.cuda.graph.Graph: what end_capture returns."""

    def __init__(self, graph, cp: _Cupy):
        self.graph, self._cp = graph, cp

    def launch(self, stream: Stream | None = None) -> None:
        self._cp.dev.replay(self.graph, self._cp.stream_ptr(stream))

    def upload(self, stream: Stream | None = None) -> None:
        pass


# ---------------------------------------------------------------- kernels
class Function:
    """cupy.cuda.Function: a loaded kernel, `ptr` its handle."""

    _count = 0

    def __init__(self, sig, cp: _Cupy):
        Function._count += 1
        self.ptr, self.sig, self._cp = 0x7000_0000 + 0x10 * Function._count, sig, cp
        self.smem_optin = 0
        cp.functions[self.ptr] = self

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        return self.smem_optin

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, n: int) -> None:
        if not 0 <= n <= SMEM_OPTIN_MAX:
            raise CUDADriverError(f"CUDA_ERROR_INVALID_VALUE: {self.sig.name} asks for {n} "
                                  f"bytes of dynamic shared memory, at most {SMEM_OPTIN_MAX}")
        self.smem_optin = n


class RawKernel:
    def __init__(self, function: Function):
        self.kernel = self.function = function
        self.name = function.sig.name

    max_dynamic_shared_size_bytes = property(
        lambda self: self.kernel.max_dynamic_shared_size_bytes,
        lambda self, n: setattr(self.kernel, "max_dynamic_shared_size_bytes", n))

    def __call__(self, grid, block, args, *, shared_mem: int = 0, stream=None,
                 enable_cooperative_groups: bool = False) -> None:
        cp = self.kernel._cp
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"kernel arguments must be a tuple, not {type(args).__name__}")
        cp.dev.launch(self.kernel.sig, grid, block, int(shared_mem), self.kernel.smem_optin,
                      [cp.classify(a, self.name, i) for i, a in enumerate(args)],
                      cp.stream_ptr(stream), "cupy")


class RawModule:
    def __init__(self, code: str | None = None, path: str | None = None, options=(),
                 backend: str = "nvrtc", translate_cucomplex: bool = False, *,
                 enable_cooperative_groups: bool = False, name_expressions=None,
                 jitify: bool = False, _cp: _Cupy):
        if code is None or path is not None or backend != "nvrtc" or name_expressions:
            raise UnmodelledCupyOp("RawModule: only code= with the nvrtc backend is modelled")
        kernels = _cp.dev.kernels
        if tuple(options) != kernels.options:
            raise KernelCheckError(f"RawModule options {tuple(options)} differ from the compile "
                                   f"check's {kernels.options}: CI compiled other kernels")
        self.source = kernels.source_of(code)
        if self.source is None:
            raise KernelCheckError("RawModule code is none of the compile check's sources "
                                   "(cuda_sources.SOURCES, expanded by source_text): its "
                                   "kernels have no compiled signature")
        self._cp = _cp
        _cp.dev.modules.append(self.source)

    def compile(self, log_stream=None) -> None:
        """Compile and load now rather than at the first get_function (recorded)."""
        self._cp.dev.compiled.append(self.source)

    def get_function(self, name: str) -> RawKernel:
        sig = self._cp.dev.kernels.by_source[self.source].get(name)
        if sig is None:
            others = sorted(self._cp.dev.kernels.by_source[self.source])
            near = [k for k in others if k[:4] == name[:4]][:8] or others[:8]
            raise CUDADriverError(f"CUDA_ERROR_NOT_FOUND: named symbol not found: no kernel "
                                  f"{name!r} in cuda/{self.source} (it has "
                                  f"{', '.join(near)}, ...)")
        return RawKernel(Function(sig, self._cp))


# ---------------------------------------------------------------- pinned memory
class PinnedMemory:
    def __init__(self, size: int, flags: int = 0, *, _cp: _Cupy):
        if _cp.dev.capturing:
            _cp.dev.allocations.append(Allocation("pinned", size, None, None, 0, True))
            _cp.dev.no_capture(f"allocating {size} bytes of pinned memory")
        self.size = size
        self._map = mmap.mmap(-1, max(size, 1))
        probe = ctypes.c_char.from_buffer(self._map)
        self.ptr = ctypes.addressof(probe)
        del probe
        _cp.dev.adopt(self._map, self.ptr, size, "pinned")


@cache
def _pinned_type(n: int) -> type:
    return type("PinnedMemoryPointer", (ctypes.c_ubyte * n,), {})


def pinned_pointer(mem: PinnedMemory, offset: int):
    """cupy.cuda.PinnedMemoryPointer: a buffer over mem's pages from offset, with `ptr`."""
    p = _pinned_type(mem.size - offset).from_buffer(mem._map, offset)
    p.mem, p.ptr = mem, mem.ptr + offset
    return p
