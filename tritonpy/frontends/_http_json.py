"""The JSON of the HTTP frontend: its encoder, Triton's JSON answers and error bodies (the
status an error's code maps to), and the reading of a JSON request body."""
from __future__ import annotations

import json
from typing import Any

from .._errors import InvalidArgumentError
from ._http1_messages import Request, Response
from ._request_parsing import parse_json_object
from .dataplane import to_error

# NaN and infinities go as Triton writes them (NaN, Infinity, -Infinity: not strict JSON, but
# what tritonclient and Python's json read back).
_ENCODER = json.JSONEncoder(separators=(",", ":"))


def _dumps(obj: Any) -> bytes:
    return _ENCODER.encode(obj).encode()


def json_response(obj: Any, status: int = 200) -> Response:
    """A JSON response."""
    return Response(status, _dumps(obj), "application/json")


def error_response(err: BaseException) -> Response:
    """Triton's error body, with the status the error code maps to."""
    e = to_error(err)
    return json_response({"error": e.message}, e.http_status)


# Triton's answers for a path it does not serve and a method a path does not take: a JSON
# body, sent as text/plain for the former and the health, model ready and infer paths, as
# application/json for the others (status line "405 Not Allowed", see _http1).
_NOT_FOUND = b'{"error":"Not Found"}'
_NOT_ALLOWED = b'{"error":"Method Not Allowed"}'


def _method_not_allowed(content_type: str = "application/json") -> Response:
    return Response(405, _NOT_ALLOWED, content_type)


def _json_body(request: Request, *, required: bool = False) -> dict[str, Any]:
    raw = request.body
    if not raw:
        if required:
            raise InvalidArgumentError("failed to parse the request JSON buffer: the body is empty")
        return {}
    return parse_json_object(raw)


def _dict(value: object, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidArgumentError(f"Unable to parse '{what}'")
    return value
