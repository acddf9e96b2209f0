"""The backend interface's fused ops (base.py): on the CPU reference, which overrides none of
them, each equals the separate ops it stands for bit for bit, and the transformer's decode layer
is written with them (the op sequence a GPU backend turns into one launch per fused op)."""

from __future__ import annotations

import numpy as np
import pytest

from service.backends.base import Backend
from service.backends.cpu.backend import CpuBackend
from service.gguf import quants
from service.gguf.quants import QuantType
from service.gguf.reader import TensorInfo
from service.model.transformer import positions_for
from tests.support.fused import qkv_views
from tests.support.models import build_model

RNG = np.random.default_rng(21)
FUSED = ("rms_norm_for_matmul", "glu_for_matmul", "attention_for_matmul", "rope_kv",
         "matmul_add", "rms_norm_add")


def normal(*shape, scale=1.0) -> np.ndarray:
    return RNG.normal(0, scale, shape).astype(np.float32)


def matrix(be, n: int, k: int, qt: QuantType):
    w = normal(n, k, scale=0.1)
    raw = quants.quantize(w, qt).reshape(-1).view(np.uint8)
    return be.load_matrix([TensorInfo("w", qt, (n, k), raw)])


def test_the_cpu_reference_overrides_no_fused_op():
    for name in FUSED:
        assert getattr(CpuBackend, name) is getattr(Backend, name), name


def test_norm_and_glu_for_matmul_equal_the_plain_ops():
    be = CpuBackend()
    x, w = normal(5, 96, scale=2.0), normal(96, scale=0.1) + 1
    got, ref = np.full((5, 96), np.nan, np.float32), np.empty((5, 96), np.float32)
    be.rms_norm_for_matmul(x, w, 1e-6, got)
    be.rms_norm(x, w, 1e-6, ref)
    assert np.array_equal(got, ref)
    gu = normal(5, 128, scale=3.0)
    for act in ("silu", "gelu_tanh"):
        got, ref = np.full((5, 64), np.nan, np.float32), np.empty((5, 64), np.float32)
        be.glu_for_matmul(gu[:, :64], gu[:, 64:], act, got)
        be.glu(gu[:, :64], gu[:, 64:], act, ref)
        assert np.array_equal(got, ref), act


@pytest.mark.parametrize("qt", [QuantType.Q4_0, QuantType.F32])
def test_matmul_add_equals_matmul_then_add(qt):
    be = CpuBackend()
    w = matrix(be, 48, 96, qt)
    a, x = normal(3, 96), normal(3, 48)
    got, tmp = x.copy(), np.full((3, 48), np.nan, np.float32)
    be.matmul_add(a, w, got, tmp)
    o = np.empty((3, 48), np.float32)
    be.matmul(a, w, o)
    assert np.array_equal(got, x + o)


def test_rms_norm_add_equals_norm_then_add():
    be = CpuBackend()
    o, x, w = normal(4, 64, scale=3.0), normal(4, 64), normal(64, scale=0.1) + 1
    got, o_in = x.copy(), o.copy()
    be.rms_norm_add(o_in, w, 1e-6, got)
    normed = np.empty_like(o)
    be.rms_norm(o, w, 1e-6, normed)
    assert np.array_equal(got, x + normed)


@pytest.mark.parametrize("norms", [False, True])
@pytest.mark.parametrize("neox", [False, True])
def test_rope_kv_equals_norms_rope_and_kv_write(norms, neox):
    be = CpuBackend()
    T, H, hkv, D = 5, 4, 2, 64
    table = be.rope_table(64, 48, 10000.0)                 # partial rotary: 48 of 64 dims
    qkv = normal(T, (H + 2 * hkv) * D)
    pos, slots = np.array([0, 3, 7, 8, 40], np.int32), np.array([0, 1, 0, 1, 0], np.int32)
    qn, kn = (normal(D, scale=0.1) + 1, normal(D, scale=0.1) + 1) if norms else (None, None)
    fused, ref = qkv.copy(), qkv.copy()
    c1 = be.new_kv_cache(1, 2, 64, hkv, D, D, "q8_0", "q4_0")
    c2 = be.new_kv_cache(1, 2, 64, hkv, D, D, "q8_0", "q4_0")
    q, k, v = qkv_views(fused, T, H, hkv, D)
    be.rope_kv(q, k, v, qn, kn, 1e-6, pos, slots, table, neox, c1, 0)
    q2, k2, v2 = qkv_views(ref, T, H, hkv, D)
    if norms:
        be.rms_norm(q2, qn, 1e-6, q2)
        be.rms_norm(k2, kn, 1e-6, k2)
    be.rope(q2, pos, table, neox)
    be.rope(k2, pos, table, neox)
    be.kv_write(c2, 0, k2, v2, slots, pos)
    assert np.array_equal(q, q2)
    assert np.array_equal(c1.k[0], c2.k[0]) and np.array_equal(c1.v[0], c2.v[0])
    assert not np.array_equal(q, qkv_views(qkv, T, H, hkv, D)[0])      # it did rotate


def test_attention_for_matmul_equals_attention():
    be = CpuBackend()
    cache = be.new_kv_cache(1, 1, 32, 2, 16, 16, "f16", "f16")
    pos, slots = np.arange(9, dtype=np.int32), np.zeros(9, np.int32)
    be.kv_write(cache, 0, normal(9, 2, 16), normal(9, 2, 16), slots, pos)
    q = normal(9, 4, 16)
    got, ref = np.full((9, 4, 16), np.nan, np.float32), np.empty((9, 4, 16), np.float32)
    be.attention_for_matmul(q, cache, 0, slots, pos, 9, 0, 0.25, got)
    be.attention(q, cache, 0, slots, pos, 9, 0, 0.25, ref)
    assert np.array_equal(got, ref)


_RECORDED = ("embed", "rms_norm", "matmul", "add", "rope", "glu", "kv_write", "attention", "moe",
             *FUSED)


class RecordingCpu(CpuBackend):
    """The CPU reference, noting every interface op the transformer itself calls (not the ops
    a fused op's default implementation calls in turn)."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []
        self._depth = 0


def _recorded(name: str):
    def op(self, *args, **kwargs):
        if self._depth == 0:
            self.calls.append(name)
        self._depth += 1
        try:
            return getattr(CpuBackend, name)(self, *args, **kwargs)
        finally:
            self._depth -= 1
    return op


for _name in _RECORDED:
    setattr(RecordingCpu, _name, _recorded(_name))


def test_decode_layer_is_written_with_the_fused_ops():
    """A llama layer: norm-for-matmul, q|k|v matmul(s), rope_kv, attention-for-matmul,
    matmul_add (wo), norm-for-matmul, gate|up matmul(s), glu-for-matmul, matmul_add (down): the
    9 launches of the CUDA backend when q|k|v and gate|up are one matrix each."""
    be = RecordingCpu()
    tr = build_model("tiny-llama-mixq", be, n_ctx=16, max_tokens=4)
    spec = tr.spec
    ids, pos, slots = np.array([5], np.int32), positions_for(3, 1), np.zeros(1, np.int32)
    be.calls.clear()
    tr.forward(ids, pos, slots, 4, 1)
    L = tr.weights.layers[0]
    layer = (["rms_norm_for_matmul"] + ["matmul"] * len(L.qkv)
             + ["rope_kv", "attention_for_matmul", "matmul_add", "rms_norm_for_matmul"]
             + ["matmul"] * len(L.gate_up) + ["glu_for_matmul", "matmul_add"])
    top = be.calls
    assert top[0] == "embed" and top[-2:] == ["rms_norm_for_matmul", "matmul"]
    body = top[1:-2]
    assert body == layer * spec.n_layer, body[:len(layer) + 2]
