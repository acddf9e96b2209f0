"""Edited copies of GGUF files for tests: malformed variants, swapped tensors or metadata."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from service.gguf.reader import GGUFFile

T = gguf.GGMLQuantizationType


def rewrite(src: Path, dst: Path, meta: dict | None = None, drop: tuple[str, ...] = (),
            tensors: dict | None = None) -> Path:
    """A copy of `src` with metadata `meta` set (value, GGUFValueType[, sub type]), keys and
    tensors in `drop` removed and `tensors` (name -> array, GGML type) added or replaced (the
    arguments are left as they are: a table of cases can pass its own)."""
    f = GGUFFile(src)
    meta, tensors = dict(meta or {}), tensors or {}
    w = gguf.GGUFWriter(str(dst), meta.pop("general.architecture",
                                     (f.metadata["general.architecture"],))[0])
    for key, value in f.metadata.items():
        if key in ("general.architecture", *drop) or key in meta:
            continue
        types = [gguf.GGUFValueType(int(t)) for t in f.header.value_types[key]]
        w.add_key_value(key, value, types[0], sub_type=types[1] if len(types) > 1 else None)
    for key, (value, *vtypes) in meta.items():
        w.add_key_value(key, value, vtypes[0], sub_type=vtypes[1] if len(vtypes) > 1 else None)
    for t in f.tensors.values():
        if t.name in drop or t.name in tensors:
            continue
        rows = int(np.prod(t.shape[:-1]))
        w.add_tensor(t.name, np.array(t.raw).reshape(rows, -1),        # (rows, row bytes) u8
                     raw_shape=(*t.shape[:-1], t.raw.size // rows),
                     raw_dtype=gguf.GGMLQuantizationType(int(t.qtype)))
    for name, (a, qtype) in tensors.items():
        w.add_tensor(name, a, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


# edits of a drafter file's d2t and what the refusal says, for a drafter with a 300-id draft
# vocabulary (and its own output.weight) of a 1024-token target (service/model/drafter_format.py)
D2T_BAD = {
    "d2t out of range": (dict(tensors={"d2t": (np.arange(1000, 1300, dtype=np.int64), T.I64)}),
                         r"ids 1000..1299; target token ids in \[0, 1024\)"),
    "d2t repeats": (dict(tensors={"d2t": (np.zeros(300, np.int64), T.I64)}),
                    "two draft rows to one target id"),
    "d2t float": (dict(tensors={"d2t": (np.zeros(300, np.float32), T.F32)}), "d2t must be I64"),
    "d2t without output": (dict(drop=("output.weight",)), "needs the drafter's own output"),
}
