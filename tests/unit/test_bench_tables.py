"""bench/cpu_decode.py's tables: a ratio only against a llama.cpp figure measured in the run.

The table functions run on hand-made rows; nothing here times anything or runs the benchmark.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "cpu_decode.py"
RATIO = re.compile(r"\d+\.\d\dx")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("cpu_decode_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _decode_rows(ref: float | None) -> list[dict]:
    return [{"model": "smollm2-135m", "prompt": "prose", "specstream": 40.0,
             "specstream_spec": 50.0, "llama_cpp": ref},
            {"model": "gemma3-270m", "prompt": "code", "specstream": 20.0,
             "specstream_spec": 30.0, "llama_cpp": ref}]


def test_without_llamacpp_no_baseline_and_no_ratio(bench):
    decode = bench.decode_table(_decode_rows(None), 64, 2, 3)
    prefill = bench.prefill_table([{"model": "smollm2-135m", "specstream": 300.0,
                                    "llama_cpp": None}], 512, 2)
    for table in (decode, prefill):
        body = table.splitlines()[3:-1]           # after the title and header, before the note
        assert body and not any(RATIO.search(line) for line in body), table
        assert table.splitlines()[-1] == bench.NOT_MEASURED
        assert "not importable" in bench.NOT_MEASURED
        numbers = {float(x) for x in re.findall(r"(\d+\.\d)/s", table)}
        assert numbers <= {40.0, 50.0, 20.0, 30.0, 300.0}   # only what this run measured


def test_with_llamacpp_ratio_is_against_the_measured_figure(bench):
    decode = bench.decode_table(_decode_rows(80.0), 64, 2, 3)
    assert bench.NOT_MEASURED not in decode
    lines = decode.splitlines()
    assert RATIO.findall(lines[3]) == [f"{40 / 80:.2f}x", f"{50 / 80:.2f}x"]
    assert RATIO.findall(lines[4]) == [f"{20 / 80:.2f}x", f"{30 / 80:.2f}x"]
    prefill = bench.prefill_table([{"model": "gemma3-270m", "specstream": 300.0,
                                    "llama_cpp": 200.0}], 512, 2)
    assert RATIO.findall(prefill) == [f"{300 / 200:.2f}x"]


# ---------------------------------------------------------------- bench/gpu_bench.py's tables
def _load(name: str):
    path = BENCH.parent / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module             # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gt():
    return _load("gpu_tables")


BW = 4.0e12                                   # copy bandwidth of the made-up run, bytes/s


def _gemv_rows() -> list[dict]:
    """Made-up times: Q4_K at 4096x14336 (a recorded llama.cpp shape) and Q8_0 and F16 at
    128256x4096 (not recorded)."""
    def row(t, n, k, nbytes, ro, c1, c8, c16):
        return {"type": t, "n": n, "k": k, "bytes": nbytes, "read_only_s": ro,
                "cols": {"1": c1, "2": c1 * 1.1, "4": c1 * 1.3, "8": c8, "16": c16}}
    return [row("Q4_K", 4096, 14336, 33_030_144, 10e-6, 12.5e-6, 15e-6, 22e-6),
            row("Q8_0", 128256, 4096, 558_170_112, 140e-6, 200e-6, 400e-6, 500e-6),
            row("F16", 128256, 4096, 1_050_673_152, 260e-6, 300e-6, 900e-6, 2000e-6)]


def _fields(line: str) -> list[str]:
    return line.split()


def test_gpu_options_defaults_quick_and_only(gt):
    a = gt.parse_args([])
    assert (a.types, a.shapes, a.columns, a.tokens) == (gt.TYPES, gt.SHAPES, gt.COLUMNS, 128)
    assert a.gemv and a.decode and a.json is None
    assert {"Q4_0", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "F16"} <= set(gt.TYPES)
    assert {(4096, 4096), (14336, 4096), (4096, 14336), (128256, 4096)} == set(gt.SHAPES)
    q = gt.parse_args(["--quick", "--only", "gemv", "--json", "/tmp/x.json"])
    assert (q.types, q.columns, q.tokens) == (gt.QUICK_TYPES, gt.QUICK_COLUMNS, 32)
    assert q.gemv and not q.decode and q.json == "/tmp/x.json"
    assert {1, 8, 16} <= set(q.columns)      # the columns the ratios need
    assert gt.parse_args(["--only", "decode", "--tokens", "7"]).tokens == 7
    for bad in (["--only", "prefill"], ["--tokens", "0"]):
        with pytest.raises(SystemExit):
            gt.parse_args(bad)


def test_copies_rotate_past_l2(gt):
    for nbytes in (1, 9_437_184, 33_030_144, 61 * 2**20, 10**9):
        c = gt.copies_for(nbytes)
        assert c >= 2 and c * nbytes >= 2 * gt.L2_BYTES
        assert c == 2 or (c - 1) * nbytes < 2 * gt.L2_BYTES      # no more than needed


def test_gemv_table_ratios_are_this_runs(gt):
    rows = _gemv_rows()
    torch = [{"n": 128256, "k": 4096, "bytes": 128256 * 4096 * 2, "cols": {"1": 280e-6}}]
    table = gt.gemv_table(rows, gt.COLUMNS, BW, torch).splitlines()
    body = table[3:]
    assert len(body) == 3
    for r, line in zip(rows, body, strict=True):
        f = _fields(line)
        assert f[0] == r["type"] and f[1] == f"{r['n']}x{r['k']}"
        c1 = r["cols"]["1"]
        assert float(f[3]) == pytest.approx(r["bytes"] / BW * 1e6, abs=0.06)     # copy floor
        assert float(f[4]) == pytest.approx(r["read_only_s"] * 1e6, abs=0.06)
        assert float(f[5]) == pytest.approx(c1 * 1e6, abs=0.06)
        assert f[11] == f"{r['read_only_s'] / c1:.0%}"
        assert f[12] == f"{r['bytes'] / BW / c1:.0%}"
        assert f[13] == f"{r['cols']['8'] / c1:.2f}x" and f[14] == f"{r['cols']['16'] / c1:.2f}x"
    q4k, q8, f16 = (_fields(line) for line in body)
    assert q4k[-2:] == ["15.8", f"{47.1 / 15.8:.2f}x"]             # recorded only where known
    assert q8[-2:] == f16[-2:] == ["-", "-"]
    assert q4k[-3] == "-"                                          # no torch row for its shape
    bf_bw = 128256 * 4096 * 2 / 280e-6
    assert q8[-3] == f"{(rows[1]['bytes'] / 200e-6) / bf_bw:.2f}x"
    assert "not measured here" in table[1]


def test_decode_table_roofline_and_nodes(gt):
    rows = [{"model": "llama3-8b", "source": "synth", "weight_bytes": 4.6e9, "n_layer": 32,
             "eager_tok_s": 150.0, "graph_tok_s": 400.0, "graph_serial_tok_s": 320.0,
             "graph_nodes": 300, "load_s": 9.0,
             "synth_s": 20.0, "launches": {"embed": 1, "layers": 288, "head": 3}},
            {"model": "llama3.2-1b", "source": "synth", "weight_bytes": 0.8e9, "n_layer": 16,
             "eager_tok_s": 300.0, "graph_tok_s": 900.0, "graph_nodes": None, "load_s": 2.0,
             "synth_s": None, "launches": {}},
            {"model": "gemma3-270m", "source": "file", "error": "not in $SPECSTREAM_MODELS_DIR"}]
    table = gt.decode_table(rows, BW, 128)
    line = next(x for x in table.splitlines() if x.startswith("llama3-8b"))
    f = _fields(line)
    roof = BW / 4.6e9
    assert f[3] == f"{roof:.0f}/s" and f[5] == "400/s" and f[6] == "320/s"
    assert f[7] == f"{400 / roof:.0%}"
    assert f[8] == "300" and f[9] == f"{(300 - 1 - 3) / 32:.1f}" and f[10] == f"{288 / 32:.1f}"
    assert f[11] == "274/s"
    f = _fields(next(x for x in table.splitlines() if x.startswith("llama3.2-1b")))
    assert f[6] == "-"                                  # no PDL-off run: nothing made up
    assert f[8:12] == ["-", "-", "-", "905/s"]          # no node count: nothing made up
    assert "gemma3-270m" in table and "not in $SPECSTREAM_MODELS_DIR" in table
    assert "synthesized in 20.0 s" in table


def test_kernel_breakdown_sums_by_name(gt):
    recs = [("gemv_q4k", 10e-6), ("rms_norm", 1e-6), ("gemv_q4k", 20e-6), ("rope", 2e-6)]
    rows = gt.aggregate_kernels(recs)
    assert [(r["name"], r["calls"]) for r in rows] == [("gemv_q4k", 2), ("rope", 1),
                                                       ("rms_norm", 1)]
    assert rows[0]["total_s"] == pytest.approx(30e-6)
    table = gt.kernel_table({"model": "m", "rows": rows}, 66e-6)
    assert f"{33 / 66:.0%} of it" in table and "4 launches" in table
    shares = [line.split()[-1] for line in table.splitlines()[2:5]]
    assert shares == [f"{30 / 33:.0%}", f"{2 / 33:.0%}", f"{1 / 33:.0%}"]


def _results(gt, decode_8b: float) -> dict:
    return {"copy_bw": BW, "gemv": _gemv_rows(), "torch_bf16": {"error": "torch not here"},
            "decode": [{"model": "llama3-8b", "source": "synth", "weight_bytes": 4.6e9,
                        "n_layer": 32, "eager_tok_s": 150.0, "graph_tok_s": decode_8b,
                        "graph_nodes": 160, "load_s": 9.0, "synth_s": None,
                        "launches": {"embed": 1, "layers": 156, "head": 3}}],
            "prefill": [], "kernels": [{"model": "llama3-8b", "step_s": 1 / decode_8b,
                                        "rows": gt.aggregate_kernels([("k", 1e-3)])}],
            "seconds": 100.0}


def test_goals_take_the_worst_gemv_and_judge_direction(gt):
    measured = gt.measured_for_goals(_results(gt, 600.0))
    assert measured["gemv_read_c1"] == (pytest.approx(140 / 200), "Q8_0 128256x4096")  # not F16
    assert measured["gemv_c8_c1"] == (pytest.approx(2.0), "Q8_0 128256x4096")
    assert measured["gemv_c16_c1"] == (pytest.approx(2.5), "Q8_0 128256x4096")
    assert measured["nodes_per_layer"] == (pytest.approx((160 - 4) / 32), "llama3-8b")
    assert measured["prefill_llama3-8b"] is None
    _, rows = gt.goals_table(_results(gt, 600.0))
    status = {r["goal"]: r["status"] for r in rows}
    assert status["decode_llama3-8b"] == "met" and status["nodes_per_layer"] == "met"
    assert status["gemv_read_c1"] == status["gemv_c8_c1"] == status["gemv_c16_c1"] == "missed"
    assert status["decode_llama3.2-1b"] == status["prefill_llama3-8b"] == "not measured"
    _, rows = gt.goals_table(_results(gt, 549.0))
    assert {r["goal"]: r["status"] for r in rows}["decode_llama3-8b"] == "missed"


def test_gpu_bench_report_and_no_cupy(gt):
    bench = _load("gpu_bench")
    a = gt.parse_args([])
    results = _results(gt, 600.0)
    text = bench.report(results, a)
    assert "torch bf16 GEMV: torch not here" in text
    assert "Goals (issue 10)" in text and "recorded in docs/design.md" in text
    assert [r["goal"] for r in results["goals"]] == list(gt.GOALS)
    if importlib.util.find_spec("cupy") is None:
        assert bench.main(["--quick"]) == 2          # says why instead of failing on import


def test_mma_rows_print_their_ratios_and_stay_out_of_the_goals(gt):
    """A tensor-core row ("Q4_K mma", variant "mma") shows its own c8/c1 and c16/c1 against
    the dp4a kernel's 1 column; the goals judge the default kernels only."""
    base = _gemv_rows()
    mma = {**base[1], "type": "Q8_0 mma", "variant": "mma",
           "cols": {"1": 200e-6, "2": 210e-6, "8": 900e-6, "16": 1000e-6}}
    table = gt.gemv_table([*base, mma], gt.COLUMNS, BW).splitlines()
    f = _fields(table[-1])
    assert f[:3] == ["Q8_0", "mma", "128256x4096"]
    assert f[8] == "-"                                           # c=4 not timed
    assert f[14:16] == [f"{900 / 200:.2f}x", f"{1000 / 200:.2f}x"]
    results = _results(gt, 600.0)
    results["gemv"].append(mma)
    measured = gt.measured_for_goals(results)
    assert measured["gemv_c8_c1"] == (pytest.approx(2.0), "Q8_0 128256x4096")
    assert measured["gemv_c16_c1"] == (pytest.approx(2.5), "Q8_0 128256x4096")


def test_mma_rows_show_the_wide_tiles_and_the_others_a_dash(gt):
    """The MMA_COLUMNS (32, 64) are timed on the tensor-core rows only: their c= columns and
    c32/c1, c64/c1 ratios; "-" on a default row."""
    base = _gemv_rows()
    mma = {**base[0], "type": "Q4_K mma", "variant": "mma",
           "cols": {"1": 20e-6, "8": 22e-6, "16": 26e-6, "32": 30e-6, "64": 50e-6}}
    table = gt.gemv_table([base[0], mma], gt.COLUMNS, BW, None, gt.MMA_COLUMNS).splitlines()
    head = _fields(table[2])
    assert head[7:14] == [f"c={c}" for c in (*gt.COLUMNS, *gt.MMA_COLUMNS)]
    assert head[20:22] == ["c32/c1", "c64/c1"]
    dp4a, f = _fields(table[-2]), _fields(table[-1])
    assert dp4a[10:12] == ["-", "-"] and dp4a[17:19] == ["-", "-"]
    assert f[11:13] == ["30.0", "50.0"]
    assert f[18:20] == [f"{30 / 20:.2f}x", f"{50 / 20:.2f}x"]
    assert gt.parse_args([]).mma_columns == gt.parse_args(["--quick"]).mma_columns == (32, 64)


# ---------------------------------------------------------------- step breakdowns
def _ablation(gt) -> dict:
    """Made-up ablation of a 4 ms step: 2.4 ms go when the Q4_K GEMVs are disabled, 3.0 ms
    with every GEMV, 3.95 ms with every kernel (a 50 us empty graph)."""
    def row(name, nodes, t, group=False):
        return {"name": name, "nodes": nodes, "t_without_s": t, "group": group}
    return {"model": "llama3-8b", "weight_bytes": 4.8e9, "copy_bw": BW, "pdl": True,
            "nodes": 330, "kernel_nodes": 323, "t_all_s": 4e-3,
            "rows": [row("attn_f16_f16", 32, 3.6e-3), row("gemv_q4_k_c1r1", 128, 1.6e-3),
                     row(gt.GROUP_GEMV, 161, 1.0e-3, True),
                     row("everything else", 162, 3.2e-3, True),
                     row(gt.GROUP_ALL, 323, 0.05e-3, True)]}


def test_ablation_groups_each_name_then_gemvs_rest_all():
    gb = _load("gpu_breakdown")
    names = ["embed_q4_k", "rms_norm_quant", "gemv_q4_k_c1r1", "gemv_q6_k_c1r1",
             "rms_norm_quant", "gemv_q4_k_c1r1", "other"]
    groups = gb.ablation_groups(names)
    assert groups == [("embed_q4_k", [0]), ("rms_norm_quant", [1, 4]),
                      ("gemv_q4_k_c1r1", [2, 5]), ("gemv_q6_k_c1r1", [3]), ("other", [6]),
                      (gb.GROUP_GEMV, [2, 3, 5]), (gb.GROUP_REST, [0, 1, 4, 6]),
                      (gb.GROUP_ALL, list(range(7)))]
    only = gb.ablation_groups(["gemv_q8_0_c1r1"] * 2)    # no empty or repeated group
    assert [label for label, _ in only] == ["gemv_q8_0_c1r1", gb.GROUP_ALL]
    assert gb.ablation_groups([]) == []


def test_graph_breakdown_table_costs_shares_and_floors(gt):
    gb = _load("gpu_breakdown")
    assert (gt.GROUP_GEMV, gt.GROUP_ALL) == (gb.GROUP_GEMV, gb.GROUP_ALL)  # one set of labels
    table = gt.graph_breakdown_table(_ablation(gt))
    lines = table.splitlines()
    assert "PDL graph" in lines[0] and "T_all 4000.0 us" in lines[0]
    rows = {" ".join(f[:-4]): f[-4:] for f in map(_fields, lines[2:7])}
    assert rows["gemv_q4_k_c1r1"] == ["128", "2400.0", f"{2400 / 128:.2f}", "60%"]
    assert rows["attn_f16_f16"] == ["32", "400.0", f"{400 / 32:.2f}", "10%"]
    assert rows["all GEMVs"] == ["161", "3000.0", f"{3000 / 161:.2f}", "75%"]
    assert rows["everything else"][1:] == ["800.0", f"{800 / 162:.2f}", "20%"]
    assert [_fields(x)[0] for x in lines[2:4]] == ["gemv_q4_k_c1r1", "attn_f16_f16"]  # by cost
    assert "every kernel disabled: 50.0 us" in table
    floor_us = 4.8e9 / BW * 1e6
    assert (f"GEMVs alone (T_all - T without GEMVs) 3000.0 us vs the weight floor (weight bytes "
            f"/ copy bandwidth) {floor_us:.1f} us: floor / GEMVs {floor_us / 3000:.0%}") in table


def test_graph_breakdown_table_without_pdl_and_error(gt):
    entry = {**_ablation(gt), "pdl": False, "pdl_refused": "cuGraphNodeSetEnabled(0): NO"}
    head = gt.graph_breakdown_table(entry).splitlines()[0]
    assert "graph without PDL" in head and "cuGraphNodeSetEnabled(0): NO" in head
    assert "PDL graph," not in head
    err = gt.graph_breakdown_table({"model": "gemma3-270m", "error": "RuntimeError: refused"})
    assert err == "Graph node ablation, gemma3-270m: RuntimeError: refused"


def test_prefill_kernel_table_cublas_and_rest(gt):
    rows = gt.aggregate_kernels([("dequant_q4_k", 5e-3), ("attn_f16_f16", 9e-3),
                                 ("dequant_q6_k", 2e-3), ("dequant_q4_k", 3e-3)])
    entry = {"model": "llama3-8b", "tokens": 512, "step_s": 50e-3, "matmuls": 225,
             "cublas_s": 20e-3, "rows": rows}
    lines = gt.prefill_kernel_table(entry).splitlines()
    assert "50.00 ms, 225 matmuls" in lines[0]
    body = [_fields(x) for x in lines[2:7]]
    assert [f[-4:] for f in body] == [["225", "20.00", f"{20 / 225:.3f}", "40%"],
                                      ["1", "9.00", "9.000", "18%"],
                                      ["2", "8.00", "4.000", "16%"],
                                      ["1", "2.00", "2.000", "4%"],
                                      ["-", "11.00", "-", "22%"]]         # 50 - 19 - 20 ms
    assert [f[0] for f in body[:4]] == ["cuBLAS", "attn_f16_f16", "dequant_q4_k", "dequant_q6_k"]
    assert "weight dequantization (dequant_*) 10.00 ms (20%)" in lines[-1]
    err = gt.prefill_kernel_table({"model": "llama3-8b", "tokens": 512, "error": "OOM"})
    assert err == "Prefill kernels, llama3-8b, 512 tokens: OOM"


def test_gpu_bench_report_prints_the_breakdowns(gt):
    bench = _load("gpu_bench")
    results = _results(gt, 600.0)
    results["prefill"] = [{"model": "llama3-8b", "tokens": 512, "tok_s": 9000.0}]
    results["graph_breakdown"] = [_ablation(gt), {"model": "gemma3-270m", "error": "no graph"}]
    results["prefill_kernels"] = [{"model": "llama3-8b", "tokens": 512, "error": "OOM"}]
    text = bench.report(results, gt.parse_args([]))
    assert "Graph node ablation, llama3-8b, PDL graph" in text
    assert "Graph node ablation, gemma3-270m: no graph" in text
    assert "Prefill kernels, llama3-8b, 512 tokens: OOM" in text


def test_variants_table_shows_each_version_against_the_default(gt):
    rows = [{"model": "llama3-8b", "graph_tok_s": 300.0,
             "variants": {"no PDL": 240.0, "fused norm": 330.0}},
            {"model": "gemma3-270m", "graph_tok_s": 1000.0, "variants": {"no PDL": 900.0}},
            {"model": "smollm2-135m", "error": "not in /tmp"}]
    out = gt.variants_table(rows).splitlines()
    assert "no PDL" in out[1] and "fused norm" in out[1]
    assert "240/s (0.80x)" in out[2] and "330/s (1.10x)" in out[2]
    assert "900/s (0.90x)" in out[3] and out[3].rstrip().endswith("-")
    assert len(out) == 4                                  # the error row has no versions
    assert gt.variants_table([{"model": "x", "graph_tok_s": 1.0}]) == ""


def test_maskfill_bench_runs_and_prints_both_paths(capsys):
    """bench/maskfill.py end to end on SmolLM2's vocabulary (one round, 1 and 4 rows): it
    calls constraint.advance_rows as the engine does, so a change of that API shows here."""
    from tests.support.models import model_path
    model_path("smollm2")                          # fetched (or skipped) as the tests fetch it
    assert _load("maskfill").main(["--rows", "1,4", "--rounds", "1"]) in (0, None)
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("loose", "json"))]
    assert [(r[0], r[-4]) for r in rows] == [("loose", "1"), ("loose", "4"), ("json", "1"),
                                             ("json", "4")], out
    assert all(float(r[-3]) > 0 and float(r[-2]) > 0 for r in rows), out


def test_backend_defaults_replace_named_keywords_by_their_types():
    """bench/gpu_backend_defaults.py sets keyword defaults by name, typed like the old ones,
    and refuses a name the function does not take."""
    mod = _load("gpu_backend_defaults")

    def f(a, n: int = 2, flag: bool = False, mode: str = "warp", opt=None):
        return n, flag, mode, opt

    got = mod.replace_defaults(f, "n=16,flag=true,mode=split,opt=3")
    assert got == {"n": 16, "flag": True, "mode": "split", "opt": 3}
    assert f(0) == (16, True, "split", 3)
    with pytest.raises(SystemExit, match="'m' is not a keyword parameter"):
        mod.replace_defaults(f, "m=1")


def test_hostcalls_bench_times_the_overlapped_loops_calls(capsys):
    """bench/hostcalls.py end to end on the CPU (SmolLM2, 2 streams, a few tokens): both sides
    ran the overlapped loop (submits counted), the constrained side its batch fills, and the
    wrapped calls are put back afterwards."""
    from service.engine.runner.model_runner import ModelRunner
    from tests.support.models import model_path
    model_path("smollm2")
    submit = ModelRunner.submit
    assert _load("hostcalls").main(["--backend", "cpu", "--model", "smollm2-135m",
                                    "--streams", "2", "--tokens", "5"]) == 0
    assert ModelRunner.submit is submit
    out = capsys.readouterr().out
    plain, constrained = out.split("== constrained")
    assert "\nsubmit " in plain and "advance_rows" not in plain, out
    assert "\nsubmit " in constrained and "advance_rows" in constrained, out


def test_structured_bench_warms_until_no_new_step_shape(monkeypatch):
    """warm_shapes runs a case until a run meets no shape the backend had not seen (nor a new
    graph captured): at least twice, at most WARM_RUNS; twice on a backend without graphs."""
    from types import SimpleNamespace
    mod = _load("structured")
    be = SimpleNamespace(_seen=set(), n_graphs=0)
    eng = SimpleNamespace(runner=SimpleNamespace(model=SimpleNamespace(backend=be)))
    # (shapes met for the first time, graphs captured) by each run: the fourth meets nothing
    deltas = iter([(2, 0), (1, 2), (0, 1), (0, 0), (5, 5)])

    def run(*a):
        shapes, graphs = next(deltas)
        be._seen |= {len(be._seen) + i for i in range(shapes)}
        be.n_graphs += graphs
        return 1.0, 0
    monkeypatch.setattr(mod, "per_token_ms", run)
    assert mod.warm_shapes(eng, 16, 8, None, True) == 4
    calls = []
    monkeypatch.setattr(mod, "per_token_ms", lambda *a: calls.append(a) or (1.0, 0))
    cpu = SimpleNamespace(runner=SimpleNamespace(model=SimpleNamespace(backend=object())))
    assert mod.warm_shapes(cpu, 16, 8, None, True) == 2 and len(calls) == 2
    monkeypatch.setattr(mod, "WARM_RUNS", 3)
    be2 = SimpleNamespace(_seen=set(), n_graphs=0)
    grow = SimpleNamespace(runner=SimpleNamespace(model=SimpleNamespace(backend=be2)))
    monkeypatch.setattr(mod, "per_token_ms", lambda *a: be2._seen.add(len(be2._seen)) or (1, 0))
    assert mod.warm_shapes(grow, 16, 8, None, True) == 3
