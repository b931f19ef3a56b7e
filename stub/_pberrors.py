"""pb_utils error types: ``TritonError`` (a value in a response) and ``TritonModelException``."""
from __future__ import annotations


class TritonError:
    """An error carried by an InferenceResponse: ``TritonError(message, code=INTERNAL)``."""

    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7

    _NAMES = ("UNKNOWN", "INTERNAL", "NOT_FOUND", "INVALID_ARG", "UNAVAILABLE", "UNSUPPORTED",
              "ALREADY_EXISTS", "CANCELLED")

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        if not isinstance(code, int) or not 0 <= code < len(self._NAMES):
            raise ValueError(f"invalid TritonError code {code!r}")
        self._msg = message
        self._code = code

    def message(self) -> str:
        return self._msg

    def code(self) -> int:
        return self._code

    def __str__(self) -> str:
        return self._msg

    def __repr__(self) -> str:
        return f"TritonError({self._msg!r}, {self._NAMES[self._code]})"

    # wire form: {"code": "INVALID_ARG", "message": ...}
    def _to_wire(self) -> dict[str, str]:
        return {"code": self._NAMES[self._code], "message": self._msg}

    @classmethod
    def _from_wire(cls, body: dict) -> TritonError:
        name = str(body.get("code", "UNKNOWN"))
        code = cls._NAMES.index(name) if name in cls._NAMES else cls.UNKNOWN
        return cls(str(body.get("message", "")), code)


class TritonModelException(Exception):
    """Raised by pb_utils calls that fail (e.g. a BLS call with a bad request)."""

    def __init__(self, msg: str) -> None:
        super().__init__(msg)
        self._msg = msg

    def message(self) -> str:
        return self._msg
