"""GGUFFile reads what `gguf.GGUFReader` reads: the same metadata values and tensor bytes."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from service.errors import ModelFormatError
from service.gguf.reader import GGUFFile
from tests.support.models import TINY_MODELS, model_path
from tests.unit.test_gguf_malformed import write_tiny


def reference(path: Path) -> tuple[dict, dict]:
    r = gguf.GGUFReader(path)
    metadata = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    tensors = {t.name: (int(t.tensor_type), tuple(int(d) for d in reversed(t.shape)),
                        np.asarray(t.data).reshape(-1).view(np.uint8)) for t in r.tensors}
    return metadata, tensors


def flat(value):
    """gguf's contents() flattens arrays of arrays; GGUFFile keeps them nested."""
    if isinstance(value, list) and value and isinstance(value[0], list):
        return [x for v in value for x in flat(v)]
    return value


def assert_same_as_reference(path: Path) -> None:
    want_md, want_tensors = reference(path)
    f = GGUFFile(path)
    assert f.metadata.keys() == want_md.keys()
    for key, value in want_md.items():
        got = flat(f.metadata[key])
        assert got == value and type(got) is type(value), key
        if isinstance(value, list) and value:
            assert {type(v) for v in got} == {type(v) for v in value}, key
    assert f.tensors.keys() == want_tensors.keys()
    for name, (type_id, shape, raw) in want_tensors.items():
        t = f.tensors[name]
        assert int(t.qtype) == type_id and t.shape == (shape or (1,)), name
        assert np.array_equal(t.raw, raw), name
        assert not t.raw.flags.writeable


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_tiny_file_matches_gguf_reader(tmp_path, endian):
    path = write_tiny(tmp_path / "tiny.gguf", endian)
    assert_same_as_reference(path)
    assert GGUFFile(path).metadata["test.nested"] == [[1, 2], [3, 4, 5]]


@pytest.mark.parametrize("name", TINY_MODELS)
def test_fixture_models_match_gguf_reader(name):
    assert_same_as_reference(model_path(name))


@pytest.mark.slow
def test_real_vocabulary_matches_gguf_reader():
    """SmolLM2's 49152 token strings and its quantized tensors, when the model is present (the
    unit tier never fetches)."""
    assert_same_as_reference(model_path("smollm2", fetch=False))


def test_invalid_utf8_in_string_array_is_refused(tmp_path):
    path = write_tiny(tmp_path / "tiny.gguf")
    data = bytearray(path.read_bytes())
    at = data.index(b"beta")
    data[at] = 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ModelFormatError, match=r"'test.words'\[1\] is not valid UTF-8"):
        GGUFFile(path)
