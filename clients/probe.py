"""A gRPC health probe for containers: `python -m clients.probe [--target HOST:PORT]
[--service NAME] [--timeout S] [--tls-ca FILE [--tls-cert FILE --tls-key FILE]
[--tls-server-name NAME]]` asks grpc.health.v1.Health/Check once and exits 0 when the answer is
SERVING, 1 otherwise (NOT_SERVING, an unknown service, no answer in time, a failed TLS
handshake), 2 for bad usage. `--tls-ca` speaks TLS, checking the server's certificate against
that CA; `--tls-cert` and `--tls-key` add a client certificate (mutual TLS).

It imports only grpcio and its health stubs (not the specstream stubs, which may need generating),
so a container's HEALTHCHECK or an exec probe costs one short Python start.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

DEFAULT_TARGET = "127.0.0.1:50051"


def channel(target: str, tls_ca: str = "", tls_cert: str = "", tls_key: str = "",
            tls_server_name: str = "") -> grpc.Channel:
    """A plaintext channel, or with `tls_ca` a TLS one (with a client certificate when given)."""
    if not tls_ca:
        return grpc.insecure_channel(target)
    creds = grpc.ssl_channel_credentials(
        root_certificates=Path(tls_ca).read_bytes(),
        private_key=Path(tls_key).read_bytes() if tls_key else None,
        certificate_chain=Path(tls_cert).read_bytes() if tls_cert else None)
    options = [("grpc.ssl_target_name_override", tls_server_name)] if tls_server_name else []
    return grpc.secure_channel(target, creds, options=options)


def check(target: str, service: str = "", timeout: float = 3.0, **tls: str) -> tuple[bool, str]:
    """(serving, what was seen) for one Check of `service` on `target` (`tls`: channel()'s
    tls_* arguments)."""
    with channel(target, **tls) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as e:
            return False, f"{e.code().name}: {e.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m clients.probe", description=__doc__.split("\n")[0])
    p.add_argument("--target", default=DEFAULT_TARGET, help="host:port of the gRPC server")
    p.add_argument("--service", default="", help="health service name ('' = the whole server)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    p.add_argument("--tls-ca", default="", help="CA certificate (PEM): speak TLS, verify with it")
    p.add_argument("--tls-cert", default="", help="client certificate (PEM), for mutual TLS")
    p.add_argument("--tls-key", default="", help="client private key (PEM), for mutual TLS")
    p.add_argument("--tls-server-name", default="",
                   help="the name the server certificate must carry (default: the target host)")
    args = p.parse_args(argv)
    if (args.tls_cert or args.tls_key or args.tls_server_name) and not args.tls_ca:
        p.error("--tls-cert, --tls-key and --tls-server-name need --tls-ca")
    if bool(args.tls_cert) != bool(args.tls_key):
        p.error("--tls-cert and --tls-key go together")
    try:
        ok, seen = check(args.target, args.service, args.timeout, tls_ca=args.tls_ca,
                         tls_cert=args.tls_cert, tls_key=args.tls_key,
                         tls_server_name=args.tls_server_name)
    except OSError as e:                 # a certificate file that cannot be read
        p.error(str(e))
    print(f"{args.target} {args.service or '(server)'}: {seen}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
