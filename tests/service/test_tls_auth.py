"""TLS, mutual TLS and bearer tokens with real certificates made at test time, a real grpcio
client and the real grpcurl binary; SIGHUP renews certificates and tokens without ending a
stream. The engine is the scripted one: what is tested is the transport and the checks."""

from __future__ import annotations

import json
import shutil
import signal
import ssl
import subprocess
import threading
import time
from contextlib import contextmanager

import grpc
import pytest

from clients import SpecstreamClient, error_details
from service.config import ServerConfig, load_config
from service.engine.types import Delta, Started
from service.errors import ConfigError
from service.serve import BackgroundServer
from tests.service.test_grpcurl import grpcurl_path
from tests.support.certs import issue, make_ca, make_pki, serial_of
from tests.support.fake_engine import FakeEngine, finished
from tests.support.grpc_harness import SERVE_FLAGS

TOKEN = "gateway-token-0123456789abcdef"
READER = "reader-token-0123456789abcdef"     # may only call Tokenize and health
GEN = "specstream.v1.GenerationService"


def _answer(request, sink, handle) -> None:
    sink(Started(prompt_tokens=len(request.prompt_ids), seed=3))
    sink(Delta((5,), "five"))
    sink(finished(n=1))


def _slow(request, sink, handle) -> None:
    """A stream that runs until cancelled, one Delta per 20 ms."""
    sink(Started(prompt_tokens=1, seed=1))
    while not handle.cancelled.is_set():
        sink(Delta((1,), "x"))
        time.sleep(0.02)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture()
def tokens(tmp_path):
    path = tmp_path / "tokens"
    path.write_text(f"# the gateway\n{TOKEN}\n{READER}  {GEN}/Tokenize  # read-only\n")
    return path


@contextmanager
def tls_server(script=_answer, **server):
    cfg = ServerConfig(port=0, metrics_port=0, grace_period_s=0.5, **server)
    engine = FakeEngine(script)
    srv = BackgroundServer(engine, cfg, engine_cfg=engine.config).start()
    try:
        yield srv
    finally:
        srv.stop()


def secure_client(srv, ca, client_cert=None, token: str | None = None, timeout=10):
    creds = grpc.ssl_channel_credentials(
        root_certificates=ca.cert_pem,
        private_key=client_cert.key_pem if client_cert else None,
        certificate_chain=client_cert.cert_pem if client_cert else None)
    channel = grpc.secure_channel(srv.target, creds)
    metadata = [("authorization", f"Bearer {token}")] if token else []
    return SpecstreamClient(channel=channel, metadata=metadata, timeout=timeout)


def _code(fn) -> str:
    with pytest.raises(grpc.RpcError) as ei:
        fn()
    return ei.value.code().name


# ------------------------------------------------------------------ TLS and mutual TLS
def test_tls_serves_a_verified_client_and_refuses_plaintext(pki):
    with tls_server(tls_cert_file=str(pki.server.cert), tls_key_file=str(pki.server.key)) as srv:
        with secure_client(srv, pki.ca) as c:
            assert c.complete(tokens=[1, 2]).text == "five"
            assert c.health() == "SERVING"
        with SpecstreamClient(srv.target, timeout=5) as plain:
            assert _code(lambda: plain.complete(tokens=[1])) == "UNAVAILABLE"
        with secure_client(srv, pki.other_ca) as untrusting:   # cannot verify the server
            assert _code(lambda: untrusting.complete(tokens=[1])) == "UNAVAILABLE"


def test_mutual_tls_needs_a_client_certificate_from_the_ca(pki):
    with tls_server(tls_cert_file=str(pki.server.cert), tls_key_file=str(pki.server.key),
                    tls_client_ca_file=str(pki.ca.cert)) as srv:
        with secure_client(srv, pki.ca, pki.client) as c:
            assert c.complete(tokens=[1]).text == "five"
        with secure_client(srv, pki.ca) as anonymous:
            assert _code(lambda: anonymous.complete(tokens=[1])) == "UNAVAILABLE"
        with secure_client(srv, pki.ca, pki.stranger) as stranger:
            assert _code(lambda: stranger.complete(tokens=[1])) == "UNAVAILABLE"


# ------------------------------------------------------------------ tokens
def test_tokens_unauthenticated_permission_denied_and_open_health(pki, tokens):
    with tls_server(tls_cert_file=str(pki.server.cert), tls_key_file=str(pki.server.key),
                    auth_token_file=str(tokens)) as srv:
        with secure_client(srv, pki.ca) as none, \
                secure_client(srv, pki.ca, token=TOKEN[:-1] + "0") as wrong, \
                secure_client(srv, pki.ca, token=READER) as reader, \
                secure_client(srv, pki.ca, token=TOKEN) as ok:
            for c in (none, wrong):
                assert _code(lambda c=c: c.complete(tokens=[1])) == "UNAUTHENTICATED"
                assert _code(lambda c=c: c.model_info()) == "UNAUTHENTICATED"
                assert c.health() == "SERVING"
            e = error_details(pytest.raises(grpc.RpcError, none.complete, tokens=[1]).value)
            assert e.reason == "UNAUTHENTICATED" and "Bearer" in e.message
            assert _code(lambda: reader.complete(tokens=[1])) == "PERMISSION_DENIED"
            assert _code(lambda: reader.detokenize([1])) == "PERMISSION_DENIED"
            assert ok.complete(tokens=[1]).text == "five"
            basic = SpecstreamClient(channel=none.channel, timeout=5,
                                     metadata=[("authorization", f"Basic {TOKEN}")])
            assert _code(lambda: basic.complete(tokens=[1])) == "UNAUTHENTICATED"
    metrics = srv.service.state.metrics.registry       # read once the server has stopped
    count = metrics.get_sample_value("specstream_rpcs_total",
                                     {"method": f"/{GEN}/Generate", "code": "UNAUTHENTICATED"})
    assert count == 4                  # no token twice, a wrong one, the Basic scheme


def test_token_file_problems_stop_startup(tmp_path):
    short, bad_grant, empty = tmp_path / "short", tmp_path / "grant", tmp_path / "empty"
    short.write_text("abc\n")
    bad_grant.write_text(f"{TOKEN} Generate\n")
    empty.write_text("# nothing\n\n")
    for path, words in ((short, "at least 16"), (bad_grant, "'Generate'"),
                        (empty, "no token"), (tmp_path / "missing", "cannot read")):
        with pytest.raises(ConfigError) as ei:
            load_config(["--auth-token-file", str(path)], {})
        assert [f for f, _ in ei.value.problems] == ["auth_token_file"]
        assert words in ei.value.problems[0][1]
        assert "abc" not in ei.value.problems[0][1] and TOKEN not in ei.value.problems[0][1]


def test_tls_settings_are_checked_together(pki):
    def fields(*argv: str) -> set[str]:
        with pytest.raises(ConfigError) as ei:
            load_config(list(argv), {})
        return {f for f, _ in ei.value.problems}

    assert fields("--tls-cert-file", str(pki.server.cert)) == {"tls_key_file"}
    assert fields("--tls-client-ca-file", str(pki.ca.cert)) == {"tls_cert_file"}
    assert fields("--tls-cert-file", str(pki.server.cert),
                  "--tls-key-file", str(pki.client.key)) == {"tls_cert_file,tls_key_file"}
    assert fields("--tls-cert-file", str(pki.server.cert), "--tls-key-file",
                  str(pki.server.key), "--plaintext") == {"plaintext"}
    assert fields("--host", "0.0.0.0") == {"host"}       # reachable, no TLS, not asked for
    assert fields("--host", "[::]", "--metrics-port", "70000") == {"host", "metrics_port"}
    for argv in (["--host", "0.0.0.0", "--plaintext"], ["--host", "::1"],
                 ["--host", "0.0.0.0", "--tls-cert-file", str(pki.server.cert),
                  "--tls-key-file", str(pki.server.key)]):
        load_config(argv, {})


def test_defaults_bind_loopback_only():
    server, _ = load_config([], {})
    assert (server.host, server.metrics_host) == ("127.0.0.1", "127.0.0.1")
    assert not server.tls and not server.plaintext and server.reflection and server.config_rpcs


# ------------------------------------------------------------------ reflection and config RPCs
def test_reflection_and_config_rpcs_can_be_turned_off(pki):
    with tls_server(plaintext=True, reflection=False, config_rpcs=False) as srv:
        with SpecstreamClient(srv.target, timeout=5) as c:
            assert c.complete(tokens=[1]).text == "five"
            for call in (c.get_config, lambda: c.validate_config(verify_width=2)):
                with pytest.raises(grpc.RpcError) as ei:
                    call()
                e = error_details(ei.value)
                assert (e.code, e.reason) == ("UNIMPLEMENTED", "DISABLED")
        out = subprocess.run([grpcurl_path(), "-plaintext", srv.target, "list"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode != 0 and "does not support the reflection API" in out.stderr


# ------------------------------------------------------------------ grpcurl
def _grpcurl(srv, pki, *args: str, token: str | None = None, data: dict | None = None,
             client_cert: bool = True) -> subprocess.CompletedProcess:
    cmd = [grpcurl_path(), "-cacert", str(pki.ca.cert)]
    if client_cert:
        cmd += ["-cert", str(pki.client.cert), "-key", str(pki.client.key)]
    if token:
        cmd += ["-H", f"authorization: Bearer {token}"]
    if data is not None:
        cmd += ["-d", json.dumps(data)]
    return subprocess.run([*cmd, srv.target, *args], capture_output=True, text=True, timeout=60)


def test_grpcurl_over_mutual_tls_with_and_without_a_token(pki, tokens):
    with tls_server(tls_cert_file=str(pki.server.cert), tls_key_file=str(pki.server.key),
                    tls_client_ca_file=str(pki.ca.cert), auth_token_file=str(tokens)) as srv:
        listed = _grpcurl(srv, pki, "list", token=TOKEN)
        assert listed.returncode == 0, listed.stderr
        assert GEN in listed.stdout.split()
        gen = _grpcurl(srv, pki, f"{GEN}/Generate", token=TOKEN,
                       data={"tokens": {"ids": [1, 2]}})
        assert gen.returncode == 0, gen.stderr
        assert '"text": "five"' in gen.stdout
        for args in (["list"], [f"{GEN}/Generate"]):
            refused = _grpcurl(srv, pki, *args, data={"tokens": {"ids": [1]}}
                               if args != ["list"] else None)
            assert refused.returncode != 0 and "Unauthenticated" in refused.stderr
        # health needs no token: the token goes with the reflection calls only
        health = subprocess.run([grpcurl_path(), "-cacert", str(pki.ca.cert), "-cert",
                                 str(pki.client.cert), "-key", str(pki.client.key),
                                 "-reflect-header", f"authorization: Bearer {TOKEN}",
                                 srv.target, "grpc.health.v1.Health/Check"],
                                capture_output=True, text=True, timeout=60)
        assert health.returncode == 0, health.stderr
        assert json.loads(health.stdout) == {"status": "SERVING"}
        no_cert = _grpcurl(srv, pki, "list", token=TOKEN, client_cert=False)
        assert no_cert.returncode != 0


# ------------------------------------------------------------------ reload
def _served_serial(srv) -> int:
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    import socket

    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as sock, \
            ctx.wrap_socket(sock, server_hostname="localhost") as tls:
        return serial_of(ssl.DER_cert_to_PEM_cert(tls.getpeercert(True)).encode())


def test_reload_renews_certificate_and_tokens_without_ending_a_stream(pki, tokens, tmp_path):
    cert, key = tmp_path / "live.crt", tmp_path / "live.key"
    shutil.copy(pki.server.cert, cert)
    shutil.copy(pki.server.key, key)
    with tls_server(_slow, tls_cert_file=str(cert), tls_key_file=str(key),
                    auth_token_file=str(tokens)) as srv:
        assert _served_serial(srv) == serial_of(pki.server.cert_pem)
        received: list[object] = []
        with secure_client(srv, pki.ca, token=TOKEN, timeout=None) as c:
            def read() -> None:
                try:
                    for r in c.generate(tokens=[1]):
                        received.append(r)
                except grpc.RpcError as e:            # the channel closes at the end
                    received.append(e.code())

            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            time.sleep(0.2)
            new_ca = make_ca(tmp_path / "ca2", "rotated CA")
            rotated = issue(new_ca, tmp_path / "ca2", "server", "rotated", server=True)
            shutil.copy(rotated.cert, cert)
            shutil.copy(rotated.key, key)
            new_token = "rotated-token-0123456789abcdef"
            tokens.write_text(new_token + "\n")
            assert srv.service.reload()
            assert _served_serial(srv) == serial_of(rotated.cert_pem)
            with secure_client(srv, new_ca, token=new_token) as fresh:
                assert fresh.health() == "SERVING"
                assert _code(lambda: fresh.complete(tokens=[1], timeout=0.3)) \
                    == "DEADLINE_EXCEEDED"                      # authenticated; _slow runs on
            with secure_client(srv, new_ca, token=TOKEN) as old_token:
                assert _code(lambda: old_token.model_info()) == "UNAUTHENTICATED"
            n = len(received)
            time.sleep(0.3)
            assert reader.is_alive() and len(received) > n     # the old stream goes on
            key.write_text("not a key\n")                       # a bad reload keeps serving
            assert not srv.service.reload()
            assert _served_serial(srv) == serial_of(rotated.cert_pem)
            assert reader.is_alive()
        reader.join(10)
        assert received[-1] == grpc.StatusCode.CANCELLED          # ended by the client only
        assert all(not isinstance(r, grpc.StatusCode) for r in received[:-1])


def test_sighup_reloads_the_running_server(serve_subprocess, model_path, pki, tokens):
    srv = serve_subprocess([str(model_path), *SERVE_FLAGS, "--tls-cert-file",
                            str(pki.server.cert), "--tls-key-file", str(pki.server.key),
                            "--auth-token-file", str(tokens)])
    srv.wait_listening()
    listening = json.loads(srv.lines[-1])
    assert (listening["transport"], listening["tokens"]) == ("tls", 2)
    srv.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = srv.proc.stderr.readline()
        if not line:
            raise AssertionError("the server exited on SIGHUP:\n" + "".join(srv.lines))
        srv.lines.append(line)
        if '"reloaded"' in line:
            assert json.loads(line)["ok"] is True
            break
    else:
        raise AssertionError("no 'reloaded' line:\n" + "".join(srv.lines))
    assert srv.proc.poll() is None                              # SIGHUP did not stop it
    srv.terminate()
    code, _ = srv.wait(60)
    assert code == 0



# ------------------------------------------------------------------ the client and its CLI
def test_client_library_and_cli_speak_mutual_tls_with_a_token(pki, tokens, capsys):
    from clients import tls_credentials
    from clients.cli import main

    with tls_server(tls_cert_file=str(pki.server.cert), tls_key_file=str(pki.server.key),
                    tls_client_ca_file=str(pki.ca.cert), auth_token_file=str(tokens)) as srv:
        creds = tls_credentials(str(pki.ca.cert), str(pki.client.cert), str(pki.client.key))
        with SpecstreamClient(srv.target, credentials=creds, token=TOKEN, timeout=10) as c:
            assert c.complete(tokens=[1]).text == "five"
        tls = ["--target", srv.target, "--ca-cert", str(pki.ca.cert), "--client-cert",
               str(pki.client.cert), "--client-key", str(pki.client.key)]
        assert main([*tls, "--token-file", str(tokens), "generate", "-q", "--tokens",
                     "1,2"]) == 0
        assert capsys.readouterr().out.splitlines()[-1] == "five"
        assert main([*tls, "generate", "-q", "--tokens", "1,2"]) == 1
        assert "UNAUTHENTICATED" in capsys.readouterr().err
