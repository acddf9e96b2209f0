"""Python client of the specstream gRPC API (sync and asyncio) and the `specstream-client` CLI."""

from clients.client import (
    DEFAULT_TARGET,
    AsyncSpecstreamClient,
    Completion,
    ErrorDetails,
    SpecstreamClient,
    build_generate_request,
    default_target,
    error_details,
    tls_credentials,
)

__all__ = [
    "DEFAULT_TARGET",
    "AsyncSpecstreamClient",
    "Completion",
    "ErrorDetails",
    "SpecstreamClient",
    "build_generate_request",
    "default_target",
    "error_details",
    "tls_credentials",
]
