"""Weight loading of the CUDA backend: GGUF tensors into device planes (layout.py), vectors,
and the end of loading.

Matrices keep the file's blocks split into planes, exactly the file's bytes (no dequantized
copy); they go through the pinned staging ring of upload.py (upload "pinned": copies overlap
reading the file, the stream waits on the device) or one synchronous copy per plane
("pageable"). A tensor loaded alone is kept by its name and the address of its bytes, so a
tied embedding and output matrix are one copy, and a drafter's tensor of the target's name (an
EAGLE-3 file's output.weight) is its own. The loader tracks the widest K and the largest matrix,
which size the GEMV and GEMM scratch at prepare time.
"""

from __future__ import annotations

import time
from typing import Any

import cupy as cp
import numpy as np
import structlog

from service.backends.cuda.layout import LAYOUTS, PlaneLayout, layout_of, split_planes
from service.backends.cuda.types import CudaMatrix
from service.backends.cuda.upload import PinnedUploader
from service.gguf.quants import dequantize
from service.gguf.reader import TensorInfo

log = structlog.get_logger(__name__)


class WeightLoader:
    def __init__(self, stream: Any, upload: str, uploader: PinnedUploader | None) -> None:
        self.stream = stream
        self.upload = upload                  # "pinned" | "pageable"
        self.uploader = uploader              # the staging ring ("pinned"), freed at the end
        self.tensor_bytes = 0                 # file bytes of the tensors loaded
        self.weight_bytes = 0                 # device bytes of the weights
        self.load_seconds = 0.0
        # tensors loaded alone, by (name, address of the file bytes)
        self.shared: dict[tuple[str, int], CudaMatrix] = {}
        self.max_k = 32                       # widest matrix row (GEMV activation scratch)
        self.max_elems = 0                    # rows * K of the largest matrix (GEMM tiles)
        self._load_t0: float | None = None

    # ---------------------------------------------------------------- start and end
    def _start_load(self) -> None:
        if self._load_t0 is not None:
            return
        self._load_t0 = time.perf_counter()
        if self.uploader is not None:
            self.uploader.after(self.stream)

    def finish_load(self) -> None:
        """The end of loading (prepare calls it): the one wait for every weight copy, the
        staging ring freed, the weight bytes on the device and the file bytes they came from
        logged (the planes hold the file's bytes exactly: no dequantized copy)."""
        if self._load_t0 is None:
            return
        if self.uploader is not None:
            self.uploader.finish()
        seconds = time.perf_counter() - self._load_t0
        self._load_t0 = None
        self.load_seconds = seconds
        log.info("weights on the GPU", upload=self.upload, weight_bytes=self.weight_bytes,
                 tensor_bytes=self.tensor_bytes, seconds=round(seconds, 3))

    # ---------------------------------------------------------------- matrices
    def _upload_planes(self, raws: list[np.ndarray], layout: PlaneLayout) -> list[Any]:
        """The planes of the blocks of `raws` stacked by rows, on the device."""
        self._start_load()
        n = sum(r.size for r in raws)
        self.tensor_bytes += n
        self.weight_bytes += n            # the planes hold exactly the file's bytes
        if self.uploader is not None:
            planes, ready = self.uploader.upload(raws, layout)
            self.stream.wait_event(ready)     # kernels wait on the device, the host does not
            return planes
        raw = raws[0] if len(raws) == 1 else np.concatenate(raws)
        planes = []
        for p in split_planes(raw, layout):
            d = cp.empty(p.size, cp.uint8)
            d.set(p, stream=self.stream)
            planes.append(d)
        self.stream.synchronize()
        return planes

    @staticmethod
    def can_fuse(tensors: list[TensorInfo]) -> bool:
        return len({t.qtype for t in tensors}) == 1 and len({t.shape[-1] for t in tensors}) == 1

    def load_matrix(self, tensors: list[TensorInfo]) -> CudaMatrix:
        if not self.can_fuse(tensors):
            raise ValueError("cannot fuse tensors of different types or widths: "
                             + ", ".join(f"{t.name} {t.qtype.name}" for t in tensors))
        key = (tensors[0].name, tensors[0].raw.__array_interface__["data"][0])
        if len(tensors) == 1 and key in self.shared:
            return self.shared[key]
        layout = layout_of(tensors[0].qtype)
        k = tensors[0].shape[-1]
        _check_width(k, layout, tensors[0].name)
        rows = sum(int(np.prod(t.shape[:-1])) for t in tensors)
        m = CudaMatrix(layout, rows, k, self._upload_planes([t.raw for t in tensors], layout))
        if len(tensors) == 1:
            self.shared[key] = m
        self.max_k = max(self.max_k, k)
        self.max_elems = max(self.max_elems, rows * k)
        return m

    def load_experts(self, tensor: TensorInfo) -> CudaMatrix:
        n_expert, n, k = tensor.shape
        layout = layout_of(tensor.qtype)
        _check_width(k, layout, tensor.name)
        self.max_k = max(self.max_k, k)
        return CudaMatrix(layout, n_expert * n, k, self._upload_planes([tensor.raw], layout),
                          n_expert)

    # ---------------------------------------------------------------- vectors
    def upload_vector(self, host) -> Any:
        host = np.ascontiguousarray(host, dtype=np.float32)
        if self.uploader is None or self._load_t0 is None:
            with self.stream:
                return cp.asarray(host)
        # While loading, through the staging ring: a pageable copy would wait for the stream.
        planes, ready = self.uploader.upload([host.reshape(-1).view(np.uint8)], LAYOUTS["F32"])
        self.stream.wait_event(ready)
        return planes[0].view(cp.float32).reshape(host.shape)

    def load_vector(self, tensor: TensorInfo) -> Any:
        self._start_load()
        v = self.upload_vector(dequantize(tensor.raw, tensor.qtype, tensor.shape))  # (n,) f32
        self.tensor_bytes += tensor.raw.size
        self.weight_bytes += v.nbytes
        return v


def _check_width(k: int, layout: PlaneLayout, name: str) -> None:
    if k % max(32, layout.block_size) and layout.quantized:
        raise ValueError(f"{name}: width {k} is not a multiple of {max(32, layout.block_size)}")
