"""``Model``: the in-process handle on one model (``Server.model(name)``), whose ``infer`` and
``async_infer`` are the embedders' request path, and the checks and conversions of a request's
inputs and settings (Triton's types) before it is queued.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from tritonpy.shm import cuda
from tritonpy.shm.cuda import DeviceRef
from tritonpy.shm.dtypes import TRITON_TO_NUMPY, triton_dtype_of

from ._errors import InvalidArgumentError, UnavailableError, public
from ._model import ModelRuntime
from ._request import AsyncResponseStream, HostRequest, ResponseStream
from ._runtime_base import READY
from ._trace import Trace

if TYPE_CHECKING:
    from .server import Server

#: The numpy dtypes that name a Triton type other than BYTES: an array of one of them is an
#: input as it is (what every frontend request sends).
_PLAIN_DTYPES = frozenset(dt for dt in map(np.dtype, TRITON_TO_NUMPY.values())
                          if dt.kind not in "OSU")


def _as_input(name: str, value: Any) -> np.ndarray:
    if type(value) is DeviceRef:  # in a client's CUDA shared memory: the stub maps it
        return value  # type: ignore[return-value]
    if not isinstance(value, np.ndarray) and hasattr(value, "__cuda_array_interface__"):
        # An embedder's CuPy array: the stub maps it by its CUDA IPC handle (a GPU model that
        # takes GPU inputs gets this very memory); kept alive until the stub lets go of it.
        if not value.nbytes:
            return np.empty(value.shape, np.dtype(value.dtype))
        try:
            return cuda.ref_of(value)  # type: ignore[return-value]
        except Exception as exc:
            raise InvalidArgumentError(f"input '{name}': cannot share its GPU memory: {exc}") \
                from None
    arr = value if isinstance(value, np.ndarray) else np.asarray(value)
    if hasattr(value, "to_numpy") and not isinstance(value, np.ndarray):
        arr = value.to_numpy()
    if arr.dtype.kind == "U":
        arr = arr.astype(object)
    try:
        triton_dtype_of(arr)
    except TypeError:
        raise InvalidArgumentError(
            f"input '{name}' has numpy dtype {arr.dtype}, which has no Triton data type") from None
    return arr


_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_UINT64_MAX = (1 << 64) - 1
_SEQUENCE_FLAGS = 3  # START (1) | END (2): the only request flags Triton knows


def _uint64(what: str, value: Any, bounded: bool = True) -> int:
    """``value`` as an int in Triton's uint64 range (``bounded`` False: any int from 0),
    else InvalidArgumentError naming it."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise InvalidArgumentError(f"{what} must be an int, not {type(value).__name__}")
    number = value.__index__()
    if number < 0 or bounded and number > _UINT64_MAX:
        raise InvalidArgumentError(f"{what} must be in 0..2**64-1 (Triton's uint64), got {number}")
    return number


def _check_settings(request_id: Any, correlation_id: Any, flags: Any, timeout: Any,
                    priority: Any) -> tuple[int | str, int, int, int]:
    """A request's settings checked as Triton types them (the ID a str, the others uint64;
    a correlation ID a uint64 or a str), so that a model never sees a value Triton cannot
    send it; raises InvalidArgumentError naming the first that is wrong."""
    if not isinstance(request_id, str):
        raise InvalidArgumentError(f"request_id must be a str, not {type(request_id).__name__}")
    if not isinstance(correlation_id, str):
        correlation_id = _uint64("correlation_id (a str or an int)", correlation_id)
    flags = _uint64("flags", flags)
    if flags & ~_SEQUENCE_FLAGS:
        raise InvalidArgumentError(
            f"flags must combine SEQUENCE_START (1) and SEQUENCE_END (2) only, got {flags}")
    # A timeout past 64 bits is left to the channel, whose "cannot be encoded" answers it
    # (tests/host/test_huge_timeout.py).
    return (correlation_id, flags, _uint64("timeout (microseconds)", timeout, bounded=False),
            _uint64("priority", priority))


@public
class Model:
    """A handle on one model (version -1: the newest loaded)."""

    def __init__(self, server: Server, name: str, version: int = -1) -> None:
        self.server = server
        self.name = name
        self.version = version

    def _rt(self) -> ModelRuntime:
        return self.server.repo.runtime(self.name, self.version)  # (Server.runtime's)

    def ready(self) -> bool:
        return self.server.repo.is_ready(self.name, self.version)

    def check(self, inputs: Mapping[str, Any], requested: Sequence[str] | None,
              request_id: str = "") -> None:
        """Validate a request from its inputs' datatypes and shapes alone (each value needs a
        numpy ``dtype`` and a ``shape``), before their data is decoded."""
        self.server.check_signature(self._rt(), list(inputs.items()), list(requested or ()),
                                    request_id)

    def config(self) -> dict:
        import json

        return json.loads(self._rt().config_json)

    def output_labels(self, output: str) -> list[str] | None:
        """The class labels of ``output`` (its ``label_filename``, a label per line: line i
        names class i), as read when the model loaded; None when it names no file."""
        return self._rt().output_labels.get(output)

    @property
    def max_batch_size(self) -> int:
        """The config's ``max_batch_size`` (0: the model does not batch)."""
        return self._rt().max_batch_size

    def metadata(self) -> dict:
        from .validation import model_metadata

        rt = self._rt()
        # As Triton: the metadata of a version names that version; of the model, every one.
        versions = [rt.version] if self.version >= 0 else self.server.repo.loaded_versions(rt.name)
        return model_metadata(rt.config, rt.name, versions)

    def decoupled(self) -> bool:
        return self._rt().decoupled

    def _request(self, stream: ResponseStream | AsyncResponseStream, inputs: Mapping[str, Any],
                 requested_output_names: Sequence[str] | None, request_id: str,
                 parameters: Mapping[str, Any] | None, correlation_id: int | str, flags: int,
                 timeout: int, priority: int, trace: Trace | None = None) -> HostRequest:
        server = self.server
        if not server._started:
            server._require_started()
        loop = server._loop
        if loop is not None and not loop.is_running():
            server._require_frame_loop()
        if type(inputs) is not dict and not isinstance(inputs, Mapping):
            raise InvalidArgumentError(
                f"inputs must be a mapping of input names to arrays, not {type(inputs).__name__}")
        # The usual values pass with a few type checks (every frontend request comes here).
        if not (type(request_id) is str and type(flags) is int and not flags & ~_SEQUENCE_FLAGS
                and type(timeout) is int and timeout >= 0
                and type(priority) is int and 0 <= priority <= _UINT64_MAX
                and (type(correlation_id) is str
                     or type(correlation_id) is int and 0 <= correlation_id <= _UINT64_MAX)):
            correlation_id, flags, timeout, priority = _check_settings(
                request_id, correlation_id, flags, timeout, priority)
        rt = self._rt()
        if rt.state != READY and rt.successor is None:  # reloaded: submit() forwards it
            raise UnavailableError(f"model '{self.name}' is not ready")
        if parameters and type(parameters) is not dict and not isinstance(parameters, Mapping):
            raise InvalidArgumentError("parameters must be a mapping of names to values, not "
                                       f"{type(parameters).__name__}")
        for k, v in parameters.items() if parameters else ():
            if not isinstance(k, str):
                raise InvalidArgumentError(f"parameter name {k!r} is not a str")
            if not isinstance(v, (bool, int, float, str)):
                raise InvalidArgumentError(
                    f"parameter '{k}' has type {type(v).__name__}; bool, int, float or str only")
            if type(v) is int and not _INT64_MIN <= v <= _INT64_MAX:
                raise InvalidArgumentError(f"parameter '{k}': {v} is out of the int64 range")
        if isinstance(requested_output_names, str):
            requested_output_names = [requested_output_names]
        arrays = []
        for n, v in inputs.items():  # (a plain array as it is, without a call: the usual input)
            arrays.append((n, v if type(v) is np.ndarray and v.dtype in _PLAIN_DTYPES
                           else _as_input(n, v)))
        req = HostRequest(rt, arrays, requested_output_names, stream._feed.sink,
                          request_id=request_id, correlation_id=correlation_id, flags=flags,
                          timeout_us=timeout, priority=priority, parameters=parameters)
        req.trace = trace
        self.server.validate(rt, req)
        # A decoupled model's stream is paced by its consumer, and cancelled once dropped.
        stream._start(req, self.server.timers if rt.decoupled else None)
        return req

    def infer(self, inputs: Mapping[str, Any],
              requested_output_names: Sequence[str] | None = None, *, request_id: str = "",
              parameters: Mapping[str, Any] | None = None, correlation_id: int | str = 0,
              flags: int = 0, timeout: int = 0, priority: int = 0) -> ResponseStream:
        """Run a request; iterate the result for its responses (one in default mode).

        A decoupled model's request is cancelled once the result is dropped before its end
        (the model sees ``is_cancelled()``), as :meth:`ResponseStream.cancel` would.

        Raises InvalidArgumentError / NotFoundError / UnavailableError for a request that
        cannot be queued; errors during execution come back as ``response.error``. On the
        event loop given as ``Server(loop=...)``, where its responses are read, it raises
        RuntimeError: use :meth:`async_infer` there.
        """
        self.server._not_on_frame_loop("model(...).infer() (use async_infer here)")
        stream = ResponseStream()
        req = self._request(stream, inputs, requested_output_names, request_id,
                            parameters, correlation_id, flags, timeout, priority)
        req.model.submit(req)
        return stream

    def async_infer(self, inputs: Mapping[str, Any],
                    requested_output_names: Sequence[str] | None = None, *,
                    request_id: str = "", parameters: Mapping[str, Any] | None = None,
                    correlation_id: int | str = 0, flags: int = 0, timeout: int = 0,
                    priority: int = 0, trace: Trace | None = None,
                    loop: asyncio.AbstractEventLoop | None = None) -> AsyncResponseStream:
        """Like :meth:`infer`, for asyncio: ``async for response in model.async_infer(...)``.
        ``trace``: record the request's timestamps in it (the frontends' tracing). ``loop``:
        the loop that will iterate the stream, when called from another thread. As with
        :meth:`infer`, dropping the result before its end cancels a decoupled model's request."""
        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                raise RuntimeError(
                    "async_infer() needs the event loop that will iterate its responses: call "
                    "it on that loop, or pass loop=... from another thread (or use infer())"
                ) from None
        elif not isinstance(loop, asyncio.AbstractEventLoop):
            raise InvalidArgumentError(f"loop must be an asyncio event loop, not "
                                       f"{type(loop).__name__}")
        stream = AsyncResponseStream(loop)
        req = self._request(stream, inputs, requested_output_names, request_id,
                            parameters, correlation_id, flags, timeout, priority, trace)
        req.model.submit(req)
        return stream
