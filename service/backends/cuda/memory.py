"""Device memory and host transfers of the CUDA backend: allocation on the backend's stream,
readback, host-to-device copies of small int32 arrays, and the step I/O of the model runner's
contract (service/engine/runner.py): one packed int32 upload per step from pinned memory, one
int32 readback into pinned memory and one event wait.

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
        self._staging: dict[int, np.ndarray] = {}     # pinned upload buffers per destination
        self._step_done: Any = None                   # the event download_step waits on

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
        stage = self._staging.get(key)
        if stage is None or stage.size < host.size:
            mem = cp.cuda.alloc_pinned_memory(max(host.size, out.size) * out.itemsize)
            stage = np.frombuffer(mem, out.dtype, max(host.size, out.size))
            self._staging[key] = stage
        # The previous step has been read back (to_host synchronizes) before the next upload,
        # so the staging buffer is free to overwrite.
        stage[: host.size] = host
        out[: host.size].set(stage[: host.size], stream=self.stream)

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

    def download_step(self, device, host) -> None:
        n = self._check_words(host, device, "download_step")
        if n != device.size:
            raise ValueError(f"download_step: {device.size} words into {host.size}")
        if n:
            cp.cuda.runtime.memcpyAsync(host.ctypes.data, device.data.ptr, n * 4,
                                        cp.cuda.runtime.memcpyDeviceToHost, self.stream.ptr)
        if self._step_done is None:
            self._step_done = cp.cuda.Event(block=False, disable_timing=True)
        self._step_done.record(self.stream)
        self._step_done.synchronize()
