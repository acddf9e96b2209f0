"""EAGLE-3 drafter files (service/model/eagle3.py, llama.cpp's `eagle3` format) and
`specstream synth --eagle3` (service/tools/synth_eagle3.py): round trips, the checks against a
target, and every malformed file refused with its reason."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest

from service.cli import main
from service.errors import ConfigError, ModelFormatError
from service.gguf.reader import GGUFFile
from service.model.eagle3 import Eagle3Spec
from service.model.hidden import HiddenRows
from service.model.spec import ModelSpec
from service.tools.synth_eagle3 import default_layers, synthesize_eagle3
from tests.support.gguf_edit import D2T_BAD, rewrite
from tests.support.models import path_and_spec

TARGET = "tiny-qwen3"


@pytest.fixture(scope="module")
def target() -> tuple[Path, ModelSpec]:
    return path_and_spec(TARGET)


@pytest.fixture(scope="module")
def reduced(tmp_path_factory, target) -> Path:
    """A drafter with a 300-id draft vocabulary, its own embeddings and the pre-fc norm."""
    out = tmp_path_factory.mktemp("e3") / "reduced.gguf"
    synthesize_eagle3(out, target[0], seed=3, draft_vocab=300, own_embedding=True,
                      norm_before_fc=True, quant="Q8_0")
    return out


def test_synth_writes_the_targets_shapes_and_reads_back(tmp_path, target):
    path, t = target
    r = synthesize_eagle3(tmp_path / "d.gguf", path, layers=(1, 2, 3))
    s = Eagle3Spec.from_gguf(GGUFFile(r.path))
    assert (s.n_embd, s.n_embd_target, s.n_head, s.n_head_kv, s.head_dim, s.n_ff) == (
        t.n_embd, t.n_embd, t.n_head, t.n_head_kv, t.head_dim, t.n_ff)
    assert s.target_layers == (1, 2, 3) and s.vocab_size == s.draft_vocab == t.vocab_size
    assert not (s.has_d2t or s.own_embedding or s.norm_before_fc) and s.own_output
    f = GGUFFile(r.path)
    assert f.tensor("fc.weight").shape == (t.n_embd, 3 * t.n_embd)
    assert f.tensor("blk.0.attn_q.weight").shape == (t.n_head * t.head_dim, 2 * t.n_embd)
    assert f.get("general.architecture") == "eagle3" and f.get("eagle3.block_count") == 1
    s.check_target(t)
    tap = s.tap
    assert tap.points == (1, 2, 3) and tap.rows is HiddenRows.ALL
    tap.check(t.n_layer)


def test_the_reduced_vocabulary_is_a_sorted_set_of_target_ids(reduced, target):
    f = GGUFFile(reduced)
    s = Eagle3Spec.from_gguf(f)
    assert s.has_d2t and s.draft_vocab == 300 and s.own_embedding and s.norm_before_fc
    d2t = f.index_tensor("d2t")
    assert f.tensor("d2t").qtype.name == "I64" and d2t.shape == (300,)
    assert np.all(np.diff(d2t) > 0) and d2t[0] >= 0 and d2t[-1] < target[1].vocab_size
    assert f.tensor("output.weight").shape == (300, s.n_embd)
    assert f.tensor("enc.output_norm.weight").shape == (3 * s.n_embd_target,)
    assert f.tensor("fc.weight").qtype.name == "Q8_0"


def test_synth_is_seeded(tmp_path, target):
    a = synthesize_eagle3(tmp_path / "a.gguf", target[0], seed=1, draft_vocab=50).path
    b = synthesize_eagle3(tmp_path / "b.gguf", target[0], seed=1, draft_vocab=50).path
    c = synthesize_eagle3(tmp_path / "c.gguf", target[0], seed=2, draft_vocab=50).path
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()


def test_default_layers_are_eagle3s_low_middle_high():
    assert default_layers(32) == (2, 16, 29)
    assert default_layers(30) == (2, 15, 27)
    assert default_layers(3) == (0, 1, 2)


@pytest.mark.parametrize("change, match", [
    (lambda t: replace(t, n_embd=512), "target_hidden_size 256"),
    (lambda t: replace(t, n_layer=2), r"past the target's 2"),
    (lambda t: replace(t, vocab_size=2048), "vocabulary of 1024"),
])
def test_a_drafter_for_another_target_is_refused(tmp_path, target, change, match):
    r = synthesize_eagle3(tmp_path / "d.gguf", target[0], layers=(1, 2, 3))
    with pytest.raises(ModelFormatError, match=match):
        r.spec.check_target(change(target[1]))


def test_bad_synth_options_are_all_reported(tmp_path, target):
    with pytest.raises(ConfigError) as e:
        synthesize_eagle3(tmp_path / "d.gguf", target[0], layers=(1, 1, 9), draft_vocab=-1,
                          quant="Q4_K")
    assert {f for f, _ in e.value.problems} == {"quant", "target-layers", "draft-vocab"}


def test_the_cli_writes_a_drafter(tmp_path, target, capsys):
    out = tmp_path / "cli.gguf"
    assert main(["synth", "--eagle3", str(target[0]), str(out), "--target-layers", "0,2,3",
                 "--draft-vocab", "64"]) == 0
    assert "target layers [0, 2, 3]" in capsys.readouterr().out
    assert Eagle3Spec.from_gguf(GGUFFile(out)).draft_vocab == 64
    assert main(["synth", str(out)]) == 2            # neither --preset nor --eagle3
    assert "exactly one of --preset, --eagle3 and --dflash" in capsys.readouterr().err


# ---------------------------------------------------------------- malformed files
V, T = gguf.GGUFValueType, gguf.GGMLQuantizationType
BAD = {
    "architecture": (dict(meta={"general.architecture": ("llama",)}), "'llama', an EAGLE-3"),
    "no layers": (dict(drop=("eagle3.target_layers",)), "target_layers' is missing"),
    "two layers": (dict(meta={"eagle3.target_layers": ([1, 2], V.ARRAY, V.INT32)}),
                   "exactly 3 layer indices"),
    "repeated layer": (dict(meta={"eagle3.target_layers": ([1, 2, 2], V.ARRAY, V.INT32)}),
                       "repeats a layer"),
    "two blocks": (dict(meta={"eagle3.block_count": (2, V.UINT32)}), "exactly one decoder"),
    "no eps": (dict(drop=("eagle3.attention.layer_norm_rms_epsilon",)),
               "layer_norm_rms_epsilon' is missing"),
    "fc shape": (dict(tensors={"fc.weight": (np.zeros((256, 512), np.float32), T.F32)}),
                 r"'fc.weight' has shape \(256, 512\), expected \(256, 768\)"),
    "no hidden norm": (dict(drop=("blk.0.attn_norm_2.weight",)), "attn_norm_2.weight' is miss"),
    "extra tensor": (dict(tensors={"blk.1.attn_q.weight": (np.zeros((4, 32), np.float32),
                                                           T.F32)}), "does not have: blk.1"),
    **D2T_BAD,
    "d2t length": (dict(tensors={"d2t": (np.arange(299, dtype=np.int64), T.I64)}),
                   r"'output.weight' has shape \(300, 256\), expected \(299, 256\)"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_malformed_files_are_refused_with_the_reason(tmp_path, reduced, case):
    kw, match = BAD[case]
    with pytest.raises(ModelFormatError, match=match):
        Eagle3Spec.from_gguf(GGUFFile(rewrite(reduced, tmp_path / "bad.gguf", **kw)))


def test_the_unchanged_copy_is_accepted(tmp_path, reduced):
    """The rewrite itself breaks nothing: the negative cases above fail for their change."""
    s = Eagle3Spec.from_gguf(GGUFFile(rewrite(reduced, tmp_path / "same.gguf")))
    assert s == Eagle3Spec.from_gguf(GGUFFile(reduced))


def test_inspect_names_a_drafter_file_and_its_format_problem(tmp_path, reduced):
    from service.tools.inspect import describe

    assert "an EAGLE-3 drafter file (its format checks pass)" in describe(reduced)
    bad = rewrite(reduced, tmp_path / "bad.gguf", drop=("blk.0.attn_norm_2.weight",))
    assert "refused: required tensor 'blk.0.attn_norm_2.weight' is missing" in describe(bad)


def test_integer_tensors_open_but_are_refused_as_weights(tmp_path, target):
    """The reader takes I32 / I64 tensors (index tables such as d2t); a model whose weight has
    one is refused by name."""
    bad = rewrite(target[0], tmp_path / "int.gguf", tensors={
        "blk.0.attn_norm.weight": (np.zeros(256, np.int32), gguf.GGMLQuantizationType.I32)})
    f = GGUFFile(bad)
    assert f.index_tensor("blk.0.attn_norm.weight").dtype == np.int64
    with pytest.raises(ModelFormatError, match="'blk.0.attn_norm.weight' has integer type I32"):
        ModelSpec.from_gguf(f)
    with pytest.raises(ModelFormatError, match="an integer index table"):
        GGUFFile(target[0]).index_tensor("blk.0.attn_norm.weight")
