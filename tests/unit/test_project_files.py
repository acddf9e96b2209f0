"""What a newcomer runs first: pyproject.toml, the Makefile, and the commands of the README and
the manuals in docs/."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import tomllib
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
README = (ROOT / "README.md").read_text()
DOCS = {p.name: p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))}
VENV_COMMANDS = ("specstream", "specstream-client", "grpcurl", "python", "pytest", "ruff")


# ------------------------------------------------------------------ pyproject.toml
def test_license_is_an_spdx_string_setuptools_reads_without_warnings(monkeypatch):
    pytest.importorskip("setuptools")
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    monkeypatch.chdir(ROOT)                       # readme and package paths are relative
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), ROOT / "pyproject.toml")
    assert [str(w.message) for w in caught if "license" in str(w.message).lower()] == []
    assert dist.metadata.license_expression == "Apache-2.0"


def test_build_requires_a_setuptools_that_reads_spdx_licenses():
    from packaging.requirements import Requirement

    reqs = [Requirement(r) for r in PYPROJECT["build-system"]["requires"]]
    tools = [r for r in reqs if r.name == "setuptools"]
    assert tools, reqs
    for r in tools:                               # SPDX `license = "..."` needs setuptools 77
        assert not r.specifier.contains("76.3.0"), r
        assert r.specifier.contains("77.0.0"), r


# ------------------------------------------------------------------ Makefile
def _dry_run(*args: str) -> str:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    r = subprocess.run(["make", "-n", "-C", str(ROOT), *args], capture_output=True, text=True,
                       check=True)
    return r.stdout.replace("\\\n", " ")


def _serve_flags(*make_args: str) -> dict[str, str]:
    serve = [line for line in _dry_run("serve", *make_args).splitlines() if " serve " in line]
    assert len(serve) == 1, serve
    argv = shlex.split(serve[0])
    assert argv[0].endswith(".venv/bin/specstream")
    return dict(zip(argv[3::2], argv[4::2], strict=False))


def test_make_serve_passes_port_metrics_port_and_host():
    pairs = _serve_flags("PORT=6001", "METRICS_PORT=6002", "METRICS_HOST=0.0.0.0",
                         "HOST=0.0.0.0", "SERVE_ARGS=--plaintext true")
    assert pairs["--port"] == "6001"
    assert pairs["--metrics-port"] == "6002"
    assert pairs["--metrics-host"] == "0.0.0.0"
    assert pairs["--host"] == "0.0.0.0"
    assert pairs["--plaintext"] == "true"


def test_make_serve_binds_this_machine_only_by_default():
    pairs = _serve_flags()
    assert (pairs["--host"], pairs["--metrics-host"]) == ("127.0.0.1", "127.0.0.1")


# ------------------------------------------------------------------ README and docs/
def _shell_commands(text: str) -> list[str]:
    """Every command line of a page's ```sh blocks (comments and continuations dropped)."""
    out = []
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        joined = re.sub(r"\\\n", " ", block)
        for line in joined.splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


def test_documented_commands_run_installed_commands_from_the_venv():
    commands = [c for text in (README, *DOCS.values()) for c in _shell_commands(text)]
    assert len(commands) > 20
    bare = []
    for line in commands:
        words = [w for w in line.split() if not re.fullmatch(r"[A-Z_]+=\S*", w)]  # env prefixes
        if words and words[0] in VENV_COMMANDS:
            bare.append(line)
    assert bare == []
    assert any(c.startswith(".venv/bin/specstream serve") for c in commands)


def test_readme_is_the_front_door():
    """The two commands, a first request, and links into docs/ that resolve; manuals live there."""
    commands = _shell_commands(README)
    assert commands[:2] == ["make serve", "make test"]
    assert any(c.startswith(".venv/bin/grpcurl ") for c in commands)
    assert len(README.splitlines()) <= 200
    links = re.findall(r"\]\(((?:docs/)?[\w.-]+\.md)(?:#[\w-]*)?\)", README)
    assert {"docs/serving.md", "docs/api.md", "docs/BENCHMARKS.md"} <= set(links)
    assert [link for link in links if not (ROOT / link).is_file()] == []


def test_readme_documents_the_make_serve_variables():
    for var in ("PORT=", "METRICS_PORT=", "METRICS_HOST=", "HOST="):
        assert f"make serve {var}" in README or re.search(rf"make serve [^`\n]*{var}", README)


def test_make_serve_logs_in_one_format():
    """Every line `make serve` logs comes from one process configured once: the server
    fetches its model itself (JSON log lines), no separate `models fetch` logging console text
    first."""
    commands = [line for line in _dry_run("serve").splitlines()
                if ".venv/bin/specstream " in line]
    assert len(commands) == 1 and " serve " in commands[0], commands
