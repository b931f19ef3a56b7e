"""The host's exception hierarchy and its one mapping onto Triton codes, HTTP and gRPC statuses.

Every error a user can see is a :class:`TritonpyError` carrying a Triton error code. The code
is what crosses the stub channel (``{"code": "INVALID_ARG", "message": ...}``), what
``pb_utils.TritonError.code()`` reports, and what picks the HTTP status and gRPC code.
"""
from __future__ import annotations

import enum
import errno
from typing import Any, TypeVar

_C = TypeVar("_C", bound=type)


def public(cls: _C) -> _C:
    """Name the package, not its private module, as the class's home: ``tritonpy.NotFoundError``
    in a traceback, a ``repr`` or a pickle (the package exports every class marked so)."""
    cls.__module__ = "tritonpy"
    return cls


@public
class ErrorCode(str, enum.Enum):
    """Triton's error codes (TRITONSERVER_Error_Code), by their short names."""

    UNKNOWN = "UNKNOWN"
    INTERNAL = "INTERNAL"
    NOT_FOUND = "NOT_FOUND"
    INVALID_ARG = "INVALID_ARG"
    UNAVAILABLE = "UNAVAILABLE"
    UNSUPPORTED = "UNSUPPORTED"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    CANCELLED = "CANCELLED"


# HTTP statuses as Triton's HTTP frontend returns them (checked against Triton 2.51: every
# code it does not single out is 400 Bad Request).
_HTTP = {
    ErrorCode.UNKNOWN: 400,
    ErrorCode.INTERNAL: 500,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.INVALID_ARG: 400,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.UNSUPPORTED: 501,
    ErrorCode.ALREADY_EXISTS: 400,
    ErrorCode.CANCELLED: 400,
}
# grpc.StatusCode names, resolved lazily so this module does not import grpc.
_GRPC = {
    ErrorCode.UNKNOWN: "UNKNOWN",
    ErrorCode.INTERNAL: "INTERNAL",
    ErrorCode.NOT_FOUND: "NOT_FOUND",
    ErrorCode.INVALID_ARG: "INVALID_ARGUMENT",
    ErrorCode.UNAVAILABLE: "UNAVAILABLE",
    ErrorCode.UNSUPPORTED: "UNIMPLEMENTED",
    ErrorCode.ALREADY_EXISTS: "ALREADY_EXISTS",
    ErrorCode.CANCELLED: "CANCELLED",
}


@public
class TritonpyError(Exception):
    """Base of every tritonpy error; ``code`` is the Triton error code."""

    code: ErrorCode = ErrorCode.UNKNOWN

    def __init__(self, message: str, code: ErrorCode | str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = ErrorCode(code) if not isinstance(code, ErrorCode) else code

    @property
    def http_status(self) -> int:
        return _HTTP[self.code]

    @property
    def grpc_code(self) -> str:
        """The name of the ``grpc.StatusCode`` member for this error."""
        return _GRPC[self.code]

    def to_wire(self) -> dict[str, str]:
        return {"code": self.code.value, "message": self.message}

    def __reduce__(self) -> Any:
        return (type(self), (self.message, self.code))


@public
class UnknownError(TritonpyError):
    code = ErrorCode.UNKNOWN


@public
class InternalError(TritonpyError):
    code = ErrorCode.INTERNAL


@public
class NotFoundError(TritonpyError, LookupError):
    code = ErrorCode.NOT_FOUND


@public
class InvalidArgumentError(TritonpyError, ValueError):
    code = ErrorCode.INVALID_ARG


@public
class UnavailableError(TritonpyError):
    code = ErrorCode.UNAVAILABLE


@public
class UnsupportedError(TritonpyError):
    code = ErrorCode.UNSUPPORTED


def listen_error(service: str, address: str, exc: OSError) -> UnavailableError:
    """The ``service`` (HTTP, GRPC, Metrics) cannot listen on ``address`` (``host:port``):
    Triton's words when the port is taken, else what the system said (an address of no
    interface, a port below 1024 without the right, ...)."""
    if exc.errno == errno.EADDRINUSE:
        return UnavailableError(f"failed to start {service} service: Unavailable - Socket "
                                f"'{address}' already in use")
    return UnavailableError(f"failed to start {service} service: cannot listen on "
                            f"'{address}': {exc.strerror or exc}")


@public
class AlreadyExistsError(TritonpyError):
    code = ErrorCode.ALREADY_EXISTS


@public
class CancelledError(TritonpyError):
    """The request was cancelled (by the client, a disconnect, or a BLS iterator's cancel())."""

    code = ErrorCode.CANCELLED


@public
class ConfigError(InvalidArgumentError):
    """A model configuration is invalid; the message names the file, line and field."""


_BY_CODE: dict[ErrorCode, type[TritonpyError]] = {
    ErrorCode.UNKNOWN: UnknownError,
    ErrorCode.INTERNAL: InternalError,
    ErrorCode.NOT_FOUND: NotFoundError,
    ErrorCode.INVALID_ARG: InvalidArgumentError,
    ErrorCode.UNAVAILABLE: UnavailableError,
    ErrorCode.UNSUPPORTED: UnsupportedError,
    ErrorCode.ALREADY_EXISTS: AlreadyExistsError,
    ErrorCode.CANCELLED: CancelledError,
}


def error_from_code(code: str | ErrorCode, message: str) -> TritonpyError:
    """The exception class for a Triton code name (unknown names become UNKNOWN)."""
    try:
        c = ErrorCode(code)
    except ValueError:
        c = ErrorCode.UNKNOWN
    return _BY_CODE[c](message)


def error_from_wire(body: Any) -> TritonpyError:
    """An exception from a channel ErrorBody ``{"code", "message"}``."""
    if isinstance(body, dict):
        return error_from_code(str(body.get("code", "UNKNOWN")), str(body.get("message", "")))
    return UnknownError(str(body))


# Triton's status words (its Status::CodeString), as load failures spell the code out.
_STATUS_WORDS = {
    ErrorCode.UNKNOWN: "Unknown", ErrorCode.INTERNAL: "Internal", ErrorCode.NOT_FOUND: "Not found",
    ErrorCode.INVALID_ARG: "Invalid argument", ErrorCode.UNAVAILABLE: "Unavailable",
    ErrorCode.UNSUPPORTED: "Unsupported", ErrorCode.ALREADY_EXISTS: "Already exists",
    ErrorCode.CANCELLED: "Cancelled",
}


def version_failed(version: int, err: TritonpyError, state: str = "UNAVAILABLE") -> str:
    """Why one version failed to load, as Triton says it (``state``: the version's state
    after it; READY when an update of a version serving on failed)."""
    return f"version {version} is at {state} state: {_STATUS_WORDS[err.code]}: {err.message}"


def input_twice(name: str, prefix: str = "") -> InvalidArgumentError:
    """An input named twice in one request, in Triton's words (every way a request comes).

    ``prefix`` is the ``[request id: ...] `` Triton's core adds to a request from a network
    frontend (see :func:`tritonpy.validation.request_prefix`).
    """
    return InvalidArgumentError(f"{prefix}input '{name}' already exists in request")


def load_cancelled() -> UnavailableError:
    """A model's load that a stop of the server cut short (``Server.cancel_loads``)."""
    return UnavailableError("the server is stopping: the model's load was cancelled")
