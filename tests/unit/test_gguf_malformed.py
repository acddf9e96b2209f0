"""Corrupt GGUF files are refused with a ModelFormatError that names the problem, cheaply.

A tiny valid llama-arch file is written with `gguf.GGUFWriter`, then one field is overwritten at
the offset `gguf.GGUFReader` reports for it. Both `prescan` and `GGUFFile` must refuse each
corruption, and a corrupt length or count must not make either allocate memory for it.
"""

from __future__ import annotations

import struct
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest

from service.errors import ModelFormatError
from service.gguf.prescan import QUANT_SIZES, prescan
from tests.support.gguf_files import gguf_writer

PEAK_LIMIT = 50 << 20            # bytes of traced memory a refused open may reach
HUGE_STRING = 1 << 60
HUGE_COUNT = 10**15
TENSORS = {                      # name -> row-major shape; 8 f32 = 32 bytes keeps rows aligned
    "token_embd.weight": (16, 8),
    "blk.0.attn_q.weight": (8, 8),
    "blk.0.attn_norm.weight": (8,),
    "output_norm.weight": (8,),
}


def write_tiny(path: Path, endianess: gguf.GGUFEndian = gguf.GGUFEndian.LITTLE) -> Path:
    rng = np.random.default_rng(0)
    with gguf_writer(path, "llama", endianess=endianess) as w:
        w.add_name("tiny malformed-test model")
        w.add_block_count(1)
        w.add_context_length(64)
        w.add_embedding_length(8)
        w.add_feed_forward_length(16)
        w.add_head_count(2)
        w.add_head_count_kv(2)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_array("test.scores", [float(i) for i in range(10)])
        w.add_array("test.words", ["alpha", "beta", "gamma"])
        w.add_array("test.nested", [[1, 2], [3, 4, 5]])
        for name, shape in TENSORS.items():
            w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    return path


# ---------------------------------------------------------------- where fields live
class Layout:
    """Byte offsets of the tiny file's fields, as the reference reader sees them."""

    def __init__(self, path: Path):
        r = gguf.GGUFReader(path)
        self.size = path.stat().st_size
        self.data_start = r.data_offset
        self.kv = {k: f.offset for k, f in r.fields.items() if not k.startswith("GGUF.")}
        self.tensors = {t.name: (t.field.offset, t.data_offset, t.n_bytes) for t in r.tensors}

    def value(self, key: str) -> int:
        """Offset of `key`'s value (just after its u32 value type)."""
        return self.kv[key] + 8 + len(key.encode()) + 4

    def tensor_field(self, name: str, field: str) -> int:
        """Offset of `field` (n_dims, dims, type, offset) in tensor `name`'s info."""
        n_dims_at = self.tensors[name][0] + 8 + len(name.encode())
        n_dims = len(TENSORS[name])
        return {"n_dims": n_dims_at, "dims": n_dims_at + 4, "type": n_dims_at + 4 + 8 * n_dims,
                "offset": n_dims_at + 8 + 8 * n_dims}[field]


def poke(data: bytearray, at: int, fmt: str, value: int) -> None:
    struct.pack_into("<" + fmt, data, at, value)


# Each corruption: (id, mutate(data, layout) -> new bytes, substrings the message must contain).
Mutation = Callable[[bytearray, Layout], bytes]


def _set(at: Callable[[Layout], int], fmt: str, value: int) -> Mutation:
    def mutate(data: bytearray, lay: Layout) -> bytes:
        poke(data, at(lay), fmt, value)
        return bytes(data)
    return mutate


CASES: list[tuple[str, Mutation, tuple[str, ...]]] = [
    ("empty", lambda d, lay: b"", ("empty",)),
    ("bad_magic", lambda d, lay: b"GGUX" + bytes(d[4:]), ("bad magic", "GGUX")),
    ("version_1", _set(lambda lay: 4, "I", 1), ("unsupported GGUF version 1",)),
    ("cut_in_header", lambda d, lay: bytes(d[:lay.kv["test.words"] + 20]), ("truncated",)),
    ("cut_in_tensor_data",
     lambda d, lay: bytes(d[:lay.tensors["output_norm.weight"][1] + 16]),
     ("truncated: tensor 'output_norm.weight' data ends at byte", "past the end of the file")),
    ("huge_tensor_count", _set(lambda lay: 8, "Q", HUGE_COUNT),
     (f"tensor count {HUGE_COUNT}", "bytes are left in the file")),
    ("huge_kv_count", _set(lambda lay: 16, "Q", HUGE_COUNT),
     (f"metadata key/value count {HUGE_COUNT}",)),
    ("huge_key_length", _set(lambda lay: lay.kv["general.name"], "Q", HUGE_STRING),
     ("metadata key #", f"string length {HUGE_STRING} exceeds the")),
    ("huge_string_length", _set(lambda lay: lay.value("general.name"), "Q", HUGE_STRING),
     (f"metadata key 'general.name' string length {HUGE_STRING} exceeds the",
      "bytes left in the file")),
    ("huge_array_count", _set(lambda lay: lay.value("test.scores") + 4, "Q", HUGE_COUNT),
     (f"metadata key 'test.scores' array count {HUGE_COUNT} needs at least",)),
    ("huge_string_in_array",
     _set(lambda lay: lay.value("test.words") + 12 + 8 + len("alpha"), "Q", HUGE_STRING),
     (f"metadata key 'test.words'[1] string length {HUGE_STRING}",)),
    ("huge_nested_array_count",
     _set(lambda lay: lay.value("test.nested") + 12 + 4, "Q", HUGE_COUNT),
     (f"'test.nested'[0] array count {HUGE_COUNT}",)),
    ("unknown_value_type", _set(lambda lay: lay.value("test.scores") - 4, "I", 77),
     ("metadata key 'test.scores' has unknown value type 77",)),
    ("unknown_array_item_type", _set(lambda lay: lay.value("test.scores"), "I", 4242),
     ("'test.scores' array item has unknown value type 4242",)),
    ("n_dims_100", _set(lambda lay: lay.tensor_field("blk.0.attn_q.weight", "n_dims"), "I", 100),
     ("tensor 'blk.0.attn_q.weight' has n_dims 100",)),
    ("dims_overflow", _set(lambda lay: lay.tensor_field("token_embd.weight", "dims") + 8, "Q",
                           1 << 62),
     ("tensor 'token_embd.weight' dimensions", "overflow int64")),
    ("offset_past_end",
     _set(lambda lay: lay.tensor_field("blk.0.attn_q.weight", "offset"), "Q", 1 << 40),
     ("tensor 'blk.0.attn_q.weight'", "past the end of the file")),
    ("unaligned_offset",
     _set(lambda lay: lay.tensor_field("blk.0.attn_q.weight", "offset"), "Q", 3),
     ("tensor 'blk.0.attn_q.weight' data offset 3 is not a multiple of the alignment 32",)),
    ("unknown_tensor_type",
     _set(lambda lay: lay.tensor_field("blk.0.attn_q.weight", "type"), "I", 99),
     ("tensor 'blk.0.attn_q.weight' has unknown ggml type 99",)),
]


def open_prescan(path: Path) -> None:
    prescan(path)


def open_gguffile(path: Path) -> None:
    from service.gguf.reader import GGUFFile

    GGUFFile(path)


OPENERS = {"prescan": open_prescan, "GGUFFile": open_gguffile}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[bytes, Layout]:
    path = write_tiny(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    return path.read_bytes(), Layout(path)


def corrupt(tmp_path: Path, tiny: tuple[bytes, Layout], mutate: Mutation) -> Path:
    data, lay = tiny
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(mutate(bytearray(data), lay))
    return path


# ---------------------------------------------------------------- refusals
def test_unknown_type_id_is_really_unknown():
    assert 99 not in QUANT_SIZES


@pytest.mark.parametrize("opener", OPENERS)
@pytest.mark.parametrize("case, mutate, expected", CASES, ids=[c[0] for c in CASES])
def test_corrupt_file_is_refused(tmp_path, tiny, opener, case, mutate, expected):
    path = corrupt(tmp_path, tiny, mutate)
    with pytest.raises(ModelFormatError) as exc:
        OPENERS[opener](path)
    msg = str(exc.value)
    assert str(path) in msg
    for part in expected:
        assert part in msg, f"{case}: {part!r} not in {msg!r}"


HUGE_CASES = [c for c in CASES if c[0].startswith("huge_")]


@pytest.mark.parametrize("opener", OPENERS)
@pytest.mark.parametrize("case, mutate, expected", HUGE_CASES, ids=[c[0] for c in HUGE_CASES])
def test_corrupt_lengths_allocate_nothing(tmp_path, tiny, opener, case, mutate, expected):
    path = corrupt(tmp_path, tiny, mutate)
    if opener == "GGUFFile":
        open_gguffile(write_tiny(tmp_path / "warm.gguf"))   # import everything before tracing
    tracemalloc.start()
    try:
        with pytest.raises(ModelFormatError):
            OPENERS[opener](path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < PEAK_LIMIT, f"{case}: peak traced memory {peak} bytes"


def test_non_file_is_refused(tmp_path):
    with pytest.raises(ModelFormatError, match="cannot read the file"):
        prescan(tmp_path / "missing.gguf")


# ---------------------------------------------------------------- valid files pass
# (GGUFFile, which runs prescan first, is compared with gguf-py on these same files, both byte
# orders, and on the tiny fixtures and SmolLM2 in test_gguf_reader.py)
def assert_header_is_gguf_readers(path: Path) -> None:
    """prescan accepts the file and reads the header gguf-py reads: byte order, alignment,
    where the data starts, each tensor's name, type, dims, offset and size, the metadata."""
    h, r = prescan(path), gguf.GGUFReader(path)
    assert h.byte_order == ("<" if r.endianess == gguf.GGUFEndian.LITTLE else ">")
    assert (h.alignment, h.data_start, h.file_size) == (r.alignment, r.data_offset,
                                                         path.stat().st_size)
    assert [(t.name, t.type_id, t.dims, h.data_start + t.offset, t.n_bytes)
            for t in h.tensors] == [(t.name, int(t.tensor_type), tuple(int(d) for d in t.shape),
                                     int(t.data_offset), int(t.n_bytes)) for t in r.tensors]
    fields = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    assert h.metadata.keys() == fields.keys()
    assert h.metadata["test.words"] == fields["test.words"] == ["alpha", "beta", "gamma"]


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG],
                         ids=["little-endian", "big-endian"])
def test_tiny_valid_file_passes(tmp_path, endian):
    assert_header_is_gguf_readers(write_tiny(tmp_path / "ok.gguf", endian))


def test_nondefault_alignment(tmp_path):
    path = tmp_path / "align.gguf"
    with gguf_writer(path, "llama") as w:
        w.add_custom_alignment(64)
        w.add_tensor("a", np.ones(3, np.float32))
        w.add_tensor("b", np.ones(5, np.float32))
    header = prescan(path)
    assert header.alignment == 64 and header.data_start % 64 == 0
    assert [t.offset for t in header.tensors] == [0, 64]          # b starts at the next 64
    data = bytearray(path.read_bytes())
    at = data.index(b"general.alignment") + len("general.alignment") + 4
    poke(data, at, "I", 48)
    path.write_bytes(bytes(data))
    with pytest.raises(ModelFormatError, match="non-zero power of two"):
        prescan(path)

