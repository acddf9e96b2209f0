"""Plot bench/concurrency.py's JSON: aggregate tok/s against concurrent streams, and inter-token
latency p50/p99 with time to first token p50 against streams. Several JSON files draw several
lines, labelled by model and backend.

    python bench/plot_concurrency.py RESULT.json [MORE.json ...] OUT.png

Needs matplotlib (`pip install matplotlib`; not a dependency of the service).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def plot(results: list[dict], png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (tp, lat) = plt.subplots(1, 2, figsize=(12, 4.5))
    for res in results:
        c, rows = res["config"], res["rows"]
        label = f"{Path(c['model']).stem} {c['backend']}"
        if c.get("engine", {}).get("gemv_mma"):
            label += " gemv_mma"
        n = [r["streams"] for r in rows]
        tp.plot(n, [r["agg_tok_s"] for r in rows], marker="o", label=label)
        line, = lat.plot(n, [r["itl_p50_ms"] for r in rows], marker="o",
                         label=f"{label} ITL p50")
        color = line.get_color()
        lat.plot(n, [r["itl_p99_ms"] for r in rows], marker="^", ls="--", color=color,
                 label=f"{label} ITL p99")
        lat.plot(n, [r["ttft_p50_ms"] for r in rows], marker="s", ls=":", color=color,
                 label=f"{label} TTFT p50")
    levels = sorted({r["streams"] for res in results for r in res["rows"]})
    for ax in (tp, lat):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(n) for n in levels])
        ax.set_xlabel("concurrent streams")
        ax.legend(fontsize=7)
    tp.set_ylim(bottom=0)
    tp.set_ylabel("aggregate tok/s")
    tp.set_title("Throughput through the gRPC server")
    lat.set_yscale("log")
    lat.set_ylabel("ms")
    lat.set_title("Inter-token latency and time to first token")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        print(__doc__.split("\n\n")[1].strip(), file=sys.stderr)
        return 2
    plot([json.loads(Path(p).read_text()) for p in args[:-1]], args[-1])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
