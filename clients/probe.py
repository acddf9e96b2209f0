"""A gRPC health probe for containers: `python -m clients.probe [--target HOST:PORT]
[--service NAME] [--timeout S]` asks grpc.health.v1.Health/Check once and exits 0 when the answer
is SERVING, 1 otherwise (NOT_SERVING, an unknown service, no answer in time), 2 for bad usage.

It imports only grpcio and its health stubs (not the specstream stubs, which may need generating),
so a container's HEALTHCHECK or an exec probe costs one short Python start.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

DEFAULT_TARGET = "127.0.0.1:50051"


def check(target: str, service: str = "", timeout: float = 3.0) -> tuple[bool, str]:
    """(serving, what was seen) for one Check of `service` on `target`."""
    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
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
    args = p.parse_args(argv)
    ok, seen = check(args.target, args.service, args.timeout)
    print(f"{args.target} {args.service or '(server)'}: {seen}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
