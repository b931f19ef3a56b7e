"""What a request says apart from its tensors, parsed with Triton's rules and words: the model
version, the request-level parameters, a tensor's shared-memory window and the JSON body itself;
and the settings both frontends share that decide what a request may reach or carry (restricted
APIs, forwarded headers).
"""
from __future__ import annotations

import json
import re
from typing import Any, Mapping, Sequence

from .._errors import InvalidArgumentError
from ._infer_types import InferRequest, ShmRef
from ._tensor_decode import JSON_TOO_DEEP, is_uint

#: Request parameters that start with ``triton_`` and that a client may still send.
RESERVED_PARAMETERS = ("triton_enable_empty_final_response",)
#: Request parameters that :func:`apply_parameters` reads itself, each with its own value rules.
SPECIAL_PARAMETERS = ("sequence_id", "sequence_start", "sequence_end", "priority", "timeout")
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
SEQUENCE_START = 1
SEQUENCE_END = 2


def parse_version(text: str) -> int:
    """A version from a URL or gRPC field: empty means the latest (-1)."""
    if text == "" or text is None:
        return -1
    if text.isdigit():
        return int(text)
    raise InvalidArgumentError(  # Triton 2.51's words, its stol's among them (measured)
        f"failed to get model version from specified version string '{text}' (details: stol), "
        "version should be an integral value > 0"
    )


# Python's json errors -> Triton's JSON parser's words for them (RapidJSON's English texts).
_JSON_WORDS = (
    ("Expecting property name", "Missing a name for object member."),
    ("Expecting ':' delimiter", "Missing a colon after a name of object member."),
    ("Unterminated string", "Missing a closing quotation mark in string."),
    ("Invalid control character", "Invalid escape character in string."),  # (sic, measured)
    ("Invalid \\escape", "Invalid escape character in string."),
    ("Extra data", "The document root must not be followed by other values."),
)


def json_error_words(exc: BaseException) -> str:
    """What Triton 2.51 says of a body its JSON parser refuses, ``<what>. at <offset>``
    (measured: "Invalid value. at 0"; QA L0_http looks for those words), for the error
    Python's parser raised."""
    if isinstance(exc, UnicodeDecodeError):
        return f"Invalid encoding in string. at {exc.start}"
    if not isinstance(exc, json.JSONDecodeError):
        return str(exc)
    msg, pos = exc.msg, exc.pos
    if msg.startswith("Expecting value"):
        if not exc.doc.strip(" \t\r\n"):
            return f"The document is empty. at {len(exc.doc)}"
        return f"Invalid value. at {pos}"
    if msg.startswith("Invalid \\uXXXX escape"):  # at its backslash, one before Python's
        return f"Incorrect hex digit after \\u escape in string. at {pos - 1}"
    if msg.startswith("Unterminated string"):
        return f"Missing a closing quotation mark in string. at {len(exc.doc)}"
    if msg.startswith(("Expecting ',' delimiter", "Illegal trailing comma")):
        inside = _open_bracket(exc.doc, pos)
        what = ("Missing a comma or ']' after an array element." if inside == "[" else
                "Missing a comma or '}' after an object member.")
        return f"{what} at {pos}"
    for start, words in _JSON_WORDS:
        if msg.startswith(start):
            return f"{words} at {pos}"
    return f"{msg} at {pos}"


def _open_bracket(doc: str, pos: int) -> str:
    """The innermost ``{`` or ``[`` still open at ``pos`` of ``doc`` ("" if none)."""
    stack: list[str] = []
    in_string = escaped = False
    for ch in doc[:pos]:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            stack.append(ch)
        elif ch in "}]" and stack:
            stack.pop()
    return stack[-1] if stack else ""


def parse_json_object(raw: bytes | bytearray, **options: Any) -> dict[str, Any]:
    """A request body's JSON object (``options`` go to ``json.loads``), or Triton's error."""
    try:
        doc = json.loads(raw, **options)
    except RecursionError:
        raise InvalidArgumentError(f"failed to parse the request JSON buffer: {JSON_TOO_DEEP}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        doc, words = _followed(raw, options)
        if words is None:
            words = json_error_words(exc)
        if doc is None:
            raise InvalidArgumentError(f"failed to parse the request JSON buffer: {words}") from None
    if not isinstance(doc, dict):
        raise InvalidArgumentError("failed to parse the request JSON buffer: expected a JSON object")
    return doc


def _followed(raw: bytes | bytearray, options: Mapping[str, Any]) -> tuple[Any, str | None]:
    """A body that begins with a whole JSON value followed by more (binary tensors sent
    without Inference-Header-Content-Length, say), read as Triton's parser reads it: the value
    when a NUL byte comes next (a C string's end to it: the input is then found short of its
    bytes), else its error at the byte after the value. (None, None) for any other body."""
    text = bytes(raw).decode("utf-8", "surrogateescape")  # (bytes not UTF-8: lone surrogates)
    start = len(text) - len(text.lstrip(" \t\r\n"))
    try:
        doc, end = json.JSONDecoder(**options).raw_decode(text, start)
    except (ValueError, RecursionError):
        return None, None
    if any("\udc80" <= ch <= "\udcff" for ch in text[start:end]):
        return None, None  # (bytes not UTF-8 inside the value: its own error)
    pos = len(text) - len(text[end:].lstrip(" \t\r\n"))
    if pos < len(text) and text[pos] == "\0":
        return doc, None
    at = len(text[:pos].encode("utf-8", "surrogateescape"))
    return None, f"The document root must not be followed by other values. at {at}"


def apply_parameters(req: InferRequest, params: Mapping[str, object], *, http: bool) -> None:
    """Fill ``req`` from request-level parameters, with Triton's rules for the special keys."""
    for key, value in params.items():
        if key == "sequence_id":
            if is_uint(value) or (isinstance(value, str)):
                req.correlation_id = value  # type: ignore[assignment]
            else:
                raise InvalidArgumentError("Unable to parse 'sequence_id'")
        elif key in ("sequence_start", "sequence_end"):
            if not isinstance(value, bool):
                raise InvalidArgumentError(f"Unable to parse '{key}'")
            if value:
                req.flags |= SEQUENCE_START if key == "sequence_start" else SEQUENCE_END
        elif key in ("priority", "timeout"):
            if not is_uint(value):
                raise InvalidArgumentError(f"Unable to parse '{key}'")
            setattr(req, key, value)
        elif key == "binary_data_output" and http:
            if not isinstance(value, bool):
                raise InvalidArgumentError("Unable to parse 'binary_data_output'")
            req.binary_output_default = value
        elif key.startswith("triton_"):
            if http or key not in RESERVED_PARAMETERS:
                allowed = "" if http else " Only the following keys starting with 'triton_' are allowed: " + " ".join(RESERVED_PARAMETERS)
                raise InvalidArgumentError(
                    "parameter keys starting with 'triton_' are reserved for Triton usage and "
                    "should not be specified." + allowed
                )
            if not isinstance(value, bool):
                raise InvalidArgumentError(
                    f"invalid value type for '{key}' parameter, expected bool_param."
                )
            req.enable_empty_final = value
        elif isinstance(value, (bool, str, float)):
            req.parameters[key] = value
        elif isinstance(value, int):
            # Triton's JSON reader holds an integer past int64 as a double; so does the model.
            req.parameters[key] = value if INT64_MIN <= value <= INT64_MAX else float(value)
        else:
            raise InvalidArgumentError(
                f"parameter '{key}' has invalid type. It should be either 'int', 'bool', or 'string'."
            )


# -- Triton's restricted APIs and forwarded headers (shared by HTTP and gRPC) --------------------

#: The API groups ``--http-restricted-api`` / ``--grpc-restricted-protocol`` can restrict.
RESTRICTED_CATEGORIES = ("health", "metadata", "inference", "shared-memory", "model-config",
                         "model-repository", "statistics", "trace", "logging")


def parse_restrictions(specs: Sequence[str], flag: str) -> dict[str, tuple[str, str]]:
    """Each ``<api>[,<api>...]:<key>=<value>`` of ``specs``, as category -> (key, value).

    Raises:
        InvalidArgumentError: a malformed spec, an unknown API, or one restricted twice.
    """
    out: dict[str, tuple[str, str]] = {}
    for spec in specs:
        apis, sep, setting = spec.partition(":")
        key, eq, value = setting.partition("=")
        if not sep or not eq or not key or not apis:
            raise InvalidArgumentError(
                f"{flag} expects <API>[,<API>...]:<key>=<value>, got '{spec}'")
        # Triton's words (its tests look for them): an "api" of HTTP, a "protocol" of gRPC.
        kind = "protocol" if "grpc" in flag else "api"
        for api in apis.split(","):
            api = api.strip()
            if api not in RESTRICTED_CATEGORIES:
                raise InvalidArgumentError(f"{flag}: unknown restricted {kind} '{api}' (one of "
                                           f"{', '.join(RESTRICTED_CATEGORIES)})")
            if api in out:
                raise InvalidArgumentError(f"{flag}: restricted {kind} '{api}' can not be "
                                           "specified in multiple config groups")
            out[api] = (key.strip(), value)
    return out


def header_pattern(pattern: str | None) -> re.Pattern[str] | None:
    """A header-forwarding pattern as Triton reads it: searched anywhere in a header's name,
    ignoring case unless it starts with ``(?-i)``. None or empty: no forwarding."""
    if not pattern:
        return None
    flags = re.IGNORECASE
    if pattern.startswith("(?-i)"):
        pattern, flags = pattern[len("(?-i)"):], re.RegexFlag(0)
    try:
        return re.compile(pattern, flags)
    except re.error as exc:
        raise InvalidArgumentError(f"invalid header forward pattern '{pattern}': {exc}") from None


def traceparent(headers: Any) -> str:
    """The W3C ``traceparent`` among (name, value) pairs ("" if none)."""
    for name, value in headers:
        if name.lower() == "traceparent":
            return str(value)
    return ""


def forward_headers(req: InferRequest, headers: Any, pattern: re.Pattern[str]) -> None:
    """Add the ``(name, value)`` pairs of ``headers`` whose name matches ``pattern`` to the
    request's parameters, as strings. As Triton 2.51's (measured, HTTP and gRPC), a header
    wins over a parameter of the same name that the request names itself."""
    for name, value in headers:
        if pattern.search(name):
            req.parameters[name] = value


def shm_ref(name: str, params: Mapping[str, object]) -> ShmRef | None:
    """The shared-memory window named by a tensor's parameters, if any."""
    if "shared_memory_region" not in params:
        if "shared_memory_byte_size" in params or "shared_memory_offset" in params:
            raise InvalidArgumentError(
                f"'shared_memory_region' is required for tensor '{name}' when "
                "'shared_memory_byte_size' or 'shared_memory_offset' is given"
            )
        return None
    region = params["shared_memory_region"]
    size = params.get("shared_memory_byte_size")
    offset = params.get("shared_memory_offset", 0)
    if not isinstance(region, str):
        raise _bad_shm_param(name, "shared_memory_region", "a string", region)
    if size is None:
        raise InvalidArgumentError(
            f"'shared_memory_byte_size' must be given with 'shared_memory_region' for tensor '{name}'"
        )
    if not is_uint(size):
        raise _bad_shm_param(name, "shared_memory_byte_size", "a non-negative integer", size)
    if not is_uint(offset):
        raise _bad_shm_param(name, "shared_memory_offset", "a non-negative integer", offset)
    return ShmRef(region, offset, size)  # type: ignore[arg-type]


def _bad_shm_param(tensor: str, param: str, expected: str, value: object) -> InvalidArgumentError:
    shown = repr(value)
    if len(shown) > 40:
        shown = shown[:37] + "..."
    return InvalidArgumentError(f"Unable to parse '{param}' of tensor '{tensor}': expected "
                                f"{expected}, got {shown}")
