"""Writing GGUF files derived from another: metadata copied key by key, tensor data streamed.

Used by the file tools (service/tools/quantize.py, fit_markov). `copy_metadata` copies every key
of a file with its GGUF value type (as `prescan` records it), the tokenizer included, editing
`general.file_type` and, for a layer-truncated copy, `<arch>.block_count` and every `<arch>.*`
array of block_count entries (per-layer values: their first N kept), except `<arch>.dflash.*`
(a drafter's target-layer ids). `write_tensor_data` streams the tensors' bytes into a `.part`
file renamed into place once complete.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from service.errors import ModelFormatError
from service.gguf.reader import GGUFFile


def copy_metadata(f: GGUFFile, writer, file_type: int | None, n_layers: int | None,
                  drop: Callable[[str], bool] = lambda key: False) -> list[str]:
    """Every key of `f` into `writer` with its value type, edited as the module says
    (`file_type` None: kept as it is), except the keys `drop` selects. Returns the keys that
    could not be copied (empty arrays, which GGUFWriter refuses)."""
    from gguf import GGUFValueType

    arch = f.metadata["general.architecture"]
    old_blocks = f.metadata[f"{arch}.block_count"]
    skipped = []
    for key, value in f.metadata.items():
        if key == "general.architecture" or drop(key):
            continue                   # the writer adds the architecture first
        types = [GGUFValueType(int(t)) for t in f.header.value_types[key]]
        vtype, sub = types[0], (types[1] if len(types) > 1 else None)
        if sub == GGUFValueType.ARRAY:
            raise ModelFormatError(f"{f.path}: {key}: nested arrays are not supported")
        if key == "general.alignment":
            writer.add_custom_alignment(int(value))
            continue
        if key == "general.file_type" and file_type is not None:
            value = file_type
        if n_layers is not None and key.startswith(f"{arch}."):
            if key == f"{arch}.block_count":
                value = n_layers
            elif (sub is not None and sub != GGUFValueType.STRING and len(value) == old_blocks
                  and ".dflash." not in key):    # a drafter's ids of *target* layers stay
                value = value[:n_layers]
        if sub is not None and len(value) == 0:
            skipped.append(key)
            continue
        writer.add_key_value(key, value, vtype, sub_type=sub)
    if "general.file_type" not in f.metadata and file_type is not None:
        writer.add_key_value("general.file_type", file_type, GGUFValueType.UINT32)
    return skipped


def write_tensor_data(w, tensors, part: Path, dst: Path) -> None:
    """Finish a GGUFWriter `w` whose metadata and tensor infos are added: header, key-values and
    tensor infos, then each tensor's data (an iterable of array chunks, in the order of the
    infos) at the file's alignment, into `part`, renamed to `dst` once complete. `part` is
    removed if anything fails, so `dst` is never a partial file."""
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        fout, align = w.fout[0], w.data_alignment
        for chunks in tensors:
            fout.write(bytes(-fout.tell() % align))
            for chunk in chunks:
                fout.write(np.ascontiguousarray(chunk).data)
        fout.write(bytes(-fout.tell() % align))
        w.close()
        os.replace(part, dst)
    finally:
        w.close()
        part.unlink(missing_ok=True)
