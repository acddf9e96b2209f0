"""Weight upload through a ring of pinned staging buffers, overlapped with reading the file.

The file's tensors are slices of a memory map: reading them is page faults, then a copy. Each
tensor's blocks are split into planes (cuda_layout.write_planes) straight into a pinned buffer
(that read is the only host copy), and every plane segment goes to its place in the device
planes with one cudaMemcpyAsync on a copy stream of its own. Buffers are filled in turn; an
event recorded after a buffer's last copy is waited on only when the ring comes back to it, so
the CPU fills buffer i+1 while buffer i is in flight. The compute stream waits (on the device,
not the host) for each tensor's copies, so a kernel may use a weight as soon as it is loaded;
`finish` synchronizes once, at the end of loading, and frees the ring.

Large fills are split into block ranges over a few threads (numpy releases the GIL while it
copies), which also overlaps the page faults of the memory map.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import cupy as cp
import numpy as np
from cupy.cuda import pinned_memory

from service.backends.cuda.layout import PlaneLayout, plane_offsets, write_planes

_H2D = 1                       # cudaMemcpyHostToDevice
_SPLIT_BYTES = 4 << 20         # fills smaller than this stay on the calling thread


class PinnedUploader:
    def __init__(self, n_buffers: int = 3, buffer_bytes: int = 64 << 20, threads: int = 4):
        if n_buffers < 2 or buffer_bytes < 1 << 20:
            raise ValueError(f"staging ring of {n_buffers} x {buffer_bytes} bytes: need at "
                             "least 2 buffers of 1 MiB")
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.n_buffers, self.buffer_bytes, self.threads = n_buffers, buffer_bytes, threads
        self._mem: list[Any] = [None] * n_buffers      # cupy PinnedMemory per buffer
        self._host: list[Any] = [None] * n_buffers     # (buffer_bytes,) u8 views of them
        self._done: list[Any] = [None] * n_buffers     # event after each buffer's last copy
        self._cur, self._used = 0, 0
        self._pool: ThreadPoolExecutor | None = None

    # ---------------------------------------------------------------- ring
    def _buffer(self) -> np.ndarray:
        i = self._cur
        if self._host[i] is None:
            self._mem[i] = pinned_memory.PinnedMemory(self.buffer_bytes)
            ptr = pinned_memory.PinnedMemoryPointer(self._mem[i], 0)
            self._host[i] = np.frombuffer(ptr, np.uint8, self.buffer_bytes)
        if self._used == 0 and self._done[i] is not None:
            self._done[i].synchronize()          # its previous copies have left the buffer
            self._done[i] = None
        return self._host[i]

    def _next(self) -> None:
        ev = cp.cuda.Event(block=False, disable_timing=True)
        ev.record(self.stream)
        self._done[self._cur] = ev
        self._cur, self._used = (self._cur + 1) % self.n_buffers, 0

    def _fill(self, raw: np.ndarray, layout: PlaneLayout, b0: int, b1: int, buf: np.ndarray,
              offsets: list[int]) -> None:
        nb = b1 - b0
        parts = min(self.threads, max(1, nb * layout.type_size // _SPLIT_BYTES))
        if parts <= 1:
            write_planes(raw, layout, b0, b1, buf, offsets)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="weight-fill")
        cuts = [b0 + nb * i // parts for i in range(parts + 1)]

        def part(i: int) -> None:
            s0, s1 = cuts[i], cuts[i + 1]
            offs = [o + (s0 - b0) * n for o, (_, n) in zip(offsets, layout.planes, strict=True)]
            write_planes(raw, layout, s0, s1, buf, offs)

        list(self._pool.map(part, range(parts)))

    # ---------------------------------------------------------------- tensors
    def after(self, stream) -> None:
        """Order later copies after the work queued on `stream` so far (device memory a load
        reuses from CuPy's pool may still be read there)."""
        ev = cp.cuda.Event(block=False, disable_timing=True)
        ev.record(stream)
        self.stream.wait_event(ev)

    def upload(self, raws: list[np.ndarray], layout: PlaneLayout) -> tuple[list[Any], Any]:
        """The planes of the blocks of `raws` (each (n_bytes,) uint8, stacked in order) as
        device arrays, and an event on the copy stream after their last copy."""
        ts, n_planes = layout.type_size, len(layout.planes)
        counts = [r.size // ts for r in raws]
        if any(r.size % ts for r in raws):
            raise ValueError(f"tensor bytes are not whole {layout.kernel} blocks")
        total = sum(counts)
        planes = [cp.empty(total * n, cp.uint8) for _, n in layout.planes]   # (blocks*n,) u8
        first = 0                                       # blocks of earlier raws
        for raw, count in zip(raws, counts, strict=True):
            b = 0
            while b < count:
                buf = self._buffer()
                room = (self.buffer_bytes - self._used - 16 * n_planes) // ts
                if room <= 0:
                    self._next()
                    continue
                take = min(room, count - b)
                offsets, end = plane_offsets(layout, take, self._used)
                self._fill(raw, layout, b, b + take, buf, offsets)
                base = buf.ctypes.data
                for (_, n), dev, o in zip(layout.planes, planes, offsets, strict=True):
                    cp.cuda.runtime.memcpyAsync(dev.data.ptr + (first + b) * n, base + o,
                                                take * n, _H2D, self.stream.ptr)
                self._used = end
                b += take
            first += count
        ready = cp.cuda.Event(block=False, disable_timing=True)
        ready.record(self.stream)
        return planes, ready

    def finish(self) -> None:
        """Wait for every copy (the one synchronize of a load) and free the ring."""
        self.stream.synchronize()
        self._mem = [None] * self.n_buffers
        self._host = [None] * self.n_buffers
        self._done = [None] * self.n_buffers
        self._cur, self._used = 0, 0
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
