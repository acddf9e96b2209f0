"""The container's health probe, `python -m clients.probe`, run as the container runs it (a
subprocess) against real servers: 0 for SERVING, 1 while loading, for an unknown service and for
a port nobody answers on."""

from __future__ import annotations

import socket
import subprocess
import sys

from tests.support.fake_engine import FakeEngine
from tests.support.grpc_harness import ROOT, serving, specstream_env


def probe(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clients.probe", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env=specstream_env())


def test_serving_server_passes():
    with serving(FakeEngine()) as (srv, _):
        for service in ("", "specstream.v1.GenerationService"):
            r = probe("--target", srv.target, "--service", service)
            assert r.returncode == 0, r.stdout + r.stderr
            assert r.stdout.strip().endswith(": SERVING")


def test_loading_server_and_unknown_service_fail():
    with serving(None) as (srv, _):                      # still loading: NOT_SERVING
        r = probe("--target", srv.target)
        assert r.returncode == 1 and r.stdout.strip().endswith(": NOT_SERVING"), r.stdout
    with serving(FakeEngine()) as (srv, _):
        r = probe("--target", srv.target, "--service", "no.such.Service")
        assert r.returncode == 1 and "NOT_FOUND" in r.stdout, r.stdout


def test_nobody_listening_fails_within_the_timeout():
    with socket.socket() as s:                           # a port that was free a moment ago
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = probe("--target", f"127.0.0.1:{port}", "--timeout", "1")
    assert r.returncode == 1 and ("UNAVAILABLE" in r.stdout or "DEADLINE" in r.stdout), r.stdout


def test_usage_error_exits_2():
    assert probe("--timeout", "soon").returncode == 2
