"""The Laguna kernels on the GPU against the CPU backend: moe_route's sigmoid router with a
selection bias and a weight scale (through the whole moe op), and softplus_gate per head and
per element on a strided gate (columns of the q|k|v|g row)."""

from __future__ import annotations

import numpy as np
import pytest

from service.backends.cpu.backend import CpuBackend
from tests.unit.test_laguna import _moe_case

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


def test_sigmoid_moe_against_cpu(cuda):
    """As test_kernels.test_moe_against_cpu (3% of the output scale: two 8-bit activation
    roundings on the GPU), with the sigmoid router, a bias that changes the choice, and a
    scale; a wrong choice or weight moves outputs by their full scale."""
    rng = np.random.default_rng(3)
    rinfo, _, infos, _ = _moe_case(rng)
    x = rng.normal(0, 1, (5, 64)).astype(np.float32)
    bias = rng.normal(0, 0.3, 8).astype(np.float32)
    cpu = CpuBackend()
    wc = [cpu.load_matrix([rinfo])] + [cpu.load_experts(infos[n]) for n in ("gate", "up", "down")]
    wg = [cuda.load_matrix([rinfo])] + [cuda.load_experts(infos[n]) for n in ("gate", "up", "down")]
    cuda.prepare(max_tokens=8, n_head=1, head_dim_v=32, n_ctx=256, n_embd=64, moe_experts=8,
                 moe_used=3, moe_ff=32)
    ref = np.empty((5, 64), np.float32)
    cpu.moe(x, *wc, 3, True, "silu", ref, gating="sigmoid", bias=bias, scale=1.5)
    out = cp.full((5, 64), np.nan, np.float32)
    cuda.moe(cp.asarray(x), *wg, 3, True, "silu", out, gating="sigmoid",
             bias=cp.asarray(bias), scale=1.5)
    got = cuda.to_host(out)
    assert np.abs(got - ref).max() <= 0.03 * np.abs(ref).max()


@pytest.mark.parametrize("per_element", [False, True])
def test_softplus_gate_against_cpu(cuda, per_element):
    rng = np.random.default_rng(5)
    T, H, D = 7, 6, 32
    G = D if per_element else 1
    a = rng.normal(0, 1, (T, H, D)).astype(np.float32)
    row = rng.normal(0, 8, (T, 100 + H * G)).astype(np.float32)     # gate = the last columns
    row[0, 100] = 30.0                                               # > 20: kept as is
    ga, grow = cp.asarray(a), cp.asarray(row)
    cuda.softplus_gate(ga, grow[:, 100:].reshape(T, H, G))
    ref = a.copy()
    CpuBackend().softplus_gate(ref, row[:, 100:].reshape(T, H, G))
    np.testing.assert_allclose(cuda.to_host(ga), ref, rtol=2e-6, atol=1e-7)
    assert np.array_equal(cuda.to_host(grow), row)
