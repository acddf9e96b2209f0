"""DSpark drafter files (llama.cpp's `dflash` architecture with a Markov head and an optional
confidence head, service/model/dflash.py), `specstream synth --dflash --markov-rank`, and the
`draft_p_min` setting: round trips, every malformed DSpark file refused with its reason, the
confidence cut's configuration refused where it cannot apply."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from service.cli import main
from service.config import EngineConfig
from service.engine.loader import dflash_header
from service.errors import ConfigError, ModelFormatError
from service.gguf.reader import GGUFFile
from service.model.dflash import DflashSpec
from service.model.spec import ModelSpec
from service.tools.synth_dflash import DflashOptions, synthesize_dflash
from tests.support.gguf_edit import rewrite
from tests.support.models import path_and_spec

V, T = gguf.GGUFValueType, gguf.GGMLQuantizationType
OPTIONS = DflashOptions(seed=3, layers=(0, 2), n_ff=128, block_size=8, draft_vocab=300,
                        markov_rank=32, markov_scale=0.5, confidence_head=True, quant="Q8_0")


@pytest.fixture(scope="module")
def target() -> tuple[Path, ModelSpec]:
    return path_and_spec("tiny-qwen3")


@pytest.fixture(scope="module")
def dspark(tmp_path_factory, target) -> Path:
    """Rank 32, a 300-id draft vocabulary, markov_w2.scale 0.5, the confidence head, Q8_0."""
    out = tmp_path_factory.mktemp("ds") / "dspark.gguf"
    return synthesize_dflash(out, target[0], OPTIONS).path


def test_synth_writes_a_dspark_drafter_and_reads_it_back(dspark, target):
    f = GGUFFile(dspark)
    s = DflashSpec.from_gguf(f)
    assert (s.markov_rank, s.markov_scale, s.confidence, s.confidence_bias) == (32, True, True,
                                                                                True)
    assert s.dspark and s.sample_from_anchor and s.first_draft_row == 0 and s.max_drafts == 8
    assert set(f.tensors) == set(s.tensor_shapes())
    assert f.tensor("markov_w1.weight").shape == (1024, 32)
    assert f.tensor("markov_w2.weight").shape == (300, 32)
    assert f.tensor("conf_proj.weight").shape == (1, 256 + 32)
    assert f.tensor("markov_w2.scale").qtype.name == "F32"
    assert (f.get("dflash.sample_from_anchor"), f.get("dflash.has_confidence_head")) == (True,
                                                                                       True)
    s.check_target(target[1])


def test_a_bonus_anchor_file_keeps_dflashs_layout(tmp_path, target):
    r = synthesize_dflash(tmp_path / "b.gguf", target[0], DflashOptions(
        layers=(1, 2), block_size=8, markov_rank=16, bonus_anchor=True))
    s = r.spec
    assert (s.sample_from_anchor, s.first_draft_row, s.max_drafts, s.confidence) == (
        False, 1, 7, False)
    assert "markov_w2.scale" not in GGUFFile(r.path).tensors


def test_bad_dspark_synth_options_are_reported(tmp_path, target):
    with pytest.raises(ConfigError) as e:
        synthesize_dflash(tmp_path / "d.gguf", target[0], DflashOptions(
            markov_rank=20, quant="Q8_0", markov_std=-1))
    assert {f for f, _ in e.value.problems} == {"markov-rank", "markov-std"}
    with pytest.raises(ConfigError, match="need a Markov head"):
        synthesize_dflash(tmp_path / "d.gguf", target[0], DflashOptions(confidence_head=True))


def test_the_cli_writes_a_dspark_drafter(tmp_path, target, capsys):
    out = tmp_path / "cli.gguf"
    assert main(["synth", "--dflash", str(target[0]), str(out), "--target-layers", "0,2",
                 "--block-size", "4", "--markov-rank", "8", "--confidence-head"]) == 0
    assert "DSpark drafter (Markov rank 8, confidence head)" in capsys.readouterr().out
    s = DflashSpec.from_gguf(GGUFFile(out))
    assert (s.markov_rank, s.confidence, s.block_size) == (8, True, 4)


def f32(*shape: int) -> tuple[np.ndarray, T]:
    return np.zeros(shape, np.float32), T.F32


BAD = {
    "no w2": (dict(drop=("markov_w2.weight",)), "'markov_w2.weight' is missing"),
    "w2 rows": (dict(tensors={"markov_w2.weight": f32(1024, 32)}),
                r"'markov_w2.weight' has shape \(1024, 32\), expected \(300, 32\)"),
    "w1 rank": (dict(tensors={"markov_w1.weight": f32(1024, 16)}),
                r"'markov_w2.weight' has shape \(300, 32\), expected \(300, 16\)"),
    "conf key disagrees": (dict(meta={"dflash.has_confidence_head": (False, V.BOOL)}),
                           "has_confidence_head' = False but tensor 'conf_proj.weight' is "
                           "present"),
    "bias without conf": (dict(meta={"dflash.has_confidence_head": (False, V.BOOL)},
                               drop=("conf_proj.weight",)),
                          "'conf_proj.bias' without 'conf_proj.weight'"),
    "conf shape": (dict(tensors={"conf_proj.weight": f32(1, 256)}),
                   r"'conf_proj.weight' has shape \(1, 256\), expected \(1, 288\)"),
    "scale type": (dict(tensors={"markov_w2.scale": (np.ones(1, np.float16), T.F16)}),
                   "'markov_w2.scale' has type F16; F32 expected"),
    "anchor key type": (dict(meta={"dflash.sample_from_anchor": (1, V.UINT32)}),
                        "sample_from_anchor' has type int"),
    "no block size": (dict(drop=("dflash.block_size",)), "DSpark drafter needs metadata "
                                                        "'dflash.block_size'"),
    "other scale": (dict(tensors={"fc.scale": f32(1)}), "'fc.scale' marks per-tensor weight"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_malformed_dspark_files_are_refused_with_the_reason(tmp_path, dspark, case):
    kw, match = BAD[case]
    with pytest.raises(ModelFormatError, match=match):
        DflashSpec.from_gguf(GGUFFile(rewrite(dspark, tmp_path / "bad.gguf", **kw)))


def test_the_unchanged_copy_is_accepted(tmp_path, dspark):
    s = DflashSpec.from_gguf(GGUFFile(rewrite(dspark, tmp_path / "same.gguf")))
    assert s == DflashSpec.from_gguf(GGUFFile(dspark))


def test_a_confidence_head_without_the_markov_head_is_refused(tmp_path, target):
    plain = synthesize_dflash(tmp_path / "p.gguf", target[0], DflashOptions(layers=(1, 2))).path
    bad = rewrite(plain, tmp_path / "bad.gguf", tensors={"conf_proj.weight": f32(1, 256)})
    with pytest.raises(ModelFormatError, match="does not have: conf_proj.weight"):
        DflashSpec.from_gguf(GGUFFile(bad))


# ---------------------------------------------------------------- draft_p_min
def test_draft_p_min_is_validated_by_name():
    problems = dict(EngineConfig(drafter="dflash", draft_model="x", draft_p_min=1.5).problems())
    assert "1.5 is out of range" in problems["draft_p_min"]
    problems = dict(EngineConfig(drafter="ngram", draft_p_min=0.5).problems())
    assert "drafter 'ngram' has none" in problems["draft_p_min"]
    assert "draft_p_min" not in dict(EngineConfig(drafter="dflash", draft_model="x",
                                                  draft_p_min=0.5).problems())


def test_draft_p_min_needs_a_confidence_head(tmp_path, target, dspark):
    plain = synthesize_dflash(tmp_path / "p.gguf", target[0], DflashOptions(
        layers=(1, 2), markov_rank=8)).path
    cfg = EngineConfig(drafter="dflash", draft_model=str(plain), draft_p_min=0.5)
    with pytest.raises(ConfigError) as e:
        dflash_header(cfg, target[1])
    assert [f for f, _ in e.value.problems] == ["draft_p_min"]
    assert "has no DSpark confidence head" in e.value.problems[0][1]
    f, spec = dflash_header(EngineConfig(drafter="dflash", draft_model=str(dspark),
                                         draft_p_min=0.5), target[1])
    assert spec.confidence
