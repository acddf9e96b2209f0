"""Imports flow one way: the backends and the GGUF layer never import service.config."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOWER = ["service.backends", "service.gguf"]


def test_backends_and_gguf_do_not_import_config():
    modules = [f"{pkg}.{p.stem}" for pkg in LOWER
               for p in sorted((ROOT / pkg.replace(".", "/")).glob("*.py"))
               if p.stem != "__init__"]
    code = ("import importlib, sys\n"
            f"for m in {modules!r}:\n"
            "    try:\n"
            "        importlib.import_module(m)\n"
            "    except ModuleNotFoundError as e:\n"   # the CUDA modules without CuPy
            "        assert e.name == 'cupy', e\n"
            "print('service.config' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False", f"service.config imported by one of {modules}"

