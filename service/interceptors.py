"""The one place where exceptions become gRPC status codes, plus the access log and RPC metrics.

Mapping (google.rpc details ride in the `grpc-status-details-bin` trailer via grpcio-status):

    InvalidRequestError   INVALID_ARGUMENT     BadRequest.FieldViolation(field) + ErrorInfo(reason)
                          (FAILED_PRECONDITION when its reason says so)
    ChatTemplateMissingError
                          FAILED_PRECONDITION  BadRequest.FieldViolation(field) +
                                               ErrorInfo(CHAT_TEMPLATE_MISSING)
    CapacityError         RESOURCE_EXHAUSTED   RetryInfo(retry_delay) + ErrorInfo(QUEUE_FULL),
                                               and the delay in the grpc-retry-pushback-ms
                                               trailer too (gRFC A6: a client's retry policy
                                               waits that long)
    UnavailableError      UNAVAILABLE          ErrorInfo(UNAVAILABLE)
    ConfigError           FAILED_PRECONDITION  PreconditionFailure per problem + ErrorInfo
    FetchError            UNAVAILABLE          ErrorInfo(MODEL_UNAVAILABLE)
    ModelFormatError      FAILED_PRECONDITION  ErrorInfo(MODEL_FORMAT)
    UnauthenticatedError  UNAUTHENTICATED      ErrorInfo(UNAUTHENTICATED)
    PermissionDeniedError PERMISSION_DENIED    ErrorInfo(PERMISSION_DENIED)
    NotServedError        UNIMPLEMENTED        ErrorInfo(DISABLED)
    ResponseTooLargeError RESOURCE_EXHAUSTED   ErrorInfo(RESPONSE_TOO_LARGE)
    anything else         INTERNAL             ErrorInfo(INTERNAL); the message names the request
                                               id only, the stack trace goes to the server log

Cancellation and deadlines are produced by gRPC itself and pass through untouched; the access log
and `specstream_rpcs_total` record them as CANCELLED, DEADLINE_EXCEEDED, or UNAVAILABLE for calls
cut off when the shutdown grace period ran out (the code the client sees then).
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import time
import uuid
from collections.abc import Awaitable, Callable

import grpc
import structlog
from google.protobuf import duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from service.errors import (
    CapacityError,
    ChatTemplateMissingError,
    ConfigError,
    FetchError,
    InvalidRequestError,
    ModelFormatError,
    NotServedError,
    PermissionDeniedError,
    ResponseTooLargeError,
    UnauthenticatedError,
    UnavailableError,
)
from service.logging import bind_request_id
from service.metrics import Metrics
from service.server_wire import invalid_utf8_field

log = structlog.get_logger(__name__)

ERROR_DOMAIN = "specstream.v1"
REQUEST_ID_METADATA = "x-request-id"
MAX_REQUEST_ID = 128             # characters; an id is echoed in every response and log line
_QUIET_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")  # probes: debug-level access log


# ------------------------------------------------------------------------- error -> status
def _pack(code: int, message: str, *details) -> status_pb2.Status:
    st = status_pb2.Status(code=code, message=message)
    for d in details:
        st.details.add().Pack(d)
    return st


def _info(reason: str, **metadata: str) -> error_details_pb2.ErrorInfo:
    return error_details_pb2.ErrorInfo(reason=reason, domain=ERROR_DOMAIN, metadata=metadata)


def status_for(exc: BaseException, request_id: str = "") -> status_pb2.Status:
    """The google.rpc.Status a client sees for `exc`."""
    if isinstance(exc, InvalidRequestError):
        violation = error_details_pb2.BadRequest.FieldViolation(
            field=exc.field, description=str(exc).removeprefix(f"{exc.field}: "))
        code = (code_pb2.FAILED_PRECONDITION if exc.reason == "FAILED_PRECONDITION"
                else code_pb2.INVALID_ARGUMENT)  # e.g. text sent to a model without vocabulary
        return _pack(code, str(exc),
                     error_details_pb2.BadRequest(field_violations=[violation]),
                     _info(exc.reason, field=exc.field))
    if isinstance(exc, ChatTemplateMissingError):
        violation = error_details_pb2.BadRequest.FieldViolation(
            field=exc.field, description=str(exc).removeprefix(f"{exc.field}: "))
        return _pack(code_pb2.FAILED_PRECONDITION, str(exc),
                     error_details_pb2.BadRequest(field_violations=[violation]),
                     _info("CHAT_TEMPLATE_MISSING", field=exc.field))
    if isinstance(exc, CapacityError):
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(max(exc.retry_after_s, 0.0) * 1e9))
        return _pack(code_pb2.RESOURCE_EXHAUSTED, str(exc),
                     error_details_pb2.RetryInfo(retry_delay=delay),
                     _info("QUEUE_FULL", retry_after_s=f"{exc.retry_after_s:g}"))
    if isinstance(exc, UnavailableError):
        return _pack(code_pb2.UNAVAILABLE, str(exc), _info("UNAVAILABLE"))
    if isinstance(exc, FetchError):
        return _pack(code_pb2.UNAVAILABLE, str(exc), _info("MODEL_UNAVAILABLE"))
    if isinstance(exc, ConfigError):
        failure = error_details_pb2.PreconditionFailure(violations=[
            error_details_pb2.PreconditionFailure.Violation(
                type="CONFIG", subject=field, description=message)
            for field, message in exc.problems])
        return _pack(code_pb2.FAILED_PRECONDITION, str(exc), failure,
                     _info("SERVER_CONFIG"))
    if isinstance(exc, ModelFormatError):
        return _pack(code_pb2.FAILED_PRECONDITION, str(exc), _info("MODEL_FORMAT"))
    if isinstance(exc, UnauthenticatedError):
        return _pack(code_pb2.UNAUTHENTICATED, str(exc), _info("UNAUTHENTICATED"))
    if isinstance(exc, PermissionDeniedError):
        return _pack(code_pb2.PERMISSION_DENIED, str(exc), _info("PERMISSION_DENIED"))
    if isinstance(exc, NotServedError):
        return _pack(code_pb2.UNIMPLEMENTED, str(exc), _info("DISABLED"))
    if isinstance(exc, ResponseTooLargeError):
        return _pack(code_pb2.RESOURCE_EXHAUSTED, str(exc), _info("RESPONSE_TOO_LARGE"))
    rid = f" (request id {request_id})" if request_id else ""
    return _pack(code_pb2.INTERNAL, f"internal error{rid}", _info("INTERNAL"))


# ------------------------------------------------------------------------- request ids
RETRY_PUSHBACK = "grpc-retry-pushback-ms"    # gRFC A6's server pushback trailer


def trailers_for(exc: BaseException) -> tuple[tuple[str, str], ...]:
    """Plain trailing metadata besides the status details: a CapacityError's retry delay as
    grpc-retry-pushback-ms (whole milliseconds), for clients that read no status details."""
    if isinstance(exc, CapacityError):
        return ((RETRY_PUSHBACK, str(round(max(exc.retry_after_s, 0.0) * 1e3))),)
    return ()


class _Status(collections.namedtuple("_Status", ("code", "details", "trailing_metadata")),
              grpc.Status):
    """A grpc.Status with trailing metadata of our choosing (as grpc_status builds its own)."""


def request_id_of(request: object, context: grpc.aio.ServicerContext) -> str:
    """The request's own id, else the x-request-id metadata value, else a new one.

    A minted id is written back into the request (when it has a request_id field) so the
    servicer, the access log and the responses all carry the same id.
    """
    rid = (getattr(request, "request_id", "") or "")[:MAX_REQUEST_ID]  # longer: refused
    if not rid:
        for key, value in context.invocation_metadata() or ():
            if key == REQUEST_ID_METADATA and isinstance(value, str):
                rid = value[:MAX_REQUEST_ID]
                break
    if not rid:
        rid = uuid.uuid4().hex
    if hasattr(request, "request_id") and not request.request_id:
        request.request_id = rid
    return rid


# ------------------------------------------------------------------------- undecodable bytes
class _Undecodable:
    """Stands in for a request whose bytes do not parse, so the RPC can answer
    INVALID_ARGUMENT instead of gRPC's default UNKNOWN (with a logged traceback), naming the
    field when it is a string that is not UTF-8."""

    def __init__(self, error: str, field: str | None = None) -> None:
        self.error, self.field = error, field


def _tolerant(deserializer: Callable | None) -> Callable | None:
    if deserializer is None:
        return None
    message_class = getattr(deserializer, "__self__", None)     # Message.FromString's class
    descriptor = getattr(message_class, "DESCRIPTOR", None)

    def load(data: bytes) -> object:
        try:
            return deserializer(data)
        except Exception as e:  # noqa: BLE001 - any parse failure is the caller's malformed input
            field = invalid_utf8_field(descriptor, data) if descriptor is not None else None
            return _Undecodable(str(e), field)
    return load


def _check_decoded(request: object) -> None:
    if isinstance(request, _Undecodable):
        if request.field is not None:
            raise InvalidRequestError(request.field, "not valid UTF-8 (string fields must be)",
                                      reason="MALFORMED_REQUEST")
        raise InvalidRequestError("request", f"the request bytes do not parse: {request.error}",
                                  reason="MALFORMED_REQUEST")
    n = len(getattr(request, "request_id", "") or "")
    if n > MAX_REQUEST_ID:       # echoed in every response and logged: refused, never cut
        raise InvalidRequestError("request_id", f"{n} characters; at most {MAX_REQUEST_ID}")


# ------------------------------------------------------------------------- the interceptor
class ServiceInterceptor(grpc.aio.ServerInterceptor):
    """Error mapping, request-id binding, access log and RPC metrics for unary and
    server-streaming methods (the only kinds our services and health use)."""

    def __init__(self, metrics: Metrics | None = None,
                 cut_off: Callable[[], bool] = lambda: False,
                 max_send_bytes: int | None = None) -> None:
        self._metrics = metrics
        self._cut_off = cut_off      # True once the shutdown grace period has run out
        self._max_send = max_send_bytes  # gRPC fails larger answers after the handler returned

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler  # unknown method (UNIMPLEMENTED) or reflection's bidi stream
        method = handler_call_details.method
        if handler.response_streaming:
            behavior = handler.unary_stream
            wrapped = (self._wrap_stream_gen(method, behavior)
                       if inspect.isasyncgenfunction(behavior)
                       else self._wrap_call(method, behavior))
            return grpc.unary_stream_rpc_method_handler(
                wrapped, request_deserializer=_tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(
            self._wrap_call(method, handler.unary_unary),
            request_deserializer=_tolerant(handler.request_deserializer),
            response_serializer=handler.response_serializer)

    def _wrap_call(self, method: str, behavior: Callable) -> Callable:
        async def call(request, context):
            rid, t0 = self._begin(request, context)
            code = "OK"
            try:
                _check_decoded(request)
                response = await behavior(request, context)
                self._check_size(response)
                return response
            except (asyncio.CancelledError, GeneratorExit):
                code = self._cancelled_code(context)
                raise                 # the servicer's finally freed the work
            except BaseException as exc:  # noqa: BLE001 - classified and re-raised or mapped
                code = await self._handle(exc, context, method, rid)
            finally:
                self._end(method, rid, context, t0, code)
        return call

    def _wrap_stream_gen(self, method: str, behavior: Callable) -> Callable:
        async def stream(request, context):
            rid, t0 = self._begin(request, context)
            code = "OK"
            try:
                _check_decoded(request)
                async for response in behavior(request, context):
                    yield response
            except (asyncio.CancelledError, GeneratorExit):
                code = self._cancelled_code(context)
                raise
            except BaseException as exc:  # noqa: BLE001 - classified and re-raised or mapped
                code = await self._handle(exc, context, method, rid)
            finally:
                self._end(method, rid, context, t0, code)
        return stream

    # -- helpers
    def _check_size(self, response: object) -> None:
        """An answer gRPC would refuse to send fails here, as RESOURCE_EXHAUSTED with the
        limit named, so the access log and metrics record what the client gets."""
        size = getattr(response, "ByteSize", None)
        if self._max_send is not None and size is not None and size() > self._max_send:
            raise ResponseTooLargeError(
                f"the answer is {size()} bytes; this server sends at most {self._max_send} "
                "(max_send_message_bytes): ask for less per call")

    def _begin(self, request, context) -> tuple[str, float]:
        rid = request_id_of(request, context)
        bind_request_id(rid)
        return rid, time.perf_counter()

    async def _handle(self, exc: BaseException, context, method: str, rid: str) -> str:
        """Maps exc to a status (raising AbortError), or re-raises gRPC's own outcomes."""
        if isinstance(exc, grpc.aio.AbortError):
            raise exc  # the servicer already chose a status
        if not isinstance(exc, Exception):
            raise exc
        st = status_for(exc, rid)
        if st.code == code_pb2.INTERNAL:
            log.error("rpc_internal_error", method=method, exc_info=exc)
        status = rpc_status.to_status(st)
        extra = trailers_for(exc)
        if extra:
            status = _Status(status.code, status.details, (*status.trailing_metadata, *extra))
        await context.abort_with_status(status)
        return code_pb2.Code.Name(st.code)  # unreachable: abort raises

    def _cancelled_code(self, context) -> str:
        """Why gRPC cancelled the handler, which its context does not tell yet while the
        handler unwinds: our own shutdown, else the deadline when (almost) none of it
        remains, else the client."""
        if self._cut_off():
            return "UNAVAILABLE"
        return "DEADLINE_EXCEEDED" if _expired(context) else "CANCELLED"

    def _end(self, method: str, rid: str, context, t0: float, code: str) -> None:
        seconds = time.perf_counter() - t0
        code = _final_code(context, code)
        if self._metrics is not None:
            self._metrics.observe_rpc(method, code, seconds)
        quiet = method.startswith(_QUIET_PREFIXES) and code == "OK"
        (log.debug if quiet else log.info)(
            "rpc", method=method, code=code, peer=context.peer(),
            duration_ms=round(seconds * 1e3, 3))


def _final_code(context: grpc.aio.ServicerContext, fallback: str) -> str:
    """The status the RPC ends with, as a name (OK, CANCELLED, INVALID_ARGUMENT, ...)."""
    try:
        code = context.code()
    except Exception:  # noqa: BLE001 - older grpcio: no code() on aio contexts
        code = None
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(code, int):
        return code_pb2.Code.Name(code)
    if context.cancelled():
        return "DEADLINE_EXCEEDED" if _expired(context) else "CANCELLED"
    return fallback


# The server's deadline starts when the request arrives, later than the client's by the
# request's transit, so a client whose deadline passes resets the stream while the server
# still sees a few milliseconds left (measured on loopback: 0 to 8 ms). A cancellation
# that close to the deadline is the deadline's.
DEADLINE_SLACK_S = 0.1


def _expired(context: grpc.aio.ServicerContext) -> bool:
    remaining = context.time_remaining()
    return remaining is not None and remaining <= DEADLINE_SLACK_S
