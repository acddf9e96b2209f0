"""DFlash drafter files (service/model/dflash.py, llama.cpp's `dflash` format) and
`specstream synth --dflash` (service/tools/synth_dflash.py): round trips, the checks against a
target, every malformed file and every unsupported variant refused with its reason (DSpark's
heads: test_dspark_format.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest

from service.cli import main
from service.errors import ConfigError, ModelFormatError
from service.gguf.reader import GGUFFile
from service.model.dflash import DflashSpec
from service.model.hidden import HiddenRows
from service.model.spec import ModelSpec
from service.tools.synth_dflash import DflashOptions, default_layers, synthesize_dflash
from tests.support.gguf_edit import D2T_BAD, rewrite
from tests.support.models import path_and_spec

TARGET = "tiny-qwen3"


@pytest.fixture(scope="module")
def target() -> tuple[Path, ModelSpec]:
    return path_and_spec(TARGET)


@pytest.fixture(scope="module")
def reduced(tmp_path_factory, target) -> Path:
    """Two layers, a 300-id draft vocabulary, own embeddings, causal, partial RoPE."""
    out = tmp_path_factory.mktemp("df") / "reduced.gguf"
    synthesize_dflash(out, target[0], DflashOptions(
        seed=3, layers=(0, 2), n_layer=2, n_ff=128, block_size=8, mask_token=5,
        draft_vocab=300, own_embedding=True, causal=True, rope_dims=32, quant="Q8_0"))
    return out


def test_synth_writes_the_targets_shapes_and_reads_back(tmp_path, target):
    path, t = target
    r = synthesize_dflash(tmp_path / "d.gguf", path, DflashOptions(layers=(1, 2)))
    s = DflashSpec.from_gguf(GGUFFile(r.path))
    assert (s.n_embd, s.n_head, s.n_head_kv, s.head_dim, s.n_ff, s.rope_dims) == (
        t.n_embd, t.n_head, t.n_head_kv, t.head_dim, t.n_ff, t.rope_dims)
    assert s.target_layers == (1, 2) and s.vocab_size == s.draft_vocab == t.vocab_size
    assert (s.n_layer, s.block_size, s.mask_token, s.causal) == (1, 16, t.vocab_size - 1, False)
    assert not (s.has_d2t or s.own_embedding or s.own_output) and s.output_name is None
    f = GGUFFile(r.path)
    assert f.tensor("fc.weight").shape == (t.n_embd, 2 * t.n_embd)
    assert f.tensor("blk.0.attn_q.weight").shape == (t.n_head * t.head_dim, t.n_embd)
    assert set(f.tensors) == set(s.tensor_shapes())
    assert f.get("general.architecture") == "dflash"
    s.check_target(t)
    tap = s.tap
    assert tap.points == (1, 2) and tap.rows is HiddenRows.ALL
    tap.check(t.n_layer)


def test_the_options_read_back(reduced, target):
    f = GGUFFile(reduced)
    s = DflashSpec.from_gguf(f)
    assert (s.target_layers, s.n_layer, s.n_ff, s.block_size, s.mask_token) == (
        (0, 2), 2, 128, 8, 5)
    assert s.causal and s.rope_dims == 32 and s.own_embedding and s.own_output and s.has_d2t
    assert s.draft_vocab == 300 and s.output_name == "output.weight"
    d2t = f.index_tensor("d2t")
    assert f.tensor("d2t").qtype.name == "I64" and d2t.shape == (300,)
    assert np.all(np.diff(d2t) > 0) and d2t[0] >= 0 and d2t[-1] < target[1].vocab_size
    assert f.tensor("blk.1.ffn_down.weight").shape == (256, 128)
    assert f.tensor("fc.weight").qtype.name == "Q8_0"


def test_synth_is_seeded(tmp_path, target):
    o = DflashOptions(seed=1, draft_vocab=50, n_ff=64)
    a = synthesize_dflash(tmp_path / "a.gguf", target[0], o).path
    b = synthesize_dflash(tmp_path / "b.gguf", target[0], o).path
    c = synthesize_dflash(tmp_path / "c.gguf", target[0], replace(o, seed=2)).path
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()


def test_default_layers_are_dflashs_spread():
    """z-lab's Qwen3-8B drafter reads HF layers 1, 9, 17, 25, 33 of 36 (llama.cpp: + 1)."""
    assert default_layers(36) == (2, 10, 18, 26, 34)
    assert default_layers(3) == (1, 2)


@pytest.mark.parametrize("change, match", [
    (lambda t: replace(t, n_embd=512), "drafter's width is 256"),
    (lambda t: replace(t, n_layer=1), r"past the target's 1"),
    (lambda t: replace(t, vocab_size=2048), "vocabulary of 1024"),
])
def test_a_drafter_for_another_target_is_refused(tmp_path, target, change, match):
    r = synthesize_dflash(tmp_path / "d.gguf", target[0], DflashOptions(layers=(1, 2)))
    with pytest.raises(ModelFormatError, match=match):
        r.spec.check_target(change(target[1]))


def test_bad_synth_options_are_all_reported(tmp_path, target):
    with pytest.raises(ConfigError) as e:
        synthesize_dflash(tmp_path / "d.gguf", target[0], DflashOptions(
            layers=(1, 1), draft_vocab=-1, quant="Q4_K", block_size=1, rope_dims=7))
    assert {f for f, _ in e.value.problems} == {"quant", "target-layers", "draft-vocab",
                                                "block-size", "rope-dims"}


def test_the_cli_writes_a_drafter(tmp_path, target, capsys):
    out = tmp_path / "cli.gguf"
    assert main(["synth", "--dflash", str(target[0]), str(out), "--target-layers", "0,2",
                 "--draft-layers", "2", "--ff", "64", "--block-size", "4", "--causal"]) == 0
    assert "target layers [0, 2], 2 layers of width 256, block 4" in capsys.readouterr().out
    s = DflashSpec.from_gguf(GGUFFile(out))
    assert (s.n_layer, s.n_ff, s.block_size, s.causal) == (2, 64, 4, True)
    assert main(["synth", str(out), "--dflash", "x", "--eagle3", "y"]) == 2
    assert "exactly one of --preset, --eagle3 and --dflash" in capsys.readouterr().err


# ---------------------------------------------------------------- malformed files
V, T = gguf.GGUFValueType, gguf.GGMLQuantizationType


def f32(*shape: int) -> tuple[np.ndarray, T]:
    return np.zeros(shape, np.float32), T.F32


BAD = {
    "architecture": (dict(meta={"general.architecture": ("eagle3",)}), "'eagle3', a DFlash"),
    "no layers": (dict(drop=("dflash.target_layers",)), "target_layers' is missing"),
    "repeated layer": (dict(meta={"dflash.target_layers": ([2, 2], V.ARRAY, V.INT32)}),
                       "repeats a layer"),
    "no mask": (dict(drop=("tokenizer.ggml.mask_token_id",)), "mask_token_id' is missing"),
    "mask range": (dict(meta={"tokenizer.ggml.mask_token_id": (1024, V.UINT32)}),
                   "outside the vocabulary of 1024"),
    "block of one": (dict(meta={"dflash.block_size": (1, V.UINT32)}), "block_size' = 1"),
    "no eps": (dict(drop=("dflash.attention.layer_norm_rms_epsilon",)),
               "layer_norm_rms_epsilon' is missing"),
    "fc shape": (dict(tensors={"fc.weight": f32(256, 768)}),
                 r"'fc.weight' has shape \(256, 768\), expected \(256, 512\)"),
    "no k norm": (dict(drop=("blk.1.attn_k_norm.weight",)), "attn_k_norm.weight' is missing"),
    "shared kv": (dict(drop=("blk.0.attn_v.weight",)), "shared K/V .* is not supported"),
    "extra tensor": (dict(tensors={"blk.2.attn_q.weight": f32(4, 32)}), "does not have: blk.2"),
    **D2T_BAD,
    "gelu": (dict(meta={"dflash.hidden_activation": ("gelu", V.STRING)}), "only silu"),
    "yarn": (dict(meta={"dflash.rope.scaling.type": ("yarn", V.STRING)}),
             "RoPE scaling is not supported"),
}
# one marker of every variant in service.model.dflash.UNSUPPORTED: (edit, what it names)
VARIANTS = {
    "dflash2 key": (dict(meta={"dflash.selector_rank": (16, V.UINT32)}),
                    r"'dflash.selector_rank' marks DFlash2"),
    "dflash2 tensor": (dict(tensors={"selector_hidden.weight": f32(16, 256)}),
                       r"'selector_hidden.weight' marks DFlash2"),
    "dflash2 conv": (dict(tensors={"blk.0.attn_conv_proj.weight": f32(64, 256)}),
                     r"'blk.0.attn_conv_proj.weight' marks DFlash2"),
    "dsv4 key": (dict(meta={"dflash.hyper_connection.count": (4, V.UINT32)}),
                 "marks DeepSeek-V4 DSpark"),
    "dsv4 tensor": (dict(tensors={"output_hc_fn.weight": f32(4, 1024)}),
                    r"'output_hc_fn.weight' marks DeepSeek-V4"),
    "swa": (dict(meta={"dflash.attention.sliding_window": (64, V.UINT32)}), "sliding-window"),
    "mrope": (dict(meta={"dflash.rope.dimension_sections": ([16, 0, 0, 0], V.ARRAY, V.INT32)}),
              "M-RoPE"),
    "embedding scale": (dict(meta={"dflash.embedding_scale": (2.0, V.FLOAT32)}),
                        "token-embedding scale"),
    "attention scale": (dict(meta={"dflash.attention.scale": (0.1, V.FLOAT32)}),
                        "custom attention scale"),
    "value scale": (dict(meta={"dflash.attention.value_scale": (0.5, V.FLOAT32)}),
                    "attention-output scale"),
    "softcap": (dict(meta={"dflash.final_logit_softcapping": (30.0, V.FLOAT32)}),
                "soft-capping"),
    "sinks": (dict(tensors={"blk.0.attn_sinks.weight": f32(4)}), "attention sinks"),
    "post norm": (dict(tensors={"blk.1.post_attention_norm.weight": f32(256)}),
                  "post-attention"),
    "rope freqs": (dict(tensors={"rope_freqs.weight": f32(16)}), "RoPE frequency factors"),
    "weight scale": (dict(tensors={"fc.scale": f32(1)}), "'fc.scale' marks per-tensor weight"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_malformed_files_are_refused_with_the_reason(tmp_path, reduced, case):
    kw, match = BAD[case]
    with pytest.raises(ModelFormatError, match=match):
        DflashSpec.from_gguf(GGUFFile(rewrite(reduced, tmp_path / "bad.gguf", **kw)))


@pytest.mark.parametrize("case", list(VARIANTS))
def test_unsupported_variants_are_refused_by_name(tmp_path, reduced, case):
    kw, match = VARIANTS[case]
    with pytest.raises(ModelFormatError, match=match + ".*not supported"):
        DflashSpec.from_gguf(GGUFFile(rewrite(reduced, tmp_path / "variant.gguf", **kw)))


def test_the_unchanged_copy_is_accepted(tmp_path, reduced):
    """The rewrite itself breaks nothing: the negative cases above fail for their change."""
    s = DflashSpec.from_gguf(GGUFFile(rewrite(reduced, tmp_path / "same.gguf")))
    assert s == DflashSpec.from_gguf(GGUFFile(reduced))


def test_inspect_names_a_dflash_file_and_its_format_problem(tmp_path, reduced):
    from service.tools.inspect import describe

    assert "a DFlash drafter file (its format checks pass)" in describe(reduced)
    bad = rewrite(reduced, tmp_path / "bad.gguf", drop=("enc.output_norm.weight",))
    assert "refused: required tensor 'enc.output_norm.weight' is missing" in describe(bad)
