"""The expert-grouped MoE path (cuda/moe.cu, service/backends/cuda/moe.py) on the GPU.

- moe_group against numpy: per expert the count and its pairs in token order, the tiles of
  every width, at 1, 2, 7, 16, 33 and 64 tokens of 8 experts each out of 128, with an expert
  every token picks, experts a third of the tokens pick, one expert per token that no other
  token picks, and experts no token picks.
- The whole moe op, grouped, against the gathered path (the same bits: the grouped GEMVs add
  each output row's terms in the gathered GEMV's order), against the CPU backend (3% of the
  output scale, test_kernels.test_moe_against_cpu's bound: two 8-bit activation roundings), and
  each token's row against the same token run alone (batch invariance, within the grouped path
  whatever the other comparison shows), at the same token counts, every tile width, several
  weight types and gate / up of two types (the GLU apart).
- Tiny MoE models (qwen3moe, Laguna): prefill and verify steps on captured graphs, grouped
  against gathered and captured against eager, logits bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

from service.backends.cpu.backend import CpuBackend
from service.backends.cuda.types import MOEG_NC, moe_group_tiles
from service.gguf.reader import TensorInfo
from tests.support.blocks import qtype, random_tensor
from tests.support.models import TINY, build_model, load_json

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

TOKENS = (1, 2, 7, 16, 33, 64)
N_EXP, N_USED, E, F = 128, 8, 256, 256
NOISE = range(68, 120)            # experts the rest of each token's picks come from
NEVER = range(120, N_EXP)         # experts no token picks


def routed_x(T: int, rng) -> np.ndarray:
    """x (T, E) f32 whose first N_EXP columns are the router logits (router_rows: identity):
    every token picks expert 0 (logit 3), expert 1 + t % 3 (2.5), expert 4 + t (2, no other
    token's pick), and 5 of NOISE (a permutation of levels 0.043 apart, below 1.2); experts
    in NEVER sit at -3. The other columns: N(0, 1) (the experts' input)."""
    x = rng.normal(0, 1, (T, E)).astype(np.float32)
    x[:, :N_EXP] = -1.0
    x[:, list(NEVER)] = -3.0
    for t in range(T):
        x[t, 0], x[t, 1 + t % 3], x[t, 4 + t] = 3.0, 2.5, 2.0
        x[t, list(NOISE)] = rng.permutation(np.linspace(-1.0, 1.2, len(NOISE)))
    return x


def expected_ids(x: np.ndarray) -> np.ndarray:
    """(T * N_USED,) the experts routed_x makes each token pick, in order of preference."""
    return np.argsort(-x[:, :N_EXP], axis=1, kind="stable")[:, :N_USED].reshape(-1).astype(
        np.int32)


def router_info(label: str) -> TensorInfo:
    w = np.zeros((N_EXP, E), np.float32)
    w[:, :N_EXP] = np.eye(N_EXP, dtype=np.float32)
    return TensorInfo(f"moeg.router.{label}", qtype("F32"), (N_EXP, E),
                      w.reshape(-1).view(np.uint8))


def expert_info(label: str, name: str, shape: tuple[int, int, int], rng) -> TensorInfo:
    raw = random_tensor(name, shape[0] * shape[1], shape[2], rng)
    return TensorInfo(f"moeg.{label}", qtype(name), shape, raw)


@pytest.fixture
def grouped_settings(cuda):
    """Restores the session backend's MoE settings after a test changes them."""
    saved = cuda.moe_group_min_tokens, cuda._moe.group_nc
    yield cuda._moe
    cuda.moe_group_min_tokens, cuda._moe.group_nc = saved


# ---------------------------------------------------------------- moe_group
def reference_groups(ids: np.ndarray, nc: int) -> tuple[np.ndarray, list[list[int]], list]:
    counts = np.bincount(ids, minlength=N_EXP)
    rows = [list(np.flatnonzero(ids == e)) for e in range(N_EXP)]
    tiles = [(e, i0, min(nc, counts[e] - i0)) for e in range(N_EXP)
             for i0 in range(0, counts[e], nc)]
    return counts, rows, tiles


@pytest.mark.parametrize("T", TOKENS)
def test_moe_group_sorts_pairs_by_expert_in_token_order(cuda, T):
    rng = np.random.default_rng(T)
    cap = 64
    cuda.prepare(max_tokens=cap, n_head=1, head_dim_v=32, n_ctx=256, n_embd=E,
                 moe_experts=N_EXP, moe_used=N_USED, moe_ff=F)
    moe = cuda._moe
    ids = expected_ids(routed_x(T, rng))
    P = ids.size
    counts_ref, rows_ref, _ = reference_groups(ids, 1)
    assert counts_ref[0] == T and all(counts_ref[e] == 0 for e in NEVER)
    assert all(counts_ref[4 + t] == 1 for t in range(T))
    for nc in MOEG_NC:
        s = moe.scratch
        for k in ("counts", "rows", "tiles", "n_tiles"):
            s[k].fill(-7)
        s["ids"][:P] = cp.asarray(ids)
        bound = moe.group(P, N_EXP, nc)
        counts = cp.asnumpy(s["counts"])
        rows = cp.asnumpy(s["rows"]).reshape(N_EXP, cap)
        n_tiles = int(cp.asnumpy(s["n_tiles"])[0])
        tiles = cp.asnumpy(s["tiles"])[:n_tiles]
        _, _, tiles_ref = reference_groups(ids, nc)
        np.testing.assert_array_equal(counts, counts_ref)
        for e in range(N_EXP):
            assert rows[e, :counts_ref[e]].tolist() == rows_ref[e], (nc, e)
        assert n_tiles == len(tiles_ref) <= bound == moe_group_tiles(P, N_EXP, nc), nc
        assert [(b // cap, b % cap, n) for b, n in tiles.tolist()] == tiles_ref, nc


def test_moe_group_reads_ids_past_one_shared_memory_chunk(cuda):
    """520 tokens (a prefill chunk): 4,160 pairs, past the 4,096 ids moe_group stages at once
    (kernels.MOE_GROUP_CHUNK); random distinct experts per token."""
    from service.backends.cuda.kernels import MOE_GROUP_CHUNK

    T = 520
    rng = np.random.default_rng(5)
    ids = np.concatenate([rng.choice(N_EXP, N_USED, replace=False) for _ in range(T)])
    ids = ids.astype(np.int32)
    assert ids.size > MOE_GROUP_CHUNK
    cuda.prepare(max_tokens=T, n_head=1, head_dim_v=32, n_ctx=1024, n_embd=E,
                 moe_experts=N_EXP, moe_used=N_USED, moe_ff=F)
    moe = cuda._moe
    s = moe.scratch
    s["ids"][:ids.size] = cp.asarray(ids)
    moe.group(ids.size, N_EXP, 8)
    counts_ref, rows_ref, tiles_ref = reference_groups(ids, 8)
    np.testing.assert_array_equal(cp.asnumpy(s["counts"]), counts_ref)
    rows = cp.asnumpy(s["rows"]).reshape(N_EXP, T)
    for e in range(N_EXP):
        assert rows[e, :counts_ref[e]].tolist() == rows_ref[e], e
    n_tiles = int(cp.asnumpy(s["n_tiles"])[0])
    assert [(b // T, b % T, n) for b, n in cp.asnumpy(s["tiles"])[:n_tiles].tolist()] \
        == tiles_ref


# ---------------------------------------------------------------- the moe op
def _moe_case(cuda, label: str, types: tuple[str, str, str], rng):
    cpu = CpuBackend()
    infos = [router_info(label)]
    for nm, t, shape in (("gate", types[0], (N_EXP, F, E)), ("up", types[1], (N_EXP, F, E)),
                         ("down", types[2], (N_EXP, E, F))):
        infos.append(expert_info(f"{label}.{nm}", t, shape, rng))
    wc = [cpu.load_matrix([infos[0]])] + [cpu.load_experts(i) for i in infos[1:]]
    wg = [cuda.load_matrix([infos[0]])] + [cuda.load_experts(i) for i in infos[1:]]
    cuda.prepare(max_tokens=64, n_head=1, head_dim_v=32, n_ctx=256, n_embd=E,
                 moe_experts=N_EXP, moe_used=N_USED, moe_ff=F)
    return cpu, wc, wg


def _run(cuda, wg, x: np.ndarray) -> np.ndarray:
    out = cuda.zeros(x.shape)
    out.fill(np.nan)
    cuda.moe(cp.asarray(x), *wg, N_USED, True, "silu", out)
    return cuda.to_host(out)


CASES = {"q4_k": ("Q4_K", "Q4_K", "Q4_K"), "q8_0": ("Q8_0", "Q8_0", "Q8_0"),
         "q3_k": ("Q3_K", "Q3_K", "Q3_K"), "iq4_xs": ("IQ4_XS", "IQ4_XS", "IQ4_XS"),
         "f16": ("F16", "F16", "F16"), "mixed": ("Q4_K", "Q5_K", "Q6_K")}


@pytest.mark.parametrize("case", CASES)
def test_grouped_moe_equals_gathered_alone_and_the_cpu(cuda, grouped_settings, case):
    rng = np.random.default_rng(21)
    cpu, wc, wg = _moe_case(cuda, case, CASES[case], rng)
    for T in TOKENS:
        x = routed_x(T, rng)
        ref = np.empty((T, E), np.float32)
        cpu.moe(x, *wc, N_USED, True, "silu", ref)
        cuda.moe_group_min_tokens = None
        gathered = _run(cuda, wg, x)
        cuda.moe_group_min_tokens = 1
        grouped = _run(cuda, wg, x)
        alone = np.concatenate([_run(cuda, wg, x[t:t + 1]) for t in range(T)])
        err = np.abs(grouped - ref).max() / np.abs(ref).max()
        same = np.array_equal(grouped, gathered)
        print(f"{case} T={T}: grouped vs CPU {err:.4f} of the scale; grouped == gathered "
              f"bits: {same} (max diff {np.abs(grouped - gathered).max():.3g})")
        assert err <= 0.03, (T, err)
        np.testing.assert_array_equal(grouped, alone, err_msg=f"T={T}: a row depends on the batch")
        np.testing.assert_array_equal(grouped, gathered, err_msg=f"T={T}: grouped != gathered")


@pytest.mark.parametrize("case", ["q4_k", "f16"])
def test_every_tile_width_gives_the_same_bits(cuda, grouped_settings, case):
    rng = np.random.default_rng(22)
    _, _, wg = _moe_case(cuda, f"{case}.nc", CASES[case], rng)
    cuda.moe_group_min_tokens = 1
    for T in (7, 64):
        x = routed_x(T, rng)
        outs = {}
        for nc in MOEG_NC:
            grouped_settings.group_nc = nc
            outs[nc] = _run(cuda, wg, x)
        assert not np.isnan(outs[1]).any()
        for nc in MOEG_NC[1:]:
            np.testing.assert_array_equal(outs[nc], outs[1], err_msg=f"T={T} nc={nc}")


# ---------------------------------------------------------------- models, captured
def _steps(tr, steps, reps: int) -> np.ndarray:
    """Logits of `steps` ((ids, start) each, slot 0) run `reps` times over the same device
    inputs (a step's graph key holds its inputs' pointers): eager, captured, replayed."""
    from service.model.transformer import positions_for

    be, bufs = tr.backend, {}
    for _ in range(reps):
        rows = []
        for s, pos in steps:
            n = len(s)
            dev = bufs.setdefault((n, pos), [be.zeros((n,), "int32") for _ in range(3)])
            be.upload_ints(np.asarray(s, np.int32), dev[0])
            be.upload_ints(positions_for(pos, n), dev[1])
            be.upload_ints(np.zeros(n, np.int32), dev[2])
            rows.append(be.to_host(tr.forward(dev[0], dev[1], dev[2], pos + n, n)))
    return np.concatenate(rows)


@pytest.mark.parametrize("name", ["tiny-qwen3moe-s-q4", "tiny-qwen3moe-s-f16", "tiny-laguna-q8"])
def test_captured_grouped_steps_equal_gathered_and_eager(name):
    """The fixture's prompt as one prefill step, then a 7-token and a 16-token verify-shaped
    step and a decode step, replayed from captured graphs (grouped, gathered) and eagerly
    (grouped): the same logits bit for bit."""
    from service.backends.cuda.backend import CudaBackend

    ids = load_json("tiny/llamacpp_moe_logits.json")["prompt_ids"]
    steps = [(ids, 0), (ids[:7], len(ids)), (ids[3:19], len(ids) + 7), (ids[:1], len(ids) + 23)]
    outs = {}
    for label, opts in (("grouped", {}), ("gathered", {"moe_group_min_tokens": None}),
                        ("eager", {"graphs": False})):
        be = CudaBackend(prefill_gemm_min_tokens=None, **opts)
        tr = build_model(TINY / f"{name}.gguf", be, max_tokens=32)
        outs[label] = _steps(tr, steps, 1 if label == "eager" else 3)
        assert (be.n_graphs >= len(steps)) == (label != "eager"), (label, be.n_graphs)
    np.testing.assert_array_equal(outs["grouped"], outs["eager"])
    same = np.array_equal(outs["grouped"], outs["gathered"])
    print(f"{name}: grouped == gathered logits bits: {same}")
    np.testing.assert_array_equal(outs["grouped"], outs["gathered"])


# ---------------------------------------------------------------- the benchmark's plumbing
def test_the_moe_bench_writes_its_rows(tmp_path):
    """bench/gpu_moe_grouped.py at 1 and 8 tokens, 2 calls per graph: every time positive, the
    distinct experts between n_used and the pairs, their bytes at most the pairs' bytes."""
    import importlib.util
    import json
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "gpu_moe_grouped.py"
    spec = importlib.util.spec_from_file_location("moe_grouped_bench", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)
    out = tmp_path / "moe.json"
    assert bench.main(["--tokens", "1", "8", "--reps", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["tokens"] for r in rows] == [1, 8]
    for r in rows:
        T = r["tokens"]
        assert bench.N_USED <= r["distinct_experts"] <= min(bench.N_EXPERT, T * bench.N_USED)
        assert 0 < r["ideal_bytes"] <= r["pair_bytes"]
        assert r["gathered_s"] > 0 and r["grouped_s"] > 0
        assert all(v > 0 for v in r["by_nc_s"].values()) and "1" in r["by_nc_s"]
