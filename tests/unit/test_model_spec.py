"""ModelSpec.from_gguf: a file that passes loads; one that cannot be served is refused with a
ModelFormatError naming the problem (architecture, metadata, tensor presence and shape)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from service.errors import ModelFormatError
from service.gguf.reader import GGUFFile
from service.model.spec import ModelSpec, RopeMode
from service.model.transformer import positions_for
from tests.support.gguf_files import gguf_writer
from tests.support.models import build_model, open_gguf

E, H, HKV, FF, V, L = 64, 4, 2, 96, 128, 2


def write_llama(path: Path, arch: str = "llama", skip: str = "", reshape: dict | None = None,
                meta: dict | None = None) -> Path:
    """A tiny llama-shaped model with float32 random weights (ggml dims are reversed)."""
    rng = np.random.default_rng(0)
    kv = {"context_length": 256, "embedding_length": E, "block_count": L,
          "feed_forward_length": FF, "attention.head_count": H, "attention.head_count_kv": HKV,
          "attention.layer_norm_rms_epsilon": 1e-5, "vocab_size": V}
    kv.update(meta or {})
    hd = E // H
    shapes = {"token_embd.weight": (V, E), "output_norm.weight": (E,),
              "output.weight": (V, E)}
    for i in range(L):
        p = f"blk.{i}."
        shapes |= {p + "attn_norm.weight": (E,), p + "attn_q.weight": (H * hd, E),
                   p + "attn_k.weight": (HKV * hd, E), p + "attn_v.weight": (HKV * hd, E),
                   p + "attn_output.weight": (E, H * hd), p + "ffn_norm.weight": (E,),
                   p + "ffn_gate.weight": (FF, E), p + "ffn_up.weight": (FF, E),
                   p + "ffn_down.weight": (E, FF)}
    shapes |= reshape or {}
    with gguf_writer(path, arch) as w:
        for key, value in kv.items():
            if isinstance(value, float):
                w.add_float32(f"{arch}.{key}", value)
            elif value is not None:
                w.add_uint32(f"{arch}.{key}", value)
        for name, shape in shapes.items():
            if name != skip:
                w.add_tensor(name, rng.standard_normal(shape).astype(np.float32) * 0.1)
    return path


def test_valid_model_loads_and_runs(tmp_path):
    f = GGUFFile(write_llama(tmp_path / "ok.gguf"))
    spec = ModelSpec.from_gguf(f)
    assert (spec.arch, spec.n_layer, spec.head_dim, spec.n_head_kv) == ("llama", L, E // H, HKV)
    assert spec.traits.rope_mode is RopeMode.NORMAL and not spec.tied_output
    tr = build_model(f.path, n_ctx=32, max_tokens=8)
    ids = np.array([1, 5, 9], np.int32)
    logits = tr.forward(ids, positions_for(0, 3), np.zeros(3, np.int32), 3, 3)
    assert logits.shape == (3, V) and np.isfinite(logits).all()


@pytest.mark.parametrize("kwargs,expected", [
    ({"arch": "mamba"}, "unsupported architecture 'mamba'"),
    ({"skip": "blk.1.ffn_up.weight"}, "required tensor 'blk.1.ffn_up.weight' is missing"),
    ({"reshape": {"blk.0.attn_k.weight": (E, E)}},
     "tensor 'blk.0.attn_k.weight' has shape (64, 64), expected (32, 64)"),
    ({"reshape": {"token_embd.weight": (V + 1, E)}}, "tensor 'token_embd.weight' has shape"),
    ({"meta": {"embedding_length": None}}, "'llama.embedding_length' is missing"),
    ({"meta": {"attention.head_count_kv": 3}}, "not a multiple of head_count_kv 3"),
    ({"meta": {"block_count": 100_000}}, "'llama.block_count' = 100000 is out of range"),
])
def test_unservable_model_is_refused(tmp_path, kwargs, expected):
    path = write_llama(tmp_path / "bad.gguf", **kwargs)
    with pytest.raises(ModelFormatError) as e:
        ModelSpec.from_gguf(GGUFFile(path))
    assert expected in str(e.value) and str(path) in str(e.value)


@pytest.mark.parametrize("name,arch,traits", [
    ("tiny-qwen3", "qwen3", {"qk_norm": True, "moe": False}),
    ("tiny-qwen3moe", "qwen3moe", {"qk_norm": True, "moe": True}),
    ("tiny-llama-mixq", "llama", {"qk_norm": False, "moe": False}),
])
def test_architecture_traits(name, arch, traits):
    spec = ModelSpec.from_gguf(open_gguf(name))
    assert spec.arch == arch
    for key, value in traits.items():
        assert getattr(spec.traits, key) is value
    assert (spec.moe is not None) is traits["moe"]
    if spec.moe:
        assert (spec.moe.n_expert, spec.moe.n_expert_used) == (16, 4)


def test_gemma3_sliding_window_pattern_and_rope_bases():
    spec = ModelSpec.from_gguf(open_gguf("gemma3", fetch=False))    # the unit tier never fetches
    assert spec.traits.post_norms and spec.traits.qk_norm and spec.tied_output
    assert spec.embed_scale == pytest.approx(640 ** 0.5) and spec.head_dim == 256
    for i, layer in enumerate(spec.layers):
        if i % 6 == 5:      # every sixth layer attends globally with the long-context base
            assert (layer.window, layer.rope_base) == (0, 1_000_000.0)
        else:
            assert (layer.window, layer.rope_base) == (512, 10_000.0)
