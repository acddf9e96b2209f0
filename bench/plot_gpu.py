"""Plot `make bench-gpu`'s JSON (bench/gpu_bench.py --json): GEMV time against columns per
weight type, next to the read-only kernel over the same bytes; decode tok/s of each model against
its roofline and llama.cpp's recorded figure.

    python bench/plot_gpu.py docs/bench-gpu.json docs/bench-gpu.png [--decode extra.json]

Needs matplotlib (`pip install matplotlib`; not a dependency of the service).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

LLAMA_CPP = {"llama3-8b": 274, "llama3.2-1b": 905, "smollm2-135m": 948, "gemma3-270m": 994}


def gemv_panel(ax, rows: list[dict], shape: tuple[int, int]) -> None:
    n, k = shape
    for r in rows:
        if (r["n"], r["k"]) != (n, k) or r["type"] == "F16":
            continue
        cols = sorted(int(c) for c in r["cols"])
        t = [r["cols"][str(c)] * 1e6 for c in cols]
        line, = ax.plot(cols, t, marker="o", label=r["type"])
        ax.axhline(r["read_only_s"] * 1e6, color=line.get_color(), ls=":", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("columns (tokens in the step)")
    ax.set_ylabel("us per GEMV")
    ax.set_title(f"GEMV {n}x{k} (dotted: read-only kernel, same bytes)")
    ax.legend(fontsize=7)


def decode_panel(ax, rows: list[dict], copy_bw: float) -> None:
    rows = [r for r in rows if r.get("graph_tok_s")]
    names = [r["model"] for r in rows]
    x = range(len(rows))
    ours = [r["graph_tok_s"] for r in rows]
    roof = [copy_bw / r["weight_bytes"] for r in rows]
    ref = [LLAMA_CPP.get(n, 0) for n in names]
    w = 0.27
    ax.bar([i - w for i in x], ours, w, label="specstream (CUDA graphs)")
    ax.bar(list(x), ref, w, label="llama.cpp (recorded, docs/design.md)")
    ax.bar([i + w for i in x], roof, w, label="roofline (weights / copy bw)")
    ax.set_yscale("log")
    ax.set_xticks(list(x), names, fontsize=8)
    ax.set_ylabel("decode tok/s, batch 1")
    ax.set_title("Decode on the H200")
    ax.legend(fontsize=7)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("json")
    ap.add_argument("png")
    ap.add_argument("--decode", help="a second JSON whose decode rows replace the first's")
    a = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = json.loads(Path(a.json).read_text())
    decode = json.loads(Path(a.decode).read_text())["decode"] if a.decode else d["decode"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    gemv_panel(axes[0], d["gemv"], (14336, 4096))
    gemv_panel(axes[1], d["gemv"], (4096, 14336))
    decode_panel(axes[2], decode, d["copy_bw"])
    fig.tight_layout()
    fig.savefig(a.png, dpi=110)
    print(f"wrote {a.png}")


if __name__ == "__main__":
    main()
