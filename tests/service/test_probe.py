"""The container's health probe, `python -m clients.probe`, run as the container runs it (a
subprocess) against real servers: 0 for SERVING, 1 while loading, for an unknown service and for
a port nobody answers on; over TLS and mutual TLS with certificates made at test time."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

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


# ------------------------------------------------------------------ TLS
def _openssl(*args: str, cwd: Path) -> None:
    exe = shutil.which("openssl")
    assert exe, "openssl makes the test certificates"
    subprocess.run([exe, *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certs(d: Path) -> None:
    """A CA, a server certificate for 127.0.0.1 / localhost and a client certificate, all
    signed by it (made now, valid for a day)."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
             "ca.pem", "-days", "1", "-subj", "/CN=probe-test-ca", cwd=d)
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for who in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{who}.key", "-out",
                 f"{who}.csr", "-subj", f"/CN={who}", cwd=d)
        _openssl("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{who}.pem", "-days", "1", "-extfile", "san.cnf",
                 cwd=d)


@contextmanager
def tls_health_server(d: Path, require_client_cert: bool) -> Iterator[str]:
    """A gRPC server answering health SERVING on a TLS port only."""
    server = grpc.server(ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    creds = grpc.ssl_server_credentials(
        [((d / "server.key").read_bytes(), (d / "server.pem").read_bytes())],
        root_certificates=(d / "ca.pem").read_bytes(),
        require_client_auth=require_client_cert)
    port = server.add_secure_port("127.0.0.1:0", creds)
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(0)


def test_tls_and_mutual_tls(tmp_path):
    make_certs(tmp_path)
    ca, cert, key = (str(tmp_path / n) for n in ("ca.pem", "client.pem", "client.key"))
    with tls_health_server(tmp_path, require_client_cert=False) as target:
        r = probe("--target", target, "--tls-ca", ca)
        assert r.returncode == 0 and r.stdout.strip().endswith(": SERVING"), r.stdout + r.stderr
        r = probe("--target", target, "--timeout", "2")             # plaintext to a TLS port
        assert r.returncode == 1, r.stdout
    with tls_health_server(tmp_path, require_client_cert=True) as target:
        r = probe("--target", target, "--tls-ca", ca, "--tls-cert", cert, "--tls-key", key)
        assert r.returncode == 0, r.stdout + r.stderr
        r = probe("--target", target, "--tls-ca", ca, "--timeout", "2")   # no client cert
        assert r.returncode == 1, r.stdout
        r = probe("--target", target.replace("127.0.0.1", "localhost"), "--tls-ca", ca,
                  "--tls-cert", cert, "--tls-key", key, "--tls-server-name", "localhost")
        assert r.returncode == 0, r.stdout + r.stderr


def test_tls_server_certificate_must_match_the_ca(tmp_path):
    make_certs(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    make_certs(other)                                    # a second, unrelated CA
    with tls_health_server(tmp_path, require_client_cert=False) as target:
        r = probe("--target", target, "--tls-ca", str(other / "ca.pem"), "--timeout", "2")
        assert r.returncode == 1 and "UNAVAILABLE" in r.stdout, r.stdout


def test_tls_usage_errors(tmp_path):
    assert probe("--tls-cert", "x.pem", "--tls-key", "x.key").returncode == 2   # no --tls-ca
    assert probe("--tls-ca", "ca.pem", "--tls-cert", "x.pem").returncode == 2    # no key
    r = probe("--tls-ca", str(tmp_path / "missing.pem"))
    assert r.returncode == 2 and "missing.pem" in r.stderr
