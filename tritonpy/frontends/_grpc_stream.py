"""The bidirectional ``ModelStreamInfer`` of the gRPC frontend (:mod:`.grpc`).

As Triton's ``src/grpc``: on the bidirectional stream each request runs concurrently, a failed
request becomes an ``error_message`` on the stream (the stream stays open), default-mode models
answer in request order, decoupled models answer as their responses arrive, and every response
carries ``triton_final_response`` (the flags-only final response only when the request asked
for it with ``triton_enable_empty_final_response``). A stream opened with the header
``triton_grpc_error: true`` ends instead at its first error from a model, with that error's
gRPC status, and what else runs on it is cancelled (as Triton 2.49+; a request refused before
it reaches a model is still answered in ``error_message``, as in Triton 2.51). On stop, a
request that comes on a stream is refused with an ``error_message``, and a stream ends, with
UNAVAILABLE "the server is stopping", once nothing has been in flight on it and no request has
come for :data:`STOP_QUIET_S`: an idle client does not hold the shutdown, and one still sending
gets an answer for each request (perf_analyzer waited for ever on requests that got none;
Triton answers each with an error until it exits).
"""
from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Any, AsyncIterator, Callable

import grpc
from tritonclient.grpc import service_pb2

from .._errors import TritonpyError, UnavailableError
from ._grpc_codec import decode_request, encode_result
from ._infer_types import InferRequest, InferResult
from ._request_parsing import forward_headers, traceparent
from .dataplane import DataPlane, to_error

log = logging.getLogger("tritonpy.frontends.grpc")  # the gRPC frontend's one logger

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


def _bare(result: InferResult, asked_version: str) -> Any:
    """A stream's error or flags-only final response: no outputs, and the version as the
    request named it (Triton copies the request's model_version: empty when none was given)."""
    resp = service_pb2.ModelInferResponse(
        model_name=result.model, model_version=asked_version, id=result.request_id)
    resp.parameters["triton_final_response"].bool_param = result.final
    return resp


class _StreamInfer:
    """The ``ModelStreamInfer`` RPC of :class:`~._grpc_service.GRPCService`, its one base.

    A mixin rather than an object of its own: the stream shares the service's state as it runs
    (``stopping`` and the ``_streams`` that :meth:`._grpc_service.GRPCService.begin_stop`
    wakes, the data plane, the header-forward pattern), and :class:`~.grpc.GRPCFrontend`
    finds each RPC by its gRPC name on the one service object. It costs nothing per request.
    """

    plane: DataPlane
    header_forward: re.Pattern[str] | None
    stopping: bool
    _streams: set[Callable[[], None]]

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
