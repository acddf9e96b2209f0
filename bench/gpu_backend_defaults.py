"""Run a bench script with some of CudaBackend's keyword defaults replaced, so a backend option
that no server setting exposes (a same-bits kernel choice such as `norm_slices`) can be timed
end to end by the benches that build their own engines:

    python3 bench/gpu_backend_defaults.py norm_slices=1[,name=value...] bench/e2e_decode.py ARGS

docs/PERFORMANCE.md section 24 used it (norm_slices 1, 4, 8, 16).
"""

from __future__ import annotations

import inspect
import os
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def replace_defaults(fn, spec: str) -> dict[str, object]:
    """Set the defaults of `fn`'s keyword parameters named in `spec` ("a=1,b=x"), each value
    converted to the type of the default it replaces; returns what was set."""
    params = [p for p in inspect.signature(fn).parameters.values()
              if p.default is not inspect.Parameter.empty]
    names = [p.name for p in params]
    defaults = list(fn.__defaults__)
    offset = len(defaults) - len(params)
    got: dict[str, object] = {}
    for item in filter(None, spec.split(",")):
        name, _, text = item.partition("=")
        if name not in names:
            raise SystemExit(f"{name!r} is not a keyword parameter of {fn.__qualname__}")
        i = offset + names.index(name)
        old = defaults[i]
        value = (text.lower() in ("1", "true", "yes") if isinstance(old, bool)
                 else type(old)(text) if old is not None else int(text))
        defaults[i] = got[name] = value
    fn.__defaults__ = tuple(defaults)
    return got


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    sys.path[:0] = [str(ROOT)]
    from service.backends.cuda.backend import CudaBackend

    got = replace_defaults(CudaBackend.__init__, argv[0])
    print(f"[CudaBackend defaults] {got}", flush=True)
    script = argv[1]
    sys.argv = argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
