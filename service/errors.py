"""Typed exceptions, mapped to gRPC status codes once (service/interceptors.py)."""

from __future__ import annotations


class SpecstreamError(Exception):
    """Base class of every error the service raises on purpose."""


class ModelFormatError(SpecstreamError):
    """A GGUF file cannot be served: bad header, metadata, tensor, or unknown architecture."""


class ConfigError(SpecstreamError):
    """One or more configuration values are invalid. `problems` lists (field, message)."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = list(problems)
        super().__init__("; ".join(f"{f}: {m}" for f, m in self.problems))


class InvalidRequestError(SpecstreamError):
    """A request field is out of range or inconsistent. `field` names it."""

    def __init__(self, field: str, message: str, reason: str = "INVALID_ARGUMENT"):
        self.field = field
        self.reason = reason
        super().__init__(f"{field}: {message}")


class ChatTemplateMissingError(SpecstreamError):
    """Chat input for a model without a chat template while none is configured. `field` names
    the input that needs one."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


class CapacityError(SpecstreamError):
    """The engine cannot take more work now; retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        self.retry_after_s = retry_after_s
        super().__init__(message)


class FetchError(SpecstreamError):
    """A model could not be fetched or verified."""


class UnavailableError(SpecstreamError):
    """The service is loading, draining or its engine has stopped."""


class UnauthenticatedError(SpecstreamError):
    """The call carries no bearer token, or one the server does not know."""


class PermissionDeniedError(SpecstreamError):
    """The call's token is known but not granted the method called."""


class NotServedError(SpecstreamError):
    """The method exists but this server's configuration turned it off."""


class ResponseTooLargeError(SpecstreamError):
    """An answer larger than the server may send (max_send_message_bytes)."""
