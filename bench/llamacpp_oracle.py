"""What the llama.cpp oracle scripts (bench/llamacpp_*_oracle.py) share besides llama.cpp's own
bindings (bench/llamacpp_ext.py): running a script's probe under the interpreter that has
`llama_cpp`, and packing float32 arrays into a fixture. The standard library and numpy only, so
either interpreter imports it (the scripts' folder is the first on sys.path)."""

from __future__ import annotations

import base64
import json
import subprocess
import sys

import numpy as np


def pack(a: np.ndarray) -> dict:
    """a as float32 in a fixture: its shape and its bytes in base64."""
    a = np.ascontiguousarray(a, np.float32)
    return {"shape": list(a.shape), "f32": base64.b64encode(a.tobytes()).decode()}


def run_probe(llama_python: str, script: str, *args: str, tail: int = 3000) -> dict:
    """`script --probe args` run by llama_python: the JSON its last line of output prints. A
    probe that fails has the last `tail` characters of its stderr printed and ends this
    process with status 1."""
    p = subprocess.run([llama_python, script, "--probe", *args], capture_output=True, text=True)
    if p.returncode:
        print(p.stderr[-tail:], file=sys.stderr)
        raise SystemExit(1)
    return json.loads(p.stdout.strip().splitlines()[-1])
