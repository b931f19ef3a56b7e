"""The ``triton_python_backend_utils`` module as a Triton Python model sees it.

Names and behaviour follow Triton's Python backend. Inside a stub process the runtime
(:mod:`tritonpy.stub._runtime`) is attached with :func:`_set_runtime`; in a plain interpreter
(unit tests of a model) the data classes work on their own and anything that needs a server
raises a clear :class:`TritonModelException`.
"""
from __future__ import annotations

import enum
import json
import weakref
from typing import Any, Callable

import numpy as np

from tritonpy.shm.dtypes import deserialize_bytes as _deserialize_bytes
from tritonpy.shm.dtypes import serialize_bytes as _serialize_bytes

from ._pbconfig import ModelConfig
from ._pberrors import TritonError, TritonModelException
from ._pbtensor import (
    TRITON_STRING_TO_NUMPY,
    Tensor,
    numpy_to_triton_type,
    triton_string_to_numpy,
    triton_to_numpy_type,
)
from ._pbtelemetry import Logger, LogLevel, Metric, MetricFamily

TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2


class MemoryType(enum.IntEnum):
    """Where a BLS call's outputs should be placed (``PreferredMemory``): Triton's numbers
    (GPU 0, CPU 1) and names; CPU_PINNED is tritonpy's (taken as CPU here)."""

    TRITONSERVER_MEMORY_GPU = 0
    TRITONSERVER_MEMORY_CPU = 1
    TRITONSERVER_MEMORY_CPU_PINNED = 2

    def __str__(self) -> str:  # as Triton's (pybind11) prints it
        return f"MemoryType.{self.name}"

    def __format__(self, spec: str) -> str:
        return str(self) if not spec else int.__format__(self, spec)


TRITONSERVER_MEMORY_GPU = MemoryType.TRITONSERVER_MEMORY_GPU
TRITONSERVER_MEMORY_CPU = MemoryType.TRITONSERVER_MEMORY_CPU
TRITONSERVER_MEMORY_CPU_PINNED = MemoryType.TRITONSERVER_MEMORY_CPU_PINNED

_runtime: Any = None  # the stub runtime, or None in a plain interpreter


def _set_runtime(rt: Any) -> None:
    global _runtime
    _runtime = rt


def _need_runtime(what: str, runner: bool = True) -> Any:
    """The runtime; ``runner``: whether a ModelRunner can stand in for the server there."""
    if _runtime is None:
        raise TritonModelException(
            f"{what} needs a running tritonpy server; in a plain interpreter use "
            "tritonpy.testing.ModelRunner to stand in for one" if runner else
            f"{what} needs a running tritonpy server (in explicit model-control mode; "
            "tritonpy.testing.ModelRunner does not serve the model loading API)"
        )
    return _runtime


class PreferredMemory:
    """Where BLS outputs should be placed: ``PreferredMemory(TRITONSERVER_MEMORY_GPU, 0)``."""

    def __init__(self, preferred_memory_type: MemoryType, preferred_device_id: int = 0) -> None:
        # As Triton's (pybind11): the type required, and a MemoryType, not a number (0 or 1
        # there is a TypeError); the device id an int, a bool being one there (True: 1).
        if not isinstance(preferred_memory_type, MemoryType):
            raise TypeError("PreferredMemory: preferred_memory_type must be "
                            "pb_utils.TRITONSERVER_MEMORY_GPU or TRITONSERVER_MEMORY_CPU (a "
                            f"MemoryType, not a number), got {preferred_memory_type!r}")
        if not isinstance(preferred_device_id, (bool, np.bool_)):
            _expect(preferred_device_id, int, "PreferredMemory: preferred_device_id")
        device = int(preferred_device_id)
        if not -(1 << 63) <= device < (1 << 63):  # Triton's is an int64 (pybind11 refuses)
            raise TypeError(f"PreferredMemory: preferred_device_id must be an int64, got "
                            f"{device}")
        self.preferred_memory_type = preferred_memory_type
        self.preferred_device_id = device


class Trace:
    """Trace context of a request: ``request.trace()`` of a traced request names its trace,
    and a BLS ``InferenceRequest(..., trace=request.trace())`` is traced under it, as Triton."""

    def __init__(self, triton_trace: int = 0, trace_context: str | None = None) -> None:
        self.triton_trace = triton_trace
        self.trace_context = trace_context

    def get_context(self, mode: str = "opentelemetry") -> str | None:
        """In OpenTelemetry trace mode, the request's model span as W3C context in JSON
        (``{"traceparent": "00-<trace id>-<span id>-01"}``), for the model to pass on to the
        services it calls; None otherwise (as Triton 2.51, which takes no argument here)."""
        return self.trace_context


_UNSET: Any = object()  # an argument left out (None given explicitly is a TypeError, as Triton)
_NO_TRACE = Trace()


def _check_parameters(parameters: Any) -> dict[str, Any]:
    if parameters is None:
        return {}
    if isinstance(parameters, str):
        try:
            parameters = json.loads(parameters)
        except ValueError as exc:
            raise TritonModelException(f"parameters is not valid JSON: {exc}") from None
    elif isinstance(parameters, dict):
        # A copy, checked: as Triton's (which turns them into JSON here), a change the model
        # makes to its dict afterwards changes nothing, and cannot get past the checks.
        parameters = dict(parameters)
    # The messages are Triton's (its tests and users match on them), plus the key at fault.
    if not isinstance(parameters, dict):
        raise TritonModelException(
            f"Expect parameters to be a dict or a JSON object string, got {type(parameters)}")
    for k, v in parameters.items():
        if not isinstance(k, str):
            raise TritonModelException(
                f"Expect parameters keys to have type str, found type {type(k)} (key {k!r})")
        for text in (k, v) if isinstance(v, str) else (k,):
            if not text.isascii():
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as exc:
                    raise TritonModelException(
                        f"parameters must be valid UTF-8 text: {exc} (key {k!r})") from None
        if not isinstance(v, (bool, int, str)):
            raise TritonModelException(
                f"Expect parameters values to have type bool/int/str, found type {type(v)} "
                f"(key '{k}')")
        if type(v) is int and not -(1 << 63) <= v < (1 << 63):  # (Triton's int64, measured)
            raise TritonModelException(
                f"Unsupported value type on parameters: {v} is not a 64-bit signed integer "
                f"(key '{k}')")
    return parameters


def _expect(value: Any, types: type | tuple[type, ...], what: str) -> None:
    """A TypeError for an argument of the wrong type, as Triton's (pybind11) API raises."""
    if types is int:  # any integer (numpy's too), not a bool or a float
        if not isinstance(value, bool) and hasattr(type(value), "__index__"):
            return
    elif isinstance(value, types):
        return
    raise TypeError(f"{what} must be {_names(types)}, got {type(value).__name__}")


def _names(types: type | tuple[type, ...]) -> str:
    return " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))


def _expect_list(value: Any, item: type | tuple[type, ...], what: str,
                 if_none: str = "") -> list:
    """``value`` as a list of ``item``; a None in it raises TritonModelException(``if_none``)
    when that is given, as Triton's does for a missing tensor."""
    _expect(value, (list, tuple), what)
    for v in value:
        if not isinstance(v, item):
            if v is None and if_none:
                raise TritonModelException(if_none)
            raise TypeError(f"{what} must hold {_names(item)} objects, got {type(v).__name__}")
    return list(value)


def _text(value: Any, what: str) -> str:
    """A str argument; bytes (e.g. read from a TYPE_STRING input) are taken as UTF-8, as by
    Triton's std::string arguments. Bytes that are not UTF-8 are taken too, as Triton takes
    them: each byte UTF-8 cannot read is a lone surrogate (surrogateescape, as os.fsdecode
    reads a folder's name), so that such a name stays apart from every text name (no name is
    taken for another model's) and simply finds no model."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "surrogateescape")
    _expect(value, str, what)
    return str(value)


def _no_sender() -> None:
    """The ``_sender_ref`` of a request whose sender was never taken (or is gone)."""
    return None


class InferenceRequest:
    """A request: one the model received in ``execute``, or one it builds for BLS."""

    # The response sender's state lives here, not in the sender: the sender refers to its
    # request and the request only weakly to its sender, so that a request the model lets go
    # of (the request and its sender alike) is freed at once, and the stub then ends it if it
    # is still open (see the stub's StubRuntime._dropped). Class defaults: a request gets its
    # own values only once its sender is taken (nothing is set per request received).
    _sender_ref: Callable[[], ResponseSender | None] = staticmethod(_no_sender)
    _taken = False  # get_response_sender() was called
    _answered = False  # the final flag was sent (the sender is closed)
    _sent = 0  # responses sent through the sender

    # Triton's argument order; inputs, requested_output_names and model_name are required.
    def __init__(self, request_id: str = "", correlation_id: int | str = 0,
                 inputs: Any = _UNSET, requested_output_names: Any = _UNSET,
                 model_name: Any = _UNSET, model_version: int = -1, flags: int = 0,
                 timeout: int = 0, preferred_memory: PreferredMemory | None = None,
                 trace: Trace | None = None, parameters: Any = None) -> None:
        if inputs is _UNSET or requested_output_names is _UNSET or model_name is _UNSET:
            missing = [n for n, v in (("inputs", inputs),
                                      ("requested_output_names", requested_output_names),
                                      ("model_name", model_name)) if v is _UNSET]
            raise TypeError(f"InferenceRequest() missing required argument(s): "
                            f"{', '.join(missing)}")
        if not isinstance(correlation_id, (int, str)):
            raise TritonModelException("correlation_id must be an int or a str")
        # A BLS call builds one of these each time: the usual types take the short way.
        if type(model_version) is not int or type(flags) is not int or type(timeout) is not int:
            _expect(model_version, int, "model_version")
            _expect(flags, int, "flags")
            _expect(timeout, int, "timeout")
            model_version, flags, timeout = int(model_version), int(flags), int(timeout)
        # Unsigned in Triton, flags of 32 bits, the others of 64 (its pybind11 API refuses
        # one out of range with a TypeError; QA: flags=2**32 was delivered as it was).
        if (flags < 0 or flags > 0xFFFFFFFF or timeout < 0 or timeout >> 64
                or (type(correlation_id) is int and (correlation_id < 0 or correlation_id >> 64))):
            for what, value, bits in (("flags", flags, 32), ("timeout", timeout, 64),
                                      ("correlation_id", correlation_id, 64)):
                if type(value) is int and value < 0:
                    raise TypeError(f"{what} must not be negative, got {value}")
                if type(value) is int and value >> bits:
                    raise TypeError(f"{what} must be below 2**{bits}, got {value}")
        self._model_name = model_name if type(model_name) is str else _text(
            model_name, "model_name")
        names = requested_output_names
        if type(names) is list and all(type(n) is str for n in names):
            self._requested_output_names = names.copy()
        else:
            self._requested_output_names = [
                _text(n, "requested_output_names")
                for n in _expect_list(names, (str, bytes), "requested_output_names")]
        self._request_id = request_id if type(request_id) is str else _text(
            request_id, "request_id")
        if "" in self._requested_output_names:  # Triton's words, as it builds the request
            raise TritonModelException(
                f"Requested output name for request with id '{self._request_id}' and model "
                f"name '{self._model_name}' should not be empty.")
        if type(inputs) is list and all(type(t) is Tensor for t in inputs):
            self._inputs = inputs.copy()
        else:
            self._inputs = _expect_list(
                inputs, Tensor, "inputs", f"Input tensor for request with id "
                f"'{self._request_id}' and model name '{self._model_name}' should not be empty.")
        self._correlation_id = correlation_id
        self._model_version = model_version
        self._flags = flags
        self._timeout = timeout
        # None: BLS outputs stay where the target model made them (Triton's default).
        if preferred_memory is not None:
            _expect(preferred_memory, PreferredMemory, "preferred_memory")
        self._preferred_memory = preferred_memory
        self._trace = trace or Trace()
        self._parameters = _check_parameters(parameters)
        # Set by the runtime on requests that arrive in execute().
        self._host_id = 0
        self._cancelled = False
        self._release_flags = TRITONSERVER_REQUEST_RELEASE_ALL
        self._decoupled_model = False
        self._gpu_ok = False

    @classmethod
    def _received(cls, model_name: str, inputs: list[Tensor], rb: dict,
                  decoupled: bool) -> InferenceRequest:
        """A request as execute() receives it, from the host's already validated fields."""
        r = cls.__new__(cls)
        r._model_name = model_name
        r._requested_output_names = rb.get("outputs") or []
        r._inputs = inputs
        r._request_id = rb.get("request_id", "")
        r._correlation_id = rb.get("correlation_id", 0)
        r._model_version = rb.get("version", -1)
        r._flags = rb.get("flags", 0)
        r._timeout = rb.get("timeout", 0)
        r._preferred_memory = None
        # Whether its responses may carry GPU tensors: only to a BLS caller that did not ask
        # for CPU outputs (the host's frontends and ensembles read tensors on the CPU).
        r._gpu_ok = rb.get("gpu_ok", False)
        trace = rb.get("trace")
        r._trace = (Trace(trace, rb.get("trace_context")) if type(trace) is int and trace > 0
                    else _NO_TRACE)
        r._parameters = rb.get("parameters") or {}
        r._host_id = rb["id"]
        r._cancelled = False
        r._release_flags = TRITONSERVER_REQUEST_RELEASE_ALL
        r._decoupled_model = decoupled
        return r

    # accessors, as Triton's
    def inputs(self) -> list[Tensor]:
        """The input tensors: a new list at each call, as Triton's (changing it changes
        nothing in the request)."""
        return list(self._inputs)

    def requested_output_names(self) -> set[str]:
        # A set, as Triton's (its C++ side keeps a std::set): duplicates collapse, no order.
        return set(self._requested_output_names)

    def request_id(self) -> str:
        return self._request_id

    def correlation_id(self) -> int | str:
        return self._correlation_id

    def model_name(self) -> str:
        return self._model_name

    def model_version(self) -> int:
        return self._model_version

    def flags(self) -> int:
        return self._flags

    def set_flags(self, flags: int) -> None:
        self._flags = flags

    def timeout(self) -> int:
        return self._timeout

    def parameters(self) -> str:
        """The request parameters as a JSON string (as Triton returns them)."""
        # A request that came through the server reads as Triton's core writes it (compact,
        # text other than ASCII as it is); one built here, as Triton's stub writes it
        # (json.dumps: spaces, \u escapes). Measured against Triton 2.51.
        if self._host_id:
            return json.dumps(self._parameters, separators=(",", ":"), ensure_ascii=False)
        return json.dumps(self._parameters)

    def trace(self) -> Trace:
        return self._trace

    def is_cancelled(self) -> bool:
        """A cheap read of a flag the host sets when the client cancels (no round trip)."""
        return self._cancelled

    def get_response_sender(self) -> ResponseSender:
        if self._host_id == 0:
            raise TritonModelException("only a request received in execute() has a response sender")
        sender = self._sender_ref()
        if sender is None:
            sender = ResponseSender(self)
            self._sender_ref = weakref.ref(sender)
            self._taken = True
        return sender

    def set_release_flags(self, flags: int) -> None:
        if flags not in (TRITONSERVER_REQUEST_RELEASE_ALL, TRITONSERVER_REQUEST_RELEASE_RESCHEDULE):
            raise TritonModelException(f"invalid release flags {flags}")
        self._release_flags = flags

    # BLS
    def exec(self, decoupled: bool = False) -> Any:
        """Run this request on another model and wait: one InferenceResponse, or an iterator of
        them when ``decoupled`` is True."""
        return _need_runtime("InferenceRequest.exec()").bls_exec(self, decoupled)

    def async_exec(self, decoupled: bool = False) -> Any:
        """Like :meth:`exec`, from a running event loop (``async def execute``): the request
        is sent at once, as Triton's is, and what it returns is awaited for the response (or
        the iterator of responses when ``decoupled``)."""
        return _need_runtime("InferenceRequest.async_exec()").bls_async_exec(self, decoupled)


def _one_of_each(tensors: list[Tensor]) -> None:
    """Refuses two output tensors of one name (Triton 2.51 sends both: an HTTP client reads
    the first, gRPC's tritonclient fails to decode the response)."""
    seen: set[str] = set()
    for t in tensors:
        if t._name in seen:
            raise TritonModelException(
                f"InferenceResponse: output tensor '{t._name}' is given twice; each output "
                "needs its own name")
        seen.add(t._name)


class InferenceResponse:
    """The response to one request: output tensors or an error, and parameters."""

    def __init__(self, output_tensors: Any = _UNSET,
                 error: TritonError | None = None, parameters: Any = None) -> None:
        output_tensors = _expect_list(
            [] if output_tensors is _UNSET else output_tensors, Tensor, "output_tensors",
            "Output tensor for inference response should not be empty.")
        if error is not None and not isinstance(error, TritonError):
            raise TypeError(  # as Triton's (pybind11)
                f"error must be a pb_utils.TritonError, got {type(error).__name__}")
        if len(output_tensors) > 1:
            _one_of_each(output_tensors)
        self._output_tensors = output_tensors
        self._err = error
        self._parameters = _check_parameters(parameters)

    def output_tensors(self) -> list[Tensor]:
        """The output tensors: a new list at each call, as Triton's (appending to it adds no
        output to the response)."""
        return list(self._output_tensors)

    def has_error(self) -> bool:
        return self._err is not None

    def error(self) -> TritonError | None:
        return self._err

    def parameters(self) -> str:
        return json.dumps(self._parameters)


class ResponseSender:
    """Sends responses for one request (decoupled models, or once in default mode)."""

    def __init__(self, request: InferenceRequest) -> None:
        self._request = request

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        # Triton's checks, in its order and words: the arguments, then default-mode limits,
        # then whether the sender is closed.
        if response is not None and not isinstance(response, InferenceResponse):
            raise TypeError(  # as Triton's (pybind11) refuses an argument of the wrong type
                f"send() takes a pb_utils.InferenceResponse or None, got "
                f"{type(response).__name__}")
        if type(flags) is not int and (isinstance(flags, float)
                                        or not hasattr(type(flags), "__index__")):
            # As Triton's (pybind11): 0.0 or "1" is a TypeError, True is taken as 1.
            raise TypeError(f"send(): flags must be an int, got {type(flags).__name__}")
        if flags not in (0, TRITONSERVER_RESPONSE_COMPLETE_FINAL):
            raise TritonModelException("Unable to send response. Unsupported flag provided.")
        final = flags == TRITONSERVER_RESPONSE_COMPLETE_FINAL
        if response is None and not final:
            raise TritonModelException("Inference Response object must be provided when the "
                                       "response flags is set to zero.")
        req = self._request
        if not req._decoupled_model and response is not None and req._sent >= 1:
            raise TritonModelException(
                "Unable to send response. Non-decoupled model cannot send more than one response."
            )
        if not req._decoupled_model and response is None and req._sent == 0:
            raise TritonModelException(
                "Unable to send response. Non-decoupled model cannot send complete final before "
                "sending a response."
            )
        if req._answered:
            raise TritonModelException(
                "Unable to send response. Response sender has been closed."
            )
        before = (req._answered, req._sent)
        if final:
            req._answered = True
        if response is not None:
            req._sent += 1
        try:
            _need_runtime("ResponseSender.send()").send_response(req, response, final)
        except BaseException:
            req._answered, req._sent = before  # nothing was sent
            raise

    def is_cancelled(self) -> bool:
        return self._request._cancelled


def get_input_tensor_by_name(inference_request: InferenceRequest, name: str) -> Tensor | None:
    # Ours without the copy inputs() makes; anything else with an inputs() (a stand-in in a
    # model's unit test) as Triton's helper takes it.
    tensors = (inference_request._inputs if type(inference_request) is InferenceRequest
               else inference_request.inputs())
    for t in tensors:
        if t.name() == name:
            return t
    return None


def get_output_tensor_by_name(inference_response: InferenceResponse, name: str) -> Tensor | None:
    tensors = (inference_response._output_tensors if type(inference_response) is
               InferenceResponse else inference_response.output_tensors())
    for t in tensors:
        if t.name() == name:
            return t
    return None


def get_input_config_by_name(model_config: dict, name: str) -> dict | None:
    for props in model_config.get("input", []):
        if props["name"] == name:
            return props
    return None


def get_output_config_by_name(model_config: dict, name: str) -> dict | None:
    for props in model_config.get("output", []):
        if props["name"] == name:
            return props
    return None


def using_decoupled_model_transaction_policy(model_config: dict) -> bool:
    if "model_transaction_policy" in model_config:
        return bool(model_config["model_transaction_policy"].get("decoupled", False))
    return False


def serialize_byte_tensor(input_tensor: np.ndarray) -> Any:
    """Triton's layout for a BYTES tensor, as ``bytes`` ("()" for an empty tensor), as Triton's
    own returns it (its docstring says a uint8 array; ``np.frombuffer`` makes one)."""
    if input_tensor.size == 0:
        return ()
    if input_tensor.dtype != np.object_ and input_tensor.dtype.type != np.bytes_:
        return None
    return _serialize_bytes(input_tensor)


def deserialize_bytes_tensor(encoded_tensor: Any) -> np.ndarray:
    """A 1-D object array of ``bytes`` from Triton's length-prefixed layout."""
    if isinstance(encoded_tensor, np.ndarray):
        encoded_tensor = encoded_tensor.tobytes()
    return _deserialize_bytes(encoded_tensor)


# The names, config and version are str (or bytes) only, as Triton's std::string arguments
# take them: an int is a TypeError there.
def load_model(model_name: str, config: str = "", files: dict[str, bytes] | None = None) -> None:
    """Load (or reload) a model; explicit model-control mode only."""
    model_name = _text(model_name, "load_model: model_name")
    config = _text(config, "load_model: config")
    if files is not None and not isinstance(files, dict):
        # Triton's check and words (a TritonModelException: what its files' contents and
        # paths get from the server too, here as there).
        raise TritonModelException(f"failed to load model '{model_name}', files should be a "
                                   "dictionary of file paths and file contents")
    _need_runtime("load_model()", runner=False).model_call(
        "load", model_name, config=config, files=None if files is None else _files(files))


def _files(files: dict) -> dict[str, bytes]:
    """``load_model``'s files as Triton 2.51's binding takes them (measured): paths as str or
    bytes (a std::string), contents as bytes only (a str or None is a TypeError there). A
    path given in bytes used to be dropped here, and the load then looked for the model in the
    repository; a path of another type was dropped too (Triton: "Unable to cast")."""
    taken = {}
    for path, content in files.items():
        if isinstance(path, bytes):
            try:
                path = path.decode("utf-8")
            except UnicodeDecodeError:
                raise TritonModelException(
                    f"load_model: the file path {path!r} is not UTF-8 text") from None
        elif not isinstance(path, str):
            raise TypeError(f"load_model: the paths in files must be str or bytes, got "
                            f"{type(path).__name__} ({path!r})")
        if not isinstance(content, bytes):
            raise TypeError(f"load_model: the content of files[{path!r}] must be bytes, got "
                            f"{type(content).__name__}")
        taken[str(path)] = content
    return taken


def unload_model(model_name: str, unload_dependents: bool = False) -> None:
    """Unload a model; explicit model-control mode only."""
    model_name = _text(model_name, "unload_model: model_name")
    if type(unload_dependents) is not bool:
        # As pybind11's bool, converting (Triton 2.51's, measured): a number (an int, a
        # float, numpy's) is taken by its truth; None, a str or a list are not.
        if unload_dependents is None or not hasattr(type(unload_dependents), "__bool__"):
            _expect(unload_dependents, bool, "unload_model: unload_dependents")
        unload_dependents = bool(unload_dependents)
    _need_runtime("unload_model()", runner=False).model_call(
        "unload", model_name, unload_dependents=unload_dependents)


def is_model_ready(model_name: str, model_version: str = "") -> bool:
    """Whether a model (and version) is loaded and ready."""
    model_name = _text(model_name, "is_model_ready: model_name")
    model_version = _text(model_version, "is_model_ready: model_version")
    return bool(_need_runtime("is_model_ready()", runner=False).model_call(
        "ready", model_name, version=model_version))


def get_model_dir() -> str:
    """The directory of the running model's version (where its model.py is), as Triton's."""
    return str(_need_runtime("get_model_dir()").version_dir)


def empty_shm_tensor(name: str, shape: Any, dtype: Any) -> Tensor:
    """A tritonpy extension: an output tensor allocated directly in shared memory.

    Fill ``tensor.as_numpy()`` in place; sending it costs no copy. Outside a server it is a
    plain numpy array.
    """
    arr = (_runtime.new_shm_array(dtype, tuple(shape)) if _runtime is not None
           else np.empty(tuple(shape), dtype=dtype))
    return Tensor(name, arr)


_Callable = Callable  # keep typing import used for type checkers

__all__ = [
    "get_model_dir",
    "TRITON_STRING_TO_NUMPY",
    "MemoryType",
    "TRITONSERVER_MEMORY_CPU",
    "TRITONSERVER_MEMORY_CPU_PINNED",
    "TRITONSERVER_MEMORY_GPU",
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_END",
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_START",
    "TRITONSERVER_REQUEST_RELEASE_ALL",
    "TRITONSERVER_REQUEST_RELEASE_RESCHEDULE",
    "TRITONSERVER_RESPONSE_COMPLETE_FINAL",
    "InferenceRequest",
    "InferenceResponse",
    "LogLevel",
    "Logger",
    "Metric",
    "MetricFamily",
    "ModelConfig",
    "PreferredMemory",
    "ResponseSender",
    "Tensor",
    "Trace",
    "TritonError",
    "TritonModelException",
    "deserialize_bytes_tensor",
    "empty_shm_tensor",
    "get_input_config_by_name",
    "get_input_tensor_by_name",
    "get_output_config_by_name",
    "get_output_tensor_by_name",
    "is_model_ready",
    "load_model",
    "numpy_to_triton_type",
    "serialize_byte_tensor",
    "triton_string_to_numpy",
    "triton_to_numpy_type",
    "unload_model",
    "using_decoupled_model_transaction_policy",
]
