"""The state of a fake CUDA device: memory, streams and captures, and the log of everything the
CUDA backend asked of it, with the checks a real device (or a real captured graph) would fail.

Memory is host memory: a device allocation is a 256-byte aligned numpy buffer, registered by
address, so a device pointer is a real address and copies (`memcpyAsync`, `set`, `get`) really
copy; kernels do not run (their outputs stay as they were). What is checked:

- a launch (through CuPy's RawKernel call or cuLaunchKernelEx) names a kernel the compile check
  compiled, in the module whose source holds it; its arguments match the compiled parameter
  list one for one (a device array on .u64, np.int32 on .u32/.s32, np.float32 on .f32,
  np.int64 / np.uint64 on .u64/.s64); the block fits the kernel's __launch_bounds__ and the
  device; the grid is non-empty and within limits; dynamic shared memory past 48 KiB was opted
  into for that function;
- while a stream captures a graph: no allocation, no host copy or wait, no launch on another
  stream, no wait on an event recorded outside the capture (each raises CaptureError);
- a graph replays only while every device pointer it captured is still allocated;
- a copy or cuBLAS call stays inside live device allocations.
"""

from __future__ import annotations

import bisect
import ctypes
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tests.support.kernel_signatures import CompiledKernels, KernelSignature

ALIGN = 256                      # cudaMalloc / CuPy's pool alignment
SMEM_DEFAULT = 48 << 10          # dynamic shared memory a kernel may use without opting in
SMEM_OPTIN_MAX = 227 << 10       # sm_90: cudaDevAttrMaxSharedMemoryPerBlockOptin
MAX_BLOCK = (1024, 1024, 64)
MAX_GRID = ((1 << 31) - 1, 65535, 65535)

# Which PTX parameter types an argument of each kind may land on.
FITS = {"ptr": {"u64"}, "int32": {"u32", "s32"}, "uint32": {"u32", "s32"},
        "float32": {"f32"}, "int64": {"u64", "s64"}, "uint64": {"u64", "s64"},
        "float64": {"f64"}, "int16": {"u16", "s16"}, "uint16": {"u16", "s16"},
        "int8": {"u8", "s8"}, "uint8": {"u8", "s8"}, "bool": {"u8", "s8"}}


class FakeCudaError(RuntimeError):
    """Something a real device, driver or captured graph would not accept."""


class KernelCheckError(FakeCudaError):
    """A launch that does not match the compiled kernel (name, arguments, geometry)."""


class CaptureError(FakeCudaError):
    """An operation a captured CUDA graph cannot contain, made while a stream captures."""


class MemoryCheckError(FakeCudaError):
    """A pointer or byte range outside every live device allocation."""


class OutOfMemoryError(MemoryError):
    """cupy.cuda.memory.OutOfMemoryError: the fake device's memory is used up."""


# ---------------------------------------------------------------- the log
@dataclass(frozen=True)
class Arg:
    kind: str                          # "ptr", or a scalar's numpy dtype name
    value: int | float
    shape: tuple[int, ...] | None = None   # a device array's shape and dtype (CuPy path)
    dtype: str | None = None

    def __str__(self) -> str:
        if self.kind == "ptr":
            return f"ptr {self.dtype}{self.shape}" if self.shape is not None \
                else f"ptr {self.value:#x}"
        return f"{self.kind} {self.value}"


@dataclass(frozen=True)
class Launch:
    kernel: str
    source: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int
    args: tuple[Arg, ...]
    stream: int
    via: str                           # "cupy" (RawKernel call) or "driver" (cuLaunchKernelEx)
    pdl: bool = False                  # programmatic stream serialization attribute set
    graph: int | None = None           # the capture it was recorded into

    def work(self) -> tuple:
        """What the kernel is asked to do, as the device sees it: name, geometry and each
        argument's bits by width (the CuPy and driver paths compare equal)."""
        return (self.kernel, self.grid, self.block, self.shared_mem,
                tuple(_bits(a) for a in self.args))


def _bits(a: Arg) -> tuple[str, int | float]:
    if a.kind == "float32":
        return "f32", int(np.float32(a.value).view(np.uint32))
    if a.kind in ("int32", "uint32"):
        return "b32", int(a.value) & 0xFFFFFFFF
    if a.kind in ("ptr", "int64", "uint64"):
        return "b64", int(a.value) & 0xFFFFFFFFFFFFFFFF
    return a.kind, a.value


@dataclass(frozen=True)
class Allocation:
    kind: str                          # "device" or "pinned"
    nbytes: int
    shape: tuple[int, ...] | None
    dtype: str | None
    ptr: int
    during_capture: bool = False       # attempted while a stream captured (and refused)


@dataclass(frozen=True)
class Copy:
    direction: str                     # "h2d", "d2h", "d2d"
    nbytes: int
    dst: int
    src: int
    stream: int
    pinned: bool                       # the host side is pinned memory
    graph: int | None = None


@dataclass(frozen=True)
class Gemm:
    m: int
    n: int
    k: int
    trans: tuple[int, int]
    types: tuple[int, int, int]
    stream: int
    graph: int | None = None


@dataclass
class Graph:
    id: int
    stream: int
    nodes: list[Any] = field(default_factory=list)     # Launch, Copy, Gemm in order
    replays: int = 0


@dataclass
class _Region:
    start: int
    nbytes: int
    kind: str


# ---------------------------------------------------------------- the device
class FakeDevice:
    def __init__(self, kernels: CompiledKernels, total_memory: int = 8 << 30):
        self.kernels = kernels
        self.total_memory = total_memory
        self.used = 0
        self.launches: list[Launch] = []
        self.allocations: list[Allocation] = []
        self.copies: list[Copy] = []
        self.gemms: list[Gemm] = []
        self.graphs: list[Graph] = []
        self.syncs: list[str] = []                   # host waits: "stream", "event", ...
        self.modules: list[str] = []                 # sources loaded by RawModule, in order
        self.compiled: list[str] = []                # sources RawModule.compile() built
        self.capturing: dict[int, Graph] = {}        # stream ptr -> the graph it records
        self._starts: list[int] = []
        self._regions: dict[int, _Region] = {}
        self._lock = threading.RLock()
        self._scalar_slots: dict[str, set[int]] = {}   # kernel -> params given nonzero integers

    # ------------------------------------------------------------ memory
    def allocate(self, nbytes: int, shape=None, dtype=None) -> np.ndarray:
        """A zeroed (nbytes,) uint8 buffer at a 256-byte aligned device address."""
        if self.capturing:
            self.allocations.append(Allocation("device", nbytes, shape, dtype, 0, True))
            self.no_capture(f"allocating {nbytes} bytes of device memory {dtype}{shape or ''}")
        if self.used + nbytes > self.total_memory:
            raise OutOfMemoryError(f"out of memory allocating {nbytes} bytes (fake device of "
                                   f"{self.total_memory} bytes, {self.used} in use)")
        raw = np.zeros(nbytes + ALIGN, np.uint8)
        off = -raw.ctypes.data % ALIGN
        buf = raw[off:off + nbytes]
        self.adopt(raw, buf.ctypes.data, nbytes, "device", shape, dtype)
        return buf

    def adopt(self, owner: Any, start: int, nbytes: int, kind: str, shape=None,
              dtype=None) -> None:
        """Register [start, start + nbytes) as live until `owner` is freed."""
        with self._lock:
            if start in self._regions:
                raise MemoryCheckError(f"{start:#x} registered twice")
            bisect.insort(self._starts, start)
            self._regions[start] = _Region(start, nbytes, kind)
            if kind == "device":
                self.used += nbytes
        self.allocations.append(Allocation(kind, nbytes, shape, dtype, start))
        weakref.finalize(owner, self._release, start)

    def _release(self, start: int) -> None:
        with self._lock:
            r = self._regions.pop(start)
            self._starts.remove(start)
            if r.kind == "device":
                self.used -= r.nbytes

    def region(self, ptr: int) -> _Region | None:
        with self._lock:
            i = bisect.bisect_right(self._starts, ptr) - 1
            if i < 0:
                return None
            r = self._regions[self._starts[i]]
            return r if ptr < r.start + max(r.nbytes, 1) else None

    def check_range(self, ptr: int, nbytes: int, what: str) -> None:
        """[ptr, ptr + nbytes) lies inside one live device allocation."""
        r = self.region(ptr)
        if r is None or r.kind != "device" or ptr + nbytes > r.start + r.nbytes:
            where = "no live device allocation" if r is None or r.kind != "device" else \
                f"an allocation of {r.nbytes} bytes at {r.start:#x}"
            raise MemoryCheckError(f"{what}: [{ptr:#x}, +{nbytes}) is outside {where}")

    def is_device(self, ptr: int) -> bool:
        r = self.region(ptr)
        return r is not None and r.kind == "device"

    def is_pinned(self, ptr: int, nbytes: int) -> bool:
        r = self.region(ptr)
        return r is not None and r.kind == "pinned" and ptr + nbytes <= r.start + r.nbytes

    # ------------------------------------------------------------ capture
    def no_capture(self, what: str, stream: int | None = None) -> None:
        """Raise when a capture is active (on `stream`, or on any stream when None)."""
        active = [s for s in self.capturing if stream is None or s == stream]
        if active:
            raise CaptureError(f"{what} while stream {active[0]:#x} captures a CUDA graph: "
                               "a captured graph cannot contain it")

    def capture_of(self, stream: int, what: str) -> Graph | None:
        """The graph `stream` records into; CaptureError for work on another stream during a
        capture (it would run now, outside the graph)."""
        g = self.capturing.get(stream)
        if g is None and self.capturing:
            other = next(iter(self.capturing))
            raise CaptureError(f"{what} on stream {stream:#x} while stream {other:#x} "
                               "captures: it would run now and be missing from the graph")
        return g

    def begin_capture(self, stream: int) -> None:
        if stream in self.capturing:
            raise CaptureError(f"stream {stream:#x} is already capturing")
        if stream == 0:
            raise CaptureError("the legacy default stream cannot be captured")
        self.capturing[stream] = Graph(len(self.graphs), stream)

    def end_capture(self, stream: int) -> Graph:
        g = self.capturing.pop(stream, None)
        if g is None:
            raise CaptureError(f"stream {stream:#x} is not capturing")
        self.graphs.append(g)
        return g

    def replay(self, g: Graph, stream: int) -> None:
        self.no_capture("launching a graph")
        for node in g.nodes:
            if isinstance(node, Launch):
                for i, a in enumerate(node.args):
                    if a.kind == "ptr" and a.value and not self.is_device(int(a.value)):
                        raise MemoryCheckError(
                            f"graph {g.id} replays {node.kernel} with argument {i} at "
                            f"{int(a.value):#x}, freed since the capture")
            elif isinstance(node, Copy):
                self._do_copy(node)
        g.replays += 1

    # ------------------------------------------------------------ copies
    def copy(self, dst: int, src: int, nbytes: int, direction: str, stream: int,
             what: str) -> None:
        """An asynchronous copy on `stream` (captured when the stream captures)."""
        if nbytes == 0:
            return
        if direction in ("h2d", "d2d"):
            self.check_range(dst, nbytes, what + " destination")
        if direction in ("d2h", "d2d"):
            self.check_range(src, nbytes, what + " source")
        host = {"h2d": src, "d2h": dst}.get(direction)
        if host is not None and self.is_device(host):
            raise MemoryCheckError(f"{what}: host side {host:#x} is device memory")
        pinned = host is not None and self.is_pinned(host, nbytes)
        g = self.capture_of(stream, what)
        if g is not None and host is not None and not pinned:
            raise CaptureError(f"{what} from pageable host memory while stream {stream:#x} "
                               "captures: a graph copies only pinned memory")
        c = Copy(direction, nbytes, dst, src, stream, pinned, None if g is None else g.id)
        self.copies.append(c)
        if g is not None:
            g.nodes.append(c)
        else:
            self._do_copy(c)

    @staticmethod
    def _do_copy(c: Copy) -> None:
        if c.nbytes:
            ctypes.memmove(c.dst, c.src, c.nbytes)

    # ------------------------------------------------------------ launches
    def launch(self, sig: KernelSignature, grid, block, shared_mem: int, smem_optin: int,
               args: list[Arg], stream: int, via: str, pdl: bool = False) -> Launch:
        g3, b3 = _dims(grid, "grid", sig), _dims(block, "block", sig)
        problems = _geometry(sig, g3, b3, shared_mem, smem_optin)
        if len(args) != len(sig.params):
            problems.append(f"{len(args)} arguments for {len(sig.params)} parameters")
        for i, (a, p) in enumerate(zip(args, sig.params, strict=False)):
            if p not in FITS.get(a.kind, ()):
                problems.append(f"argument {i} ({a}) on a .{p} parameter")
        if problems:
            raise KernelCheckError(
                f"kernel {sig.name} (cuda/{sig.source}): " + "; ".join(problems)
                + f"\n  compiled: {sig.describe()}\n  launched: {sig.name}<<<{g3}, {b3}, "
                f"{shared_mem}>>>({', '.join(map(str, args))})")
        if via == "cupy":
            ints = {i for i, a in enumerate(args) if a.kind in ("int64", "uint64") and a.value}
            self._scalar_slots.setdefault(sig.name, set()).update(ints)
        g = self.capture_of(stream, f"launch of {sig.name}")
        rec = Launch(sig.name, sig.source, g3, b3, shared_mem, tuple(args), stream, via, pdl,
                     None if g is None else g.id)
        self.launches.append(rec)
        if g is not None:
            g.nodes.append(rec)
        return rec

    def driver_arg(self, sig: KernelSignature, i: int, value: int | float) -> Arg:
        """A parameter read back from cuLaunchKernelEx's parameter array by its PTX type: a
        .u64 holds a live device pointer, null, or an integer the CuPy path passed there."""
        p = sig.params[i]
        if p != "u64":
            kind = {"u32": "uint32", "s32": "int32", "f32": "float32", "s64": "int64",
                    "f64": "float64"}.get(p, p)
            return Arg(kind, value)
        v = int(value)
        if v == 0 or i in self._scalar_slots.get(sig.name, ()):
            return Arg("uint64", v)
        if not self.is_device(v):
            raise MemoryCheckError(f"kernel {sig.name}: parameter {i} (.u64) is {v:#x}, in no "
                                   f"live device allocation\n  compiled: {sig.describe()}")
        return Arg("ptr", v)

    def sync(self, what: str, stream: int | None = None) -> None:
        """A host wait for `stream` (None: the whole device)."""
        self.no_capture(f"a host wait ({what})", stream)
        self.syncs.append(what)


def _dims(d, what: str, sig: KernelSignature) -> tuple[int, int, int]:
    if isinstance(d, (int, np.integer)):
        d = (d,)
    if not isinstance(d, tuple) or not 1 <= len(d) <= 3 \
            or not all(isinstance(v, (int, np.integer)) for v in d):
        raise KernelCheckError(f"kernel {sig.name}: {what} {d!r} is not a tuple of 1-3 ints")
    return tuple(int(v) for v in (*d, 1, 1)[:3])


def _geometry(sig: KernelSignature, g: tuple[int, int, int], b: tuple[int, int, int],
              shared_mem: int, smem_optin: int) -> list[str]:
    out = []
    if min(g) < 1 or any(v > m for v, m in zip(g, MAX_GRID, strict=True)):
        out.append(f"grid {g} outside 1..{MAX_GRID}")
    threads = b[0] * b[1] * b[2]
    if min(b) < 1 or any(v > m for v, m in zip(b, MAX_BLOCK, strict=True)) or threads > 1024:
        out.append(f"block {b} outside the device's limits")
    if sig.max_threads is not None and threads > sig.max_threads:
        out.append(f"block of {threads} threads exceeds __launch_bounds__ {sig.max_threads}")
    if shared_mem < 0 or shared_mem > max(SMEM_DEFAULT, smem_optin):
        out.append(f"{shared_mem} bytes of dynamic shared memory, "
                   f"{max(SMEM_DEFAULT, smem_optin)} allowed (max_dynamic_shared_size_bytes)")
    return out
