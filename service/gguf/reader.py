"""Open a GGUF file (memory-mapped) and refuse what cannot be served.

`GGUFFile` exposes plain-Python metadata and raw tensor views; every structural problem (bad
magic, truncated header, tensor data past the end of the file, unsupported quant type) becomes a
`ModelFormatError` that names the file and the problem. The header is read and checked by
`service.gguf.prescan` (corrupt counts or lengths are refused before anything is allocated for
them); the tensor bytes are slices of one read-only `numpy.memmap` of the file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from service.errors import ModelFormatError
from service.gguf.prescan import QUANT_NAMES, Header, TensorEntry, prescan
from service.gguf.quants import QuantType, block_spec, supported_types

# integer element types a tensor may have as an index table (never a weight): its raw bytes
# are read with `index_tensor`
INDEX_TYPES = {int(QuantType.I32): np.int32, int(QuantType.I64): np.int64}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file. `shape` is row-major (outermost first), the reverse of ggml's ne."""

    name: str
    qtype: QuantType
    shape: tuple[int, ...]      # e.g. (n_out, n_in) for a weight matrix
    raw: np.ndarray             # (n_bytes,) uint8, a read-only view of the mapped file

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))


class GGUFFile:
    """A validated, memory-mapped GGUF file."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelFormatError(f"{self.path}: no such file")
        self.header: Header = prescan(self.path)
        self.metadata: dict[str, Any] = self.header.metadata
        data = np.memmap(self.path, dtype=np.uint8, mode="r")
        self.tensors: dict[str, TensorInfo] = {
            t.name: self._tensor_info(t, data) for t in self.header.tensors}

    def _tensor_info(self, t: TensorEntry, data: np.ndarray) -> TensorInfo:
        spec = block_spec(t.type_id)
        index = t.type_id in INDEX_TYPES                # an index table (EAGLE-3's d2t)
        if spec is None and not index:
            raise ModelFormatError(
                f"{self.path}: tensor {t.name!r} has unsupported quant type "
                f"{QUANT_NAMES.get(t.type_id, t.type_id)}; supported: "
                + ", ".join(q.name for q in supported_types())
            )
        shape = tuple(reversed(t.dims)) or (1,)  # 0-d: a scalar
        if any(d <= 0 for d in shape):
            raise ModelFormatError(f"{self.path}: tensor {t.name!r} has an empty shape {shape}")
        # prescan checked that rows are whole blocks and that the bytes lie inside the file
        start = self.header.data_start + t.offset
        return TensorInfo(t.name, QuantType(t.type_id), shape, data[start:start + t.n_bytes])

    # ---------------------------------------------------------------- metadata access
    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str, kind: type | tuple[type, ...] = (int, float)) -> Any:
        if key not in self.metadata:
            raise ModelFormatError(f"{self.path}: required metadata key {key!r} is missing")
        value = self.metadata[key]
        if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
            raise ModelFormatError(
                f"{self.path}: metadata key {key!r} has type {type(value).__name__}, "
                f"expected {kind}"
            )
        return value

    def tensor(self, name: str, shape: tuple[int, ...] | None = None) -> TensorInfo:
        """The tensor called `name`, checked against the expected row-major `shape`."""
        info = self.tensors.get(name)
        if info is None:
            raise ModelFormatError(f"{self.path}: required tensor {name!r} is missing")
        if shape is not None and info.shape != tuple(shape):
            raise ModelFormatError(
                f"{self.path}: tensor {name!r} has shape {info.shape}, expected {tuple(shape)}"
            )
        return info

    def index_tensor(self, name: str) -> np.ndarray:
        """An integer index tensor (I32 / I64) as a flat int64 array (ModelFormatError when the
        tensor is missing or of another type)."""
        info = self.tensor(name)
        dtype = INDEX_TYPES.get(int(info.qtype))
        if dtype is None:
            raise ModelFormatError(f"{self.path}: tensor {name!r} has type {info.qtype.name}; "
                                   "an integer index table (I32 or I64) expected")
        return np.frombuffer(info.raw, dtype=np.dtype(dtype).newbyteorder("<")).astype(np.int64)

    def has_tensor(self, name: str) -> bool:
        return name in self.tensors
