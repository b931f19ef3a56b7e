"""``GRPCInferenceService`` over a :class:`DataPlane` (the gRPC frontend, :mod:`.grpc`): its
unary RPCs, each error turned into the gRPC status its Triton code maps to, and the fast path
of ``ModelInfer`` (a request's decode and a response's head kept by their shape). The
bidirectional ``ModelStreamInfer`` is in :mod:`._grpc_stream`.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import re
import time
from typing import Any, Awaitable, Callable, TypeVar

import grpc
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2, service_pb2

from .._errors import InvalidArgumentError, TritonpyError, UnavailableError, UnsupportedError
from ._grpc_codec import (
    _RAW_OUT_TAG,
    _param_value,
    _varint,
    decode_request,
    encode_result,
    split_infer,
)
from ._grpc_stream import _StreamInfer
from ._h2_grpc import Serialized
from ._infer_types import InferRequest, InferResult, RequestPlan, ShmRef, keep
from ._request_parsing import forward_headers, parse_version, shm_ref, traceparent
from .dataplane import DataPlane, needs_traceback, to_error

log = logging.getLogger("tritonpy.frontends.grpc")  # the gRPC frontend's one logger

_DECOUPLED = "ModelInfer RPC doesn't support models with decoupled transaction policy"

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])

#: grpc.health.v1.HealthCheckResponse with status SERVING (1) and NOT_SERVING (2), encoded.
_SERVING, _NOT_SERVING = b"\x08\x01", b"\x08\x02"


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
            if needs_traceback(exc):
                log.exception("gRPC %s failed", fn.__name__)
            await context.abort(getattr(grpc.StatusCode, err.grpc_code), err.message)

    return wrapper  # type: ignore[return-value]


class _Keyed:
    """A parsed ``ModelInferRequest`` and the key of the plan its decode may make."""

    __slots__ = ("message", "key")

    def __init__(self, message: Any, key: bytes) -> None:
        self.message, self.key = message, key


class GRPCService(_StreamInfer):
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
