"""`specstream quantize`: re-quantized and layer-truncated GGUF files load, keep the vocabulary
and metadata, hold exactly the re-encoded source tensors, and run."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from service.cli import main
from service.gguf.prescan import ValueType
from service.gguf.quants import QuantType, dequantize, quantize
from service.gguf.reader import GGUFFile
from service.model.spec import ModelSpec
from service.model.tokenizer import Tokenizer
from service.model.transformer import positions_for
from service.tools.quantize import MODES, keeps_tensor, output_type, requantize
from tests.support.gguf_files import gguf_writer
from tests.support.models import build_model, model_path

CHANGED_KEYS = {"general.file_type"}
Q8, Q4, F32 = QuantType.Q8_0, QuantType.Q4_0, QuantType.F32


def test_output_type_rules():
    mix, q8 = MODES["q4-mix"], MODES["q8_0"]
    assert output_type(mix, "blk.0.attn_q.weight", (256, 256), QuantType.Q4_K) == Q4
    assert output_type(mix, "dflash.dspark.markov.w1", (1024, 64), QuantType.F16) == Q8
    assert output_type(MODES["q4_0"], "dflash.fc.weight", (64, 128), QuantType.F16) == Q4
    assert output_type(q8, "blk.0.attn_norm.weight", (256,), QuantType.F16) == F32  # 1-D
    assert output_type(q8, "blk.0.ffn_gate_inp.weight", (16, 256), F32) == F32     # router
    assert output_type(q8, "blk.0.odd.weight", (8, 48), QuantType.F16) == QuantType.F16  # rows
    assert output_type(q8, "blk.0.ffn_up_exps.weight", (16, 256, 256), QuantType.Q4_K) == Q8


def test_keeps_tensor():
    assert keeps_tensor("blk.3.attn_q.weight", None)
    assert keeps_tensor("blk.3.attn_q.weight", 4) and not keeps_tensor("blk.4.attn_q.weight", 4)
    assert not keeps_tensor("blk.12.ffn_up.weight", 2)
    for name in ("token_embd.weight", "output_norm.weight", "output.weight", "dflash.fc.weight"):
        assert keeps_tensor(name, 1)


def check_copy(src_path, out_path, mode: str, n_layers: int | None) -> GGUFFile:
    """The checks every re-quantized file must pass; returns the opened output."""
    src, out = GGUFFile(src_path), GGUFFile(out_path)
    arch = src.metadata["general.architecture"]
    n = n_layers or src.metadata[f"{arch}.block_count"]
    # metadata: everything copied (tokenizer included) with the same value types, except the
    # file type and block count
    md_src = {k: v for k, v in src.metadata.items() if k not in CHANGED_KEYS}
    md_out = {k: v for k, v in out.metadata.items() if k not in CHANGED_KEYS}
    md_src[f"{arch}.block_count"] = n
    assert md_out == md_src
    assert out.metadata["general.file_type"] == MODES[mode].file_type
    assert out.header.value_types == {"general.file_type": (ValueType.UINT32,)
                                      } | src.header.value_types
    # tensors: the kept ones, in the source's order, each the source re-encoded
    kept = [t for t in src.tensors.values() if keeps_tensor(t.name, n)]
    assert list(out.tensors) == [t.name for t in kept]
    assert any(t.name.startswith(f"blk.{n - 1}.") for t in kept)
    for t in kept:
        o = out.tensors[t.name]
        assert o.shape == t.shape and o.qtype == output_type(MODES[mode], t.name, t.shape, t.qtype)
        if o.qtype == t.qtype:
            np.testing.assert_array_equal(o.raw, t.raw)
        else:   # encoding is per row: a sample of rows (all of a small tensor) suffices
            k, rows = t.shape[-1], int(np.prod(t.shape[:-1]))
            pick = np.unique(np.linspace(0, rows - 1, min(rows, 512)).astype(int))
            src_rows = t.raw.reshape(rows, -1)[pick]
            x = dequantize(src_rows, t.qtype, (pick.size, k))                  # (r, K) f32
            np.testing.assert_array_equal(o.raw.reshape(rows, -1)[pick], quantize(x, o.qtype),
                                          err_msg=t.name)
    # it loads as a model and runs
    spec = ModelSpec.from_gguf(out)
    assert spec.n_layer == len(spec.layers) == n
    tr = build_model(out.path, n_ctx=32, max_tokens=8)
    ids = np.array([1, 5, 9, 13, 17], np.int32)
    logits = np.asarray(tr.forward(ids, positions_for(0, 5), np.zeros(5, np.int32), 5, 5))
    assert logits.shape[0] == 5 and logits.shape[1] >= spec.vocab_size
    assert np.isfinite(logits).all()
    return out


@pytest.mark.parametrize("name,mode,n_layers", [
    ("tiny-llama-mixq", "q4_0", 2),         # every source type, re-encoded
    ("tiny-qwen3", "q8_0", None),
    ("tiny-qwen3moe", "q4-mix", 1),         # 3-D expert tensors, a router kept at F32
])
def test_tiny_models(tmp_path, name, mode, n_layers):
    src = model_path(name)
    out = tmp_path / "out.gguf"
    r = requantize(src, out, mode, n_layers)
    assert r.path == out and not (tmp_path / "out.gguf.part").exists()
    check_copy(src, out, mode, n_layers)
    # the value types, read by the gguf package this time
    types_src, types_out = gguf.GGUFReader(src).fields, gguf.GGUFReader(out).fields
    assert {k: f.types for k, f in types_out.items() if k not in CHANGED_KEYS} == {
        k: f.types for k, f in types_src.items() if k not in CHANGED_KEYS}


def _logits(path) -> np.ndarray:
    tr = build_model(path)
    ids = (np.arange(3, 35, dtype=np.int32) * 7) % 1000
    return np.asarray(tr.forward(ids, positions_for(0, 32), np.zeros(32, np.int32), 32, 32))


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3moe"])
def test_q8_0_copy_computes_what_the_source_computes(tmp_path, name):
    """8-bit re-encoding changes weights by under 1% of their block maxima: the logits move by
    0.6% of their spread (median over positions, measured); a mixed-up layout would move
    them by ~100%."""
    requantize(model_path(name), tmp_path / "q8.gguf", "q8_0")
    a, b = _logits(model_path(name)), _logits(tmp_path / "q8.gguf")
    d = b - a
    d -= d.mean(axis=1, keepdims=True)
    rel = np.abs(d).mean(axis=1) / a.std(axis=1)
    assert np.median(rel) <= 0.03, rel


def test_dflash_tensors_and_per_layer_arrays(tmp_path):
    """A drafter-like file: q4-mix keeps `dflash.*` at Q8_0, and --layers cuts per-layer
    metadata arrays."""
    src = tmp_path / "draft.gguf"
    rng = np.random.default_rng(0)
    tensors = {"dflash.dspark.markov.w1": rng.standard_normal((64, 32)).astype(np.float16),
               "dflash.hidden_norm.weight": np.ones(32, np.float32)}
    for i in range(3):
        tensors[f"blk.{i}.attn_q.weight"] = rng.standard_normal((32, 64)).astype(np.float32)
    with gguf_writer(src, "qwen3") as w:
        w.add_uint32("qwen3.block_count", 3)
        w.add_array("qwen3.attention.head_count", [4, 8, 16])          # per layer: cut to 2
        w.add_array("qwen3.dflash.target_layer_ids", [1, 5, 9])         # target layers: kept
        w.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])            # strings: untouched
        for name, x in tensors.items():
            w.add_tensor(name, x)
    out = tmp_path / "mix.gguf"
    requantize(src, out, "q4-mix", 2)
    f = GGUFFile(out)
    assert {n: t.qtype for n, t in f.tensors.items()} == {
        "dflash.dspark.markov.w1": Q8, "dflash.hidden_norm.weight": F32,
        "blk.0.attn_q.weight": Q4, "blk.1.attn_q.weight": Q4}
    assert f.metadata["qwen3.block_count"] == 2
    assert f.metadata["qwen3.attention.head_count"] == [4, 8]
    assert f.metadata["qwen3.dflash.target_layer_ids"] == [1, 5, 9]
    assert f.metadata["tokenizer.ggml.tokens"] == ["a", "b", "c"]
    w1 = dequantize(f.tensors["dflash.dspark.markov.w1"].raw, Q8, (64, 32))
    np.testing.assert_allclose(w1, tensors["dflash.dspark.markov.w1"], atol=0.03)


def test_refusals(tmp_path, capsys):
    src = model_path("tiny-qwen3")
    assert main(["quantize", str(src), str(tmp_path / "o.gguf"), "--type", "q3_k"]) == 2
    assert "unknown type 'q3_k'; one of q8_0, q4_0, q4-mix" in capsys.readouterr().err
    assert main(["quantize", str(src), str(tmp_path / "o.gguf"), "--type", "q8_0",
                 "--layers", "4"]) == 2
    assert "has 3 blocks (allowed range 1..3)" in capsys.readouterr().err
    assert main(["quantize", str(src), str(tmp_path / "o.gguf"), "--type", "q8_0",
                 "--layers", "0"]) == 2
    assert main(["quantize", str(src), str(src), "--type", "q8_0"]) == 2
    assert "overwrite the input" in capsys.readouterr().err
    assert not (tmp_path / "o.gguf").exists()


def test_smollm2_truncated_self_drafter(tmp_path, capsys):
    """The real use: a 2-block q4-mix copy of SmolLM2 through the command line. Same
    vocabulary (the tokenizer encodes text identically), first blocks re-encoded, and it runs."""
    src = model_path("smollm2", fetch=False)          # the unit tier never fetches
    out = tmp_path / "smollm2-2l.gguf"
    assert main(["quantize", str(src), str(out), "--type", "q4-mix", "--layers", "2"]) == 0
    assert str(out) in capsys.readouterr().out
    f = check_copy(src, out, "q4-mix", 2)
    text = "The capital of France is Paris; 12 * 7 = 84."
    t_src = Tokenizer.from_metadata(GGUFFile(src).metadata)
    t_out = Tokenizer.from_metadata(f.metadata)
    assert t_out.encode(text) == t_src.encode(text) and len(t_out.encode(text)) > 5
