"""Where a step's GPU time goes, measured two ways (bench/gpu_bench.py and bench/gpu_prefill.py).

- `launch_events`: CUDA events around every `CudaBackend._launch` of some eager work, one pair
  per launch (the one wrapper behind the eager decode breakdown and the prefill breakdown).
- `prefill_kernels`: one eager prefill step, per kernel name, plus the cuBLAS time (matmul
  spans less the launches inside them) and the rest (host gaps, CuPy copies).
- `graph_breakdown`: node ablation of the captured single-token step graph. Its kernel nodes
  are named by matching each node's CUfunction against the backend's loaded kernels; every
  kernel name (and the groups "all GEMVs", "everything else", "all kernel nodes") is disabled
  in the executable graph (cuGraphNodeSetEnabled), the graph replayed, and the node re-enabled:
  cost = T_all - T_without. Disabled nodes compute nothing, so the values the replays write are
  garbage; only the times mean anything. Attention reads positions from device arrays, so no
  kernel can read out of bounds whatever runs before it.

CuPy comes in as the `cp` argument and bench/gpu_decode.py as `G` (nothing is imported at load
time); cuda-bindings is imported where the graph is read. Results are JSON-ready dicts, printed
by bench/gpu_tables.py.
"""

from __future__ import annotations

from contextlib import contextmanager

REPLAYS, ROUNDS = 20, 5       # graph replays between two events; median over rounds
GEMV_PREFIX = "gemv_"
GROUP_GEMV, GROUP_REST, GROUP_ALL = "all GEMVs", "everything else", "all kernel nodes"
OTHER = "other"               # a kernel node whose function is none of the backend's kernels


# ---------------------------------------------------------------- events around launches
@contextmanager
def launch_events(cp, be, tag=lambda: None):
    """Within the block, every `be._launch` is bracketed by two CUDA events on the backend's
    stream; yields the list of (kernel name, tag() at launch, start event, end event) that
    fills as launches happen. The class's `_launch` is restored on exit."""
    records: list[tuple] = []
    launch = be._launch

    def timed(name, grid, block, args, **kwargs):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(be.stream)
        launch(name, grid, block, args, **kwargs)
        e1.record(be.stream)
        records.append((name, tag(), e0, e1))

    be._launch = timed                    # an instance attribute shadows the method
    try:
        yield records
    finally:
        del be._launch


def seconds(cp, e0, e1) -> float:
    return cp.cuda.get_elapsed_time(e0, e1) / 1e3


# ---------------------------------------------------------------- prefill, per kernel
def prefill_kernels(cp, be, step, model: str, tokens: int) -> dict:
    """One more eager prefill `step()` with events around every launch and every matmul:
    {model, tokens, step_s, matmuls, cublas_s, rows: [{name, calls, total_s}]}; cublas_s = the
    matmul spans less the kernel launches inside them (x to f16, weight dequantization, the
    1-row logits GEMV), i.e. the cuBLAS GEMMs and the host time between their calls."""
    from gpu_tables import aggregate_kernels

    spans: list[tuple] = []
    inside = [False]

    def spanned(fn):
        def call(*args, **kwargs):
            if inside[0]:                  # a matmul inside a matmul: its span has it
                return fn(*args, **kwargs)
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(be.stream)
            inside[0] = True
            try:
                fn(*args, **kwargs)
            finally:
                inside[0] = False
            e1.record(be.stream)
            spans.append((e0, e1))
        return call

    be.matmul, be.matmul_add = spanned(be.matmul), spanned(be.matmul_add)
    try:
        with launch_events(cp, be, tag=lambda: inside[0]) as records:
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(be.stream)
            step()
            e1.record(be.stream)
            e1.synchronize()
    finally:
        del be.matmul, be.matmul_add       # the class's methods again
    inner = sum(seconds(cp, a, b) for _, within, a, b in records if within)
    return {"model": model, "tokens": tokens, "step_s": seconds(cp, e0, e1),
            "matmuls": len(spans),
            "cublas_s": sum(seconds(cp, a, b) for a, b in spans) - inner,
            "rows": aggregate_kernels([(name, seconds(cp, a, b)) for name, _, a, b in records])}


# ---------------------------------------------------------------- graph node ablation
def ablation_groups(names: list[str]) -> list[tuple[str, list[int]]]:
    """(label, indices into `names`) to disable together: each kernel name alone (in order of
    first appearance), then all GEMVs, everything else, all kernel nodes (groups left out when
    empty; "everything else" and "all GEMVs" also when they are every node)."""
    by: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        by.setdefault(name, []).append(i)
    gemv = [i for i, n in enumerate(names) if n.startswith(GEMV_PREFIX)]
    rest = [i for i, n in enumerate(names) if not n.startswith(GEMV_PREFIX)]
    groups = list(by.items())
    groups += [(label, idx) for label, idx in ((GROUP_GEMV, gemv), (GROUP_REST, rest))
               if idx and len(idx) < len(names)]
    if names:
        groups.append((GROUP_ALL, list(range(len(names)))))
    return groups


class _Refused(RuntimeError):
    """cuGraphNodeSetEnabled said no (e.g. for nodes with programmatic dependencies)."""


def _ok(cu, result, what: str):
    """The values after the error code of a cuda-bindings call; raises on any other code."""
    err, *rest = result
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what}: {getattr(err, 'name', err)}")
    return rest


def _kernel_nodes(cu, be, graph) -> tuple[list, list[str], int]:
    """(kernel nodes, their kernel names, number of all nodes) of a CuPy graph."""
    by_ptr = {}
    for name, fn in be._kernels.items():
        handle = getattr(getattr(fn, "kernel", None), "ptr", None) or getattr(fn, "ptr", None)
        if handle:
            by_ptr[int(handle)] = name
    (_, count) = _ok(cu, cu.cuGraphGetNodes(graph.graph, 0), "cuGraphGetNodes (count)")
    (nodes, count) = _ok(cu, cu.cuGraphGetNodes(graph.graph, int(count)), "cuGraphGetNodes")
    nodes = list(nodes)[: int(count)]
    kernels, names = [], []
    for node in nodes:
        (kind,) = _ok(cu, cu.cuGraphNodeGetType(node), "cuGraphNodeGetType")
        if kind != cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
            continue
        (params,) = _ok(cu, cu.cuGraphKernelNodeGetParams(node), "cuGraphKernelNodeGetParams")
        kernels.append(node)
        names.append(by_ptr.get(int(params.func)) or _by_name(cu, be, params.func))
    return kernels, names, len(nodes)


def _by_name(cu, be, func) -> str:
    """A kernel's name from the driver when its handle matched none (a backend kernel's name,
    else OTHER)."""
    try:
        err, name = cu.cuFuncGetName(func)
    except Exception:          # a driver without cuFuncGetName: the handle stays unnamed
        return OTHER
    if err != cu.CUresult.CUDA_SUCCESS:
        return OTHER
    name = name.decode() if isinstance(name, bytes) else str(name)
    return name if name in be._kernels else OTHER


def _replay_s(G, graph, stream) -> float:
    """Seconds per replay of `graph` (median of ROUNDS rounds of REPLAYS replays)."""
    def replays():
        for _ in range(REPLAYS):
            graph.launch(stream=stream)

    graph.launch(stream=stream)            # the first launch after a change uploads it
    return G.event_time(stream, replays, REPLAYS, ROUNDS)


def _set_enabled(cu, graph, nodes, on: int) -> None:
    for node in nodes:
        (err,) = cu.cuGraphNodeSetEnabled(graph.graphExec, node, on)
        if err != cu.CUresult.CUDA_SUCCESS:
            raise _Refused(f"cuGraphNodeSetEnabled({on}): {getattr(err, 'name', err)}")


def _ablate(G, be, graph) -> dict:
    """T_all and, per ablation group, T with its nodes disabled; every node enabled again on
    the way out (also after a failure)."""
    from cuda.bindings import driver as cu

    if not getattr(graph, "graph", 0) or not getattr(graph, "graphExec", 0):
        raise RuntimeError("the CuPy graph exposes no graph / graphExec handle")
    nodes, names, n_all = _kernel_nodes(cu, be, graph)
    if not nodes:
        raise RuntimeError("the step graph has no kernel nodes")
    be.synchronize()
    out = {"nodes": n_all, "kernel_nodes": len(nodes), "t_all_s": _replay_s(G, graph, be.stream),
           "rows": []}
    try:
        for label, idx in ablation_groups(names):
            _set_enabled(cu, graph, [nodes[i] for i in idx], 0)
            t = _replay_s(G, graph, be.stream)
            _set_enabled(cu, graph, [nodes[i] for i in idx], 1)
            out["rows"].append({"name": label, "nodes": len(idx), "t_without_s": t,
                                "group": label in (GROUP_GEMV, GROUP_REST, GROUP_ALL)})
    finally:
        be.synchronize()
        for node in nodes:                 # whatever happened, every node runs again
            cu.cuGraphNodeSetEnabled(graph.graphExec, node, 1)
    return out


def _step_graph(be):
    graphs = [g for key, (g, _) in be._graphs.items() if key[0] == 1]
    if not graphs:
        raise RuntimeError("no single-token step graph was captured")
    return graphs[0]


def graph_breakdown(G, be, tr, model: str, copy_bw: float) -> dict:
    """Node ablation of the single-token step graph `be` captured last ({model, pdl, ...} or
    {model, error}). When the driver refuses to disable nodes of the PDL graph, the step is
    captured again without PDL (`pdl_refused` says why) and that graph is ablated; be.pdl and
    the captured graphs are then restored (cleared: later measurements capture their own)."""
    entry = {"model": model, "weight_bytes": be.weight_bytes, "copy_bw": copy_bw,
             "pdl": be.pdl}
    try:
        return {**entry, **_ablate(G, be, _step_graph(be))}
    except _Refused as exc:
        if not be.pdl:
            return {**entry, "error": str(exc)}
        entry.update(pdl=False, pdl_refused=str(exc))
    except Exception as exc:   # the bench goes on without this table
        return {**entry, "error": f"{type(exc).__name__}: {exc}"}
    pdl = be.pdl
    try:
        be._graphs.clear()
        be._seen.clear()
        be.pdl = False
        G._decode_rate(be, tr, 8)          # captures the single-token step again
        return {**entry, **_ablate(G, be, _step_graph(be))}
    except Exception as exc:
        return {**entry, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        be.pdl = pdl
        be._graphs.clear()
        be._seen.clear()
