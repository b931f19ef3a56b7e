"""A gRPC server on HTTP/2 (the ``h2`` state machine) and the frontends' asyncio loop.

``grpc.aio``'s server costs ~150 µs of CPU per unary call on this kind of machine before any
work is done, and makes its client spend ~120 µs more (many small writes and pings). This one
parses frames with ``h2``, writes each call's headers, message and trailers in one send, and
runs the same servicer methods (:class:`~tritonpy.frontends.grpc.GRPCService`) through a small
context with the parts of ``grpc.aio.ServicerContext`` they use (``abort``, ``write``,
``add_done_callback``). What it speaks: unary and bidirectional-streaming calls, deadlines
(``grpc-timeout``), compressed requests (gzip, deflate), flow control both ways, cancellation
(``RST_STREAM``), a drained stop (``GOAWAY``). Not served: TLS, server reflection.
"""
from __future__ import annotations

import asyncio
import gzip
import logging
import struct
import zlib
from typing import Any, AsyncIterator, Awaitable, Callable
from urllib.parse import quote

import grpc
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings

log = logging.getLogger(__name__)

_PREFIX = struct.Struct(">BI")  # a gRPC message: compressed flag, length
_RESPONSE_HEADERS = [(b":status", b"200"), (b"content-type", b"application/grpc"),
                     (b"grpc-accept-encoding", b"identity,deflate,gzip")]
_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
_OK = 0
_CANCELLED = grpc.StatusCode.CANCELLED.value[0]
_UNKNOWN = grpc.StatusCode.UNKNOWN.value[0]
_DEADLINE = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
_UNIMPLEMENTED = grpc.StatusCode.UNIMPLEMENTED.value[0]
_INTERNAL = grpc.StatusCode.INTERNAL.value[0]
_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
_RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
#: Our receive windows: large, so a client sending big tensors rarely waits for an update.
_WINDOW = 1 << 24
_MAX_FRAME = (1 << 24) - 1


class Method:
    """One RPC: its handler (a servicer's bound method), how to read its requests and write its
    responses, and whether the client streams (bidirectional) or sends one request."""

    __slots__ = ("handler", "parse", "streaming")

    def __init__(self, handler: Callable[..., Awaitable[Any]], parse: Callable[[Any], Any],
                 streaming: bool) -> None:
        self.handler, self.parse, self.streaming = handler, parse, streaming


class _Closed(Exception):
    """The call is over (cancelled, reset by the client, or the connection is gone)."""


class Context:
    """What a servicer method sees of its call (a subset of ``grpc.aio.ServicerContext``)."""

    __slots__ = ("_call", "code", "details", "_done")

    def __init__(self, call: _Call) -> None:
        self._call = call
        self.code = _OK
        self.details = ""
        self._done: list[Callable[[Any], None]] = []

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        """End the call with ``code`` and ``details`` (raises, as grpc's does)."""
        self.code, self.details = code.value[0], details
        raise grpc.aio.AbortError(details)

    async def write(self, message: Any) -> None:
        """Send one message of a streaming response; raises once the call is over."""
        await self._call.send_message(message.SerializeToString())

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        """Run ``callback(context)`` once the call's last bytes are handed to the socket."""
        self._done.append(callback)

    def cancelled(self) -> bool:
        return self._call.closed

    def finish(self) -> None:
        for callback in self._done:
            try:
                callback(self)
            except Exception:
                log.exception("gRPC done callback failed")


class _Call:
    """One stream of a connection: its request bytes, its handler task, its sends."""

    __slots__ = ("conn", "sid", "method", "buf", "messages", "ended", "closed", "headers_sent",
                 "task", "deadline", "encoding", "window", "context")

    def __init__(self, conn: _Connection, sid: int, method: Method | None,
                 encoding: bytes | None) -> None:
        self.conn, self.sid, self.method, self.encoding = conn, sid, method, encoding
        self.buf = bytearray()
        self.messages: asyncio.Queue[Any] | None = None  # streaming: parsed requests, then None
        self.ended = False  # the client sent END_STREAM
        self.closed = False  # nothing more can be sent
        self.headers_sent = False
        self.task: asyncio.Task[None] | None = None
        self.deadline: asyncio.TimerHandle | None = None
        self.window: asyncio.Future[None] | None = None  # waiting for the client's window
        self.context = Context(self)

    # -- receiving -------------------------------------------------------------------------------
    def feed(self, data: bytes) -> list[Any]:
        """Append request bytes; return the whole messages they complete, parsed."""
        buf = self.buf
        buf += data
        out = []
        while len(buf) >= 5:
            flag, size = _PREFIX.unpack_from(buf)
            if len(buf) < 5 + size:
                break
            assert self.method is not None
            view = memoryview(buf)
            part = view[5:5 + size]
            try:  # protobuf copies what it keeps: parse in place, no copy of the message
                out.append(self.method.parse(self._decompress(part) if flag else part))
            finally:
                part.release()
                view.release()
            del buf[:5 + size]
        return out

    def _decompress(self, payload: memoryview) -> bytes:
        if self.encoding == b"gzip":
            return gzip.decompress(payload)
        if self.encoding == b"deflate":
            return zlib.decompress(payload)
        raise _Status(_UNIMPLEMENTED, f"Compression algorithm '{(self.encoding or b'identity').decode()}' "
                                      "is not supported")

    # -- sending ---------------------------------------------------------------------------------
    async def send_message(self, payload: bytes, flush: bool = True) -> None:
        """Send one message (its headers first if none went yet); ``flush=False`` leaves the
        bytes for the next write (a unary call's trailers follow at once)."""
        if self.closed:
            raise _Closed("the call is over")
        conn = self.conn
        if not self.headers_sent:
            self.headers_sent = True
            try:
                conn.h2.send_headers(self.sid, _RESPONSE_HEADERS)
            except h2.exceptions.StreamClosedError:
                raise _Closed("the client closed the stream") from None
        await self._send_data(_PREFIX.pack(0, len(payload)) + payload)
        if flush:
            conn.flush()

    async def _send_data(self, data: bytes) -> None:
        h2c = self.conn.h2
        view = memoryview(data)
        while view:
            if self.closed:
                raise _Closed("the call is over")
            size = min(len(view), h2c.local_flow_control_window(self.sid), h2c.max_outbound_frame_size)
            if size <= 0:
                self.conn.flush()
                self.window = asyncio.get_running_loop().create_future()
                await self.window
                self.window = None
                continue
            try:
                h2c.send_data(self.sid, view[:size])
            except h2.exceptions.StreamClosedError:
                raise _Closed("the client closed the stream") from None
            view = view[size:]

    def finish(self, code: int, details: str = "") -> None:
        """Send the trailers (or a trailers-only response) and end the stream."""
        if self.closed:
            return
        self.closed = True
        self.cancel_deadline()
        trailers = [(b"grpc-status", str(code).encode())]
        if details:
            trailers.append((b"grpc-message", quote(details, safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~").encode()))
        h2c = self.conn.h2
        try:
            if not self.headers_sent:
                self.headers_sent = True
                h2c.send_headers(self.sid, _RESPONSE_HEADERS[:2] + trailers, end_stream=True)
            else:
                h2c.send_headers(self.sid, trailers, end_stream=True)
        except h2.exceptions.H2Error:  # the client reset the stream meanwhile
            pass
        self.conn.flush_soon()
        self.conn.calls.pop(self.sid, None)
        self.context.finish()

    def cancel_deadline(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def abandon(self) -> None:
        """The client reset the stream or the connection is gone: stop the handler."""
        if self.closed:
            return
        self.closed = True
        self.cancel_deadline()
        self.conn.calls.pop(self.sid, None)
        if self.window is not None and not self.window.done():
            self.window.set_exception(_Closed("the call is over"))
        if self.task is not None:
            self.task.cancel()
        if self.messages is not None:
            self.messages.put_nowait(None)
        self.context.finish()

    def expire(self) -> None:
        """The client's deadline passed."""
        self.deadline = None
        if self.task is not None:
            self.task.cancel()
        self.finish(_DEADLINE, "Deadline Exceeded")
        try:
            self.conn.h2.reset_stream(self.sid, h2.errors.ErrorCodes.CANCEL)
        except h2.exceptions.H2Error:
            pass
        self.conn.flush()


class _Status(Exception):
    """End the call with this gRPC status (before or outside a handler)."""

    def __init__(self, code: int, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _Connection(asyncio.Protocol):
    """One client connection."""

    def __init__(self, server: Http2GrpcServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        config = h2.config.H2Configuration(
            client_side=False, header_encoding=None, validate_inbound_headers=False,
            normalize_inbound_headers=False, validate_outbound_headers=False,
            normalize_outbound_headers=False)
        self.h2 = h2.connection.H2Connection(config)
        self.h2.local_settings = h2.settings.Settings(client=False, initial_values={
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 1 << 16,
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: _WINDOW,
            h2.settings.SettingCodes.MAX_FRAME_SIZE: _MAX_FRAME,
        })
        # H2Connection read these from its default settings when it was made.
        self.h2.max_inbound_frame_size = _MAX_FRAME
        self.calls: dict[int, _Call] = {}
        self.flush_pending = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no asyncio.Transport
        self.server.connections.add(self)
        self.h2.initiate_connection()
        self.h2.increment_flow_control_window(_WINDOW)  # the connection's own window
        self.flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        for call in list(self.calls.values()):
            call.abandon()
        self.transport = None

    def flush(self) -> None:
        data = self.h2.data_to_send()
        if data and self.transport is not None:
            self.transport.write(data)

    def flush_soon(self) -> None:
        """Flush at the end of this turn of the loop: the answers of the calls that end in
        it (many clients share a connection) leave in one write."""
        if not self.flush_pending:
            self.flush_pending = True
            asyncio.get_running_loop().call_soon(self._deferred_flush)

    def _deferred_flush(self) -> None:
        self.flush_pending = False
        self.flush()

    def data_received(self, data: bytes) -> None:
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError as exc:
            log.debug("gRPC connection dropped: HTTP/2 protocol error: %s", exc)
            self.flush()
            if self.transport is not None:
                self.transport.close()
            return
        event: Any
        for event in events:
            kind = type(event)
            if kind is h2.events.DataReceived:
                self._data(event)
            elif kind is h2.events.RequestReceived:
                self._request(event)
            elif kind is h2.events.StreamEnded:
                self._ended(event.stream_id)
            elif kind is h2.events.WindowUpdated:
                self._window(event.stream_id)
            elif kind is h2.events.StreamReset:
                call = self.calls.get(event.stream_id)
                if call is not None:
                    call.abandon()
            elif kind is h2.events.RemoteSettingsChanged:
                self._window(0)  # a new initial window may let waiting sends go on
            elif kind is h2.events.ConnectionTerminated:
                # The client opens no more streams; those running may still finish.
                if not self.calls and self.transport is not None:
                    self.transport.close()
        self.flush()

    def _request(self, event: Any) -> None:
        sid = event.stream_id
        path = encoding = timeout = None
        for name, value in event.headers:
            if name == b":path":
                path = value
            elif name == b"grpc-encoding":
                encoding = value
            elif name == b"grpc-timeout":
                timeout = value
        method = self.server.methods.get(path) if path is not None else None
        call = _Call(self, sid, method, encoding)
        self.calls[sid] = call
        if method is None:
            call.finish(_UNIMPLEMENTED, f"Method not found: {(path or b'').decode(errors='replace')}")
            return
        if self.server.stopping:
            call.finish(_UNAVAILABLE, "the server is stopping")
            return
        if timeout is not None:
            seconds = _parse_timeout(timeout)
            if seconds is not None:
                call.deadline = asyncio.get_running_loop().call_later(seconds, call.expire)
        if method.streaming:
            call.messages = asyncio.Queue()
            call.task = asyncio.ensure_future(self.server.run_streaming(call))

    def _data(self, event: Any) -> None:
        sid = event.stream_id
        if event.flow_controlled_length:
            try:
                self.h2.acknowledge_received_data(event.flow_controlled_length, sid)
            except h2.exceptions.StreamClosedError:
                pass
        call = self.calls.get(sid)
        if call is None or call.closed or call.method is None:
            return
        try:
            messages = call.feed(event.data)
        except _Status as exc:
            call.finish(exc.code, exc.details)
            self._abort_task(call)
            return
        except Exception as exc:  # a message that does not parse
            call.finish(_INTERNAL, f"Failed to parse the request: {exc}")
            self._abort_task(call)
            return
        if not messages:
            return
        if call.messages is not None:
            for m in messages:
                call.messages.put_nowait(m)
        elif call.task is None and len(messages) == 1:
            call.task = asyncio.ensure_future(self.server.run_unary(call, messages[0]))
        else:
            call.finish(_UNIMPLEMENTED, "a unary method got more than one request message")
            self._abort_task(call)

    @staticmethod
    def _abort_task(call: _Call) -> None:
        if call.task is not None:
            call.task.cancel()

    def _ended(self, sid: int) -> None:
        call = self.calls.get(sid)
        if call is None or call.closed:
            return
        call.ended = True
        if call.messages is not None:
            call.messages.put_nowait(None)
        elif call.task is None:
            call.finish(_UNIMPLEMENTED if not call.buf else _INTERNAL,
                        "no request message" if not call.buf else "a request message is cut short")

    def _window(self, sid: int) -> None:
        calls = self.calls.values() if sid == 0 else [c for c in (self.calls.get(sid),) if c]
        for call in list(calls):
            if call.window is not None and not call.window.done():
                call.window.set_result(None)

    def goaway(self) -> None:
        """Tell the client the connection is closing."""
        try:
            self.h2.close_connection(last_stream_id=max(self.calls, default=0))
        except h2.exceptions.H2Error:
            return
        self.flush()


def _parse_timeout(value: bytes) -> float | None:
    unit = _TIMEOUT_UNITS.get(value[-1:])
    if unit is None or not value[:-1].isdigit():
        return None
    return int(value[:-1]) * unit


class Http2GrpcServer:
    """Serve ``methods`` (path → :class:`Method`) on ``host:port``."""

    def __init__(self, methods: dict[str, Method]) -> None:
        self.methods = {path.encode(): m for path, m in methods.items()}
        self.connections: set[_Connection] = set()
        self.stopping = False
        self._server: asyncio.AbstractServer | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen; return the port (the one picked when ``port`` is 0)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port,
                                                reuse_address=True)
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self, grace: float) -> None:
        """Take no new calls, give the running ones ``grace`` seconds, cancel the rest."""
        self.stopping = True  # new calls are refused (UNAVAILABLE) from now on
        if self._server is not None:
            self._server.close()
        # GOAWAY only once the calls are over: h2 sends nothing after it on a connection.
        tasks = [c.task for conn in self.connections for c in conn.calls.values()
                 if c.task is not None and not c.task.done()]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=grace)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)
        for conn in list(self.connections):
            conn.goaway()
            if conn.transport is not None:
                conn.transport.close()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def run_unary(self, call: _Call, request: Any) -> None:
        assert call.method is not None
        context = call.context
        try:
            response = await call.method.handler(request, context)
            if not call.closed:
                await call.send_message(response.SerializeToString(), flush=False)
        except grpc.aio.AbortError:
            call.finish(context.code or _UNKNOWN, context.details)
            return
        except (asyncio.CancelledError, _Closed):
            return
        except Exception as exc:
            log.exception("gRPC call failed")
            call.finish(_UNKNOWN, f"Unexpected {type(exc).__name__}: {exc}")
            return
        call.finish(_OK)

    async def run_streaming(self, call: _Call) -> None:
        assert call.method is not None and call.messages is not None
        context = call.context
        messages = call.messages

        async def requests() -> AsyncIterator[Any]:
            while True:
                message = await messages.get()
                if message is None:
                    return
                yield message

        try:
            await call.method.handler(requests(), context)
        except grpc.aio.AbortError:
            call.finish(context.code or _UNKNOWN, context.details)
            return
        except (asyncio.CancelledError, _Closed):
            return
        except Exception as exc:
            log.exception("gRPC stream failed")
            call.finish(_UNKNOWN, f"Unexpected {type(exc).__name__}: {exc}")
            return
        call.finish(_OK)
