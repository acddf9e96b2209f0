"""`make bench-gpu`: the CUDA backend's GEMVs and decode, every ratio against a baseline
measured in the same run, and issue 10's goals met or missed.

    python bench/gpu_bench.py [--quick] [--only gemv|decode] [--json PATH] [--tokens N]

- GEMV (through `CudaBackend.matmul`, as a decode step runs it): per type and shape, 1..16
  columns, back to back inside one CUDA graph rotating over weight copies larger than the L2,
  against a read-only kernel over the same bytes timed the same way, the device-to-device copy
  bandwidth, and torch's bf16 GEMV (when torch is importable).
- Decode tok/s of synthetic llama3-8b, llama3.2-1b and qwen3-30b-a3b (MoE) Q4_K_M (seeded into
  --synth-dir, reused when present) and of the real models in $SPECSTREAM_MODELS_DIR, eager and
  with graphs, against the roofline (weight bytes / copy bandwidth); graph nodes per step; a
  per-kernel breakdown of one eager step (CUDA events around each `CudaBackend._launch`); where
  the graph-replayed step's time goes, by disabling its kernel nodes name by name
  (bench/gpu_breakdown.py); prefill tok/s of the 8B shape at 512 tokens and its per-kernel time.
Tables and goals are in bench/gpu_tables.py (pure Python, tested on the CPU). Helpers shared
with bench/gpu_decode.py are imported from it.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import gpu_breakdown as B  # noqa: E402
import gpu_tables as T  # noqa: E402
from synth_model import synth_model  # noqa: E402

GEMV_REPS = 20            # calls per captured graph


# ---------------------------------------------------------------- GEMV
def bench_gemv(cp, G, a, copy_bw: float) -> list[dict]:
    from service.backends.cuda.backend import CudaBackend

    be = CudaBackend(graphs=False)
    ro = cp.RawKernel(G.READ_ONLY, "read_only")
    rng = np.random.default_rng(a.seed)
    rows = []
    for name in a.types:
        for n, k in a.shapes:
            t0 = time.perf_counter()
            new = _gemv_row(cp, G, be, ro, rng, name, n, k, a.columns, a.mma_columns)
            rows += new
            cp.get_default_memory_pool().free_all_blocks()     # this row's weight copies
            r = new[0]
            print(f"  gemv {name} {n}x{k}: c1 {r['cols']['1'] * 1e6:.1f} us, read-only "
                  f"{r['read_only_s'] * 1e6:.1f} us"
                  + "".join(f", {v['type']} c{c} {v['cols'][c] * 1e6:.1f} us"
                            for v in new[1:] for c in v["cols"] if c != "1")
                  + f" ({time.perf_counter() - t0:.1f} s)", flush=True)
    return rows


def _random_raw(name: str, n: int, k: int, rng) -> np.ndarray:
    """(n rows of K) raw blocks of type `name`: at most 4096 random rows, repeated (the bytes'
    values do not change a GEMV's speed; generating 500 MB of them would)."""
    from service.gguf.quants import QuantType
    from service.tools.synth import random_tensor

    m = min(n, 4096)
    seed = int(rng.integers(1 << 31))
    small = random_tensor(QuantType[name], (m, k), seed)              # (m * row_bytes,) u8
    return np.resize(small, n * (small.size // m))                     # (n * row_bytes,) u8


def rotating_copies(cp, be, t):
    """Matrix t loaded on backend be, and enough copies of it to rotate past the L2: (the
    first, all copies, each copy's planes as one flat array for the read-only kernel, bytes)."""
    from service.backends.cuda.types import CudaMatrix

    w0 = be.load_matrix([t])
    be._shared.pop(t.name, None)          # the backend keeps named tensors for tied weights
    nbytes = sum(int(p.size) for p in w0.planes)
    with be.stream:
        ws = [w0] + [CudaMatrix(w0.layout, w0.rows, w0.k, [p.copy() for p in w0.planes])
                     for _ in range(T.copies_for(nbytes) - 1)]
        flat = [cp.concatenate(w.planes) for w in ws]                  # the same bytes, one each
    return w0, ws, flat, nbytes


def _gemv_row(cp, G, be, ro, rng, name: str, n: int, k: int, columns,
              mma_columns=()) -> list[dict]:
    """The row of the default (dp4a) GEMV; for types with a tensor-core GEMV (CudaBackend's
    gemv_mma, which runs every width on it, one column included) a second row "<type> mma"
    (its ratios against its own one column; the dp4a row above has the default's), timed
    also at `mma_columns` (its 32- and 64-column tiles, the GEMM kept off)."""
    from service.backends.cuda.kernels import GEMV_MMA_TYPES
    from service.gguf.quants import QuantType
    from service.gguf.reader import TensorInfo

    t = TensorInfo(f"bench.{name}.{n}x{k}", QuantType[name], (n, k),
                   _random_raw(name, n, k, rng))
    w0, ws, flat, nbytes = rotating_copies(cp, be, t)
    copies = len(ws)
    sink = cp.zeros(1, cp.int32)
    c_max = max((*columns, *mma_columns))
    be.prepare(max_tokens=c_max, n_head=1, head_dim_v=32, n_ctx=256, n_embd=k)
    x = be.zeros((c_max, k))                                           # (C, K) f32
    with be.stream:
        x[...] = cp.asarray(rng.normal(0, 1, (c_max, k)).astype(np.float32))
    out = be.zeros((c_max, n))                                         # (C, N) f32
    be.synchronize()
    def timed(cs) -> dict[str, float]:
        return {str(c): G.graph_time(
            be.stream, lambda i, c=c: be.matmul(x[:c], ws[i % copies], out[:c]), GEMV_REPS)
            for c in cs}

    with be.stream:
        t_ro = G.graph_time(be.stream, lambda i: ro(
            (264,), (512,), (flat[i % copies], np.int64(nbytes // 16), sink)), GEMV_REPS)
        cols = timed(columns)
        row = {"type": name, "n": n, "k": k, "bytes": nbytes, "copies": copies,
               "read_only_s": t_ro, "cols": cols}
        if w0.layout.kernel not in GEMV_MMA_TYPES:
            return [row]
        gemm = be.prefill_gemm_min_tokens
        be.gemv_mma, be.prefill_gemm_min_tokens = True, None
        try:
            mma = timed((*columns, *mma_columns))
        finally:
            be.gemv_mma, be.prefill_gemm_min_tokens = False, gemm
    return [row, {**row, "type": f"{name} mma", "variant": "mma", "cols": mma}]


def bench_torch(a) -> list[dict] | dict:
    """torch's bf16 GEMV per shape, inside one torch CUDA graph, rotating over copies."""
    try:
        import torch

        if not torch.cuda.is_available():
            return {"error": "torch sees no CUDA device"}
    except Exception as exc:   # torch is a peer on the GPU host, never a dependency
        return {"error": f"torch not importable ({exc})"}
    rows = []
    g = torch.Generator(device="cuda").manual_seed(a.seed)
    for n, k in a.shapes:
        try:
            rows.append(_torch_row(torch, g, n, k, a.columns))
        except Exception as exc:   # the peer's failure is reported, ours still stand
            return {"error": f"torch bf16 GEMV {n}x{k} failed: {type(exc).__name__}: {exc}"}
        torch.cuda.empty_cache()                                  # this shape's copies
    return rows


def _torch_row(torch, g, n: int, k: int, columns) -> dict:
    nbytes = n * k * 2
    copies = T.copies_for(nbytes)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g)  # (N, K) bf16
          for _ in range(copies)]
    x = torch.randn(max(columns), k, device="cuda", dtype=torch.bfloat16, generator=g)
    out = torch.empty(max(columns), n, device="cuda", dtype=torch.bfloat16)     # (C, N) bf16
    cols = {str(c): _torch_graph_time(torch, lambda i, c=c: torch.mm(
        x[:c], ws[i % copies].t(), out=out[:c])) for c in columns}
    return {"n": n, "k": k, "bytes": nbytes, "copies": copies, "cols": cols}


def _torch_graph_time(torch, launch, reps: int = GEMV_REPS) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                 # warm-up: cuBLAS handles and workspaces
        for i in range(3):
            launch(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            launch(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        graph.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) / 1e3 / reps)
    return float(np.median(times))


# ---------------------------------------------------------------- decode
def bench_decode(cp, G, a, results: dict) -> None:
    from service.config import models_dir_from_env

    models = [(preset, "synth", quant) for preset, quant in T.SYNTH]
    models += [(name, "file", None) for name in T.REAL]
    if a.models:                  # named: a real file's name, else a synthetic preset
        models = [(m, "file", None) if m in T.REAL else (m, "synth", "Q4_K_M")
                  for m in a.models]
    for model, source, quant in models:
        row = {"model": model, "source": source}
        try:
            if quant:
                path, synth_s = synth_model(a.synth_dir, model, quant, a.seed)
            else:
                path, synth_s = models_dir_from_env() / f"{model}.gguf", None
                if not path.is_file():
                    results["decode"].append({**row, "error": f"not in {path.parent}"})
                    continue
            _decode_model(cp, G, a, model, source, path, synth_s, results)
        except Exception as exc:   # one model's failure is a row of the table, not the end
            results["decode"].append({**row, "error": f"{type(exc).__name__}: {exc}"})
        gc.collect()
        cp.get_default_memory_pool().free_all_blocks()             # this model's weights


def _decode_model(cp, G, a, model, source, path, synth_s, results: dict) -> None:
    from service.backends.cuda.backend import CudaBackend
    from service.gguf.reader import GGUFFile
    from service.model.spec import ModelSpec
    from service.model.transformer import Transformer

    prefill = model == T.PREFILL_MODEL
    f = GGUFFile(path)
    spec = ModelSpec.from_gguf(f)
    t0 = time.perf_counter()
    be = CudaBackend(graphs=False)
    tr = Transformer(spec, f, be, n_ctx=max(1024, a.tokens + 64), n_slots=1,
                     max_tokens=T.PREFILL_TOKENS if prefill else 32, max_logits=16)
    be.synchronize()
    load_s = time.perf_counter() - t0
    eager = G._decode_rate(be, tr, a.tokens)
    kernels, launches = _eager_breakdown(cp, be, tr, 40 + a.tokens + 8)
    be.graphs = True                      # the same weights, now one graph per step shape
    graphs = G._decode_rate(be, tr, a.tokens)
    step_graphs = [g for key, (g, _) in be._graphs.items() if key[0] == 1]
    nodes = G._graph_nodes(step_graphs[0]) if step_graphs else None
    step_bytes = _step_bytes(f, spec, be.weight_bytes)
    results["graph_breakdown"].append({**B.graph_breakdown(G, be, tr, model, results["copy_bw"]),
                                       "step_bytes": step_bytes})
    # the versions that mattered, each with its graphs captured again, same weights
    variants = {name: _variant_rate(G, be, tr, a.tokens, **attrs)
                for name, attrs in DECODE_VARIANTS.items()
                if name != "no PDL" or be.pdl}
    serial, early = variants.get("no PDL"), variants["early weight read"]
    results["decode"].append({
        "model": model, "source": source, "weight_bytes": be.weight_bytes,
        "step_bytes": step_bytes,
        "n_layer": spec.n_layer, "eager_tok_s": eager, "graph_tok_s": graphs,
        "graph_serial_tok_s": serial, "graph_early_tok_s": early, "variants": variants,
        "graph_nodes": nodes if isinstance(nodes, int) else None, "launches": launches,
        "load_s": load_s,
        "synth_s": synth_s})
    results["kernels"].append({"model": model, "step_s": 1.0 / graphs,
                               "rows": T.aggregate_kernels(kernels)})
    print(f"  {model}: loaded in {load_s:.1f} s, eager {eager:.0f} tok/s, graphs "
          f"{graphs:.0f} tok/s ({serial and round(serial)} without PDL, {early:.0f} with the "
          f"early weight read), {nodes} nodes",
          flush=True)
    if prefill:
        be.graphs = False
        n = T.PREFILL_TOKENS
        row, kern = {"model": model, "tokens": n}, {"model": model, "tokens": n}
        try:
            step = _prefill_step(be, tr, n)
            row["tok_s"] = _prefill_rate(be, step, n)
            tiled, be.prefill_attention_min_tokens = be.prefill_attention_min_tokens, None
            try:                   # the split attention kernel of decode, for comparison
                row["split_attention_tok_s"] = _prefill_rate(be, step, n)
            finally:
                be.prefill_attention_min_tokens = tiled
        except Exception as exc:   # the decode figures above stand without it
            row["error"] = kern["error"] = f"{type(exc).__name__}: {exc}"
        if "error" not in kern:
            try:                   # one more step, with events around its launches
                kern = B.prefill_kernels(cp, be, step, model, n)
            except Exception as exc:
                kern["error"] = f"{type(exc).__name__}: {exc}"
        results["prefill"].append(row)
        results["prefill_kernels"].append(kern)


# CudaBackend settings of the decode versions measured beside the default (docs/PERFORMANCE.md)
DECODE_VARIANTS = {
    "no PDL": {"pdl": False},                         # every kernel fully serialized
    "early weight read": {"gemv_early": True},        # c1r1e
    "fused norm": {"fuse_norm": True},                # residual GEMV + RMSNorm in one launch
    "no c1r1p": {"gemv_prefetch_rows": 0},            # the plain one-column loop everywhere
}


def _step_bytes(f, spec, weight_bytes: int) -> int:
    """Weight bytes a one-token step reads: all of them, but of a mixture of experts' stacked
    expert tensors (names with `_exps`) only the n_used of n_expert a token selects."""
    if spec.moe is None:
        return weight_bytes
    exps = sum(t.raw.nbytes for t in f.tensors.values() if "_exps" in t.name)
    return int(weight_bytes - exps + exps * spec.moe.n_expert_used / spec.moe.n_expert)


def _variant_rate(G, be, tr, tokens: int, **attrs) -> float:
    """Decode tok/s with the backend attributes `attrs` set (graphs captured afresh), then the
    attributes and an empty graph cache restored."""
    old = {k: getattr(be, k) for k in attrs}
    be._graphs.clear()
    be._seen.clear()
    for k, v in attrs.items():
        setattr(be, k, v)
    try:
        return G._decode_rate(be, tr, tokens)
    finally:
        for k, v in old.items():
            setattr(be, k, v)
        be._graphs.clear()
        be._seen.clear()


def _step_inputs(be, tokens: list[int], start: int):
    n = len(tokens)
    ids, pos, slots = (be.zeros((n,), "int32") for _ in range(3))
    be.upload_ints(np.asarray(tokens, np.int32), ids)
    be.upload_ints(np.arange(start, start + n, dtype=np.int32), pos)
    be.upload_ints(np.zeros(n, np.int32), slots)
    return ids, pos, slots


def _eager_breakdown(cp, be, tr, pos: int) -> tuple[list[tuple[str, float]], dict]:
    """(kernel name, seconds) of each launch of one eager single-token step at `pos`, from
    CUDA events recorded around `CudaBackend._launch` on the backend's stream; and the launch
    count per part of the step: "embed", "layers" (from the first layer's norm) and "head"
    (from the output norm on: norm, logits)."""
    ids, p, slots = _step_inputs(be, [1], pos)
    tr.forward(ids, p, slots, pos + 1, 1)              # warm: every kernel loaded
    part = ["embed"]
    rms_norm, rms_norm_mm = be.rms_norm, be.rms_norm_for_matmul
    output_norm = tr.weights.output_norm

    def mark(w):
        part[0] = "head" if w is output_norm else "layers" if part[0] == "embed" else part[0]

    def norm(x, w, eps, out):
        mark(w)
        rms_norm(x, w, eps, out)

    def norm_mm(x, w, eps, out):            # the fused norm + 8-bit blocks of a matmul input
        mark(w)
        rms_norm_mm(x, w, eps, out)

    be.rms_norm, be.rms_norm_for_matmul = norm, norm_mm
    try:
        with B.launch_events(cp, be, tag=lambda: part[0]) as records:
            tr.forward(ids, p, slots, pos + 1, 1)
            be.synchronize()
    finally:
        del be.rms_norm, be.rms_norm_for_matmul         # the class's methods again
    counts = {k: sum(r[1] == k for r in records) for k in ("embed", "layers", "head")}
    return [(name, B.seconds(cp, e0, e1)) for name, _, e0, e1 in records], counts


def _prefill_step(be, tr, n: int):
    """One n-token prefill step (tokens 1..1000 repeated, positions from 0) as a callable."""
    ids, pos, slots = _step_inputs(be, [1 + i % 1000 for i in range(n)], 0)
    return lambda: tr.forward(ids, pos, slots, n, 1)


def _prefill_rate(be, step, n: int) -> float:
    """Tokens per second of one n-token prefill `step()` (best of 3, after a warm-up)."""
    best = float("inf")
    for i in range(4):
        be.synchronize()
        t0 = time.perf_counter()
        step()
        be.synchronize()
        if i:
            best = min(best, time.perf_counter() - t0)
    return n / best


# ---------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    a = T.parse_args(argv)
    try:
        import cupy as cp

        if cp.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no CUDA device")
    except Exception as exc:
        print(f"gpu_bench: needs CuPy and a CUDA device ({exc})", file=sys.stderr)
        return 2
    # its helpers: copy bandwidth, graph timing, the decode loop, graph node count
    import gpu_decode as G

    t_start = time.perf_counter()
    props = cp.cuda.runtime.getDeviceProperties(0)
    copy_bw = G.copy_bandwidth()
    device = props["name"]
    results: dict = {"meta": {"device": device.decode() if isinstance(device, bytes) else device,
                              "args": sys.argv[1:] if argv is None else argv,
                              "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "cupy": cp.__version__},
                     "copy_bw": copy_bw, "gemv": [], "torch_bf16": [], "decode": [],
                     "prefill": [], "kernels": [], "graph_breakdown": [],
                     "prefill_kernels": []}
    print(f"{results['meta']['device']}: device-to-device copy {copy_bw / 1e12:.2f} TB/s "
          "(bytes read + written)", flush=True)
    if a.gemv:
        results["gemv"] = bench_gemv(cp, G, a, copy_bw)
        results["torch_bf16"] = bench_torch(a)
    if a.decode:
        bench_decode(cp, G, a, results)
    results["seconds"] = time.perf_counter() - t_start
    print(report(results, a))
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
        print(f"results written to {a.json}")
    return 0


def report(results: dict, a) -> str:
    parts = []
    torch_rows = results["torch_bf16"] if isinstance(results["torch_bf16"], list) else []
    if results["gemv"]:
        parts.append(T.gemv_table(results["gemv"], a.columns, results["copy_bw"], torch_rows,
                                  a.mma_columns))
        parts.append(T.torch_table(torch_rows, a.columns) if torch_rows else
                     f"torch bf16 GEMV: {results['torch_bf16'].get('error')}")
    if results["decode"]:
        parts.append(T.decode_table(results["decode"], results["copy_bw"], a.tokens))
        if T.variants_table(results["decode"]):
            parts.append(T.variants_table(results["decode"]))
        for k in results["kernels"]:
            parts.append(T.kernel_table(k, k["step_s"]))
        parts += [T.graph_breakdown_table(g) for g in results.get("graph_breakdown", [])]
    if results["prefill"]:
        parts.append("\n".join(f"Prefill {r['model']}, {r['tokens']} tokens in one step: "
                               + (f"{r['tok_s']:,.0f} tok/s" if "tok_s" in r else r["error"])
                               + (f" (with the split attention kernel instead of the tiled "
                                  f"one: {r['split_attention_tok_s']:,.0f} tok/s)"
                                  if r.get("split_attention_tok_s") else "")
                               for r in results["prefill"]))
        parts += [T.prefill_kernel_table(k) for k in results.get("prefill_kernels", [])]
    table, results["goals"] = T.goals_table(results)
    parts.append(table)
    parts.append(f"(whole run {results['seconds']:.0f} s)")
    return "\n\n".join(parts)


if __name__ == "__main__":
    sys.exit(main())
