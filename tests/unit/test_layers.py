"""Imports flow one way, by one table: the layer of every module under service/, clients/ and
bench/, and the layers each layer may import.

    cli -> serve -> server -> engine -> model -> backends -> gguf   (each of them -> leaves)
    cli -> tools -> engine, model, backends, gguf                   (nothing else imports tools)
    server, clients -> protos                                       (clients: nothing else)
    config -> leaves; engine and above -> config
    leaves (errors, formats, chat_templates, credentials, the package itself) -> leaves
    bench -> anything but tests/

Every import statement counts, at module level or inside a function (or under TYPE_CHECKING),
read with `ast` from the source, so no module is imported to check it. GPU libraries (CuPy, the
CUDA bindings) are imported only by the CUDA backend (service/backends/cuda*), the CUDA compile
check and the GPU benchmarks (bench/gpu_*); tests/gpu is not checked here.
"""

from __future__ import annotations

import ast
from fnmatch import fnmatch
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECKED = ("service", "clients", "bench")
GENERATED = ROOT / "service" / "proto"          # protoc's output, gitignored

# layer: (its modules: fnmatch patterns on dotted names, first layer matching wins;
#         the layers its modules may import)
BELOW_ENGINE = {"model", "backends", "gguf", "leaf"}
LAYERS: dict[str, tuple[tuple[str, ...], frozenset[str]]] = {
    "leaf": (("service", "service.errors", "service.formats", "service.chat_templates",
              "service.credentials"), frozenset({"leaf"})),
    "config": (("service.config", "service.config.*"), frozenset({"config", "leaf"})),
    "protos": (("service.proto", "service.proto.*", "service.proto_build"),
               frozenset({"protos"})),
    "gguf": (("service.gguf", "service.gguf.*"), frozenset({"gguf", "leaf"})),
    "backends": (("service.backends", "service.backends.*"),
                 frozenset({"backends", "gguf", "leaf"})),
    "model": (("service.model", "service.model.*"), frozenset(BELOW_ENGINE)),
    "engine": (("service.engine", "service.engine.*"),
               frozenset({"engine", "config", *BELOW_ENGINE})),
    "tools": (("service.tools", "service.tools.*"),
              frozenset({"tools", "engine", "config", *BELOW_ENGINE})),
    "server": (("service.server*", "service.vllm_*", "service.interceptors", "service.metrics",
                "service.logging"),
               frozenset({"server", "protos", "engine", "config", *BELOW_ENGINE})),
    "serve": (("service.serve",),
              frozenset({"serve", "server", "protos", "engine", "config", *BELOW_ENGINE})),
    "cli": (("service.cli",), frozenset({"cli", "serve", "server", "protos", "tools", "engine",
                                         "config", *BELOW_ENGINE})),
    "clients": (("clients", "clients.*"), frozenset({"clients", "protos"})),
    "bench": (("bench", "bench.*"),
              frozenset({"bench", "clients", "cli", "serve", "server", "protos", "tools",
                         "engine", "config", *BELOW_ENGINE})),
}
# third-party packages only some modules may import: top-level name -> module patterns
GPU_ONLY = ("service.backends.cuda*", "bench.gpu_*")
RESTRICTED: dict[str, tuple[str, ...]] = {
    "cupy": GPU_ONLY,
    "cuda": (*GPU_ONLY, "service.tools.cuda_check"),
    "tests": (),                            # test helpers are for tests only
}


def layer_of(module: str) -> str | None:
    return next((layer for layer, (patterns, _) in LAYERS.items()
                 if any(fnmatch(module, p) for p in patterns)), None)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def checked_files() -> dict[str, Path]:
    """Every .py file the table covers, by module name (the generated stubs excepted)."""
    return {module_name(p): p for top in CHECKED for p in sorted((ROOT / top).rglob("*.py"))
            if GENERATED not in p.parents}


def imports(module: str, source: str, known: set[str]) -> list[tuple[int, str]]:
    """(line, imported module) of every import statement of `module`. `from a import b` names
    the module a.b where that is a module, else a; a bench script's bare `import sibling` is
    bench.sibling."""
    package = module if module in known and any(
        k.startswith(module + ".") for k in known) else module.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            out += [(node.lineno, f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
                    for a in node.names]
    if module.startswith("bench."):
        out = [(n, f"bench.{m}" if f"bench.{m.split('.')[0]}" in known else m) for n, m in out]
    return sorted(set(out))


def violations(module: str, source: str, known: set[str]) -> list[str]:
    """What `module` (its source) imports against the table."""
    layer = layer_of(module)
    if layer is None:
        return [f"{module}: in no layer of the table"]
    allowed = LAYERS[layer][1]
    found = []
    for line, target in imports(module, source, known):
        top = target.split(".")[0]
        if top in RESTRICTED:
            if not any(fnmatch(module, p) for p in RESTRICTED[top]):
                found.append(f"{module}:{line} imports {target}, which only "
                             f"{', '.join(RESTRICTED[top]) or 'tests/'} may import")
        elif top in CHECKED and (layer_of(target) or "?") not in allowed:
            found.append(f"{module}:{line} imports {target}: layer {layer} may not import "
                         f"layer {layer_of(target)}")
    return found


def test_every_module_imports_only_what_its_layer_may():
    files = checked_files()
    known = set(files)
    checked = {m for m in files if layer_of(m) is not None}
    assert checked == known, f"modules in no layer of the table: {sorted(known - checked)}"
    found = [v for m, p in files.items() for v in violations(m, p.read_text("utf-8"), known)]
    assert not found, "\n".join(found)
    assert len(files) > 50       # the walk found the tree


@pytest.mark.parametrize("module, source", [
    ("service.gguf.x", "def f():\n    from service.model.spec import ModelSpec\n"),
    ("service.backends.x", "import service.engine.runner\n"),
    ("service.config.x", "def f():\n    from service.model import chat\n"),
    ("service.engine.x", "from service.tools import synth\n"),
    ("service.server", "from service.tools.quantize import requantize\n"),
    ("service.server", "def f():\n    from service.serve import BackgroundServer\n"),
    ("service.server", "from clients import SpecstreamClient\n"),
    ("service.engine.x", "from service.proto import config_pb2\n"),
    ("service.model.x", "import cupy as cp\n"),
    ("service.tools.x", "from cuda.bindings import nvrtc\n"),
    ("clients.x", "from service.config import settings\n"),
    ("bench.x", "from tests.blocks import random_tensor\n"),
    ("service.errors", "from service.formats import KVType\nfrom service.config import x\n"),
    ("service.model.x", "from ..engine import runner\n"),
    ("service.newthing", "import os\n"),
])
def test_a_forbidden_import_is_reported(module, source):
    """Negative control: a synthetic module breaking one rule is reported, once."""
    assert len(violations(module, source, set(checked_files()))) == 1


@pytest.mark.parametrize("module, source", [
    ("service.engine.x", "def f():\n    from service.model.spec import ModelSpec\n"),
    ("service.cli", "from service.tools import synth\n"),
    ("service.backends.cuda_x", "import cupy as cp\n"),
    ("clients.x", "from service.proto_build import stubs\n"),
    ("bench.x", "import gpu_tables as T\nfrom service.tools.synth import random_tensor\n"),
    ("service.model.x", "from . import tokenizer\n"),
])
def test_an_allowed_import_is_not_reported(module, source):
    assert violations(module, source, set(checked_files())) == []
