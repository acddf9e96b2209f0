"""Seeded synthetic GGUF models for the benchmarks (service.tools.synth), generated once into a
folder and reused: `<preset>-<quant>-seed<seed>.gguf` (bench/gpu_bench.py, bench/speculative.py
and bench/concurrency.py name them alike, so each reuses the others' files)."""

from __future__ import annotations

from pathlib import Path

DEFAULT_DIR = "/tmp/specstream-synth"


def synth_model(folder: str | Path, preset: str, quant: str = "Q4_K_M", seed: int = 0
                ) -> tuple[Path, float | None]:
    """The seeded synthetic model's path, generated unless present; seconds it took (None when
    the file was there)."""
    from service.tools.synth import synthesize

    path = Path(folder) / f"{preset}-{quant}-seed{seed}.gguf"
    if path.is_file():
        return path, None
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_suffix(".part")
    res = synthesize(part, preset, quant, seed=seed)
    part.rename(path)
    print(f"  synthesized {path} ({res.n_bytes / 1e9:.2f} GB in {res.seconds:.1f} s)",
          flush=True)
    return path, res.seconds
