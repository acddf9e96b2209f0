"""`describe` summarizes a GGUF file without dumping its arrays."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from service.errors import ModelFormatError
from service.tools.inspect import describe, format_value
from tests.support.gguf_files import gguf_writer
from tests.support.models import model_path


def write_model(path: Path) -> Path:
    with gguf_writer(path, "llama") as w:
        w.add_name("inspect test")
        w.add_block_count(2)
        w.add_embedding_length(8)
        w.add_rope_freq_base(10000.0)
        w.add_tokenizer_model("gpt2")
        w.add_token_list([f"tok{i:04d}" for i in range(1000)])
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}" * 4)
        w.add_tensor("token_embd.weight", np.zeros((1000, 8), np.float32))
        w.add_tensor("output_norm.weight", np.ones(8, np.float32))
    return path


def test_describe_small_model(tmp_path):
    text = describe(write_model(tmp_path / "m.gguf"))
    assert "architecture  llama" in text
    assert "name          inspect test" in text
    assert "llama.block_count" in text and "llama.rope.freq_base" in text
    assert "10000" in text
    assert "vocab size" in text and "1,000" in text
    assert "1 'tok0001'" in text and "2 'tok0002'" in text
    assert "present (" in text
    assert "tok0500" not in text                     # arrays are summarized, never dumped
    assert "parameters    8,008" in text
    assert "tensors       2" in text
    assert "F32" in text and "32,032" in text       # 8008 f32 elements
    assert len(text.splitlines()) < 60


def test_describe_mixed_quant_fixture():
    text = describe(model_path("tiny-llama-mixq"))
    for qtype in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16"):
        assert f"\n  {qtype} " in text
    assert "chat template                                absent" in text


def test_format_value():
    assert format_value(list(range(262144))) == "[array of 262,144 int]"
    assert format_value("x" * 500).endswith("... (500 chars)")
    assert format_value(True) == "true"


def test_describe_refuses_garbage(tmp_path):
    p = tmp_path / "junk.gguf"
    p.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelFormatError, match="bad magic"):
        describe(p)


def write_llama(path: Path, **overrides: int) -> Path:
    """A llama GGUF with the hyperparameters `overrides` changes (tensors left out)."""
    values = {"block_count": 2, "context_length": 64, "embedding_length": 8,
              "feed_forward_length": 16, "attention.head_count": 2}
    values.update(overrides)
    with gguf_writer(path, "llama") as w:
        for key, value in values.items():
            w.add_uint32(f"llama.{key}", value)
        w.add_tokenizer_model("gpt2")
        w.add_token_list([f"tok{i:04d}" for i in range(64)])
        w.add_tensor("token_embd.weight", np.zeros((64, 8), np.float32))
    return path


@pytest.mark.parametrize("key, value", [
    ("block_count", 2**31), ("context_length", 2**31), ("embedding_length", 0)])
def test_inspect_flags_impossible_hyperparameters(tmp_path, capsys, key, value):
    from tests.support.cli import run_cli

    good = describe(model_path("tiny-llama-mixq"))
    assert re.search(r"serving check\n  hyperparameters and tensors +ok\n", good)
    path = write_llama(tmp_path / "bad.gguf", **{key: value})
    text = describe(path)
    assert f"llama.{key}" in text.split("serving check")[1]
    code, out, _ = run_cli(capsys, "inspect", str(path))
    assert code == 1 and "refused" in out
