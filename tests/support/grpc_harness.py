"""Servers for the service tests: the test engine config, an in-process server with its client
around any engine, `specstream serve` in a subprocess."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from clients import SpecstreamClient
from service.config import EngineConfig
from service.serve import BackgroundServer

ROOT = Path(__file__).resolve().parents[2]
N_CTX = 512
N_SLOTS = 4
TEST_ENGINE = EngineConfig(backend="cpu", n_ctx=N_CTX, n_slots=N_SLOTS, max_queue=64)
ENGINE_FLAGS = ["--backend", "cpu", "--n-ctx", str(N_CTX), "--n-slots", str(N_SLOTS)]
SERVE_FLAGS = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", *ENGINE_FLAGS]


@contextmanager
def serving(engine: Any, timeout: float = 120, **server_options
            ) -> Iterator[tuple[BackgroundServer, SpecstreamClient]]:
    """`engine` (a real or fake engine, or None: a server still loading) served on a localhost
    port in this process (BackgroundServer(engine, **server_options)), and a client of it."""
    with BackgroundServer(engine, **server_options) as srv, \
            SpecstreamClient(srv.target, timeout=timeout) as client:
        yield srv, client


def specstream_bin() -> str:
    exe = Path(sys.executable).parent / "specstream"
    return str(exe) if exe.exists() else shutil.which("specstream") or "specstream"


def specstream_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a `specstream` subprocess: this one, `extra`, and this checkout first
    on PYTHONPATH. The console script imports `service` from wherever the virtualenv's editable
    install points, which is another checkout when several share one virtualenv; the subprocess
    must run (and cache the numba kernels of) the code under test."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, **(extra or {}), "PYTHONPATH": path}


class ServeProcess:
    """`specstream serve` in a subprocess; its JSON log on stderr gives the bound port."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([specstream_bin(), "serve", *args], cwd=ROOT,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=specstream_env(env))
        self.lines: list[str] = []
        self.port = 0

    def wait_listening(self, timeout: float = 60.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                raise AssertionError("server exited early:\n" + "".join(self.lines))
            self.lines.append(line)
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == "listening":
                self.port = int(event["port"])
                return self.port
        raise AssertionError("no 'listening' log line:\n" + "".join(self.lines))

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> tuple[int, str]:
        _, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, "".join(self.lines) + err

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate(timeout=10)


def run_serve(args: list[str], env: dict[str, str] | None = None,
              timeout: float = 60) -> subprocess.CompletedProcess:
    """Runs `specstream serve ARGS` to completion (startup failures)."""
    return subprocess.run([specstream_bin(), "serve", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=specstream_env(env))
