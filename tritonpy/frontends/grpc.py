"""KServe v2 gRPC frontend (``inference.GRPCInferenceService``) on our HTTP/2 server
(:mod:`._http2`, HTTP/2 framed on the frontends' event loop, ``hpack`` for headers).

The service definition is the one ``tritonclient[grpc]`` ships, so the real client talks to it
unchanged. Behaviour follows Triton's ``src/grpc``: every output travels in
``raw_output_contents``; errors become the gRPC status the Triton error code maps to; on the
bidirectional stream each request runs concurrently, a failed request becomes an
``error_message`` on the stream (the stream stays open), default-mode models answer in request
order, decoupled models answer as their responses arrive, and every response carries
``triton_final_response`` (the flags-only final response only when the request asked for it
with ``triton_enable_empty_final_response``). A stream opened with the header
``triton_grpc_error: true`` ends instead at its first error from a model, with that error's
gRPC status, and what else runs on it is cancelled (as Triton 2.49+; a request refused before
it reaches a model is still answered in ``error_message``, as in Triton 2.51). On stop, a request that comes on a stream is refused
with an ``error_message``, and a stream ends, with UNAVAILABLE "the server is stopping", once
nothing has been in flight on it and no request has come for :data:`STOP_QUIET_S`: an idle client
does not hold the shutdown, and one still sending gets an answer for each request (perf_analyzer
waited for ever on requests that got none; Triton answers each with an error until it exits).
"""
from __future__ import annotations

import asyncio
import functools
import logging
import re
import time
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import grpc
import numpy as np
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2, service_pb2

from .._errors import (
    InvalidArgumentError,
    TritonpyError,
    UnavailableError,
    UnsupportedError,
    input_twice,
    listen_error,
)
from .._scheduler import debug_count
from ..validation import request_prefix
from ._http2 import MAX_MESSAGE_SIZE, Http2GrpcServer, KeepAlive, Method, Serialized
from .dataplane import (
    SPECIAL_PARAMETERS,
    DataPlane,
    InferRequest,
    InferResult,
    RequestPlan,
    ShmRef,
    RequestedOutput,
    apply_parameters,
    class_count,
    element_count,
    forward_headers,
    traceparent,
    input_from_raw,
    keep,
    parse_version,
    shm_ref,
    string_count_error,
    to_error,
)

log = logging.getLogger(__name__)

_END = object()
_STOP = object()  # the server is stopping: end the stream once nothing is in flight on it
#: The status message of a stream that the server ends as it stops (UNAVAILABLE).
_STOPPING = "the server is stopping"
#: On stop, a stream ends once no request has come on it for this long (and none runs).
STOP_QUIET_S = 1.0


class _Fail:
    """A stream opened with ``triton_grpc_error: true`` ends at its first error from a model,
    with that error's gRPC status (Triton 2.49+), instead of answering it in
    ``error_message``."""

    __slots__ = ("error",)

    def __init__(self, error: TritonpyError) -> None:
        self.error = error


class _Traced:
    """A stream response of a traced request: the writer stamps GRPC_SEND_START/END around it
    and, after the request's last one, finishes the trace (as Triton's stream traces)."""

    __slots__ = ("msg", "trace", "final")

    def __init__(self, msg: Any, trace: Any, final: bool) -> None:
        self.msg, self.trace, self.final = msg, trace, final
#: Answers a stream holds for its client before it takes no more from the server.
_STREAM_AHEAD = 64
_DECOUPLED = "ModelInfer RPC doesn't support models with decoupled transaction policy"

# Which typed ``contents`` field carries each datatype.
_CONTENTS = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
    "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
    "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
    "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}
_FIELD_TYPE = {"bool_contents": "BOOL", "int_contents": "INT32", "int64_contents": "INT64",
               "uint_contents": "UINT32", "uint64_contents": "UINT64", "fp32_contents": "FP32",
               "fp64_contents": "FP64", "bytes_contents": "BYTES"}

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])

#: grpc.health.v1.HealthCheckResponse with status SERVING (1) and NOT_SERVING (2), encoded.
_SERVING, _NOT_SERVING = b"\x08\x01", b"\x08\x02"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"


def _rpc(fn: F) -> F:
    """Turn any error of a unary RPC into the gRPC status its Triton code maps to."""

    @functools.wraps(fn)
    async def wrapper(self: GRPCService, request: Any, context: Any) -> Any:
        try:
            return await fn(self, request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # never let a bad request take the server down
            err = to_error(exc)
            if not isinstance(exc, TritonpyError):
                log.exception("gRPC %s failed", fn.__name__)
            await context.abort(getattr(grpc.StatusCode, err.grpc_code), err.message)

    return wrapper  # type: ignore[return-value]


def _delayed(handler: F, seconds: int) -> F:
    """``handler`` answering ``seconds`` late, as Triton's test hook
    ``TRITONSERVER_SERVER_DELAY_GRPC_RESPONSE_SEC`` delays every gRPC answer but inference
    ones (upstream's non-inference client timeout tests need it). The work is done first."""

    @functools.wraps(handler)
    async def late(request: Any, context: Any) -> Any:
        try:
            response = await handler(request, context)
        except asyncio.CancelledError:
            raise
        except BaseException:
            await asyncio.sleep(seconds)
            raise
        await asyncio.sleep(seconds)
        return response

    return late  # type: ignore[return-value]


def _health_request(data: Any) -> None:
    """A HealthCheckRequest, checked (not kept): a message that is not protobuf is refused
    INTERNAL, as Triton refuses it (measured). An empty message type reads any well-formed
    one, its ``service`` field an unknown field."""
    service_pb2.ServerLiveRequest.FromString(data)


def _param_value(p: Any) -> Any:
    """The Python value of an InferParameter / ModelRepositoryParameter / SettingValue."""
    kind = p.WhichOneof("parameter_choice")
    return None if kind is None else getattr(p, kind)


def _set_param(target: Any, key: str, value: Any) -> None:
    p = target[key]
    if isinstance(value, bool):
        p.bool_param = value
    elif isinstance(value, int):
        p.int64_param = value
    elif isinstance(value, float):
        p.double_param = value
    else:
        p.string_param = str(value)


def _request_parameters(params: Any) -> dict[str, Any]:
    """A request's parameters as Python values; Triton takes an ordinary one only as int64,
    bool, string or double (a ``uint64_param`` is refused, as an unset value)."""
    out = {}
    for key, p in params.items():
        kind = p.WhichOneof("parameter_choice")
        if kind in (None, "uint64_param") and not (
                key in SPECIAL_PARAMETERS or key.startswith("triton_")):
            raise InvalidArgumentError(
                f"invalid value type for '{key}' parameter, expected int64_param, bool_param, "
                "or string_param.")
        out[key] = None if kind is None else getattr(p, kind)
    return out


def decode_request(plane: DataPlane, request: Any) -> InferRequest:
    """A :class:`InferRequest` from a ``ModelInferRequest`` message."""
    model = request.model_name
    req = InferRequest(model, parse_version(request.model_version), request_id=request.id)
    apply_parameters(req, _request_parameters(request.parameters), http=False)
    raw = request.raw_input_contents
    index = 0
    for inp in request.inputs:
        name, datatype, shape = inp.name, inp.datatype, list(inp.shape)
        params = {k: _param_value(v) for k, v in inp.parameters.items()}
        ref = shm_ref(name, params)
        has_contents = inp.HasField("contents")
        if name in req.inputs:
            raise input_twice(name, request_prefix(req.request_id))
        if ref is not None:
            if has_contents:
                raise InvalidArgumentError(
                    f"unexpected 'content' provided when using shared memory for input tensor "
                    f"'{name}' for model '{model}'"
                )
            req.inputs[name] = plane.input_from_shm(name, datatype, shape, ref, model=model,
                                                    request_id=req.request_id)
        elif has_contents and len(raw):
            raise InvalidArgumentError(
                f"contents field must not be specified when using raw_input_contents for "
                f"'{name}' for model '{model}'"
            )
        elif has_contents:
            req.inputs[name] = _from_contents(model, name, datatype, shape, inp.contents,
                                              req.request_id)
        elif index < len(raw):
            req.inputs[name] = input_from_raw(name, datatype, shape, raw[index], model=model,
                                              request_id=req.request_id)
            index += 1
        else:
            raise InvalidArgumentError(
                f"unable to find data for input tensor '{name}' for model '{model}' in request."
            )
    if index != len(raw):
        raise InvalidArgumentError(
            f"unexpected number of raw_input_contents for model '{model}': "
            f"{len(raw)} given, {index} inputs use them"
        )
    if len(request.outputs):
        req.outputs = []
        for out in request.outputs:
            params = {k: _param_value(v) for k, v in out.parameters.items()}
            req.outputs.append(RequestedOutput(out.name, None, shm_ref(out.name, params),
                                               class_count(out.name, params.get("classification"))))
    return req


def _from_contents(model: str, name: str, datatype: str, shape: list[int], contents: Any,
                   request_id: str = "") -> np.ndarray:
    fields = [f.name for f, _ in contents.ListFields()]
    expected = _CONTENTS.get(datatype)
    if expected is None:
        raise InvalidArgumentError(
            f"input '{name}' for model '{model}': datatype '{datatype}' cannot be sent in typed "
            "contents, use raw_input_contents"
        )
    for f in fields:
        if f != expected:
            raise InvalidArgumentError(
                f"unexpected explicit tensor data for input tensor '{name}' for model '{model}' "
                f"of type '{_FIELD_TYPE[f]}', expected datatype '{datatype}'"
            )
    count = element_count(name, shape)
    values = getattr(contents, expected)
    if len(values) != count:
        if datatype == "BYTES":  # Triton's words, as for raw BYTES data
            raise InvalidArgumentError(request_prefix(request_id) + string_count_error(
                name, len(values), count, f" for model '{model}'"))
        raise InvalidArgumentError(
            f"unexpected number of elements {len(values)} for input '{name}', expecting {count}"
        )
    if datatype == "BYTES":
        arr = np.empty(count, dtype=object)
        arr[:] = list(values)
    else:
        from ..shm.dtypes import numpy_dtype

        try:
            arr = np.array(values, dtype=numpy_dtype(datatype)) if count else np.empty(
                0, numpy_dtype(datatype))
        except OverflowError:  # int_contents carry INT8/INT16, uint_contents UINT8/UINT16
            raise InvalidArgumentError(
                f"unexpected explicit tensor data for input tensor '{name}' for model "
                f"'{model}': value out of range for {datatype}") from None
    return arr.reshape(shape)


def encode_result(result: InferResult) -> Any:
    """A ``ModelInferResponse`` from a successful :class:`InferResult`."""
    resp = service_pb2.ModelInferResponse(
        model_name=result.model, model_version=str(result.version), id=result.request_id
    )
    for key, value in result.parameters.items():
        _set_param(resp.parameters, key, value)
    for out in result.outputs:
        resp.outputs.add(name=out.name, datatype=out.datatype, shape=out.shape)
        if out.shm is not None:  # named with no parameters and empty contents, as Triton's
            resp.raw_output_contents.append(b"")
        else:
            resp.raw_output_contents.append(bytes(out.raw()))
    return resp


#: The tag of ``raw_input_contents`` (field 7) and of ``raw_output_contents`` (field 6), both
#: length-delimited, on the wire.
_RAW_IN_TAG = 7 << 3 | 2
_RAW_OUT_TAG = bytes([6 << 3 | 2])


def split_infer(data: Any) -> tuple[bytes, list[tuple[int, int]]] | None:
    """A ``ModelInferRequest``'s wire bytes in two parts: every field but its raw input
    contents (as bytes, in order: what decodes the same way every time) and where each raw
    input content lies (start, end), in order. None when they are not the plain
    length-delimited fields this message is made of: a full parse then decides."""
    n = len(data)
    i = 0
    head = []
    raws = []
    while i < n:
        tag = data[i]
        if tag & 0x80 or tag & 7 != 2:  # a field past 15, or not length-delimited
            return None
        j = i + 1
        size = shift = 0
        while True:
            if j >= n or shift > 35:
                return None
            b = data[j]
            j += 1
            size |= (b & 0x7F) << shift
            if b < 0x80:
                break
            shift += 7
        end = j + size
        if end > n:
            return None
        if tag == _RAW_IN_TAG:
            raws.append((j, end))
        else:
            head.append(data[i:end])
        i = end
    return b"".join(head), raws


class _Keyed:
    """A parsed ``ModelInferRequest`` and the key of the plan its decode may make."""

    __slots__ = ("message", "key")

    def __init__(self, message: Any, key: bytes) -> None:
        self.message, self.key = message, key


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _bare(result: InferResult, asked_version: str) -> Any:
    """A stream's error or flags-only final response: no outputs, and the version as the
    request named it (Triton copies the request's model_version: empty when none was given)."""
    resp = service_pb2.ModelInferResponse(
        model_name=result.model, model_version=asked_version, id=result.request_id)
    resp.parameters["triton_final_response"].bool_param = result.final
    return resp


class GRPCService:
    """``GRPCInferenceService`` over a :class:`DataPlane`."""

    def __init__(self, plane: DataPlane, header_forward: re.Pattern[str] | None = None) -> None:
        self.plane = plane
        self.header_forward = header_forward  # --grpc-header-forward-pattern
        self.stopping = False
        self._streams: set[Callable[[], None]] = set()  # wakes each open stream on stop
        # Decoded request headers by their wire bytes, response heads by what they say (see
        # RequestPlan): a client sends requests of one shape alike.
        self._plans: dict[bytes, RequestPlan] = {}
        self._heads: dict[tuple, bytes] = {}

    def parse_infer(self, data: Any) -> Any:
        """A ``ModelInfer`` request off the wire: the :class:`InferRequest` itself when a
        request with the same header was decoded before (its raw contents copied out of
        ``data``, or views of it when ``data`` is read-only: a large message's own buffer, see
        ``_Call.feed``), else the parsed message (with its plan's key)."""
        split = split_infer(data)
        if split is None:
            return service_pb2.ModelInferRequest.FromString(data)
        key, spans = split
        plan = self._plans.get(key)
        if plan is not None:
            keep_views = type(data) is memoryview and data.readonly
            try:
                req = plan.request([data[a:b] if keep_views else bytes(data[a:b])
                                    for a, b in spans], self.plane.input_from_shm)
            except TritonpyError:
                # An input's shm region gone or shrunk: the full decode, in the call's handler,
                # answers it (this runs as the bytes are read, where an error is the
                # connection's).
                req = None
            if req is not None:
                return req
        return _Keyed(service_pb2.ModelInferRequest.FromString(data), key)

    def _decode(self, request: Any) -> InferRequest:
        """What :meth:`parse_infer` made, as a request (a plan kept for its header when every
        input came in its raw contents)."""
        if type(request) is InferRequest:
            return request
        if type(request) is not _Keyed:
            return decode_request(self.plane, request)
        message = request.message
        req = decode_request(self.plane, message)
        raw = iter(message.raw_input_contents)
        specs = []
        shm: dict[str, tuple[str, list, ShmRef]] = {}
        for inp in message.inputs:  # each from the raw contents or shared memory
            if "shared_memory_region" in inp.parameters:
                ref = shm_ref(inp.name, {k: _param_value(v) for k, v in inp.parameters.items()})
                assert ref is not None  # (decoded so above)
                specs.append(RequestPlan.shm_spec(inp.name))
                shm[inp.name] = (inp.datatype, list(inp.shape), ref)
            elif inp.HasField("contents"):  # typed contents: decoded in full each time
                return req
            else:
                specs.append(RequestPlan.spec(inp.name, req.inputs[inp.name], len(next(raw))))
        keep(self._plans, request.key, RequestPlan(req, specs, shm))
        return req

    def _encode(self, result: InferResult) -> Any:
        """The ``ModelInferResponse`` of ``result``; serialized here from a kept head when it
        has no parameters (the head: every field but the raw output contents, which follow it;
        an output in shared memory has empty contents)."""
        if result.parameters:
            return encode_result(result)
        key: list[Any] = [result.model, result.version, result.request_id]
        raws = []
        for out in result.outputs:
            in_shm = out.shm is not None
            key.append((out.name, out.datatype, out.shape, in_shm))
            raws.append(b"" if in_shm else out.raw())
        head = self._heads.get(tuple(key))
        if head is None:
            resp = encode_result(result)
            del resp.raw_output_contents[:]
            head = resp.SerializeToString()
            keep(self._heads, tuple(key), head)
        parts = [head]
        size = len(head)
        for raw in raws:
            n = len(raw)
            tag = _RAW_OUT_TAG + _varint(n)
            parts += (tag, raw)
            size += len(tag) + n
        # The outputs follow the head as they are (views of the response's arrays): a large one
        # goes to the socket without being copied into the message.
        return Serialized(parts, size)

    def begin_stop(self) -> None:
        """The server is stopping: a stream with nothing in flight ends now, the others once
        their last request is answered. (A client idling on an open stream kept Triton from
        exiting until its exit timeout.)"""
        self.stopping = True
        for wake in list(self._streams):
            wake()

    # -- health and metadata -----------------------------------------------------------------

    @_rpc
    async def ServerLive(self, request: Any, context: Any) -> Any:  # noqa: N802 (gRPC names)
        """Server liveness."""
        return service_pb2.ServerLiveResponse(live=self.plane.live())

    @_rpc
    async def ServerReady(self, request: Any, context: Any) -> Any:  # noqa: N802
        """Server readiness."""
        return service_pb2.ServerReadyResponse(ready=await self.plane.ready())

    @_rpc
    async def HealthCheck(self, request: Any, context: Any) -> Any:  # noqa: N802
        """``grpc.health.v1.Health/Check``, the standard gRPC health check (Kubernetes' gRPC
        probes call it): SERVING while the server is ready, else NOT_SERVING. As in Triton
        2.51 (measured), the service the request names is not looked at."""
        return Serialized([_SERVING if await self.plane.ready() else _NOT_SERVING], 2)

    @_rpc
    async def ModelReady(self, request: Any, context: Any) -> Any:  # noqa: N802
        """Model readiness (false for an unknown model)."""
        ready = await self.plane.model_ready(request.name, parse_version(request.version))
        return service_pb2.ModelReadyResponse(ready=ready)

    @_rpc
    async def ServerMetadata(self, request: Any, context: Any) -> Any:  # noqa: N802
        """Server name, version and extensions."""
        meta = self.plane.server_metadata()
        return service_pb2.ServerMetadataResponse(
            name=meta.get("name", ""), version=meta.get("version", ""),
            extensions=list(meta.get("extensions", [])),
        )

    @_rpc
    async def ModelMetadata(self, request: Any, context: Any) -> Any:  # noqa: N802
        """KServe model metadata."""
        meta = self.plane.model_metadata(request.name, parse_version(request.version))
        return json_format.ParseDict(meta, service_pb2.ModelMetadataResponse(), ignore_unknown_fields=True)

    @_rpc
    async def ModelConfig(self, request: Any, context: Any) -> Any:  # noqa: N802
        """The model configuration."""
        config = self.plane.model_config(request.name, parse_version(request.version))
        msg = json_format.ParseDict(config, model_config_pb2.ModelConfig(), ignore_unknown_fields=True)
        return service_pb2.ModelConfigResponse(config=msg)

    @_rpc
    async def ModelStatistics(self, request: Any, context: Any) -> Any:  # noqa: N802
        """Per-model statistics."""
        stats = await self.plane.statistics(request.name, request.version)
        return json_format.ParseDict(stats, service_pb2.ModelStatisticsResponse(), ignore_unknown_fields=True)

    # -- repository --------------------------------------------------------------------------

    @_rpc
    async def RepositoryIndex(self, request: Any, context: Any) -> Any:  # noqa: N802
        """The model repository index."""
        if request.repository_name:
            raise UnsupportedError("'repository_name' specification is not supported")
        resp = service_pb2.RepositoryIndexResponse()
        for m in await self.plane.repository_index(request.ready):
            resp.models.add(name=str(m.get("name", "")), version=str(m.get("version", "")),
                            state=str(m.get("state", "")), reason=str(m.get("reason", "")))
        return resp

    @_rpc
    async def RepositoryModelLoad(self, request: Any, context: Any) -> Any:  # noqa: N802
        """Load a model (explicit mode), with optional config override and files."""
        if request.repository_name:
            raise UnsupportedError("'repository_name' specification is not supported")
        config: str | None = None
        files: dict[str, bytes] = {}
        for key, param in request.parameters.items():
            value = _param_value(param)
            if key == "config" and isinstance(value, str):
                config = value
            elif key.startswith("file:") and isinstance(value, bytes):
                files[key] = value
            else:
                raise InvalidArgumentError(f"unexpected parameter '{key}' in load request")
        await self.plane.load(request.model_name, config, files or None)
        return service_pb2.RepositoryModelLoadResponse()

    @_rpc
    async def RepositoryModelUnload(self, request: Any, context: Any) -> Any:  # noqa: N802
        """Unload a model (explicit mode)."""
        if request.repository_name:
            raise UnsupportedError("'repository_name' specification is not supported")
        dependents = False
        if "unload_dependents" in request.parameters:
            dependents = _param_value(request.parameters["unload_dependents"])
            if not isinstance(dependents, bool):
                raise InvalidArgumentError("Unable to parse 'unload_dependents'")
        await self.plane.unload(request.model_name, dependents)
        return service_pb2.RepositoryModelUnloadResponse()

    # -- shared memory -----------------------------------------------------------------------

    @_rpc
    async def SystemSharedMemoryStatus(self, request: Any, context: Any) -> Any:  # noqa: N802
        """Registered system shared-memory regions."""
        resp = service_pb2.SystemSharedMemoryStatusResponse()
        for r in self.plane.shm.status(request.name):
            resp.regions[str(r["name"])].CopyFrom(
                service_pb2.SystemSharedMemoryStatusResponse.RegionStatus(
                    name=r["name"], key=r["key"], offset=r["offset"], byte_size=r["byte_size"]
                )
            )
        return resp

    @_rpc
    async def SystemSharedMemoryRegister(self, request: Any, context: Any) -> Any:  # noqa: N802
        """Register a system shared-memory region."""
        self.plane.shm.register(request.name, request.key, request.offset, request.byte_size)
        return service_pb2.SystemSharedMemoryRegisterResponse()

    @_rpc
    async def SystemSharedMemoryUnregister(self, request: Any, context: Any) -> Any:  # noqa: N802
        """Unregister one region, or all when the name is empty."""
        self.plane.shm.unregister(request.name)
        return service_pb2.SystemSharedMemoryUnregisterResponse()

    # CUDA shared memory (refused, as a Triton built without GPU support, where no GPU counts).

    @_rpc
    async def CudaSharedMemoryStatus(self, request: Any, context: Any) -> Any:  # noqa: N802
        """Registered CUDA shared-memory regions."""
        resp = service_pb2.CudaSharedMemoryStatusResponse()
        for r in self.plane.shm.cuda_status(request.name):
            resp.regions[str(r["name"])].CopyFrom(
                service_pb2.CudaSharedMemoryStatusResponse.RegionStatus(
                    name=r["name"], device_id=r["device_id"], byte_size=r["byte_size"]))
        return resp

    @_rpc
    async def CudaSharedMemoryRegister(self, request: Any, context: Any) -> Any:  # noqa: N802
        """Register a device allocation by its CUDA IPC handle."""
        self.plane.shm.register_cuda(request.name, bytes(request.raw_handle), request.device_id,
                                     request.byte_size)
        return service_pb2.CudaSharedMemoryRegisterResponse()

    @_rpc
    async def CudaSharedMemoryUnregister(self, request: Any, context: Any) -> Any:  # noqa: N802
        """Unregister one region, or all when the name is empty."""
        self.plane.shm.unregister_cuda(request.name)
        return service_pb2.CudaSharedMemoryUnregisterResponse()

    # -- settings ----------------------------------------------------------------------------

    @_rpc
    async def TraceSetting(self, request: Any, context: Any) -> Any:  # noqa: N802
        """Get or update the trace settings (server-wide, or a model's: an empty value clears
        the model's own)."""
        new: dict[str, Any] | None = None
        if request.settings:
            new = {}
            for key, setting in request.settings.items():
                given = list(setting.value)
                if key == "trace_level":
                    new[key] = given or None
                elif len(given) > 1:  # Triton's words; nothing is applied
                    raise InvalidArgumentError(f"expect only 1 value for '{key}'")
                else:
                    new[key] = given[0] if given else None
        settings = self.plane.trace_settings(new, request.model_name)
        resp = service_pb2.TraceSettingResponse()
        for key, value in settings.items():
            resp.settings[key].value.extend(value if isinstance(value, list) else [str(value)])
        return resp

    @_rpc
    async def LogSettings(self, request: Any, context: Any) -> Any:  # noqa: N802
        """Get or update the dynamic logging settings."""
        new = {k: _param_value(v) for k, v in request.settings.items()}
        try:
            values = self.plane.update_log_settings(new) if new else self.plane.log_settings.get()
        except UnavailableError as exc:  # a bad log_format: HTTP's 503 is INVALID_ARGUMENT here
            raise InvalidArgumentError(exc.message.replace("--log_format", "log_format")) \
                from None
        resp = service_pb2.LogSettingsResponse()
        for key, value in values.items():
            s = resp.settings[key]
            if isinstance(value, bool):
                s.bool_param = value
            elif isinstance(value, int):
                s.uint32_param = value
            else:
                s.string_param = str(value)
        return resp

    # -- inference ---------------------------------------------------------------------------

    @_rpc
    async def ModelInfer(self, request: Any, context: Any) -> Any:  # noqa: N802
        """One request, one response (default-mode models only)."""
        t_read = time.monotonic_ns()
        req = self._decode(request)
        if self.header_forward is not None:
            forward_headers(req, context.metadata, self.header_forward)
        if self.plane.server.tracing.active:
            # The HTTP/2 server hands over a request once read: its wait is not timed here.
            req.received = (("GRPC_WAITREAD_START", t_read), ("GRPC_WAITREAD_END", t_read))
            req.traceparent = traceparent(context.metadata)
        try:
            result = await self.plane.infer(req, decoupled_error=_DECOUPLED)
        except Exception:
            failed = req.trace
            if failed is not None:  # as Triton: a failed request's trace has its send too
                failed.at("GRPC_SEND_START")

                def sent_error(_: Any) -> None:
                    failed.at("GRPC_SEND_END")
                    failed.finish()
                context.add_done_callback(sent_error)
            raise
        trace = req.trace
        if trace is None:
            return self._encode(result)
        try:
            message = self._encode(result)
        except BaseException:
            trace.finish()
            raise
        trace.at("GRPC_SEND_START")

        def sent(_: Any) -> None:
            trace.at("GRPC_SEND_END")
            trace.finish()
        context.add_done_callback(sent)
        return message

    async def ModelStreamInfer(self, request_iterator: AsyncIterator[Any], context: Any) -> None:  # noqa: N802
        """Bidirectional stream: any number of requests, each answered as its responses come.

        Answers go out through ``context.write`` rather than ``yield``: a write to a client
        that went away fails here, where it ends the stream quietly, instead of inside grpc,
        which logs a traceback for it."""
        queue: asyncio.Queue[Any] = asyncio.Queue()
        # Set while the queue has room: a request's responses are taken from the server only
        # as fast as the client reads them (past that they wait in the server's response
        # stream, which cancels the request when too many do).
        room = asyncio.Event()
        room.set()
        tasks: set[asyncio.Task[None]] = set()
        metadata = context.metadata
        fail_fast = any(k.lower() == "triton_grpc_error" and v.strip().lower() == "true"
                        for k, v in metadata)

        last_request = [time.monotonic()]

        def wake() -> None:
            queue.put_nowait(_STOP)

        def task_done(task: asyncio.Task[None]) -> None:
            tasks.discard(task)
            if self.stopping and not tasks:
                wake()  # after the answer it queued: the stream ends once that is written

        async def read() -> None:
            # Default-mode models answer in request order (as Triton): each request waits for
            # the previous one's turn before writing.
            previous: asyncio.Future[None] | None = None
            try:
                async for request in request_iterator:
                    last_request[0] = time.monotonic()
                    turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                    task = asyncio.create_task(self._stream_one(request, queue, room, previous,
                                                                turn, metadata, fail_fast))
                    previous = turn
                    tasks.add(task)
                    task.add_done_callback(task_done)
                # Once: no task is added after the requests end. Not until ``tasks`` is empty:
                # their done callbacks empty it, and on Python 3.12+ gather() of tasks that are
                # done returns without yielding to the loop, so a task whose callback had not
                # run yet kept that loop spinning for ever (the whole frontend with it).
                if tasks:
                    await asyncio.gather(*list(tasks), return_exceptions=True)
                queue.put_nowait(_END)
            except Exception as exc:
                queue.put_nowait(exc)

        reader = asyncio.create_task(read())
        self._streams.add(wake)
        if self.stopping:
            wake()
        try:
            while True:
                item = await queue.get()
                if not room.is_set() and queue.qsize() <= _STREAM_AHEAD // 2:
                    room.set()
                if item is _END:
                    return
                if item is _STOP:
                    if not tasks:
                        quiet = time.monotonic() - last_request[0]
                        if quiet >= STOP_QUIET_S:
                            await context.abort(grpc.StatusCode.UNAVAILABLE, _STOPPING)
                        # A client still sending gets each request refused (error_message)
                        # until it stops: perf_analyzer waits for ever for requests that got no
                        # answer, even once the stream has ended.
                        asyncio.get_running_loop().call_later(STOP_QUIET_S - quiet, wake)
                    continue
                if isinstance(item, BaseException):
                    raise item
                if type(item) is _Fail:
                    err = item.error
                    await context.abort(getattr(grpc.StatusCode, err.grpc_code), err.message)
                traced = item if type(item) is _Traced else None
                if traced is not None:
                    item = traced.msg
                    traced.trace.at("GRPC_SEND_START")
                try:
                    await context.write(item)
                except Exception as exc:  # the client is gone: nobody to answer
                    log.debug("stream ended: a response could not be written: %r", exc)
                    return
                finally:
                    if traced is not None:
                        traced.trace.at("GRPC_SEND_END")
                        if traced.final:
                            traced.trace.finish()
        finally:
            # The client went away or the server is stopping: cancel what is still running
            # (DataPlane.stream cancels each request inside the server).
            while not queue.empty():  # traces whose last answer was not written: end them
                left = queue.get_nowait()
                if type(left) is _Traced and left.final:
                    left.trace.finish()
            self._streams.discard(wake)
            reader.cancel()
            for task in list(tasks):
                task.cancel()
            await asyncio.gather(reader, *tasks, return_exceptions=True)

    async def _stream_one(self, request: Any, queue: asyncio.Queue[Any], room: asyncio.Event,
                          wait_for: asyncio.Future[None] | None, turn: asyncio.Future[None],
                          metadata: Any, fail_fast: bool = False) -> None:
        decoupled = False
        req: InferRequest | None = None
        handed = False  # the trace's last answer went to the writer, which finishes it
        try:
            if self.stopping:  # the drain waits for what runs, not for what comes after it
                raise UnavailableError("the server is stopping: this stream takes no new "
                                       "requests")
            req = decode_request(self.plane, request)
            if self.header_forward is not None:  # the stream's metadata, for each request
                forward_headers(req, metadata, self.header_forward)
            if self.plane.server.tracing.active:
                t_read = time.monotonic_ns()  # the HTTP/2 server hands over a read message
                req.received = (("GRPC_WAITREAD_START", t_read), ("GRPC_WAITREAD_END", t_read))
                req.traceparent = traceparent(metadata)
            model = self.plane.model(req.model, req.version)
            decoupled = bool(model.decoupled())
            if decoupled:
                turn.set_result(None)
            # The trace is finished by the writer, after the last answer's GRPC_SEND_END.
            async for result in self.plane.stream(req, model, own_trace=False):
                if not decoupled and wait_for is not None:
                    await wait_for
                if fail_fast and result.error is not None:
                    queue.put_nowait(_Fail(result.error))
                    return
                msg = self._stream_message(result, req.enable_empty_final, decoupled,
                                           request.model_version)
                if msg is not None:
                    if req.trace is not None:
                        msg = _Traced(msg, req.trace, result.final)
                        handed = result.final
                    queue.put_nowait(msg)
                    if queue.qsize() >= _STREAM_AHEAD:
                        room.clear()
                    if not room.is_set():
                        await room.wait()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not decoupled and wait_for is not None:
                await wait_for
            err = to_error(exc)
            log.debug("stream request %r failed: %s", request.id, err.message)
            # Refused before it reached the model (unknown model, bad inputs): answered in
            # error_message even with triton_grpc_error, and the stream goes on, as in Triton
            # 2.51 (measured), where only a model's error ends such a stream.
            msg = service_pb2.ModelStreamInferResponse(
                error_message=err.message,
                infer_response=service_pb2.ModelInferResponse(id=request.id))
            trace = req.trace if req is not None else None
            if trace is not None and not handed:
                msg, handed = _Traced(msg, trace, True), True
            queue.put_nowait(msg)
        finally:
            if not turn.done():
                turn.set_result(None)
            if req is not None and req.trace is not None and not handed:
                req.trace.finish()  # cancelled, or its last answer had nothing to send

    @staticmethod
    def _stream_message(result: InferResult, enable_empty_final: bool, decoupled: bool,
                        asked_version: str) -> Any:
        if result.error is not None:
            return service_pb2.ModelStreamInferResponse(
                error_message=result.error.message, infer_response=_bare(result, asked_version))
        if decoupled and result.final and result.empty:
            # The flags-only final response of a decoupled model: sent only on request.
            if not enable_empty_final:
                return None
            if not result.parameters:
                return service_pb2.ModelStreamInferResponse(
                    infer_response=_bare(result, asked_version))
        resp = encode_result(result)
        resp.parameters["triton_final_response"].bool_param = result.final
        return service_pb2.ModelStreamInferResponse(infer_response=resp)


#: The API group of each method, as --grpc-restricted-protocol names them.
_CATEGORIES = {
    "ServerLive": "health", "ServerReady": "health", "ModelReady": "health",
    "ServerMetadata": "metadata", "ModelMetadata": "metadata",
    "ModelInfer": "inference", "ModelStreamInfer": "inference",
    "ModelConfig": "model-config", "ModelStatistics": "statistics",
    "RepositoryIndex": "model-repository", "RepositoryModelLoad": "model-repository",
    "RepositoryModelUnload": "model-repository",
    "SystemSharedMemoryStatus": "shared-memory", "SystemSharedMemoryRegister": "shared-memory",
    "SystemSharedMemoryUnregister": "shared-memory", "CudaSharedMemoryStatus": "shared-memory",
    "CudaSharedMemoryRegister": "shared-memory", "CudaSharedMemoryUnregister": "shared-memory",
    "TraceSetting": "trace", "LogSettings": "logging",
}


class GRPCFrontend:
    """The gRPC endpoint of one :class:`DataPlane`.

    Args:
        plane: the shared data plane.
        host: address to listen on.
        port: port to listen on (0 picks a free one; see :attr:`port` after :meth:`start`).
        max_message_size: largest request message in bytes (Triton's 2^31-1 by default); a
            larger one is answered RESOURCE_EXHAUSTED.
        restricted: API group -> (key, value): a call to the group must carry the metadata
            ``triton-grpc-protocol-<key>: <value>``, else it is refused UNAVAILABLE (Triton's
            ``--grpc-restricted-protocol``).
        header_forward: metadata whose names match it reach the model as request parameters
            (``--grpc-header-forward-pattern``).
        compression: the inference responses' compression level (``none``, ``low``,
            ``medium``, ``high``: Triton's ``--grpc-infer-response-compression-level``).
        ssl: a server ``ssl.SSLContext`` to serve TLS with (``--grpc-use-ssl``).
        reuse_port: bind with SO_REUSEPORT (``--reuse-grpc-port``).
        keepalive: the keepalive pings, ping policy and connection age (Triton's
            ``--grpc-keepalive-*``, ``--grpc-http2-*``, ``--grpc-max-connection-age*``); None:
            their defaults.
    """

    def __init__(self, plane: DataPlane, host: str = "0.0.0.0", port: int = 8001,
                 max_message_size: int = MAX_MESSAGE_SIZE,
                 restricted: dict[str, tuple[str, str]] | None = None,
                 header_forward: re.Pattern[str] | None = None, compression: str = "none",
                 ssl: Any = None, reuse_port: bool = False,
                 keepalive: KeepAlive | None = None) -> None:
        self.plane = plane
        self.host = host
        self.port = port
        self.max_message_size = max_message_size
        self.restricted = restricted or {}
        self.header_forward = header_forward
        self.compression = compression
        self.ssl = ssl
        self.reuse_port = reuse_port
        self.keepalive = keepalive
        self.cut = asyncio.Event()  # set: a stop ends at once (Frontends.cut_short)
        self._server: Http2GrpcServer | None = None
        self._service: GRPCService | None = None

    async def start(self) -> None:
        """Bind and start serving."""
        service = GRPCService(self.plane, self.header_forward)
        described = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
        late = debug_count("TRITONSERVER_SERVER_DELAY_GRPC_RESPONSE_SEC")
        if late:
            log.info("gRPC answers other than inference ones are delayed %d s "
                     "(TRITONSERVER_SERVER_DELAY_GRPC_RESPONSE_SEC)", late)
        methods = {}
        for m in described.methods:
            infer = m.name in ("ModelInfer", "ModelStreamInfer")
            parse = (service.parse_infer if m.name == "ModelInfer"
                     else getattr(service_pb2, m.input_type.name).FromString)
            handler = getattr(service, m.name)
            methods[f"/{described.full_name}/{m.name}"] = Method(
                _delayed(handler, late) if late and not infer else handler, parse,
                m.client_streaming, compressible=infer,
                restricted=self._restriction(_CATEGORIES.get(m.name, "")),
                # A stream reads its own (triton_grpc_error), once per stream.
                metadata=infer and (m.name == "ModelStreamInfer" or self.header_forward is not None
                                    or self.plane.server.tracing.mode == "opentelemetry"))
        methods[HEALTH_CHECK] = Method(
            _delayed(service.HealthCheck, late) if late else service.HealthCheck,
            _health_request, False, restricted=self._restriction("health"))
        server = Http2GrpcServer(methods, self.max_message_size, self.compression, self.ssl,
                                 self.keepalive, cut=self.cut)
        try:
            self.port = await server.start(self.host, self.port, self.reuse_port)
        except OSError as exc:
            address = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
            raise listen_error("GRPC", address, exc) from None
        self._service = service
        self._server = server
        log.info("Started GRPCInferenceService at %s:%d", self.host, self.port)

    def _restriction(self, category: str) -> tuple[str, str] | None:
        """The (metadata name, value) a call of the API group ``category`` must carry."""
        need = self.restricted.get(category)
        return None if need is None else (f"triton-grpc-protocol-{need[0]}", need[1])

    async def stop(self, timeout: float = 30.0) -> None:
        """Stop accepting, give in-flight RPCs up to ``timeout`` seconds, then cancel them."""
        if self._server is not None:
            if self._service is not None:
                self._service.begin_stop()
            await self._server.stop(timeout)
            self._server = None
