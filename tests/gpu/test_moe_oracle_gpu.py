"""The MoE oracle fixtures (tiny Laguna and qwen3moe, tests/data/tiny/llamacpp_moe_logits.json)
on the CUDA backend: against llama.cpp's logits with tests/gpu/test_models.py's bounds (two
8-bit activation roundings meet: median <= 7%, 75th percentile <= 12%), against the CPU
backend rounding activations the GPU's way (median <= 1%, clear argmaxes equal), and decode
steps on the captured graphs equal to eager ones bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from service.backends.cpu.backend import CpuBackend
from tests.support.logits import relative_errors
from tests.support.models import (
    MOE_FIXTURE,
    MOE_MODELS,
    TINY,
    build_model,
    forward_host,
    load_json,
    moe_oracle_logits,
)
from tests.support.near_ties import top2_gap

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

CLEAR_GAP = 1.0       # tests/golden/test_moe_oracle.py's


def cuda_backend(**options):
    from service.backends.cuda.backend import CudaBackend

    return CudaBackend(**({"graphs": False, "prefill_gemm_min_tokens": None} | options))


@pytest.mark.parametrize("name", MOE_MODELS)
def test_moe_models_match_llamacpp_and_the_cpu(name):
    ours, ref = moe_oracle_logits(name, cuda_backend())
    rel = relative_errors(ours, ref)
    cpu, _ = moe_oracle_logits(name, CpuBackend(act_quant="gpu"))
    rel_cpu = relative_errors(ours, cpu)
    # the model's own floor: the CPU against itself with its attention and matmuls summed in
    # another order (per query / per row), as far as last-bit differences get amplified
    floor, _ = moe_oracle_logits(name, CpuBackend(act_quant="gpu", invariant_tokens=32))
    rel_floor = relative_errors(floor, cpu)
    print(f"{name}: vs llama.cpp median {np.median(rel):.4f}, vs CPU(gpu rounding) median "
          f"{np.median(rel_cpu):.5f} max {rel_cpu.max():.5f}; CPU vs CPU in another order "
          f"median {np.median(rel_floor):.5f} max {rel_floor.max():.5f}")
    assert np.median(rel) <= 0.07 and np.percentile(rel, 75) <= 0.12, rel
    clear = np.array([top2_gap(r) for r in ref]) >= CLEAR_GAP
    clear &= np.array([top2_gap(r) for r in ours]) >= CLEAR_GAP
    np.testing.assert_array_equal(ours.argmax(1)[clear], ref.argmax(1)[clear])
    # 1.5%, or 1.5x the model's own floor where a sharp softmax amplifies last-bit differences
    # further: tiny-laguna-q8's CPU against itself in another order is at 1.04% (2-core host)
    # to 1.2% (16 cores), and came out 0 under pytest-xdist on the GPU host (both orders took
    # the same path there), so the floor alone cannot set the bound; a wrong op moves the
    # logits by tens of percent
    assert np.median(rel_cpu) <= max(0.015, 1.5 * np.median(rel_floor)), rel_cpu


@pytest.mark.parametrize("name", ["tiny-laguna-q8", "tiny-laguna-elem-q5", "tiny-qwen3moe-s-q8"])
def test_captured_decode_equals_eager(name):
    """A prefill chunk then llama.cpp's greedy ids one token per step, on captured graphs and
    eagerly: the same logits bit for bit (sigmoid routing, the gate and the shared expert are
    inside the graph)."""
    fx = load_json(MOE_FIXTURE)
    m = fx["models"][name]
    outs = []
    for graphs in (True, False):
        tr = build_model(TINY / m["file"], cuda_backend(graphs=graphs))
        rows = [forward_host(tr, fx["prompt_ids"], 0, 1)]
        pos = len(fx["prompt_ids"])
        for i, tok in enumerate(m["greedy_ids"][:6]):
            rows.append(forward_host(tr, [tok], pos + i, 1))
        outs.append(np.concatenate(rows))
    np.testing.assert_array_equal(outs[0], outs[1])


def test_laguna_xs2_real_shapes_match_the_cpu(tmp_path):
    """`specstream synth --preset laguna-xs2 --layers 2` (Q4_K_M: a dense full-attention layer
    with 48 query heads and YaRN over 64 of 128 dims, then a sliding-window layer with 64 heads,
    256 experts top-8 and the shared expert): a 40-token prefill chunk and 4 decode steps on
    CUDA against the CPU backend rounding activations the GPU's way (median <= 1%, as the
    tiny models)."""
    from service.tools.synth import synthesize

    path = synthesize(tmp_path / "xs2.gguf", "laguna-xs2", "Q4_K_M", seed=1, n_layer=2).path
    ids = [(37 * i) % 99000 + 5 for i in range(40)]
    outs = []
    for be in (cuda_backend(graphs=True), CpuBackend(act_quant="gpu")):
        tr = build_model(path, be, n_ctx=128, max_tokens=48)
        rows = [forward_host(tr, ids, 0, len(ids))]
        for i, tok in enumerate((11, 2024, 7, 99)):
            rows.append(forward_host(tr, [tok], len(ids) + i, 1))
        outs.append(np.concatenate(rows))
    rel = relative_errors(outs[0], outs[1])
    print(f"laguna-xs2 2 layers: CUDA vs CPU median {np.median(rel):.5f} max {rel.max():.5f}")
    assert np.median(rel) <= 0.01, rel


def _layer_trace(backend) -> dict[str, list[np.ndarray]]:
    """tiny-laguna-q8's prompt step on `backend`, eager, with every layer's attention output
    (T, H, Dv) before and after the softplus gate and every MoE layer's input (T, E) copied to
    the host as the step runs."""
    to_host = backend.to_host
    rec: dict[str, list[np.ndarray]] = {"attention": [], "gated": [], "moe input": []}
    attention, gate, moe = backend.attention, backend.softplus_gate, backend.moe

    def attention_hook(q, cache, layer, slots, positions, kv_len, window, scale, out, *rest):
        attention(q, cache, layer, slots, positions, kv_len, window, scale, out, *rest)
        rec["attention"].append(np.array(to_host(out)))

    def gate_hook(a, g):
        gate(a, g)
        rec["gated"].append(np.array(to_host(a)))

    def moe_hook(x, *args, **kw):
        rec["moe input"].append(np.array(to_host(x)))
        moe(x, *args, **kw)

    backend.attention, backend.softplus_gate, backend.moe = attention_hook, gate_hook, moe_hook
    logits, _ = moe_oracle_logits("tiny-laguna-q8", backend)
    rec["logits"] = [logits]
    return rec


def test_laguna_layers_match_the_cpu_where_nothing_amplifies():
    """Per-layer GPU vs CPU (GPU rounding) differences of tiny-laguna-q8's prompt step, printed
    with -s (max |difference| per position over the tensor's max |value|). This random-weight
    model amplifies last-bit differences: on the CPU alone, summing its attention in another
    order moves the prompt logits by a median 0.5% (and the matmuls' order too: 1.2%), with
    position 0 unchanged, since a softmax over one key is exactly 1 whatever the order. So what
    must agree tightly is position 0 of every layer (the whole path: q|k|v|gate GEMV, per-head
    norms, YaRN over part of the head, the gate, MoE routing, the shared expert) and layer 0 at
    every position (attention over up to 24 keys with 4 query heads on 2 KV heads, before any
    amplified difference reaches its inputs)."""
    gpu = _layer_trace(cuda_backend())
    cpu = _layer_trace(CpuBackend(act_quant="gpu"))
    for what in ("attention", "gated", "moe input", "logits"):
        assert len(gpu[what]) == len(cpu[what]) > 0, what
        for i, (g, c) in enumerate(zip(gpu[what], cpu[what], strict=True)):
            axes = tuple(range(1, g.ndim))
            d = np.abs(g - c).max(axis=axes) / max(float(np.abs(c).max()), 1e-30)   # (T,)
            print(f"{what} {i}: " + " ".join(f"{v:.1e}" for v in d))
            assert d[0] <= 1e-5, (what, i, d)
            if what in ("attention", "gated") and i == 0:
                assert d.max() <= 1e-3, (what, i, d)
