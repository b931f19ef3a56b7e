"""The data plane both network frontends share (as MLServer's ``handlers/dataplane.py``).

The HTTP and gRPC frontends only translate their wire formats into the neutral
:class:`InferRequest` below and :class:`InferResult` back; everything in between lives here:
request parameters, tensor decoding (raw bytes, JSON, typed contents, client shared memory),
the call into the in-process :class:`tritonpy.Server` without blocking the event loop,
cancellation when the client goes away, output placement (binary, JSON, shared memory) and the
one mapping of any failure onto a :class:`~tritonpy._errors.TritonpyError`.
"""
from __future__ import annotations

import asyncio
import json
import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncGenerator, Callable, Mapping, Sequence, Union

import numpy as np

from .._errors import (
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    TritonpyError,
    UnavailableError,
    UnsupportedError,
)
from .._trace import Trace
from ..shm.cuda import DeviceRef
from ..shm._errors import ProtocolError, ShmError, ShmExhaustedError, TruncatedElementError
from ..shm.dtypes import (ITEMSIZE, TRITON_TO_NUMPY, ElementCountError, TruncatedPrefixError,
                          deserialize_bytes, serialize_bytes)
from ..validation import request_prefix
from ._log_settings import LogSettings
from .sharedmem import SharedMemoryRegistry

if TYPE_CHECKING:
    from .._request import AsyncResponseStream
    from .._model_handle import Model
    from ..server import Server

ParamValue = Union[bool, int, float, str]
Buffer = Union[bytes, bytearray, memoryview]

#: Triton's default for ``--http-max-input-size`` (and our gRPC receive limit).
DEFAULT_MAX_INPUT_SIZE = 64 * 1024 * 1024
#: Request parameters that start with ``triton_`` and that a client may still send.
RESERVED_PARAMETERS = ("triton_enable_empty_final_response",)
#: Request parameters that :func:`apply_parameters` reads itself, each with its own value rules.
SPECIAL_PARAMETERS = ("sequence_id", "sequence_start", "sequence_end", "priority", "timeout")
#: Triton's words for a client's request that comes while the server drains (see
#: Server.refuse_new_requests).
STOPPING = ("Server is stopping, scheduler for model has stopped accepting new inference "
            "requests")
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
#: BYTES inputs of at least this many wire bytes in one request are decoded in a worker thread:
#: millions of elements take a second, which the event loop must not spend.
BYTES_OFF_LOOP = 1 << 20
SEQUENCE_START = 1
SEQUENCE_END = 2


# ----------------------------------------------------------------------------- wire-neutral types


@dataclass(frozen=True)
class ShmRef:
    """A window of a registered client shared-memory region."""

    region: str
    offset: int
    byte_size: int


class PendingBytes:
    """A BYTES input as it came off the wire, decoded only once the request has been checked
    against the model (as Triton, which checks datatype and shape before the elements).

    It has the ``dtype`` and ``shape`` its decoded array will have, which is all validation
    reads.
    """

    __slots__ = ("name", "shape", "buf", "model", "request_id")
    dtype = np.dtype(object)

    def __init__(self, name: str, shape: tuple[int, ...], buf: Buffer, model: str,
                 request_id: str) -> None:
        self.name, self.shape, self.buf = name, shape, buf
        self.model, self.request_id = model, request_id

    def decode(self) -> np.ndarray:
        return array_from_raw(self.name, "BYTES", self.shape, self.buf, model=self.model,
                              request_id=self.request_id)


@dataclass
class RequestedOutput:
    """One entry of a request's ``outputs``; ``binary`` None means the request's default;
    ``classification`` > 0 asks for that many classes instead of the tensor."""

    name: str
    binary: bool | None = None
    shm: ShmRef | None = None
    classification: int = 0


@dataclass
class InferRequest:
    """An inference request after wire decoding, before it reaches the model."""

    model: str
    version: int = -1
    inputs: dict[str, np.ndarray | PendingBytes] = field(default_factory=dict)
    outputs: list[RequestedOutput] | None = None
    request_id: str = ""
    parameters: dict[str, ParamValue] = field(default_factory=dict)
    correlation_id: int | str = 0
    flags: int = 0
    timeout: int = 0
    priority: int = 0
    binary_output_default: bool = False
    enable_empty_final: bool = False
    # Tracing: the frontend's timestamps so far (name, ns), the caller's W3C traceparent
    # (OpenTelemetry mode), and the trace once sampled.
    received: tuple[tuple[str, int], ...] = ()
    traceparent: str = ""
    trace: Trace | None = None
    # The system shared-memory regions its outputs go to, kept registered while it runs.
    shm_held: Sequence[Any] = ()


#: Decoded request headers kept for the next request of the same header, and encoded response
#: headers kept for the next response of the same shape (a client sends requests of one shape
#: alike, and gets answers alike): at most this many of each, all forgotten at once when full.
HEADER_CACHE_SIZE = 256

#: An input a :class:`RequestPlan` decodes: name, byte size as it came, numpy dtype (None:
#: BYTES, left as :class:`PendingBytes` whatever its size), shape, element count. An input read
#: from a system shared-memory region has the byte size -1 (see :meth:`RequestPlan.shm_spec`).
InputSpec = tuple[str, int, "np.dtype | None", tuple[int, ...], int]
#: How a plan reads an input from shared memory: :meth:`DataPlane.input_from_shm` (the region
#: and window checked each time).
ShmReader = Callable[..., Any]


class RequestPlan:
    """What a request said apart from its tensors' bytes, decoded and checked once: the
    request's settings, its requested outputs, and how to decode each input from its bytes
    (``inputs``, see :data:`InputSpec`). A frontend keeps one per request header it has seen
    (only headers whose inputs all come with the request or from system shared memory, not
    from JSON) and makes the next such request with :meth:`request`; its bytes are checked as a
    full decode checks them, and an input in shared memory is read as a full decode reads it."""

    __slots__ = ("model", "version", "settings", "outputs", "inputs", "shm", "raw_count")

    def __init__(self, req: InferRequest, inputs: list[InputSpec],
                 shm: dict[str, tuple[str, list, ShmRef]] | None = None) -> None:
        self.model, self.version = req.model, req.version
        # Copies: the request goes on, and its parameters may gain forwarded headers.
        self.settings = (req.request_id, dict(req.parameters), req.correlation_id, req.flags,
                         req.timeout, req.priority, req.binary_output_default,
                         req.enable_empty_final)
        self.outputs = None if req.outputs is None else list(req.outputs)
        self.inputs = inputs
        self.shm = shm or {}  # name -> (datatype, shape, region window) of a shm input
        self.raw_count = len(inputs) - len(self.shm)  # the buffers request() takes

    @staticmethod
    def shm_spec(name: str) -> InputSpec:
        """The :data:`InputSpec` of an input read from shared memory (its datatype, shape and
        window go in the plan's ``shm``)."""
        return (name, -1, None, (), 0)

    @staticmethod
    def spec(name: str, value: np.ndarray | PendingBytes, nbytes: int) -> InputSpec:
        """The :data:`InputSpec` of a decoded input that came as ``nbytes`` bytes."""
        dtype = None if isinstance(value, PendingBytes) else value.dtype
        return (name, nbytes, dtype, tuple(value.shape), int(math.prod(value.shape)))

    def request(self, buffers: Sequence[Buffer],
                from_shm: ShmReader | None = None) -> InferRequest | None:
        """A request with this plan's settings and inputs decoded from ``buffers`` (one per
        input that came with the request, in order) and read with ``from_shm`` (the others);
        None when they do not fit (their number or a size): a full decode then gives the
        error."""
        specs = self.inputs
        if len(buffers) != self.raw_count:
            return None
        rid, params, correlation_id, flags, timeout, priority, binary, empty_final = self.settings
        req = InferRequest(self.model, self.version,
                           outputs=None if self.outputs is None else list(self.outputs),
                           request_id=rid, parameters=dict(params), correlation_id=correlation_id,
                           flags=flags, timeout=timeout, priority=priority,
                           binary_output_default=binary, enable_empty_final=empty_final)
        inputs = req.inputs
        if self.shm:
            given = iter(buffers)
            buffers = [b"" if spec[1] < 0 else next(given) for spec in specs]
        for (name, nbytes, dtype, shape, count), buf in zip(specs, buffers):
            if nbytes < 0:
                assert from_shm is not None
                datatype, asked, ref = self.shm[name]
                inputs[name] = from_shm(name, datatype, asked, ref, model=self.model,
                                        request_id=rid)
            elif dtype is None:
                inputs[name] = PendingBytes(name, shape, buf, self.model, rid)
            elif len(buf) != nbytes:
                return None
            else:
                arr = np.frombuffer(buf, dtype, count)
                # (1-D: the shape frombuffer gives, count elements)
                inputs[name] = arr if len(shape) == 1 else arr.reshape(shape)
        return req


def keep(cache: dict, key: Any, value: Any) -> None:
    """``cache[key] = value``, forgetting everything first once it holds
    :data:`HEADER_CACHE_SIZE` entries."""
    if len(cache) >= HEADER_CACHE_SIZE:
        cache.clear()
    cache[key] = value


@dataclass
class OutputTensor:
    """An output ready for the wire: ``array`` for the body, or ``shm`` when already written."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    array: np.ndarray | None
    shm: ShmRef | None = None
    binary: bool = False

    def raw(self) -> Buffer:
        """The tensor's bytes in Triton's layout (length-prefixed elements for BYTES)."""
        assert self.array is not None
        return tensor_bytes(self.array, self.datatype)


@dataclass
class InferResult:
    """One response of a model, wire-neutral; ``final`` marks the last of a stream."""

    model: str
    version: int
    request_id: str
    outputs: list[OutputTensor]
    parameters: dict[str, Any]
    final: bool = True
    error: TritonpyError | None = None
    empty: bool = False  # only the final flag, no response (see InferenceResponse.empty)


# ------------------------------------------------------------------------------ error mapping


def to_error(exc: BaseException) -> TritonpyError:
    """Map any exception raised while serving a request onto a :class:`TritonpyError`."""
    if isinstance(exc, TritonpyError):
        return exc
    if isinstance(exc, ShmExhaustedError):
        return UnavailableError(str(exc))
    if isinstance(exc, (ProtocolError, ValueError, TypeError)):
        return InvalidArgumentError(str(exc))
    if isinstance(exc, ShmError):
        return InternalError(str(exc))
    return InternalError(f"{type(exc).__name__}: {exc}")


# ------------------------------------------------------------------------------ small parsers


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


def is_uint(value: object) -> bool:
    """True for a non-negative int that is not a bool (JSON true is not a number)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


#: Largest element count and byte size of a tensor (Triton's int64 limit).
MAX_TENSOR_SIZE = 2**63 - 1
#: Deepest nesting of a JSON ``data`` list (Triton's limit).
MAX_JSON_DEPTH = 100
JSON_TOO_DEEP = f"JSON nesting depth exceeds maximum allowed limit ({MAX_JSON_DEPTH})"


def _numpy_max_dims() -> int:
    try:
        np.empty((1,) * 64)
    except ValueError:
        return 32  # numpy 1.x
    return 64


#: The most dimensions a numpy array (so a tensor here) can have.
MAX_DIMS = _numpy_max_dims()


def element_count(name: str, shape: Sequence[object]) -> int:
    """Validate a shape from the wire and return its element count."""
    if not isinstance(shape, (list, tuple)) or not all(is_uint(d) for d in shape):
        raise InvalidArgumentError(f"Unable to parse 'shape' of input '{name}'")
    if len(shape) > MAX_DIMS:
        raise InvalidArgumentError(
            f"input '{name}' has {len(shape)} dimensions; tensors have at most {MAX_DIMS} "
            "here (numpy's limit)")
    count = math.prod(shape)  # type: ignore[arg-type]
    if count > MAX_TENSOR_SIZE:
        raise InvalidArgumentError(
            f"shape {list(shape)} of input '{name}' causes total element count to exceed "
            f"maximum size of {MAX_TENSOR_SIZE}")
    return count  # type: ignore[no-any-return]


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
        raise InvalidArgumentError(
            f"failed to parse the request JSON buffer: {json_error_words(exc)}") from None
    if not isinstance(doc, dict):
        raise InvalidArgumentError("failed to parse the request JSON buffer: expected a JSON object")
    return doc


def check_byte_size(name: str, datatype: str, count: int) -> None:
    """Refuse a fixed-size tensor whose byte size does not fit Triton's int64."""
    if count * ITEMSIZE.get(datatype, 1) > MAX_TENSOR_SIZE:
        raise InvalidArgumentError(
            f"byte size overflow for input '{name}': {count} {datatype} elements exceed "
            f"{MAX_TENSOR_SIZE} bytes")


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


# --------------------------------------------------------------------------- tensor decoding


def _numpy_dtype(name: str, datatype: object) -> np.dtype:
    if not isinstance(datatype, str) or datatype not in TRITON_TO_NUMPY:
        if datatype == "BF16":  # only where ml_dtypes cannot be imported
            raise UnsupportedError(f"input '{name}': BF16 tensors need the ml_dtypes package")
        raise InvalidArgumentError(f"invalid datatype '{datatype}' for input '{name}'")
    return np.dtype(TRITON_TO_NUMPY[datatype])


def input_from_raw(name: str, datatype: str, shape: Sequence[int], buf: Buffer, *,
                   model: str, request_id: str = "") -> np.ndarray | PendingBytes:
    """:func:`array_from_raw`, except that a BYTES input is left as :class:`PendingBytes`
    (its shape checked) for :meth:`DataPlane.stream` to decode after validation."""
    if datatype == "BYTES":
        element_count(name, shape)
        return PendingBytes(name, tuple(shape), buf, model, request_id)
    return array_from_raw(name, datatype, shape, buf, model=model, request_id=request_id)


def array_from_raw(name: str, datatype: str, shape: Sequence[int], buf: Buffer, *,
                   model: str, request_id: str = "") -> np.ndarray:
    """A zero-copy array over ``buf``, after checking its size against the shape.

    ``model`` and ``request_id`` are for the messages, in Triton's words.
    """
    dtype = _numpy_dtype(name, datatype)
    count = element_count(name, shape)
    if datatype == "BYTES":
        try:
            arr = deserialize_bytes(buf, count)
        except TruncatedElementError as exc:
            raise InvalidArgumentError(
                f"incomplete string data for inference input '{name}', expecting string of "
                f"length {exc.length} but only {exc.available} bytes available") from None
        except TruncatedPrefixError as exc:
            raise InvalidArgumentError(
                f"{request_prefix(request_id)}incomplete string length indicator for inference "
                f"input '{name}' for model '{model}', expecting 4 bytes but only "
                f"{exc.available} bytes available") from None
        except ElementCountError as exc:
            raise InvalidArgumentError(request_prefix(request_id) + string_count_error(
                name, exc.found, exc.expected, f" for model '{model}'")) from None
        except ProtocolError as exc:
            raise InvalidArgumentError(f"input '{name}': {exc}") from None
        return arr.reshape(tuple(shape))
    check_raw_size(name, datatype, shape, len(buf), model=model, request_id=request_id)
    return np.frombuffer(buf, dtype=dtype, count=count).reshape(tuple(shape))


def string_count_error(name: str, found: int, expected: int, where: str) -> str:
    """The error for a BYTES input of ``found`` elements whose shape says ``expected``, in
    Triton's words; ``where`` (the model, or the shape) goes after the input's name."""
    if found > expected:
        return (f"unexpected number of string elements {found} for inference input "
                f"'{name}'{where}, expecting {expected}")
    return f"expected {expected} string elements for inference input '{name}'{where}, got {found}"


def check_raw_size(name: str, datatype: str, shape: Sequence[int], nbytes: int, *,
                   model: str, request_id: str = "") -> None:
    """Fail unless ``nbytes`` is the size of a (non-BYTES) tensor of this type and shape."""
    _numpy_dtype(name, datatype)
    count = element_count(name, shape)
    check_byte_size(name, datatype, count)
    expected = count * ITEMSIZE[datatype]
    if nbytes != expected:
        raise InvalidArgumentError(
            f"{request_prefix(request_id)}input byte size mismatch for input '{name}' for model "
            f"'{model}'. Expected {expected}, got {nbytes}"
        )


_KINDS = {"b": "b", "i": "iu", "u": "iu", "f": "iuf"}


def array_from_json(name: str, datatype: str, shape: Sequence[int], data: object) -> np.ndarray:
    """An array from a JSON ``data`` list (any nesting; row-major like Triton)."""
    dtype = _numpy_dtype(name, datatype)
    if datatype == "BF16":  # Triton's words: JSON has no bfloat16 form
        raise InvalidArgumentError(
            f"receiving BF16 data via JSON is not supported. Please use the binary data format "
            f"for input {name}")
    count = element_count(name, shape)
    if not isinstance(data, list):
        raise InvalidArgumentError(f"Unable to parse 'data' of input '{name}': expected a list")
    depth = 0
    if datatype != "BYTES":
        check_byte_size(name, datatype, count)
        probe: object = data
        while isinstance(probe, list) and probe:  # rectangular data: its first path is deepest
            depth, probe = depth + 1, probe[0]
        if depth > MAX_JSON_DEPTH:
            raise InvalidArgumentError(f"Unable to parse 'data' of input '{name}': {JSON_TOO_DEEP}")
    if datatype == "BYTES":
        flat: list[object] = []
        _flatten(name, data, flat, 1)
        if not all(isinstance(s, str) for s in flat):
            raise InvalidArgumentError(f"Unable to parse 'data' of input '{name}': BYTES elements must be strings")
        if len(flat) != count:  # the counts, as for binary data (Triton says them for both)
            raise InvalidArgumentError(
                string_count_error(name, len(flat), count, f" (shape {list(shape)})"))
        arr = np.empty(len(flat), dtype=object)
        try:
            arr[:] = [str(s).encode("utf-8") for s in flat]  # all str (checked above)
        except UnicodeEncodeError as exc:  # JSON's "\udcff": no character, hence no UTF-8
            raise InvalidArgumentError(
                f"Unable to parse 'data' of input '{name}': a string holds an unpaired "
                f"surrogate (\\u{ord(exc.object[exc.start]):04x}), which is not text") from None
    else:
        if depth > MAX_DIMS:  # past numpy's dimension limit: flatten in Python first
            flat_values: list[object] = []
            _flatten(name, data, flat_values, 1)
            data = flat_values
        try:
            arr = np.array(data)
        except ValueError:
            # Ragged nesting ([[1, 2], [3]]): as Triton 2.51 (measured), the values are read
            # in order whatever the nesting, and only their count must match the shape.
            flat_values = []
            _flatten(name, data, flat_values, 1)
            data = flat_values
            try:
                arr = np.array(data)
            except ValueError as exc:
                raise InvalidArgumentError(
                    f"Unable to parse 'data' of input '{name}': {exc}") from None
        if dtype.kind in "iu" and arr.dtype.kind in "fO":
            # Integers on both sides of 2**63 have no common numpy integer type: numpy makes
            # floats of them (or objects), losing the low bits. Build from exact Python ints.
            arr = _exact_integers(name, datatype, data)
        if arr.size and arr.dtype.kind not in _KINDS[dtype.kind]:
            raise InvalidArgumentError(
                f"Unable to parse 'data' of input '{name}': expected {datatype} values"
            )
        if dtype.kind in "iu" and arr.size:
            info = np.iinfo(dtype)
            if arr.min() < info.min or arr.max() > info.max:
                raise InvalidArgumentError(f"Unable to parse 'data' of input '{name}': value out of range for {datatype}")
        # As Triton's (measured), a float past its type's range is infinite (1e40 for FP32):
        # no numpy RuntimeWarning on the server's stderr for it.
        with np.errstate(over="ignore"):
            arr = arr.astype(dtype, copy=False).ravel()
    if arr.size != count:
        raise InvalidArgumentError(
            f"Unable to parse 'data' of input '{name}': Shape does not match true shape of 'data' field"
        )
    return arr.reshape(tuple(shape))


def _exact_integers(name: str, datatype: str, data: list[object]) -> np.ndarray:
    """``data`` as an array of ``datatype`` when every element is a JSON integer in range."""
    flat: list[object] = []
    _flatten(name, data, flat, 1)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in flat):
        raise InvalidArgumentError(f"Unable to parse 'data' of input '{name}': expected {datatype} values")
    info = np.iinfo(TRITON_TO_NUMPY[datatype])
    if any(v < info.min or v > info.max for v in flat):  # type: ignore[operator]
        raise InvalidArgumentError(f"Unable to parse 'data' of input '{name}': value out of range for {datatype}")
    return np.array(flat, dtype=TRITON_TO_NUMPY[datatype])


def _flatten(name: str, data: list[object], out: list[object], depth: int) -> None:
    if depth > MAX_JSON_DEPTH:
        raise InvalidArgumentError(f"Unable to parse 'data' of input '{name}': {JSON_TOO_DEEP}")
    for item in data:
        if isinstance(item, list):
            _flatten(name, item, out, depth + 1)
        else:
            out.append(item)


# ------------------------------------------------------------------ classification extension

#: Output datatypes that can be classified, as in Triton (FP16, BOOL and BYTES cannot; Triton
#: 2.51 even drops the connection, and dies, on a BYTES output).
_CLASSIFIABLE = frozenset({"FP32", "FP64", "INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16",
                           "UINT32", "UINT64"})


def class_count(name: str, value: object) -> int:
    """The ``classification`` parameter of requested output ``name``: 0 (absent) or more."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgumentError(
            f"output '{name}': the 'classification' parameter must be a non-negative integer "
            f"(how many classes to return), got {value!r}")
    return value


def classify(name: str, datatype: str, arr: np.ndarray, count: int, batched: bool,
             labels: Sequence[str] | None) -> np.ndarray:
    """Triton's classification extension: the ``count`` highest values of an output as BYTES
    elements ``"<value>:<index>[:<label>]"``, highest first, equal values by index.

    A batching model's output is classified per batch entry (shape ``[batch, count]``), any
    other over all its elements (shape ``[count]``); ``count`` past the number of classes gives
    them all. Floats print with 6 decimals, integers as they are; ``labels[i]`` (the output's
    ``label_filename``, a line per class) names index ``i`` when it has that many lines.
    """
    if datatype not in _CLASSIFIABLE:
        raise InvalidArgumentError(
            f"class result not available for output '{name}' due to unsupported type "
            f"'{datatype}'")
    rows = arr.reshape(arr.shape[0], -1) if batched and arr.ndim else arr.reshape(1, -1)
    n = rows.shape[1]
    k = min(count, n)
    floating = datatype in ("FP32", "FP64")
    out = np.empty((rows.shape[0], k), dtype=object)
    for r, row in enumerate(rows):
        # Descending by value, equal values by ascending index: a stable ascending sort of the
        # reversed row, read backwards (no negation, which unsigned types would wrap).
        order = (n - 1) - np.argsort(row[::-1], kind="stable")[::-1][:k]
        for j, i in enumerate(order.tolist()):
            value = row[i].item()
            text = f"{value:f}:{i}" if floating else f"{value}:{i}"
            if labels is not None and i < len(labels):
                text += f":{labels[i]}"
            out[r, j] = text.encode()
    return out if batched else out[0]


def tensor_bytes(arr: np.ndarray, datatype: str) -> Buffer:
    """The bytes of an output in Triton's layout; a zero-copy view for fixed-size types."""
    if datatype == "BYTES":
        return serialize_bytes(arr)
    if arr.size and arr.flags.c_contiguous:
        try:
            return arr.data.cast("B")  # one call where numpy's view takes three
        except (TypeError, ValueError):  # a type the buffer protocol does not carry (BF16)
            pass
    # A flat uint8 view (memoryview.cast refuses shapes with a zero, e.g. (0, 3)).
    return np.ascontiguousarray(arr).view(np.uint8).reshape(-1).data


def json_data(out: OutputTensor) -> list[Any] | None:
    """The output as a flat JSON list, or None when JSON cannot carry it losslessly (FP16 and
    BF16, bytes that are not UTF-8). NaN and infinities stay floats: the encoder writes them as
    ``NaN``, ``Infinity`` and ``-Infinity``, as Triton's does (Python's json reads them)."""
    assert out.array is not None
    flat = out.array.ravel()
    if out.datatype == "BYTES":
        try:
            return [x.decode("utf-8") if isinstance(x, bytes) else str(x) for x in flat.tolist()]
        except UnicodeDecodeError:
            return None
    if out.datatype in ("FP16", "BF16"):
        return None
    return flat.tolist()  # type: ignore[no-any-return]


# ----------------------------------------------------------------------------------- the plane


def _submit(model: Model, req: InferRequest, names: list[str] | None, trace: Trace | None,
            loop: asyncio.AbstractEventLoop | None = None) -> AsyncResponseStream:
    """``req`` submitted to ``model`` (``loop``: the loop that will read its responses, when
    called from another thread)."""
    return model.async_infer(req.inputs, names, request_id=req.request_id,
                             parameters=req.parameters, correlation_id=req.correlation_id,
                             flags=req.flags, timeout=req.timeout, priority=req.priority,
                             trace=trace, loop=loop)


class DataPlane:
    """Everything the frontends do against the in-process server."""

    def __init__(self, server: Server, shm: SharedMemoryRegistry | None = None,
                 log_settings: LogSettings | None = None) -> None:
        self.server = server
        self.shm = shm if shm is not None else SharedMemoryRegistry()
        self.log_settings = log_settings if log_settings is not None else LogSettings()

    # -- health and metadata (from the event loop; readiness, which may ask a stub, in a thread)

    def live(self) -> bool:
        """Whether the server is live."""
        return bool(self.server.live())

    async def ready(self) -> bool:
        """Whether the server is ready (in a thread: a model's ``is_ready`` asks its stub,
        whose answer is read on the frame loop, maybe this one)."""
        return bool(await asyncio.to_thread(self.server.ready))

    def server_metadata(self) -> dict[str, Any]:
        """KServe server metadata."""
        return self.server.metadata()

    def update_log_settings(self, new: Mapping[str, Any]) -> dict[str, Any]:
        """Apply a logging update from a network client; the settings in effect after it.

        As Triton, a client may not choose the log file: where the server writes is the
        operator's call (``--log-file``), so ``log_file`` is refused and nothing is applied.
        """
        if new.get("log_file") is not None:
            raise UnsupportedError("log file location can not be updated through network protocol")
        return self.log_settings.update(new)

    def trace_settings(self, settings: Mapping[str, Any] | None = None,
                       model: str = "") -> dict[str, Any]:
        """The trace settings in effect (for ``model``: its own over the server's), after
        applying ``settings`` when given."""
        if model:
            # As Triton: a model not loaded is unknown (with --model-namespacing, the
            # settings are a name's, for each model of that name).
            if not any(e.runtimes for e in self.server.repo.named(model)):
                raise InvalidArgumentError(f"Request for unknown model : {model}")
        tracing = self.server.tracing
        return tracing.update(settings, model) if settings is not None else tracing.settings(model)

    def model(self, name: str, version: int = -1) -> Model:
        """The model object; NotFoundError for an unknown model (an empty name too, as in
        Triton)."""
        return self.server.model(name, version)

    async def model_ready(self, name: str, version: int = -1) -> bool:
        """Whether a model version is ready (False for an unknown model, as Triton); in a
        thread, as :meth:`ready`."""
        try:
            model = self.model(name, version)
        except UnavailableError:  # a server whose start failed: Triton's "Server not ready"
            raise
        except TritonpyError:
            return False
        return bool(await asyncio.to_thread(model.ready))

    def model_metadata(self, name: str, version: int = -1) -> dict[str, Any]:
        """KServe model metadata."""
        return self.model(name, version).metadata()

    def model_config(self, name: str, version: int = -1) -> dict[str, Any]:
        """The model configuration in Triton's JSON form."""
        return self.model(name, version).config()

    # -- repository and statistics (may block: run in a worker thread) -----------------------

    async def repository_index(self, ready_only: bool = False) -> list[dict[str, Any]]:
        """The repository index; only READY entries when ``ready_only``."""
        models = await asyncio.to_thread(self.server.models)
        if ready_only:
            models = [m for m in models if m.get("state") == "READY"]
        return models

    async def load(self, name: str, config: str | None, files: Mapping[str, bytes] | None) -> None:
        """Load (or reload) a model in explicit mode."""
        try:
            await asyncio.to_thread(self.server.load, name, config, dict(files) if files else None)
        except NotFoundError:
            # Triton's words and code for a model that is in no repository.
            raise InternalError(f"failed to load '{name}', failed to poll from model repository") from None

    async def unload(self, name: str, unload_dependents: bool = False) -> None:
        """Unload a model in explicit mode; as Triton's, this returns at once while its
        in-flight requests finish (the model shows UNLOADING meanwhile)."""
        await asyncio.to_thread(self.server.unload, name, unload_dependents, False)

    async def statistics(self, name: str = "", version: str = "") -> dict[str, Any]:
        """Triton's ModelStatisticsResponse in JSON form."""
        if version:
            parse_version(version)
        return await asyncio.to_thread(self.server.statistics, name, version)

    # -- inference ---------------------------------------------------------------------------

    def input_from_shm(self, name: str, datatype: str, shape: Sequence[int], ref: ShmRef, *,
                       model: str, request_id: str = "") -> np.ndarray | PendingBytes:
        """An array copied out of a client's shared-memory window (BYTES: decoded later), a
        large one straight into the host's pool (sent to the stub by handle, no further
        copy); for a CUDA region, the stand-in that the model's stub maps.

        A copy, not a view: a client may shrink its shm object at any time, and a view past
        its new end would be a SIGBUS (see :mod:`.sharedmem`)."""
        if self.shm.is_cuda(ref.region):
            return self._input_from_cuda(name, datatype, shape, ref, model, request_id)

        def buffer(n: int) -> np.ndarray:  # called once the window is known to be there
            if datatype != "BYTES":  # the size against the shape before anything is copied
                check_raw_size(name, datatype, shape, n, model=model, request_id=request_id)
            if n > self.server.transport.inline_limit:
                return self.server.pool.new_array(np.uint8, (n,))
            return np.empty(n, np.uint8)

        data = self.shm.read(ref.region, ref.offset, ref.byte_size, buffer)
        return input_from_raw(name, datatype, shape, data.data, model=model, request_id=request_id)

    def _input_from_cuda(self, name: str, datatype: str, shape: Sequence[int], ref: ShmRef,
                         model: str, request_id: str) -> DeviceRef:
        if datatype == "BYTES":
            raise InvalidArgumentError(
                f"input '{name}': BYTES tensors cannot be read from CUDA shared memory")
        dtype = _numpy_dtype(name, datatype)
        count = element_count(name, shape)
        check_byte_size(name, datatype, count)
        expected = count * ITEMSIZE[datatype]
        if ref.byte_size != expected:
            raise InvalidArgumentError(
                f"{request_prefix(request_id)}input byte size mismatch for input '{name}' for "
                f"model '{model}'. Expected {expected}, got {ref.byte_size}")
        return self.shm.cuda_input(ref.region, ref.offset, ref.byte_size, dtype, tuple(shape))

    async def _decode_pending(self, req: InferRequest, model: Model, names: list[str] | None) -> bool:
        """Check the request against the model, then decode its BYTES inputs: in a worker
        thread when they are large (:data:`BYTES_OFF_LOOP`), so other clients are served.
        Returns whether they were large."""
        model.check(req.inputs, names, req.request_id)
        pending = [p for p in req.inputs.values() if isinstance(p, PendingBytes)]
        large = sum(len(p.buf) for p in pending) >= BYTES_OFF_LOOP
        if large:
            arrays = await asyncio.to_thread(lambda: [p.decode() for p in pending])
        else:
            arrays = [p.decode() for p in pending]
        for p, arr in zip(pending, arrays):
            req.inputs[p.name] = arr
        return large

    def check_outputs(self, req: InferRequest) -> None:
        """Fail early (before the model runs) on an output window that does not exist, and
        hold the system shared-memory regions of the others (``req.shm_held``: an unregister
        is refused until :meth:`_release`, as in Triton, so that the output is not lost at
        the request's end). An output asked for twice is asked for once, with its first
        entry's settings (Triton 2.51 does so, measured; later Tritons refuse it)."""
        outputs = req.outputs or ()
        if len(outputs) > 1:
            first: dict[str, RequestedOutput] = {}
            for out in outputs:
                first.setdefault(out.name, out)
            if len(first) < len(outputs):
                req.outputs = outputs = list(first.values())
        windows: list[tuple[str, int, int]] | None = None
        for out in outputs:
            if out.shm is not None:
                if out.classification:  # as Triton: the classes are not written to shm
                    raise InvalidArgumentError(
                        f"output '{out.name}' can't set both 'shared_memory_region' and "
                        "'classification'")
                if self.shm.is_cuda(out.shm.region):
                    self.shm.cuda_check(out.shm.region, out.shm.offset, out.shm.byte_size)
                else:
                    windows = windows or []
                    windows.append((out.shm.region, out.shm.offset, out.shm.byte_size))
        if windows:
            req.shm_held = self.shm.hold(windows)

    def _release(self, req: InferRequest) -> None:
        """The request is over: its output regions may be unregistered again."""
        held, req.shm_held = req.shm_held, ()
        if held:
            self.shm.release(held)

    async def infer(self, req: InferRequest, *, decoupled_error: str) -> InferResult:
        """Run one request on a default-mode model and return its single response.

        Args:
            req: the decoded request.
            decoupled_error: the message for a decoupled model, which this path cannot serve
                (each protocol words it its own way in Triton).

        The trace (``req.trace``) of a request that fails with an error is the caller's to
        finish, once it has sent the error (as Triton, whose trace of a failed request ends
        with the send's timestamps); a cancelled one's is finished here.
        """
        model = self.server.model(req.model, req.version)
        if model.decoupled():
            raise UnsupportedError(decoupled_error)
        # The model's response stream is read here directly, not through ``stream()``: its
        # async generator and the closing of it are a good part of the frontend's work.
        frames = self.server.frames
        counted = frames.request_began()  # with others in flight, the loop does not poll
        try:
            responses = await self._start(req, model, own_trace=False)
            resp = None
            try:
                async for resp in responses:
                    if resp.final:
                        break
            except asyncio.CancelledError:
                if resp is None or not resp.final:
                    responses.cancel()
                raise
            except Exception as exc:
                raise to_error(exc) from None
            if resp is None:
                raise InternalError(f"model '{req.model}' returned no response")
            frames.spin()  # the client's next request will find the loop awake
            result = self._result(req, resp)
            if result.error is not None:
                raise result.error
        except BaseException as exc:
            if req.trace is not None and not isinstance(exc, Exception):
                req.trace.finish()
            raise
        finally:
            if counted:
                frames.request_ended()
            if req.shm_held:
                self._release(req)
        return result

    async def _start(self, req: InferRequest, model: Model, own_trace: bool) -> AsyncResponseStream:
        """Check and submit ``req``; its model's response stream. A sampled request's trace is
        put in ``req.trace`` (finished here if the request fails to start and ``own_trace``).
        The output regions it holds (:meth:`check_outputs`) are released here if it fails to
        start, else by the caller when it ends."""
        if self.server.refusing:
            raise UnavailableError(STOPPING)
        self.check_outputs(req)
        try:
            names = [o.name for o in req.outputs] if req.outputs is not None else None
            large = False
            for value in req.inputs.values():
                if type(value) is PendingBytes:
                    large = await self._decode_pending(req, model, names)
                    break
            tracing = self.server.tracing
            trace = tracing.start(model.name, req.traceparent) if tracing.active else None
            if trace is not None:
                trace.stamps(req.received)
                req.trace = trace
            try:
                # Large BYTES inputs are encoded for the stub as they are sent: off the loop.
                responses = (await asyncio.to_thread(_submit, model, req, names, trace,
                                                     asyncio.get_running_loop())
                             if large else _submit(model, req, names, trace))
            except Exception as exc:  # validation errors raise straight from infer()
                if own_trace and trace is not None:
                    trace.finish()
                raise to_error(exc) from None
            # The request's inputs may be views of the HTTP body or a client's shm window; the
            # server has its own copy by now, so drop ours (lets an unregister unmap at once).
            req.inputs = {}
            return responses
        except BaseException:
            self._release(req)
            raise

    async def stream(self, req: InferRequest, model: Model | None = None,
                     own_trace: bool = True) -> AsyncGenerator[InferResult, None]:
        """Run one request and yield each response as it arrives (decoupled or not).

        A response-level error is yielded as ``InferResult.error``; an error before the model
        runs (validation, unknown model) is raised. If the consumer is cancelled (the client
        went away) the request is cancelled in the server too. A sampled request's trace is in
        ``req.trace``; it is finished here when the stream ends, unless ``own_trace`` is false
        (the caller adds its send timestamps, then finishes it).
        """
        if model is None:
            model = self.model(req.model, req.version)
        responses = await self._start(req, model, own_trace)
        trace = req.trace
        finished = False
        try:
            async for resp in responses:
                finished = bool(resp.final)
                yield self._result(req, resp)
                if finished:
                    break
        except (asyncio.CancelledError, GeneratorExit):
            if not finished:
                responses.cancel()
            raise
        except Exception as exc:
            raise to_error(exc) from None
        finally:
            if req.shm_held:
                self._release(req)
            if own_trace and trace is not None:
                trace.finish()

    def _result(self, req: InferRequest, resp: Any) -> InferResult:
        result = InferResult(
            model=resp.model or req.model, version=int(resp.model_version),
            request_id=resp.request_id if resp.request_id is not None else req.request_id,
            outputs=[], parameters=dict(resp.parameters or {}), final=bool(resp.final),
            empty=resp.empty,
        )
        if resp.error is not None:
            result.error = to_error(resp.error)
            return result
        try:
            result.outputs = self._outputs(req, resp.outputs)
        except Exception as exc:
            result.error = to_error(exc)
            result.outputs = []
        return result

    def _outputs(self, req: InferRequest, tensors: Mapping[str, Any]) -> list[OutputTensor]:
        wanted = {o.name: o for o in req.outputs} if req.outputs is not None else {}
        # As Triton 2.51 (measured): in the order the model made them, whatever the order
        # the request lists them in.
        order = [n for n in tensors if n in wanted] if req.outputs else list(tensors)
        outs = []
        for name in order:
            t = tensors[name]
            arr = t.view()  # only read from here on: serialized, classified or copied to shm
            spec = wanted.get(name)
            if spec is not None and spec.classification:
                model = self.model(req.model, req.version)
                arr = classify(name, t.data_type, arr, spec.classification,
                               model.max_batch_size > 0, model.output_labels(name))
                out = OutputTensor(name, "BYTES", arr.shape, arr)
            else:
                shape = t.shape  # a tensor's: a tuple of ints already
                if type(shape) is not tuple:
                    shape = tuple(int(d) for d in shape)
                out = OutputTensor(name, t.data_type, shape, arr)
            if spec is not None and spec.shm is not None:
                self._write_shm(out, spec.shm)
            else:
                # As Triton 2.51 (measured): binary_data_output is the default of the outputs
                # the request does not list; a listed one is binary only if it says so.
                out.binary = bool(spec.binary) if spec is not None else req.binary_output_default
            outs.append(out)
        return outs

    def _write_shm(self, out: OutputTensor, ref: ShmRef) -> None:
        data = out.raw()
        n = len(data)
        if n > ref.byte_size:
            raise InternalError(
                f"shared memory size specified with the request for output '{out.name}' "
                f"({ref.byte_size} bytes) should be at least {n} bytes to hold the results"
            )
        if n and self.shm.is_cuda(ref.region):
            self.shm.cuda_write(ref.region, ref.offset, data)
        elif n:
            self.shm.write(ref.region, ref.offset, data)
        out.array = None
        out.shm = ShmRef(ref.region, ref.offset, n)
