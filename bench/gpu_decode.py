"""GPU benchmark: quantized GEMV against a read-only kernel over the same bytes, and decode
tok/s of the real models with and without CUDA graphs, against the memory roofline.

    python bench/gpu_decode.py [--tokens 128] [--gemv-only | --decode-only]

Every ratio is against a baseline measured in the same run: the GEMV against a plain 16-byte
load kernel streaming the same weight bytes (both timed back to back inside one CUDA graph,
rotating over copies larger than the 50 MB L2); decode against bytes of weights / the measured
device-to-device copy bandwidth (read + write bytes / time of a 1 GiB copy).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import cupy as cp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.backends.cuda import CudaBackend  # noqa: E402
from service.config import models_dir_from_env  # noqa: E402
from service.gguf.reader import GGUFFile, TensorInfo  # noqa: E402
from service.model.spec import ModelSpec  # noqa: E402
from service.model.transformer import Transformer  # noqa: E402
from tests.support.blocks import qtype, random_tensor  # noqa: E402

READ_ONLY = r"""
extern "C" __global__ void read_only(const int4* __restrict__ p, long long n, int* sink) {
    int acc = 0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const int4 v = p[i];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x7fffffff) sink[0] = acc;   // keeps the loads; practically never true
}
"""
L2_BYTES = 50 * 2**20


def copy_bandwidth() -> float:
    """Bytes read + written per second of a 1 GiB device-to-device copy (median of 10)."""
    a = cp.empty(2**30, cp.uint8)
    b = cp.empty_like(a)
    times = []
    for _ in range(12):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        cp.copyto(b, a)
        e1.record()
        e1.synchronize()
        times.append(cp.cuda.get_elapsed_time(e0, e1) / 1e3)
    return 2 * a.nbytes / float(np.median(times[2:]))


def graph_time(stream, launch, reps: int = 20) -> float:
    """Seconds per call of `launch(i)` for i in range(reps), captured as one graph."""
    stream.begin_capture()
    for i in range(reps):
        launch(i)
    g = stream.end_capture()
    g.launch(stream)
    stream.synchronize()
    return event_time(stream, lambda: g.launch(stream), reps)


def event_time(stream, run, per: int, rounds: int = 5) -> float:
    """Seconds of `run()` between two events on `stream`, over `per` (median of `rounds`)."""
    times = []
    for _ in range(rounds):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(stream)
        run()
        e1.record(stream)
        e1.synchronize()
        times.append(cp.cuda.get_elapsed_time(e0, e1) / 1e3 / per)
    return float(np.median(times))


def bench_gemv(types, shapes, columns) -> None:
    be = CudaBackend(graphs=False)
    ro = cp.RawKernel(READ_ONLY, "read_only")
    rng = np.random.default_rng(0)
    print("\nGEMV inside one CUDA graph, weights rotated past L2 (us per call)")
    print(f"{'type':6} {'N x K':>12} {'MB':>6} {'read-only':>9} " +
          " ".join(f"{'c=' + str(c):>8}" for c in columns) + "  read/c=1  c=8/c=1")
    for name in types:
        for n, k in shapes:
            _gemv_row(be, ro, rng, name, n, k, columns)


def _gemv_row(be, ro, rng, name: str, n: int, k: int, columns) -> None:
    t = TensorInfo("w", qtype(name), (n, k), random_tensor(name, n, k, rng))
    copies = max(2, -(-L2_BYTES * 2 // t.raw.size))
    ws = [be.load_matrix([TensorInfo(f"{name}{n}x{k}.{i}", t.qtype, t.shape, t.raw)])
          for i in range(copies)]
    be.prepare(max_tokens=16, n_head=1, head_dim_v=32, n_ctx=256, n_embd=k)
    x = be.zeros((16, k))
    x[...] = cp.asarray(rng.normal(0, 1, (16, k)).astype(np.float32))
    out = be.zeros((16, n))
    flat = [cp.concatenate(w.planes) for w in ws]     # the same bytes, one buffer
    sink = cp.zeros(1, cp.int32)
    cp.cuda.Device().synchronize()
    nbytes = t.raw.size
    with be.stream:
        t_ro = graph_time(be.stream, lambda i: ro(
            (264,), (512,), (flat[i % copies], np.int64(nbytes // 16), sink)))
        row = [graph_time(be.stream, lambda i, c=c: be.matmul(x[:c], ws[i % copies], out[:c]))
               for c in columns]
    cells = " ".join(f"{v * 1e6:8.1f}" for v in row)
    print(f"{name:6} {n:>5}x{k:<6} {nbytes / 1e6:6.1f} {t_ro * 1e6:9.1f} {cells}  "
          f"{t_ro / row[0]:8.2f}  {row[columns.index(8)] / row[0]:6.2f}x")


def bench_decode(tokens: int, bw: float) -> None:
    print(f"\nDecode, greedy, batch 1, {tokens} tokens after a 32-token prompt "
          f"(copy bandwidth {bw / 1e12:.2f} TB/s measured)")
    print(f"{'model':14} {'weights MB':>10} {'roofline':>9} {'eager':>9} {'graphs':>9} "
          f"{'graphs/roof':>11} {'graph nodes':>11}")
    for name in ("smollm2-135m", "gemma3-270m"):
        path = models_dir_from_env() / f"{name}.gguf"
        if not path.is_file():
            print(f"{name:14} (not in {path.parent})")
            continue
        f = GGUFFile(path)
        spec = ModelSpec.from_gguf(f)
        rates, nodes, wbytes = {}, 0, 0
        for graphs in (False, True):
            be = CudaBackend(graphs=graphs)
            tr = Transformer(spec, f, be, n_ctx=512, n_slots=1, max_tokens=32)
            wbytes = be.weight_bytes
            rates[graphs] = _decode_rate(be, tr, tokens)
            if graphs:
                nodes = _graph_nodes(next(iter(be._graphs.values()))[0])
        roof = bw / wbytes
        print(f"{name:14} {wbytes / 1e6:10.1f} {roof:8.0f}/s {rates[False]:8.0f}/s "
              f"{rates[True]:8.0f}/s {rates[True] / roof:10.1%} {nodes:>11}")


def _decode_rate(be, tr, tokens: int) -> float:
    """Tokens per second of greedy decode steps: upload the position, run the step, argmax on
    the device, feed the id back on the device, read the id."""
    ids, pos, slots = (be.zeros((32,), "int32") for _ in range(3))
    arg = be.zeros((1,), "int32")
    be.upload_ints(np.arange(1, 33, dtype=np.int32), ids)
    be.upload_ints(np.arange(32, dtype=np.int32), pos)
    be.upload_ints(np.zeros(32, np.int32), slots)
    tr.forward(ids, pos, slots, 32, 1)
    host_pos = np.zeros(1, np.int32)
    t0 = 0.0
    for p in range(32, 40 + tokens):
        if p == 40:
            t0 = time.perf_counter()
        host_pos[0] = p
        be.upload_ints(host_pos, pos)
        lg = tr.forward(ids[:1], pos[:1], slots[:1], p + 1, 1)
        be.argmax(lg, arg)
        with be.stream:
            ids[:1] = arg
        be.to_host(arg)
    return tokens / (time.perf_counter() - t0)


def _graph_nodes(graph) -> int | str:
    try:
        from cuda.bindings import runtime as rt

        err, _, n = rt.cudaGraphGetNodes(graph.graph, 0)
        return int(n)
    except Exception:
        return "n/a"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--gemv-only", action="store_true")
    ap.add_argument("--decode-only", action="store_true")
    a = ap.parse_args()
    bw = copy_bandwidth()
    if not a.decode_only:
        bench_gemv(["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"], [(14336, 4096), (4096, 14336)],
                   [1, 2, 4, 8, 16])
    if not a.gemv_only:
        bench_decode(a.tokens, bw)


if __name__ == "__main__":
    main()
