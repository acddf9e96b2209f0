"""GPU benchmark: load time of a synthetic Llama-3-8B-shaped Q4_K_M model on the CUDA backend,
weights through the pinned staging ring against the pageable path (the baseline), same run.

    python bench/gpu_load.py [--dir DIR] [--seed 0] [--layers N] [--repeats 2]

The file is generated once, as `specstream synth --preset llama3-8b --quant Q4_K_M --seed S`
would, into DIR (default $TMPDIR/specstream-bench) and reused by later runs (and by
bench/gpu_prefill.py). The page cache cannot be dropped without root, so every timed load reads
a warm file: the file is read once before the first load, and the loads alternate between the
two paths. A load is the whole `Transformer(...)` construction (weights, KV cache, RoPE
tables, scratch buffers) up to a device synchronize.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import cupy as cp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.backends.cuda.backend import CudaBackend  # noqa: E402
from service.gguf.reader import GGUFFile  # noqa: E402
from service.model.spec import ModelSpec  # noqa: E402
from service.model.transformer import Transformer  # noqa: E402
from service.tools.synth import synthesize  # noqa: E402

MODES = ("pageable", "pinned")


def synthetic_file(preset: str = "llama3-8b", quant: str = "Q4_K_M", seed: int = 0,
                   layers: int | None = None, directory: str | None = None) -> Path:
    """The seeded synthetic GGUF, generated on first use (to a temporary name, then renamed,
    so an interrupted run leaves nothing to reuse)."""
    d = Path(directory) if directory else Path(tempfile.gettempdir()) / "specstream-bench"
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{preset}-{quant}-seed{seed}{f'-{layers}l' if layers else ''}.gguf"
    if not path.is_file():
        cmd = (f"specstream synth --preset {preset} --quant {quant} --seed {seed}"
               + (f" --layers {layers}" if layers else "") + f" {path}")
        print(f"generating: {cmd}", flush=True)
        part = path.with_suffix(".part")
        r = synthesize(part, preset, quant, seed=seed, n_layer=layers)
        part.rename(path)
        print(f"  {r.n_bytes / 1e9:.2f} GB in {r.seconds:.1f} s", flush=True)
    return path


def warm_read(path: Path) -> float:
    """Read the whole file once (fills the page cache); bytes per second of that read."""
    buf = bytearray(64 << 20)
    n, t0 = 0, time.perf_counter()
    with open(path, "rb", buffering=0) as fh:
        while True:
            got = fh.readinto(buf)
            if not got:
                break
            n += got
    return n / (time.perf_counter() - t0)


def timed_load(f: GGUFFile, spec: ModelSpec, mode: str) -> dict:
    pool = cp.get_default_memory_pool()
    pool.free_all_blocks()
    used0 = pool.used_bytes()
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    be = CudaBackend(graphs=False, upload=mode)
    tr = Transformer(spec, f, be, n_ctx=256, n_slots=1, max_tokens=16)
    cp.cuda.Device().synchronize()
    seconds = time.perf_counter() - t0
    out = {"seconds": seconds, "weight_bytes": be.weight_bytes,
           "loaded_bytes": be.tensor_bytes, "device_bytes": pool.used_bytes() - used0}
    del tr, be
    pool.free_all_blocks()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    path = synthetic_file(seed=a.seed, layers=a.layers, directory=a.dir)
    f = GGUFFile(path)
    spec = ModelSpec.from_gguf(f)
    file_bytes = path.stat().st_size
    tensor_bytes = sum(t.raw.size for t in f.tensors.values())
    cp.zeros(1).sum()                       # CUDA context and CuPy's pools before any timing
    print(f"\n{path.name}: warm read of the file {warm_read(path) / 1e9:.1f} GB/s "
          "(page cache warm: every load below reads from memory, not disk)")
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for _ in range(a.repeats):
        for mode in MODES:
            runs[mode].append(timed_load(f, spec, mode))
    print(f"\nTransformer load on the CUDA backend, best of {a.repeats} (warm page cache)")
    print(f"{'upload':9} {'file GB':>8} {'tensor GB':>9} {'device weight GB':>16} {'ratio':>6} "
          f"{'load s':>7} {'GB/s':>6} {'vs pageable':>11} {'all device GB':>13}")
    base = min(r["seconds"] for r in runs["pageable"])
    for mode in MODES:
        best = min(runs[mode], key=lambda r: r["seconds"])
        s = best["seconds"]
        print(f"{mode:9} {file_bytes / 1e9:8.3f} {tensor_bytes / 1e9:9.3f} "
              f"{best['weight_bytes'] / 1e9:16.3f} {best['weight_bytes'] / tensor_bytes:6.3f} "
              f"{s:7.2f} {tensor_bytes / s / 1e9:6.2f} {base / s:10.2f}x "
              f"{best['device_bytes'] / 1e9:13.3f}")
        assert best["loaded_bytes"] <= tensor_bytes
    print("ratio = device weight bytes / the file's tensor bytes (goal <= 1.05); all device = "
          "CuPy pool bytes held after the load (weights, KV cache, workspace)")
    print("runs (s): " + "; ".join(f"{m} " + " ".join(f"{r['seconds']:.2f}" for r in runs[m])
                                   for m in MODES))


if __name__ == "__main__":
    main()
