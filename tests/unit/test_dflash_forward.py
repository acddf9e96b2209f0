"""The host DFlash draft forward (service/model/dflash_forward.py) on synthetic drafters for
tiny-qwen3: context rows injected in chunks equal one injection, the block's attention (every
block row sees every other unless causal), the context it reads ([0, n) only), and the d2t
scatter against the full-vocabulary drafter it was cut from. llama.cpp's block logits as the
oracle: tests/golden/test_dflash_oracle.py."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest

from service.gguf.quants import dequantize
from service.gguf.reader import GGUFFile
from service.model.dflash import DflashSpec
from service.model.dflash_forward import DflashDraft
from service.tools.synth_dflash import DflashOptions, synthesize_dflash
from tests.support.gguf_edit import rewrite
from tests.support.models import model_path

TARGET, N_CTX, T = "tiny-qwen3", 64, 12


@pytest.fixture(scope="module")
def full(tmp_path_factory) -> Path:
    return synthesize_dflash(tmp_path_factory.mktemp("dff") / "full.gguf", model_path(TARGET),
                             DflashOptions(seed=4, layers=(1, 2), n_layer=2, quant="F32",
                                           weight_std=0.1)).path


def draft(path: Path, spec_of=lambda s: s) -> DflashDraft:
    f = GGUFFile(path)
    return DflashDraft(spec_of(DflashSpec.from_gguf(f)), f, GGUFFile(model_path(TARGET)), N_CTX)


def features(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((T, 2 * 256)).astype(np.float32)


def test_chunked_injection_equals_one_injection(full):
    a, b = draft(full), draft(full)
    g = a.encode(features())
    a.inject(g, 0)
    b.inject(b.encode(features()[:5]), 0)
    b.inject(b.encode(features()[5:]), 5)
    ids = [9] + [a.spec.mask_token] * 5
    # equal but for float32 summation order (BLAS over 5 / 7 rows against 12)
    np.testing.assert_allclose(a.block(ids, T), b.block(ids, T), rtol=0, atol=2e-4)


@pytest.mark.parametrize("causal", [False, True])
def test_block_rows_see_each_other_unless_causal(full, causal):
    """Changing the block's last token changes every row (non-causal) or only the last."""
    d = draft(full, lambda s: replace(s, causal=causal))
    d.inject(d.encode(features()), 0)
    m = d.spec.mask_token
    a, b = d.block([9, m, m, m], T), d.block([9, m, m, 77], T)
    changed = np.abs(a - b).max(axis=1) > 0
    assert changed.tolist() == ([False] * 3 if causal else [True] * 3) + [True]


def test_the_block_reads_the_context_below_its_position(full):
    """Rows at or past the block's position (a stale earlier block) are not read; a context
    row below it is."""
    d = draft(full)
    d.inject(d.encode(features()), 0)
    ids = [9] + [d.spec.mask_token] * 3
    before = d.block(ids, 8)
    d.inject(d.encode(features(1)[8:]), 8)           # rewrite rows 8..11
    np.testing.assert_array_equal(d.block(ids, 8), before)
    d.inject(d.encode(features(1)[7:8]), 7)           # rewrite row 7
    assert np.abs(d.block(ids, 8) - before).max() > 1e-3


def test_the_reduced_vocabulary_scatters_to_its_target_ids(full, tmp_path):
    """A drafter whose output keeps 300 rows of the full one's (d2t = their ids) gives the full
    one's logits at those ids and -inf elsewhere."""
    ids = np.sort(np.random.default_rng(3).choice(1024, 300, replace=False)).astype(np.int64)
    assert not GGUFFile(full).has_tensor("output.weight")    # the full one uses the target's
    head = GGUFFile(model_path(TARGET)).tensor("output.weight")
    w = dequantize(head.raw, head.qtype, head.shape)[ids]                # (300, E) f32
    reduced = rewrite(full, tmp_path / "reduced.gguf", tensors={
        "output.weight": (w, gguf.GGMLQuantizationType.F32),
        "d2t": (ids, gguf.GGMLQuantizationType.I64)})
    a, b = draft(full), draft(reduced)
    assert b.spec.has_d2t and b.spec.draft_vocab == 300
    for d in (a, b):
        d.inject(d.encode(features()), 0)
    blk = [9] + [a.spec.mask_token] * 3
    la, lb = a.block(blk, T), b.block(blk, T)
    np.testing.assert_allclose(lb[:, ids], la[:, ids], rtol=1e-5, atol=1e-5)
    rest = np.setdiff1d(np.arange(1024), ids)
    assert np.isneginf(lb[:, rest]).all()
