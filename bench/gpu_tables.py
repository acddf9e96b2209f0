"""bench/gpu_bench.py without the GPU: its options, the figures recorded elsewhere, the roofline,
the goals and every table it prints. Pure Python (no CuPy), so the CPU CI tests it
(tests/unit/test_bench_tables.py).

Results are one JSON-ready dict (`--json` writes it):
    copy_bw      bytes read + written per second of a device-to-device copy
    gemv         [{type, n, k, bytes, read_only_s, cols: {"1": s, ...}}]   (N x K = rows x width)
                 (variant "mma", type "<type> mma": the tensor-core GEMV, CudaBackend(gemv_mma=
                 True), also at the MMA_COLUMNS (its 32- and 64-column tiles); not counted in
                 the goals, which judge the default kernels)
    torch_bf16   [{n, k, bytes, cols}]  or {"error": why}
    decode       [{model, source, weight_bytes, n_layer, eager_tok_s, graph_tok_s, graph_nodes,
                   launches: {embed, layers, head} (of one eager step), load_s, synth_s}]
                 (a row with "error" when a model failed)
    prefill      [{model, tokens, tok_s}]
    kernels      [{model, step_s, rows: [{name, calls, total_s}]}]
    graph_breakdown  [{model, pdl, pdl_refused?, weight_bytes, copy_bw, nodes, kernel_nodes,
                   t_all_s, rows: [{name, nodes, t_without_s, group}]}]  or [{model, error}]
                 (node ablation of the single-token step graph, bench/gpu_breakdown.py)
    prefill_kernels  [{model, tokens, step_s, matmuls, cublas_s, rows: [{name, calls,
                   total_s}]}]  or [{model, tokens, error}]   (one eager prefill step)
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

L2_BYTES = 60 * 2**20          # the H200's L2: rotated weight copies must exceed it
TYPES = ("Q4_0", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "F16")
SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336), (128256, 4096))      # (N, K)
COLUMNS = (1, 2, 4, 8, 16)
# the tensor-core rows only, one tile each (gemv_mma.cu c32 / c64); the default takes the GEMM
# at these widths (prefill_gemm_min_tokens)
MMA_COLUMNS = (32, 64)
QUICK_TYPES, QUICK_SHAPES, QUICK_COLUMNS = ("Q4_K", "Q8_0"), ((4096, 14336),), (1, 8, 16)
SYNTH = (("llama3-8b", "Q4_K_M"), ("llama3.2-1b", "Q4_K_M"), ("qwen3-30b-a3b", "Q4_K_M"))
REAL = ("smollm2-135m", "gemma3-270m")
PREFILL_MODEL, PREFILL_TOKENS = "llama3-8b", 512
RECORDED = "llama.cpp (recorded in docs/design.md, not measured here)"
GROUP_GEMV, GROUP_ALL = "all GEMVs", "all kernel nodes"    # labels of bench/gpu_breakdown.py
CUBLAS, UNLAUNCHED = "cuBLAS GEMM*", "outside launches and matmuls*"

# llama.cpp on the project's H200 (docs/design.md, 2026-12-02): microseconds of one GEMV
# (test-backend-ops perf) at 1, 2, 4, 8 columns, by (type, N, K).
LLAMACPP_GEMV_US = {
    ("Q4_K", 4096, 14336): (15.8, 18.7, 27.3, 47.1),
    ("Q6_K", 4096, 14336): (24.1, 29.3, 39.2, 57.5),
    ("Q4_0", 4096, 14336): (14.7, 14.8, 20.3, 32.9),
    ("Q8_0", 4096, 14336): (23.4, 25.0, 29.3, 45.9),
    ("Q4_K", 14336, 4096): (19.7, 19.9, 29.5, 49.1),
    ("Q4_K", 4096, 4096): (7.7, 7.7, 10.5, 16.3),
}
LLAMACPP_DECODE = {"llama3-8b": 274.0, "llama3.2-1b": 905.0, "smollm2-135m": 948.0,
                   "gemma3-270m": 994.0}                       # tok/s, tg128
LLAMACPP_PREFILL = {"llama3-8b": 9050.0}                       # tok/s, pp512


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="gpu_bench.py", description=(
        "GEMV and decode benchmark of the CUDA backend; every ratio against a baseline "
        "measured in the same run"))
    ap.add_argument("--quick", action="store_true",
                    help="fewer GEMV types/shapes/columns and 32 decode tokens")
    ap.add_argument("--only", choices=("gemv", "decode"), help="run one part")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--tokens", type=int, help="decode tokens per model (default 128, quick 32)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the synthetic models and inputs")
    ap.add_argument("--models", metavar="A,B",
                    help="decode only these models: synthetic presets (Q4_K_M, e.g. "
                         "qwen3-30b-a3b) or real file names (default: "
                         f"{','.join(p for p, _ in SYNTH + tuple((r, None) for r in REAL))})")
    ap.add_argument("--synth-dir", default="/tmp/specstream-synth",
                    help="where synthetic models are generated (reused when present)")
    a = ap.parse_args(argv)
    if a.tokens is not None and a.tokens < 1:
        ap.error("--tokens must be >= 1")
    a.types = QUICK_TYPES if a.quick else TYPES
    a.shapes = QUICK_SHAPES if a.quick else SHAPES
    a.columns = QUICK_COLUMNS if a.quick else COLUMNS
    a.mma_columns = MMA_COLUMNS
    a.tokens = a.tokens or (32 if a.quick else 128)
    a.gemv = a.only in (None, "gemv")
    a.decode = a.only in (None, "decode")
    a.models = a.models.split(",") if a.models else None
    return a


# ---------------------------------------------------------------- arithmetic
def copies_for(nbytes: int, l2: int = L2_BYTES) -> int:
    """Weight copies to rotate over so that together they are at least twice the L2."""
    return max(2, math.ceil(2 * l2 / nbytes))


def roofline_tok_s(weight_bytes: float, copy_bw: float) -> float:
    """Decode steps per second if each only read its weights at the copy bandwidth."""
    return copy_bw / weight_bytes


def aggregate_kernels(records: list[tuple[str, float]]) -> list[dict]:
    """(kernel name, seconds) per launch -> per name {name, calls, total_s}, largest first."""
    by: dict[str, dict] = {}
    for name, sec in records:
        row = by.setdefault(name, {"name": name, "calls": 0, "total_s": 0.0})
        row["calls"] += 1
        row["total_s"] += sec
    return sorted(by.values(), key=lambda r: (-r["total_s"], r["name"]))


def nodes_per_layer(row: dict) -> float | None:
    """Graph nodes of one decode layer: the step's nodes less the launches outside the layers
    (embedding, output norm and logits, counted in an eager step), over the layers."""
    nodes, launches = row.get("graph_nodes"), row.get("launches")
    if nodes is None or not launches:
        return None
    return (nodes - launches["embed"] - launches["head"]) / row["n_layer"]


def _col(row: dict, c: int) -> float | None:
    return row["cols"].get(str(c))


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


# ---------------------------------------------------------------- goals (issue 10's table)
@dataclass(frozen=True)
class Goal:
    figure: str
    llama_cpp: str               # llama.cpp's figure as recorded, text
    target: float
    higher_is_better: bool
    unit: str                    # "%" (a fraction printed as percent), "x", "tok/s", "nodes"

    def met(self, value: float) -> bool:
        return value >= self.target if self.higher_is_better else value <= self.target


GOALS = {
    "gemv_read_c1": Goal("every quantized GEMV at 1 column vs read-only (worst)", "60%", 0.90,
                         True, "%"),
    "gemv_c8_c1": Goal("8 columns / 1 column time (worst)", "3.0x", 1.5, False, "x"),
    "gemv_c16_c1": Goal("16 columns / 1 column time (worst)", "(MMQ)", 2.0, False, "x"),
    "decode_llama3-8b": Goal("decode, 8B shape Q4_K_M", "274 tok/s", 550, True, "tok/s"),
    "decode_llama3.2-1b": Goal("decode, 1B shape Q4_K_M", "905 tok/s", 1800, True, "tok/s"),
    "decode_smollm2-135m": Goal("decode, real SmolLM2-135M Q4_1", "948 tok/s", 2500, True,
                                "tok/s"),
    "decode_gemma3-270m": Goal("decode, real Gemma-3-270M Q4_K_M", "994 tok/s", 2000, True,
                               "tok/s"),
    "decode_qwen3-30b-a3b": Goal("decode, 30B-A3B MoE shape Q4_K_M (128 experts, 8 used)",
                                 "295 tok/s", 590, True, "tok/s"),
    "prefill_llama3-8b": Goal("prefill, 8B shape, 512 tokens", "9,050 tok/s", 9050, True,
                              "tok/s"),
    "nodes_per_layer": Goal("graph nodes per decode layer (llama shape)", "~15-17 kernels", 6,
                            False, "nodes"),
}


def measured_for_goals(results: dict) -> dict[str, tuple[float, str] | None]:
    """Each goal's figure from this run's results, with where it was measured (None: not run)."""
    out: dict[str, tuple[float, str] | None] = dict.fromkeys(GOALS)
    quant = [r for r in results.get("gemv", [])
             if r["type"] not in ("F16", "BF16", "F32") and not r.get("variant")]

    def worst(values, pick):
        values = [(v, w) for v, w in values if v is not None]
        return pick(values) if values else None

    where = lambda r: f"{r['type']} {r['n']}x{r['k']}"    # noqa: E731
    out["gemv_read_c1"] = worst([(_ratio(r["read_only_s"], _col(r, 1)), where(r)) for r in quant],
                                min)
    for c in (8, 16):
        out[f"gemv_c{c}_c1"] = worst([(_ratio(_col(r, c), _col(r, 1)), where(r)) for r in quant],
                                     max)
    for r in results.get("decode", []):
        if r.get("graph_tok_s") is not None:
            out[f"decode_{r['model']}"] = (r["graph_tok_s"], "CUDA graphs")
    for r in results.get("prefill", []):
        if r.get("tok_s") is not None:
            out[f"prefill_{r['model']}"] = (r["tok_s"], f"{r['tokens']} tokens")
    llama = [r for r in results.get("decode", []) if r.get("graph_nodes") is not None
             and r["model"] in ("llama3-8b", "llama3.2-1b")]
    per = [(nodes_per_layer(r), r["model"]) for r in llama]
    out["nodes_per_layer"] = worst(per, max)
    return {k: v for k, v in out.items() if k in GOALS}


def _fmt(value: float, unit: str) -> str:
    if unit == "%":
        return f"{value:.0%}"
    if unit == "x":
        return f"{value:.2f}x"
    if unit == "nodes":
        return f"{value:.1f}"
    return f"{value:,.0f} tok/s"


def goals_table(results: dict) -> tuple[str, list[dict]]:
    measured = measured_for_goals(results)
    rows, lines = [], [f"Goals (issue 10); llama.cpp column: {RECORDED}",
                       f"{'figure':52} {'llama.cpp':>15} {'goal':>14} {'this run':>13} "
                       f"{'status':>12}  measured on"]
    for key, g in GOALS.items():
        m = measured[key]
        status = "not measured" if m is None else ("met" if g.met(m[0]) else "missed")
        goal = ("<= " if not g.higher_is_better else ">= ") + _fmt(g.target, g.unit)
        value = "-" if m is None else _fmt(m[0], g.unit)
        lines.append(f"{g.figure:52} {g.llama_cpp:>15} {goal:>14} {value:>13} {status:>12}  "
                     f"{'' if m is None else m[1]}")
        rows.append({"goal": key, "figure": g.figure, "llama_cpp_recorded": g.llama_cpp,
                     "target": g.target, "higher_is_better": g.higher_is_better,
                     "value": None if m is None else m[0], "where": None if m is None else m[1],
                     "status": status})
    return "\n".join(lines), rows


# ---------------------------------------------------------------- tables
def _us(sec: float | None, width: int = 8) -> str:
    return f"{'-':>{width}}" if sec is None else f"{sec * 1e6:{width}.1f}"


def _x(v: float | None, width: int = 7, pct: bool = False) -> str:
    if v is None:
        return f"{'-':>{width}}"
    return f"{v:{width}.0%}" if pct else f"{v:{width - 1}.2f}x"


def gemv_table(rows: list[dict], columns, copy_bw: float, torch_rows=None,
               mma_columns=()) -> str:
    """One line per (type, shape): microseconds per GEMV at each column count (`mma_columns`:
    timed on the tensor-core rows only, "-" on the others), the read-only kernel and the copy
    floor over the same bytes, and ratios measured in this run."""
    torch = {(r["n"], r["k"]): r for r in torch_rows or []}
    wide = tuple(mma_columns)
    head = (f"{'type':8} {'N x K':>13} {'MB':>7} {'copy':>7} {'read':>7} "
            + " ".join(f"{'c=' + str(c):>8}" for c in (*columns, *wide))
            + f" {'c1 GB/s':>8} {'read/c1':>7} {'copy/c1':>7} {'c8/c1':>7} {'c16/c1':>7}"
            + "".join(f" {f'c{c}/c1':>7}" for c in wide)
            + f" {'vs bf16':>7} {'llama c1':>8} {'llama c8/c1':>11}")
    lines = ["GEMV: us per call inside one CUDA graph of back-to-back calls, weights rotated "
             f"past the {L2_BYTES >> 20} MB L2",
             "copy = bytes / device copy bandwidth; read = a read-only kernel over the same "
             "bytes; read/c1 = GEMV speed as a share of it; vs bf16 = GB/s against torch's bf16 "
             "GEMV of the shape at 1 column; llama c1 (us), llama c8/c1 = " + RECORDED, head]
    for r in rows:
        t1 = _col(r, 1)
        t_bf = _col(torch[(r["n"], r["k"])], 1) if (r["n"], r["k"]) in torch else None
        bf_bw = None if t_bf is None else torch[(r["n"], r["k"])]["bytes"] / t_bf
        bw1 = None if t1 is None else r["bytes"] / t1
        copy_s = r["bytes"] / copy_bw
        rec = LLAMACPP_GEMV_US.get((r["type"], r["n"], r["k"]))
        lines.append(
            f"{r['type']:8} {r['n']:>6}x{r['k']:<6} {r['bytes'] / 1e6:7.1f} {_us(copy_s, 7)} "
            f"{_us(r['read_only_s'], 7)} "
            + " ".join(_us(_col(r, c)) for c in (*columns, *wide))
            + f" {'-' if bw1 is None else f'{bw1 / 1e9:.0f}':>8}"
            f" {_x(_ratio(r['read_only_s'], t1), pct=True)} {_x(_ratio(copy_s, t1), pct=True)}"
            f" {_x(_ratio(_col(r, 8), t1))} {_x(_ratio(_col(r, 16), t1))}"
            + "".join(f" {_x(_ratio(_col(r, c), t1))}" for c in wide)
            + f" {_x(_ratio(bw1, bf_bw))} {'-' if rec is None else f'{rec[0]:.1f}':>8}"
            f" {_x(None if rec is None else rec[3] / rec[0], 11)}")
    return "\n".join(lines)


def torch_table(rows: list[dict], columns) -> str:
    lines = ["torch bf16 GEMV (torch.mm into a preallocated output), timed the same way",
             f"{'N x K':>13} {'MB':>7} " + " ".join(f"{'c=' + str(c):>8}" for c in columns)
             + f" {'c1 GB/s':>8} {'c8/c1':>7}"]
    for r in rows:
        t1 = _col(r, 1)
        gbs = "-" if t1 is None else f"{r['bytes'] / t1 / 1e9:.0f}"
        lines.append(f"{r['n']:>6}x{r['k']:<6} {r['bytes'] / 1e6:7.1f} "
                     + " ".join(_us(_col(r, c)) for c in columns)
                     + f" {gbs:>8} {_x(_ratio(_col(r, 8), t1))}")
    return "\n".join(lines)


def decode_table(rows: list[dict], copy_bw: float, tokens: int) -> str:
    lines = [f"Decode, greedy, batch 1, {tokens} tokens after a 32-token prompt; roofline = "
             f"bytes a step reads (MoE: the selected experts' share) / copy bandwidth "
             f"({copy_bw / 1e12:.2f} TB/s, this run)",
             f"{'model':14} {'source':6} {'weights MB':>10} {'roofline':>10} {'eager':>9} "
             f"{'graphs':>9} {'no PDL':>9} {'graphs/roof':>11} {'nodes':>6} {'nodes/layer':>11} "
             f"{'kern/layer':>10} {'llama.cpp*':>10}"]
    for r in rows:
        if r.get("error"):
            lines.append(f"{r['model']:14} {r.get('source', ''):6} {r['error']}")
            continue
        roof = roofline_tok_s(r.get("step_bytes") or r["weight_bytes"], copy_bw)
        nodes, per = r.get("graph_nodes"), nodes_per_layer(r)
        per = "-" if per is None else f"{per:.1f}"
        kern = r["launches"]["layers"] / r["n_layer"] if r.get("launches") else None
        kern = "-" if kern is None else f"{kern:.1f}"
        rec = LLAMACPP_DECODE.get(r["model"])
        serial = r.get("graph_serial_tok_s")
        serial = "-" if serial is None else f"{serial:.0f}/s"
        lines.append(f"{r['model']:14} {r['source']:6} {r['weight_bytes'] / 1e6:10.1f} "
                     f"{roof:8.0f}/s {r['eager_tok_s']:7.0f}/s {r['graph_tok_s']:7.0f}/s "
                     f"{serial:>9} "
                     f"{_x(r['graph_tok_s'] / roof, 11, pct=True)} "
                     f"{'-' if nodes is None else nodes:>6} {per:>11} {kern:>10} "
                     f"{'-' if rec is None else f'{rec:.0f}/s':>10}")
    lines.append(f"* {RECORDED}; graphs = kernels launched with programmatic dependent launch "
                 "(each kernel's launch overlaps its predecessor), no PDL = the same graphs "
                 "with every kernel fully serialized; nodes = graph nodes of a decode step; "
                 "nodes/layer = those less "
                 "the eager step's launches outside the layers (embedding, output norm, logits), "
                 "over the layers; kern/layer = the eager step's launches inside the layers, "
                 "over the layers")
    times = [f"{r['model']} {r['load_s']:.1f} s" + ("" if r.get("synth_s") is None else
                                                    f" (synthesized in {r['synth_s']:.1f} s)")
             for r in rows if not r.get("error")]
    if times:
        lines.append("load times: " + ", ".join(times))
    return "\n".join(lines)


def variants_table(rows: list[dict]) -> str:
    """Decode tok/s of each selectable version against the default graphs, same run."""
    rows = [r for r in rows if r.get("variants")]
    if not rows:
        return ""
    names = list(dict.fromkeys(n for r in rows for n in r["variants"]))
    lines = ["Decode versions side by side (CUDA graphs; tok/s and ratio to the default)",
             f"{'model':14} {'default':>9} " + " ".join(f"{n:>22}" for n in names)]
    for r in rows:
        base = r["graph_tok_s"]
        cells = []
        for n in names:
            v = r["variants"].get(n)
            cells.append(f"{'-':>22}" if v is None else
                         f"{f'{v:.0f}/s ({v / base:.2f}x)':>22}")
        lines.append(f"{r['model']:14} {base:7.0f}/s " + " ".join(cells))
    return "\n".join(lines)


def kernel_table(entry: dict, graph_step_s: float | None = None) -> str:
    """Per-kernel time of one eager decode step (CUDA events around each launch)."""
    rows, total = entry["rows"], sum(r["total_s"] for r in entry["rows"])
    lines = [f"Kernels of one eager decode step, {entry['model']} (CUDA events around each "
             "launch, summed by kernel name)",
             f"{'kernel':28} {'calls':>6} {'total us':>9} {'us/call':>8} {'share':>6}"]
    for r in rows:
        lines.append(f"{r['name']:28} {r['calls']:>6} {r['total_s'] * 1e6:9.1f} "
                     f"{r['total_s'] / r['calls'] * 1e6:8.2f} "
                     f"{_x(_ratio(r['total_s'], total), 6, pct=True)}")
    calls = sum(r["calls"] for r in rows)
    tail = f"sum of kernel times {total * 1e6:.1f} us over {calls} launches"
    if graph_step_s is not None:
        tail += (f"; a graph-replayed step (with upload, argmax and readback) took "
                 f"{graph_step_s * 1e6:.1f} us, kernels are {_ratio(total, graph_step_s):.0%} "
                 "of it")
    lines.append(tail)
    return "\n".join(lines)


def _cost_rows(entry: dict) -> tuple[list[tuple], dict[str, tuple]]:
    """(name, nodes, cost_s) of each kernel name, largest first; and the groups by name."""
    rows = [(r["name"], r["nodes"], entry["t_all_s"] - r["t_without_s"]) for r in entry["rows"]]
    groups = {r["name"]: row for r, row in zip(entry["rows"], rows, strict=True) if r["group"]}
    named = [row for r, row in zip(entry["rows"], rows, strict=True) if not r["group"]]
    return sorted(named, key=lambda x: (-x[2], x[0])), groups


def graph_breakdown_table(entry: dict) -> str:
    """Where the graph-replayed decode step's time goes (bench/gpu_breakdown.py): per kernel
    name, the time removed from one replay when its nodes are disabled, then the groups."""
    head = f"Graph node ablation, {entry['model']}"
    if entry.get("error"):
        return f"{head}: {entry['error']}"
    graph = ("PDL graph" if entry["pdl"] else "graph without PDL"
             + (f" (the PDL graph's nodes could not be disabled: {entry['pdl_refused']})"
                if entry.get("pdl_refused") else ""))
    t_all = entry["t_all_s"]
    lines = [f"{head}, {graph}: T_all {t_all * 1e6:.1f} us per replay of the single-token step "
             f"({entry['nodes']} nodes, {entry['kernel_nodes']} kernel nodes); removed = T_all "
             "- T with those nodes disabled (values computed are garbage, times are not)",
             f"{'kernel nodes disabled':28} {'nodes':>6} {'us removed':>10} {'us/node':>8} "
             f"{'share':>6}"]
    named, groups = _cost_rows(entry)
    for name, nodes, cost in [*named, *groups.values()]:
        lines.append(f"{name:28} {nodes:>6} {cost * 1e6:10.1f} {cost / nodes * 1e6:8.2f} "
                     f"{_x(_ratio(cost, t_all), 6, pct=True)}")
    tail = []
    if GROUP_ALL in groups:
        tail.append(f"every kernel disabled: {(t_all - groups[GROUP_ALL][2]) * 1e6:.1f} us per "
                    "replay (the empty graph's floor)")
    floor = (entry.get("step_bytes") or entry["weight_bytes"]) / entry["copy_bw"]
    if GROUP_GEMV in groups:
        gemv = groups[GROUP_GEMV][2]
        tail.append(f"GEMVs alone (T_all - T without GEMVs) {gemv * 1e6:.1f} us vs the weight "
                    f"floor (weight bytes / copy bandwidth) {floor * 1e6:.1f} us: floor / GEMVs "
                    f"{_ratio(floor, gemv):.0%}" if gemv > 0 else
                    f"GEMVs alone {gemv * 1e6:.1f} us; weight floor {floor * 1e6:.1f} us")
    tail.append("kernels overlap in time (with PDL each launch hides behind its predecessor) "
                "and a disabled node still passes through the graph, so the removed times need "
                "not add up to T_all")
    return "\n".join(lines + tail)


def prefill_kernel_table(entry: dict) -> str:
    """Where one eager prefill step's time goes (bench/gpu_breakdown.prefill_kernels)."""
    head = f"Prefill kernels, {entry['model']}, {entry['tokens']} tokens"
    if entry.get("error"):
        return f"{head}: {entry['error']}"
    step, rows = entry["step_s"], entry["rows"]
    launched = sum(r["total_s"] for r in rows)
    items = sorted([(CUBLAS, entry["matmuls"], entry["cublas_s"])]
                   + [(r["name"], r["calls"], r["total_s"]) for r in rows],
                   key=lambda x: (-x[2], x[0]))
    items.append((UNLAUNCHED, None, step - launched - entry["cublas_s"]))
    lines = [f"{head}, one eager step with CUDA events around each launch and matmul: "
             f"{step * 1e3:.2f} ms, {entry['matmuls']} matmuls",
             f"{'kernel':34} {'calls':>6} {'total ms':>9} {'ms/call':>8} {'share':>6}"]
    for name, calls, sec in items:
        per = "-" if not calls else f"{sec / calls * 1e3:.3f}"
        lines.append(f"{name:34} {'-' if calls is None else calls:>6} {sec * 1e3:9.2f} "
                     f"{per:>8} {_x(_ratio(sec, step), 6, pct=True)}")
    deq = sum(r["total_s"] for r in rows if r["name"].startswith("dequant_"))
    lines.append(f"{CUBLAS} = matmul spans less the launches inside them (x to f16, weight "
                 f"dequantization, the 1-row logits GEMV); weight dequantization (dequant_*) "
                 f"{deq * 1e3:.2f} ms ({deq / step:.0%}); "
                 f"{UNLAUNCHED} = the step less both (host gaps, CuPy copies)")
    return "\n".join(lines)
