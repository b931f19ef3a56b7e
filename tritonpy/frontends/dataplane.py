"""The data plane both network frontends share (as MLServer's ``handlers/dataplane.py``).

The HTTP and gRPC frontends only translate their wire formats into the neutral
:class:`~._infer_types.InferRequest` and :class:`~._infer_types.InferResult` back; everything
in between is :class:`DataPlane`'s: the call into the in-process :class:`tritonpy.Server`
without blocking the event loop, inputs read from client shared memory, cancellation when the
client goes away, output placement (binary, JSON, shared memory) and the one mapping of any
failure onto a :class:`~tritonpy._errors.TritonpyError`. What it shares with the frontends
lives beside it, one concern a module:

- ``_infer_types``: the wire-neutral request and result types, and the per-header request plan;
- ``_request_parsing``: request parameters, model version, a tensor's shared-memory window, the
  JSON body, restricted APIs and forwarded headers;
- ``_tensor_decode``: input tensors from raw bytes or JSON, and Triton's limits on tensors;
- ``_tensor_encode``: output bytes, the JSON form of an output, the classification extension;
- ``_log_settings``: the dynamic logging settings.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, AsyncGenerator, Mapping, Sequence

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
from ..shm._errors import FdLimitError, ProtocolError, ShmError, ShmExhaustedError
from ..shm.dtypes import ITEMSIZE
from ..validation import request_prefix
from ._infer_types import InferRequest, InferResult, OutputTensor, RequestedOutput, ShmRef
from ._log_settings import LogSettings
from ._request_parsing import parse_version
from ._tensor_decode import (PendingBytes, check_byte_size, check_raw_size, element_count,
                             input_from_raw, numpy_dtype)
from ._tensor_encode import classify
from .sharedmem import SharedMemoryRegistry

if TYPE_CHECKING:
    from .._request import AsyncResponseStream
    from .._model_handle import Model
    from ..server import Server

#: Triton's default for ``--http-max-input-size`` (and our gRPC receive limit).
DEFAULT_MAX_INPUT_SIZE = 64 * 1024 * 1024
#: Triton's words for a client's request that comes while the server drains (see
#: Server.refuse_new_requests).
STOPPING = ("Server is stopping, scheduler for model has stopped accepting new inference "
            "requests")
#: BYTES inputs of at least this many wire bytes in one request are decoded in a worker thread:
#: millions of elements take a second, which the event loop must not spend.
BYTES_OFF_LOOP = 1 << 20


# ------------------------------------------------------------------------------ error mapping


def needs_traceback(exc: BaseException) -> bool:
    """Whether an error of serving a request is tritonpy's own fault, to log with its
    traceback; not one it answers in words of its own (a TritonpyError), nor a full
    /dev/shm or a descriptor limit (the client's answer says it all; before, each such 503
    of a request whose input lay in a client's shared memory logged a traceback)."""
    return not isinstance(exc, (TritonpyError, ShmExhaustedError, FdLimitError))


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
                       model: str, request_id: str = ""
                       ) -> np.ndarray | PendingBytes | DeviceRef:
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
        dtype = numpy_dtype(name, datatype)
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
