"""bench/gpu_bench.py's GPU paths run and produce complete, consistent rows (no figure is
judged here: speed is the benchmark's business, not a test's)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

from tests.support.models import TINY, load_json

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("gpu_bench_on_gpu", BENCH / "gpu_bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _positive(x) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


def test_quick_gemv_run_writes_every_row(bench, tmp_path):
    out = tmp_path / "bench.json"
    assert bench.main(["--quick", "--only", "gemv", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    T = bench.T
    from service.backends.cuda.kernels import GEMV_MMA_TYPES

    mma = {t.upper() for t in GEMV_MMA_TYPES}  # types with a tensor-core row "<type> mma"
    assert [(r["type"], r["n"], r["k"]) for r in res["gemv"]] == [
        (v, n, k) for t in T.QUICK_TYPES for n, k in T.QUICK_SHAPES
        for v in ((t, f"{t} mma") if t in mma else (t,))]
    for r in res["gemv"]:
        assert _positive(r["read_only_s"]) and r["copies"] * r["bytes"] >= 2 * T.L2_BYTES
        wide = T.MMA_COLUMNS if r.get("variant") == "mma" else ()
        assert sorted(r["cols"]) == sorted(str(c) for c in (*T.QUICK_COLUMNS, *wide))
        assert all(_positive(v) for v in r["cols"].values())
    assert _positive(res["copy_bw"])
    assert {g["goal"] for g in res["goals"]} == set(T.GOALS)


def test_decode_path_on_a_tiny_model(bench):
    """The decode, breakdown and prefill code of one model, on tiny-llama-mixq under the 8B
    label (so the prefill runs too)."""
    import gpu_decode as G

    T = bench.T
    a = T.parse_args(["--tokens", "4"])
    path = TINY / load_json("tiny/llamacpp_tiny_logits.json")["models"]["tiny-llama-mixq"]["file"]
    results = {"decode": [], "kernels": [], "prefill": [], "prefill_kernels": [],
               "graph_breakdown": [], "copy_bw": G.copy_bandwidth()}
    bench._decode_model(cp, G, a, T.PREFILL_MODEL, "file", path, None, results)
    (row,), (kern,), (pre,) = results["decode"], results["kernels"], results["prefill"]
    (ablation,), (pre_kern,) = results["graph_breakdown"], results["prefill_kernels"]
    assert _positive(row["eager_tok_s"]) and _positive(row["graph_tok_s"])
    assert set(row["variants"]) == set(bench.DECODE_VARIANTS) - ({"no PDL"} if not
                                                                  row["graph_serial_tok_s"]
                                                                  else set())
    assert all(_positive(v) for v in row["variants"].values())
    if row["graph_nodes"] is not None:        # cuda-bindings present: the ablation ran
        assert "error" not in ablation, ablation
    assert "error" not in pre_kern, pre_kern
    assert _positive(pre["split_attention_tok_s"])
    n = row["launches"]
    assert n["embed"] >= 1 and n["head"] >= 2 and n["layers"] >= 5 * row["n_layer"]
    assert sum(r["calls"] for r in kern["rows"]) == sum(n.values())
    assert all(r["total_s"] > 0 for r in kern["rows"])
    if row["graph_nodes"] is not None:        # cuda-bindings present: count the graph's nodes
        assert row["graph_nodes"] >= n["layers"]
    assert "error" not in pre and _positive(pre["tok_s"])
