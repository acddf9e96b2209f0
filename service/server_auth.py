"""Bearer-token authentication of every RPC but health.

A call presents `authorization: Bearer TOKEN` metadata. No token, a malformed header or a token
the file does not hold is UNAUTHENTICATED; a known token without a grant for the method called
is PERMISSION_DENIED. Tokens are compared by their SHA-256 digests with `hmac.compare_digest`,
against every token of the file whatever matched before, so the time a check takes says nothing
about how much of a guess was right. Health stays open: load balancers and Kubernetes probes
carry no tokens.

    TokenAuthenticator(path)   the token file, read and checked (ConfigError)
        .check(method, metadata)  raises UnauthenticatedError / PermissionDeniedError
        .reload()                 read the file again (SIGHUP); on a problem keep the old tokens
    AuthInterceptor(authenticator)  refuses a call before its handler runs
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Iterable

import grpc
from grpc_status import rpc_status

from service.credentials import TokenGrant, read_token_file, token_digest
from service.errors import PermissionDeniedError, UnauthenticatedError

OPEN_PREFIXES = ("/grpc.health.v1.Health/",)   # answered without a token
AUTHORIZATION = "authorization"
SCHEME = "bearer"


class TokenAuthenticator:
    """The tokens of one token file, and the check every call goes through."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._tokens: tuple[TokenGrant, ...] = read_token_file(path)

    @property
    def count(self) -> int:
        return len(self._tokens)

    def reload(self) -> None:
        """Reads the file again; ConfigError (the old tokens stay) when it has a problem."""
        self._tokens = read_token_file(self.path)    # one assignment: checks see old or new

    def check(self, method: str, metadata: Iterable[tuple[str, str | bytes]] | None) -> None:
        if method.startswith(OPEN_PREFIXES):
            return
        presented = _bearer(metadata)
        if presented is None:
            raise UnauthenticatedError("this server needs a bearer token: send the metadata "
                                       "'authorization: Bearer TOKEN'")
        digest = token_digest(presented)
        found: TokenGrant | None = None
        for grant in self._tokens:                   # every token, whatever matched
            if hmac.compare_digest(digest, grant.digest):
                found = grant
        if found is None:
            raise UnauthenticatedError("the bearer token is not valid for this server")
        if not found.allows(method):
            raise PermissionDeniedError(f"this token may not call {method.lstrip('/')}")


def _bearer(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The token of the first authorization header, if it uses the Bearer scheme."""
    for key, value in metadata or ():
        if key.lower() != AUTHORIZATION:
            continue
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        scheme, _, token = value.strip().partition(" ")
        if scheme.lower() != SCHEME:
            return None
        return token.strip() or None
    return None


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Runs the authenticator before any handler: a refused call gets a handler that answers
    its status (through service.interceptors.status_for, so the access log and the metrics of
    the outer ServiceInterceptor record it like any other failure)."""

    def __init__(self, authenticator: TokenAuthenticator,
                 status_for: Callable[[BaseException], object]) -> None:
        self._auth = authenticator
        self._status_for = status_for

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return None                              # unknown method: UNIMPLEMENTED
        try:
            self._auth.check(details.method, details.invocation_metadata)
        except (UnauthenticatedError, PermissionDeniedError) as exc:
            return self._refusal(handler, exc)
        return handler

    def _refusal(self, handler: grpc.RpcMethodHandler, exc: BaseException
                 ) -> grpc.RpcMethodHandler:
        status = rpc_status.to_status(self._status_for(exc))

        async def refuse(request, context):
            await context.abort_with_status(status)

        kinds = {(False, False): grpc.unary_unary_rpc_method_handler,
                 (False, True): grpc.unary_stream_rpc_method_handler,
                 (True, False): grpc.stream_unary_rpc_method_handler,
                 (True, True): grpc.stream_stream_rpc_method_handler}
        make = kinds[(handler.request_streaming, handler.response_streaming)]
        return make(refuse, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)
