"""pb_utils error types: ``TritonError`` (a value in a response) and ``TritonModelException``."""
from __future__ import annotations

import enum
import os
import traceback

import tritonpy.shm as _shm


class _ErrorCode(enum.IntEnum):
    """Triton's error codes: an enum of their own, as in Triton's pb_utils (its pybind11
    ``__ErrorCode``, whose members also compare equal to their numbers)."""

    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7

    # As Triton's (measured): str() and f-strings name the code ("__ErrorCode.NOT_FOUND"),
    # where an IntEnum would print its number; a model that logs a code reads the same here.
    def __str__(self) -> str:
        return f"__ErrorCode.{self.name}"

    def __format__(self, spec: str) -> str:
        return str(self) if not spec else int.__format__(self, spec)


_ErrorCode.__name__ = _ErrorCode.__qualname__ = "__ErrorCode"  # Triton's repr


# Code names by value (not a class attribute: dir(TritonError) lists its codes alone, as
# Triton's).
_CODE_NAMES = tuple(c.name for c in _ErrorCode)


class TritonError:
    """An error carried by an InferenceResponse: ``TritonError(message, code=INTERNAL)``."""

    UNKNOWN = _ErrorCode.UNKNOWN
    INTERNAL = _ErrorCode.INTERNAL
    NOT_FOUND = _ErrorCode.NOT_FOUND
    INVALID_ARG = _ErrorCode.INVALID_ARG
    UNAVAILABLE = _ErrorCode.UNAVAILABLE
    UNSUPPORTED = _ErrorCode.UNSUPPORTED
    ALREADY_EXISTS = _ErrorCode.ALREADY_EXISTS
    CANCELLED = _ErrorCode.CANCELLED

    def __init__(self, message: str, code: _ErrorCode = _ErrorCode.INTERNAL) -> None:
        # As Triton's (pybind11, measured): a str or bytes message and one of the codes
        # above (a plain number is refused there too), anything else a TypeError: a model
        # that passed one here would fail there.
        if isinstance(message, bytes):
            message = message.decode("utf-8", "replace")
        elif not isinstance(message, str):
            raise TypeError(f"TritonError message must be a str, got {type(message).__name__}")
        if not isinstance(code, _ErrorCode):
            raise TypeError(f"invalid TritonError code {code!r}: one of TritonError.UNKNOWN, "
                            "INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, "
                            "ALREADY_EXISTS or CANCELLED")
        self._msg = message
        self._code = code

    def message(self) -> str:
        return self._msg

    def code(self) -> _ErrorCode:
        return self._code

    def __str__(self) -> str:
        return self._msg

    def __repr__(self) -> str:
        return f"TritonError({self._msg!r}, {_CODE_NAMES[self._code]})"

    # wire form: {"code": "INVALID_ARG", "message": ...}
    def _to_wire(self) -> dict[str, str]:
        return {"code": _CODE_NAMES[self._code], "message": self._msg}

    @classmethod
    def _from_wire(cls, body: dict) -> TritonError:
        name = str(body.get("code", "UNKNOWN"))
        code = _ErrorCode[name] if name in _CODE_NAMES else _ErrorCode.UNKNOWN
        return cls(str(body.get("message", "")), code)


class TritonModelException(Exception):
    """Raised by pb_utils calls that fail (e.g. a BLS call with a bad request).

    Takes any arguments, as a plain exception (Triton's does): ``raise
    TritonModelException()`` in a model is that exception, not a TypeError.
    """

    def message(self) -> str:
        """The message (a tritonpy addition; Triton's exception has none of its own)."""
        return str(self)


# -- what a client is told when execute fails (Triton 2.51's texts, measured against it) -------
# tritonpy.stub's and tritonpy.shm's directories: not their common parent, which in a source
# checkout is the checkout itself (it may hold the model repository too).
_OWN_DIRS = tuple(os.path.join(os.path.dirname(os.path.abspath(f)), "")
                  for f in (__file__, _shm.__file__))


def execute_failed(instance: str, message: str) -> str:
    """The error every request of a failed execute gets."""
    return f"Failed to process the request(s) for model '{instance}', message: {message}"


def exception_text(err: BaseException) -> str:
    """``Type: message``, then the model's frames innermost first, as Triton writes an
    exception from execute (tritonpy's own frames left out, as Triton's are C++)."""
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if not f.filename.startswith(_OWN_DIRS)]
    # An exception without a message reads "<EMPTY MESSAGE>", as Triton 2.51 writes it.
    text = f"{type(err).__name__}: {_message(err) or '<EMPTY MESSAGE>'}"
    if frames:
        text += "\n\nAt:\n" + "".join(f"  {f.filename}({f.lineno}): {f.name}\n"
                                      for f in reversed(frames))
    return sendable(text)


def _message(err: BaseException) -> str:
    try:
        return str(err)
    except Exception as exc:  # an exception whose __str__ fails
        return f"<str() of the exception raised {type(exc).__name__}>"


def sendable(text: str) -> str:
    """``text`` with what UTF-8 cannot carry (a lone surrogate) escaped, so it can go."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def unsendable(exc: BaseException, what: str = "response") -> str:
    """Why a response (or a BLS request) could not be sent at all."""
    return sendable(f"the {what} cannot be sent: {type(exc).__name__}: {_message(exc)}")


def not_a_list(result: object) -> str:
    return f"Expected a list in the execute return, found type '{type(result)}'."


def count_mismatch(requests: int, responses: int) -> str:
    return ("Number of InferenceResponse objects do not match the number of InferenceRequest "
            f"objects. InferenceRequest(s) size is:{requests}, and InferenceResponse(s) size "
            f"is:{responses}\n")


def not_a_response(item: object) -> str:
    return ("Expected an 'InferenceResponse' object in the execute function return list, "
            f"found type '{type(item)}'.")


def decoupled_returned(model: str) -> str:
    return (f"Python model '{model}' is using the decoupled mode and the execute function "
            "must return None.")


def _error_body(code: str, message: str) -> dict[str, str]:
    return {"code": code, "message": message}
