"""Device memory and host transfers of the CUDA backend: allocation on the backend's stream,
readback, host-to-device copies of small int32 arrays, and the step I/O of the model runner's
contract (service/engine/runner/model_runner.py): one packed int32 upload per step from pinned
memory, one int32 readback into pinned memory queued after the step and one event wait (the
overlapped loop waits for step k after queueing step k + 1).

An allocation or a host copy into a device array may reuse or overwrite the memory of a view
whose 8-bit blocks the scratch holds, so both forget them (launcher.ActivationBlocks).
"""

from __future__ import annotations

from typing import Any

import cupy as cp
import numpy as np

from service.backends.cuda.launcher import ActivationBlocks
from service.backends.cuda.types import check_dtype


class DeviceMemory:
    def __init__(self, stream: Any, blocks: ActivationBlocks) -> None:
        self.stream = stream
        self._blocks = blocks
        # pinned upload buffer per destination, with the event recorded after its last copy
        self._staging: dict[int, tuple[np.ndarray, Any]] = {}
        self._events: list[Any] = []                  # events no queued download holds

    def zeros(self, shape, dtype="float32") -> Any:
        self._blocks.forget()        # the new array may reuse a freed view's memory
        with self.stream:
            return cp.zeros(shape, dtype=dtype)

    def to_host(self, x) -> np.ndarray:
        out = cp.asnumpy(x, stream=self.stream)
        self.stream.synchronize()
        return out

    def upload_ints(self, host, out) -> None:
        self._blocks.forget()
        host = np.asarray(host, dtype=out.dtype)
        key = out.data.ptr
        stage, copied = self._staging.get(key, (None, None))
        if stage is None or stage.size < host.size:
            mem = cp.cuda.alloc_pinned_memory(max(host.size, out.size) * out.itemsize)
            stage = np.frombuffer(mem, out.dtype, max(host.size, out.size))
            copied = cp.cuda.Event(block=False, disable_timing=True)
        else:
            # the overlapped loop queues work ahead of the host: the last copy from this buffer
            # may still be waiting its turn on the stream
            copied.synchronize()
        stage[: host.size] = host
        out[: host.size].set(stage[: host.size], stream=self.stream)
        copied.record(self.stream)
        self._staging[key] = (stage, copied)

    def synchronize(self) -> None:
        self.stream.synchronize()

    @staticmethod
    def memory_free() -> int:
        """Free device memory, counting what CuPy's pool holds unused as free."""
        pool = cp.get_default_memory_pool()
        return int(cp.cuda.runtime.memGetInfo()[0]) + pool.free_bytes()

    # ---------------------------------------------------------------- step I/O
    @staticmethod
    def host_buffer(n: int) -> np.ndarray:
        mem = cp.cuda.alloc_pinned_memory(max(1, n) * 4)
        buf = np.frombuffer(mem, np.int32, n)                      # (n,) i32 pinned
        buf[:] = 0
        return buf

    @staticmethod
    def _check_words(host, device, what: str) -> int:
        check_dtype(host, np.int32, f"{what} host")
        check_dtype(device, np.int32, f"{what} device")
        if device.ndim != 1 or not device.flags.c_contiguous or not host.flags.c_contiguous:
            raise ValueError(f"{what}: buffers must be contiguous 1-D")
        return min(host.size, device.size)

    def upload_step(self, host, device) -> None:
        n = self._check_words(host, device, "upload_step")
        if n != host.size:
            raise ValueError(f"upload_step: {host.size} words into {device.size}")
        cp.cuda.runtime.memcpyAsync(device.data.ptr, host.ctypes.data, n * 4,
                                    cp.cuda.runtime.memcpyHostToDevice, self.stream.ptr)

    def queue_download(self, device, host) -> Any:
        n = self._check_words(host, device, "queue_download")
        if n != device.size:
            raise ValueError(f"queue_download: {device.size} words into {host.size}")
        if n:
            cp.cuda.runtime.memcpyAsync(host.ctypes.data, device.data.ptr, n * 4,
                                        cp.cuda.runtime.memcpyDeviceToHost, self.stream.ptr)
        done = self._events.pop() if self._events else cp.cuda.Event(block=False,
                                                                       disable_timing=True)
        done.record(self.stream)
        return done

    def wait_download(self, ticket) -> None:
        ticket.synchronize()
        self._events.append(ticket)
