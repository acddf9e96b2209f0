"""The Laguna architecture's spec (llama.cpp src/models/laguna.cpp), read from the tiny fixture
files and from `specstream synth --preset laguna-xs2`'s header; the YaRN RoPE table; the
softplus gate op. (The numbers against llama.cpp: tests/golden/test_moe_oracle.py.)"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest

from service.backends.cpu import ops
from service.backends.rope_angles import rope_cos_sin
from service.errors import ModelFormatError
from service.gguf.reader import GGUFFile
from service.model.spec import ModelSpec, RopeScaling, Router
from service.tools.synth import synthesize
from tests.support.models import TINY


def _spec(name: str) -> ModelSpec:
    return ModelSpec.from_gguf(GGUFFile(TINY / f"{name}.gguf"))


def test_tiny_laguna_layers_follow_llamacpp():
    s = _spec("tiny-laguna-q8")
    assert s.arch == "laguna" and s.n_head == 6 and s.n_head_kv == 2
    # full / SWA / SWA / SWA, full first; full layers: 4 heads, YaRN over 16 dims at base 5e5;
    # SWA layers: 6 heads, plain RoPE over 32 dims at base 1e4, window 8
    assert [la.window for la in s.layers] == [0, 8, 8, 8, 0]
    assert [la.n_head for la in s.layers] == [4, 6, 6, 6, 4]
    assert [la.rope_dims for la in s.layers] == [16, 32, 32, 32, 16]
    assert [la.rope_base for la in s.layers] == [5e5, 1e4, 1e4, 1e4, 5e5]
    assert [la.rope_scaling is not None for la in s.layers] == [True, False, False, False, True]
    assert s.layers[0].rope_scaling.freq_scale == 0.25
    assert s.layers[0].rope_scaling.n_ctx_orig == 256
    assert [la.moe for la in s.layers] == [False, True, True, True, True]   # 1 leading dense
    assert {la.attn_gate for la in s.layers} == {1}                         # per head
    m = s.moe
    assert (m.n_expert, m.n_expert_used, m.n_ff_expert, m.n_ff_shared) == (8, 3, 32, 32)
    assert (m.router, m.selection_bias, m.normalize_top_k, m.weights_scale) == (
        Router.SIGMOID, True, True, 1.5)
    assert {la.attn_gate for la in _spec("tiny-laguna-elem-q5").layers} == {32}   # per element


def test_laguna_xs2_preset_has_the_real_shapes(tmp_path):
    r = synthesize(tmp_path / "xs2.gguf", "laguna-xs2", "Q4_K_M", data=False)
    s = ModelSpec.from_gguf(GGUFFile(r.path))
    assert (s.n_layer, s.n_embd, s.n_head_kv, s.head_dim, s.vocab_size) == (
        40, 2048, 8, 128, 100352)
    assert [la.n_head for la in s.layers[:4]] == [48, 64, 64, 64]
    assert [la.window for la in s.layers[:4]] == [0, 512, 512, 512]
    assert (s.layers[0].rope_dims, s.layers[1].rope_dims) == (64, 128)
    assert (s.layers[0].rope_base, s.layers[1].rope_base) == (500000.0, 10000.0)
    assert [la.moe for la in s.layers].count(False) == 1
    assert (s.moe.n_expert, s.moe.n_expert_used, s.moe.router) == (256, 8, Router.SIGMOID)


def _with(f: GGUFFile, **meta) -> GGUFFile:
    g = copy.copy(f)
    g.metadata = dict(f.metadata) | {f"laguna.{k}": v for k, v in meta.items()}
    return g


@pytest.mark.parametrize("meta,match", [
    ({"attention.head_count": [4, 6, 6]}, "head counts"),
    ({"attention.head_count": [4, 5, 6, 6, 4]}, "multiple of head_count_kv"),
    ({"expert_gating_func": 4}, "expert_gating_func 4"),
    ({"rope.scaling.type": "longrope"}, "rope.scaling.type"),
    ({"rope.dimension_count_swa": 64}, "dimension_count_swa"),
])
def test_bad_laguna_metadata_is_refused(meta, match):
    f = GGUFFile(TINY / "tiny-laguna-q8.gguf")
    with pytest.raises(ModelFormatError, match=match):
        ModelSpec.from_gguf(_with(f, **meta))


def test_a_gate_of_another_width_is_refused():
    f = GGUFFile(TINY / "tiny-laguna-q8.gguf")
    g = copy.copy(f)
    g.tensors = dict(f.tensors)
    g.tensors["blk.2.attn_gate.weight"] = f.tensors["blk.1.attn_q_norm.weight"]    # (32,)
    with pytest.raises(ModelFormatError, match="attn_gate"):
        ModelSpec.from_gguf(g)


def test_expert_weights_norm_defaults_off_for_laguna():
    f = GGUFFile(TINY / "tiny-laguna-q8.gguf")
    g = copy.copy(f)
    g.metadata = {k: v for k, v in f.metadata.items() if k != "laguna.expert_weights_norm"}
    assert not ModelSpec.from_gguf(g).moe.normalize_top_k


# ---------------------------------------------------------------- YaRN table
def test_yarn_table_extrapolates_fast_pairs_interpolates_slow_ones_and_scales():
    n_dims, base, n_ctx = 64, 500000.0, 300
    sc = RopeScaling(freq_scale=1 / 32, n_ctx_orig=4096)
    cos, sin = rope_cos_sin(n_ctx, n_dims, base, sc)
    pc, ps = rope_cos_sin(n_ctx, n_dims, base)
    mscale = 1 + 0.1 * math.log(32)
    # ggml_rope_yarn_corr_dims: pairs below floor(corr(32)) extrapolate (plain angles), pairs
    # at or above ceil(corr(1)) interpolate (angles / 32)
    corr = [n_dims * math.log(4096 / (b * 2 * math.pi)) / (2 * math.log(base)) for b in (32, 1)]
    lo, hi = max(0, math.floor(corr[0])), min(n_dims - 1, math.ceil(corr[1]))
    assert 0 < lo < hi < n_dims // 2
    np.testing.assert_allclose(cos[:, :lo], pc[:, :lo] * mscale, atol=2e-6)
    np.testing.assert_allclose(sin[:, :lo], ps[:, :lo] * mscale, atol=2e-6)
    inv = base ** (-np.arange(0, n_dims, 2) / n_dims)
    ang = np.arange(n_ctx)[:, None] * inv[None, hi:] / 32
    np.testing.assert_allclose(cos[:, hi:], np.cos(ang) * mscale, atol=2e-6)
    # in between: neither
    mid = (lo + hi) // 2
    assert not np.allclose(cos[:, mid], pc[:, mid] * mscale, atol=1e-3)
    # no scaling and ext_factor 0 with freq_scale 1: the plain table
    c1, _ = rope_cos_sin(n_ctx, n_dims, base, RopeScaling(1.0, 4096, ext_factor=0.0))
    np.testing.assert_array_equal(c1, pc)


def test_softplus_gate_per_head_and_per_element():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 4, 8)).astype(np.float32)
    g1 = (rng.standard_normal((3, 4, 1)) * 10).astype(np.float32)
    g1[0, 0, 0] = 25.0                                  # above ggml's threshold: kept as is
    out = a.copy()
    ops.softplus_gate(out, g1)
    # ggml's float32 formula: 1 + exp(v) rounded to f32 before the log (not log1p)
    one = np.float32(1.0)
    want = a * np.where(g1 > 20, g1, np.log(one + np.exp(g1)))
    np.testing.assert_allclose(out, want, rtol=1e-6)
    assert out[0, 0, 3] == a[0, 0, 3] * np.float32(25.0)
    ge = rng.standard_normal((3, 4, 8)).astype(np.float32)
    out = a.copy()
    ops.softplus_gate(out, ge)
    np.testing.assert_allclose(out, a * np.log1p(np.exp(ge.astype(np.float64))), rtol=1e-5)


# ---------------------------------------------------------------- sigmoid routing (CPU op)
def _moe_case(rng, n_exp=8, f=32, e=64):
    from gguf.quants import dequantize as gdq

    from service.gguf.reader import TensorInfo
    from tests.support.blocks import qtype, random_tensor

    router = rng.normal(0, 0.3, (n_exp, e)).astype(np.float32)
    infos, dense = {}, {}
    for nm, shape in (("gate", (n_exp, f, e)), ("up", (n_exp, f, e)), ("down", (n_exp, e, f))):
        raw = random_tensor("Q8_0", shape[0] * shape[1], shape[2], rng)
        infos[nm] = TensorInfo(nm, qtype("Q8_0"), shape, raw)
        dense[nm] = gdq(raw.reshape(shape[0] * shape[1], -1), qtype("Q8_0")).reshape(shape)
    raw_router = router.reshape(-1).view(np.uint8)                     # (n_exp * e * 4,) bytes
    return (TensorInfo("laguna.router", qtype("F32"), (n_exp, e), raw_router), router, infos,
            dense)


def test_sigmoid_router_picks_by_biased_probs_and_weights_by_plain_ones():
    """CPU moe against numpy: top-3 of sigmoid(x W^T) + bias, weights = the unbiased
    sigmoids of those experts, normalized, times 1.5. The bias is large enough to change the
    choice (checked: without it other experts win)."""
    from service.backends.cpu.backend import CpuBackend

    rng = np.random.default_rng(3)
    rinfo, router, infos, dense = _moe_case(rng)
    x = rng.normal(0, 1, (5, 64)).astype(np.float32)
    bias = rng.normal(0, 0.3, 8).astype(np.float32)
    be = CpuBackend()
    w = [be.load_matrix([rinfo])] + [be.load_experts(infos[n]) for n in ("gate", "up", "down")]
    out = np.empty((5, 64), np.float32)
    be.moe(x, *w, 3, True, "silu", out, gating="sigmoid", bias=bias, scale=1.5)
    probs = 1 / (1 + np.exp(-(x.astype(np.float64) @ router.T)))
    top = np.argsort(-(probs + bias), axis=1)[:, :3]
    assert (top != np.argsort(-probs, axis=1)[:, :3]).any()
    want = np.zeros((5, 64))
    for t in range(5):
        wt = probs[t, top[t]] / probs[t, top[t]].sum() * 1.5
        for e, we in zip(top[t], wt, strict=True):
            g, u = dense["gate"][e] @ x[t], dense["up"][e] @ x[t]
            want[t] += we * (dense["down"][e] @ (g / (1 + np.exp(-g)) * u))
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("pattern,windows", [
    (2, [0, 8, 0, 8, 0]), (0, [8] * 5), ([True, False, True, True, False], [8, 0, 8, 8, 0]),
])
def test_sliding_window_pattern_key_overrides_the_default(pattern, windows):
    f = GGUFFile(TINY / "tiny-laguna-q8.gguf")
    s = ModelSpec.from_gguf(_with(f, **{"attention.sliding_window_pattern": pattern}))
    assert [la.window for la in s.layers] == windows
    # the window decides the layer's RoPE kind too
    assert [la.rope_scaling is None for la in s.layers] == [w > 0 for w in windows]


def test_laguna_pre_tokenizer_matches_llamacpp(tmp_path):
    """The `laguna` pre-tokenizer (lines first, then qwen2's regex) on laguna-xs2's synthetic
    vocabulary gives llama.cpp's ids (tests/data/tiny/llamacpp_laguna_tokens.json). (The
    synthetic vocabulary has no piece holding a newline, so the split into lines gives the ids
    qwen2's regex alone gives here: a real Laguna vocabulary is what would tell them apart.)"""
    import json

    from service.model.tokenizer import Tokenizer

    fx = json.loads((TINY / "llamacpp_laguna_tokens.json").read_text())
    path = synthesize(tmp_path / "xs2.gguf", fx["preset"], "Q4_K_M", n_layer=1, data=False).path
    md = GGUFFile(path).metadata
    got = [Tokenizer.from_metadata(md).encode(t, add_bos=False, parse_special=True)
           for t in fx["texts"]]
    assert got == fx["ids"]


def test_qwen3moe_ignores_the_routing_keys_as_llamacpp_does():
    """llama.cpp's qwen3moe graph fixes softmax routing with renormalized weights and no scale,
    whatever expert_gating_func / expert_weights_norm / expert_weights_scale say."""
    f = GGUFFile(TINY / "tiny-qwen3moe-s-q8.gguf")
    g = copy.copy(f)
    g.metadata = dict(f.metadata) | {"qwen3moe.expert_gating_func": 2,
                                     "qwen3moe.expert_weights_norm": False,
                                     "qwen3moe.expert_weights_scale": 2.5}
    m = ModelSpec.from_gguf(g).moe
    assert (m.router, m.normalize_top_k, m.weights_scale, m.selection_bias, m.n_ff_shared) == (
        Router.SOFTMAX, True, 1.0, False, 0)
