"""Open a GGUF file through the `gguf` package (memory-mapped) and refuse what cannot be served.

`GGUFFile` exposes plain-Python metadata and raw tensor views; every structural problem (bad
magic, truncated header, tensor data past the end of the file, unsupported quant type) becomes a
`ModelFormatError` that names the file and the problem. The header is pre-scanned by
`service.gguf.prescan` before the `gguf` reader runs, so corrupt counts or lengths in the metadata
are refused before anything is allocated for them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from service.errors import ModelFormatError
from service.gguf.prescan import prescan
from service.gguf.quants import QuantType, block_spec


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
        prescan(self.path)
        try:
            from gguf import GGUFReader

            reader = GGUFReader(self.path, "r")
        except ModelFormatError:
            raise
        except Exception as exc:  # the gguf package raises ValueError, struct.error, ...
            raise ModelFormatError(f"{self.path}: not a readable GGUF file ({exc})") from exc
        self.metadata: dict[str, Any] = {}
        for key, field in reader.fields.items():
            if key.startswith("GGUF."):
                continue
            try:
                self.metadata[key] = field.contents()
            except Exception as exc:
                raise ModelFormatError(f"{self.path}: metadata key {key!r} is unreadable") from exc
        self.tensors: dict[str, TensorInfo] = {}
        file_size = self.path.stat().st_size
        for t in reader.tensors:
            self.tensors[t.name] = self._tensor_info(t, file_size)

    def _tensor_info(self, t: Any, file_size: int) -> TensorInfo:
        try:
            qtype = QuantType(int(t.tensor_type))
        except ValueError:
            qtype = None
        if qtype is None or block_spec(qtype) is None:
            raise ModelFormatError(
                f"{self.path}: tensor {t.name!r} has unsupported quant type "
                f"{getattr(t.tensor_type, 'name', t.tensor_type)}; supported: "
                + ", ".join(q.name for q in QuantType)
            )
        spec = block_spec(qtype)
        shape = tuple(int(d) for d in reversed([int(x) for x in t.shape])) or (1,)  # 0-d: scalar
        if any(d <= 0 for d in shape):
            raise ModelFormatError(f"{self.path}: tensor {t.name!r} has an empty shape {shape}")
        if shape[-1] % spec.block_size:
            raise ModelFormatError(
                f"{self.path}: tensor {t.name!r} row length {shape[-1]} is not a multiple of "
                f"the {qtype.name} block size {spec.block_size}"
            )
        n_bytes = int(np.prod(shape)) // spec.block_size * spec.type_size
        end = int(t.data_offset) + n_bytes
        if end > file_size:
            raise ModelFormatError(
                f"{self.path}: tensor {t.name!r} data ends at byte {end}, past the end of the "
                f"file ({file_size} bytes): the file is truncated"
            )
        raw = np.asarray(t.data).reshape(-1).view(np.uint8)
        if raw.size != n_bytes:
            raise ModelFormatError(
                f"{self.path}: tensor {t.name!r} holds {raw.size} bytes, expected {n_bytes}"
            )
        return TensorInfo(t.name, qtype, shape, raw)

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

    def has_tensor(self, name: str) -> bool:
        return name in self.tensors
