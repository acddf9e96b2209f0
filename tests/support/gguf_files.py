"""GGUF files a test writes itself (with gguf-py's writer): small models and corrupt headers."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import gguf


@contextmanager
def gguf_writer(path: Path, arch: str, **options) -> Iterator[gguf.GGUFWriter]:
    """A GGUFWriter of `path` for `arch` (options: GGUFWriter's, such as endianess); the block
    adds metadata and tensors, and the file is written when it ends."""
    w = gguf.GGUFWriter(str(path), arch, **options)
    yield w
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
