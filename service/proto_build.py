"""Generates the gRPC stubs of protos/specstream/v1/*.proto into service/proto/ (gitignored).

Stubs are never committed: they are generated with the grpcio-tools installed next to the
grpcio that will load them, so a generated file never asks for a newer runtime than is present.
Nothing happens on import: `stubs()` (called by build_server, the clients and the request
builders on first use) runs `ensure_stubs()`, which regenerates only when the .proto files,
this script or the grpcio-tools version changed (a stamp file records them), then imports them.

Files land flat in service/proto/ (generation_pb2.py, config_pb2_grpc.py, ...) with their
imports rewritten from `specstream.v1` to `service.proto`, so no sys.path tricks are needed.
A descriptor set with source info sits next to them: generated _pb2 modules drop comments, and
reflection serves this set instead so `grpcurl describe` shows every field's documentation.

    python -m service.proto_build [--force]
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
import tempfile
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PROTO_DIR = PROTO_ROOT / "specstream" / "v1"
OUT_DIR = Path(__file__).resolve().parent / "proto"
STAMP = OUT_DIR / ".stamp"
_IMPORT_RE = re.compile(r"^from specstream\.v1 import ", re.MULTILINE)
DESCRIPTOR_SET = "specstream_v1.binpb"  # FileDescriptorSet with source info (comments)


def _proto_files() -> list[Path]:
    return sorted(PROTO_DIR.glob("*.proto"))


def _fingerprint() -> str:
    import grpc

    h = hashlib.sha256()
    h.update(grpc.__version__.encode())  # a new grpcio runtime gets freshly generated stubs
    try:
        from importlib.metadata import version

        h.update(version("grpcio-tools").encode())
    except Exception:  # noqa: BLE001 - metadata may be missing in odd installs; hash the rest
        pass
    h.update(Path(__file__).read_bytes())
    for p in _proto_files():
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def stubs_current() -> bool:
    try:
        return STAMP.read_text().strip() == _fingerprint()
    except OSError:
        return False


def generate() -> None:
    """Runs protoc into a temporary folder, rewrites imports, then moves files into place."""
    from grpc_tools import protoc

    protos = _proto_files()
    if not protos:
        raise RuntimeError(f"no .proto files under {PROTO_DIR}")
    well_known = Path(protoc.__file__).resolve().parent / "_proto"
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=OUT_DIR.parent, prefix=".proto-") as tmp:
        args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{well_known}",
                f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}",
                # The same files with their comments, for reflection (grpcurl describe).
                "--include_source_info", f"--descriptor_set_out={tmp}/{DESCRIPTOR_SET}"]
        rc = protoc.main(args + [str(p.relative_to(PROTO_ROOT)) for p in protos])
        if rc != 0:
            raise RuntimeError(f"protoc failed with status {rc} on {PROTO_DIR}")
        built = Path(tmp) / "specstream" / "v1"
        staged = Path(tmp) / "flat"
        staged.mkdir()
        for src in sorted(built.iterdir()):
            if src.suffix in (".py", ".pyi"):
                text = _IMPORT_RE.sub("from service.proto import ", src.read_text())
                (staged / src.name).write_text(text)
        (staged / "__init__.py").write_text('"""Generated stubs (service/proto_build.py)."""\n')
        os.replace(Path(tmp) / DESCRIPTOR_SET, staged / DESCRIPTOR_SET)
        for f in staged.iterdir():
            os.replace(f, OUT_DIR / f.name)  # atomic per file: concurrent builders write the same
    tmp_stamp = OUT_DIR / f".stamp.{os.getpid()}"
    tmp_stamp.write_text(_fingerprint() + "\n")
    os.replace(tmp_stamp, STAMP)


def documented_files() -> dict[str, bytes]:
    """Serialized FileDescriptorProtos of our .proto files, comments included, by file name."""
    from google.protobuf import descriptor_pb2

    try:
        data = (OUT_DIR / DESCRIPTOR_SET).read_bytes()
    except OSError:
        return {}                # reflection then serves the files without comments
    fds = descriptor_pb2.FileDescriptorSet.FromString(data)
    return {f.name: f.SerializeToString() for f in fds.file}


# ---------------------------------------------------------------- reflection with comments
class _DocumentedFile:
    """A FileDescriptor whose CopyToProto also carries the .proto comments (source info)."""

    def __init__(self, pool: DocumentedPool, descriptor: Any) -> None:
        self._pool, self._d = pool, descriptor
        self.name = descriptor.name

    @property
    def dependencies(self) -> list[_DocumentedFile]:
        return [_DocumentedFile(self._pool, d) for d in self._d.dependencies]

    def CopyToProto(self, proto: Any) -> None:  # noqa: N802 - the descriptor API's name
        documented = self._pool.files.get(self.name)
        if documented is None:
            self._d.CopyToProto(proto)
        else:
            proto.MergeFromString(documented)


class DocumentedPool:
    """The default descriptor pool, answering reflection with our documented files."""

    def __init__(self) -> None:
        from google.protobuf import descriptor_pool

        self._base = descriptor_pool.Default()
        self.files = documented_files()

    def FindFileByName(self, name: str) -> _DocumentedFile:  # noqa: N802
        return _DocumentedFile(self, self._base.FindFileByName(name))

    def FindFileContainingSymbol(self, symbol: str) -> _DocumentedFile:  # noqa: N802
        return _DocumentedFile(self, self._base.FindFileContainingSymbol(symbol))

    def __getattr__(self, name: str) -> Any:     # FindMessageTypeByName, FindAllExtensions...
        return getattr(self._base, name)


def ensure_stubs() -> bool:
    """Generates the stubs if missing or stale. Returns True when it generated them."""
    if stubs_current():
        return False
    if not _proto_files() and (OUT_DIR / "generation_pb2.py").exists():
        return False             # an install that ships stubs but not the .proto sources
    generate()
    return True


class Stubs(NamedTuple):
    config_pb2: ModuleType
    config_pb2_grpc: ModuleType
    generation_pb2: ModuleType
    generation_pb2_grpc: ModuleType


@lru_cache(maxsize=1)
def stubs() -> Stubs:
    """The generated modules, generated first when missing or stale (once per process)."""
    ensure_stubs()
    from service.proto import config_pb2, config_pb2_grpc, generation_pb2, generation_pb2_grpc

    return Stubs(config_pb2, config_pb2_grpc, generation_pb2, generation_pb2_grpc)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--clean" in argv:
        shutil.rmtree(OUT_DIR, ignore_errors=True)
        return 0
    if "--force" in argv:
        generate()
    else:
        ensure_stubs()
    print(f"stubs in {OUT_DIR}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
