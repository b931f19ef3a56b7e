"""One call of :mod:`._http2`'s server (an HTTP/2 stream): its request bytes parsed into
messages (inflated, on or off the event loop), its response messages framed as the client's
windows allow, its trailers, deadline and cancel; and :class:`Context`, what a servicer method
sees of it.
"""
from __future__ import annotations

import asyncio
import logging
import zlib
from typing import TYPE_CHECKING, Any, Callable, Sequence
from urllib.parse import quote

import grpc

from . import _h2_frames, _h2_grpc
from ._h2_frames import _DATA, _NO_ERROR, _RST_STREAM, _frame, _literal
from ._h2_grpc import (_COMPRESS_OFF_LOOP, _COMPRESSED_HEADERS, _DEADLINE, _INTERNAL, _MESSAGE_SAFE,
                       _OK, _RESOURCE_EXHAUSTED, _RESPONSE_HEADERS, _SMALL_MESSAGE,
                       _TRAILERS_OK, _UNIMPLEMENTED, Method, Serialized, _Closed, _compress,
                       _Status)

if TYPE_CHECKING:
    from ._h2_connection import _Connection

# The server's one logger, named as before the split (log settings and tests name it).
log = logging.getLogger("tritonpy.frontends._http2")

# The structs are bound by assignment, not imported by name: CPython 3.11 compiles
# ``name.method(...)`` on a global an import statement bound as an attribute load and a call (a
# bound method made at each call), on any other global as LOAD_METHOD, as before the split.
_FRAME, _U32, _PREFIX = _h2_frames._FRAME, _h2_frames._U32, _h2_grpc._PREFIX

#: A compressed request message larger than this is inflated off the event loop (a message
#: can inflate to ~1000 times its size: seconds of CPU for the largest ones).
INFLATE_ON_LOOP = 65536


class Context:
    """What a servicer method sees of its call (a subset of ``grpc.aio.ServicerContext``),
    and ``metadata``: the call's own headers as (name, value) pairs, for a method that asks for
    them (empty otherwise)."""

    __slots__ = ("_call", "code", "details", "_done", "metadata")

    def __init__(self, call: _Call) -> None:
        self._call = call
        self.code = _OK
        self.details = ""
        self._done: list[Callable[[Any], None]] = []
        self.metadata: Sequence[tuple[str, str]] = ()

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        """End the call with ``code`` and ``details`` (raises, as grpc's does)."""
        self.code, self.details = code.value[0], details
        raise grpc.aio.AbortError(details)

    async def write(self, message: Any) -> None:
        """Send one message of a streaming response; raises once the call is over."""
        await self._call.send_message(message if type(message) is Serialized
                                      else message.SerializeToString())

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
                 "task", "deadline", "encoding", "window", "send_window", "unacked", "context",
                 "compress")

    def __init__(self, conn: _Connection, sid: int, method: Method | None,
                 encoding: bytes | None, compress: bytes | None = None) -> None:
        self.conn, self.sid, self.method, self.encoding = conn, sid, method, encoding
        self.compress = compress  # the algorithm its response messages use, if any
        self.buf = bytearray()
        self.messages: asyncio.Queue[Any] | None = None  # streaming: parsed requests, then None
        self.ended = False  # the client has sent all it will (END_STREAM)
        self.closed = False  # nothing more can be sent
        self.headers_sent = False
        self.task: asyncio.Task[None] | None = None
        self.deadline: asyncio.TimerHandle | None = None
        self.window: asyncio.Future[None] | None = None  # waiting for the client's window
        self.send_window = conn.peer_window  # what the client lets us send on this stream
        self.unacked = 0  # bytes received on this stream since our last WINDOW_UPDATE
        self.context = Context(self)

    # -- receiving -------------------------------------------------------------------------------
    def feed(self, data: Any) -> list[Any]:
        """Append request bytes; return the whole messages they complete, parsed."""
        buf = self.buf
        buf += data
        out = []
        limit = self.conn.server.max_message
        while len(buf) >= 5:
            flag, size = _PREFIX.unpack_from(buf)
            if size > limit:
                raise _Status(_RESOURCE_EXHAUSTED,
                              f"Received message larger than max ({size} vs. {limit})")
            if len(buf) < 5 + size:
                break
            assert self.method is not None
            if not flag and size > _SMALL_MESSAGE and len(buf) == 5 + size:
                # A large message alone in the buffer: the buffer is its own from now on, and
                # what the parser keeps may be views of it (read-only ones: see parse).
                self.buf = bytearray()
                out.append(self.method.parse(memoryview(buf)[5:].toreadonly()))
                return out
            view = memoryview(buf)
            part = view[5:5 + size]
            try:  # protobuf copies what it keeps: parse in place, no copy of the message
                if flag and size > INFLATE_ON_LOOP:  # up to ~1000x its size: off the loop
                    out.append(_Deferred(self, bytes(part)))
                else:
                    out.append(self.method.parse(self._decompress(part) if flag else part))
            finally:
                part.release()
                view.release()
            del buf[:5 + size]
        return out

    def inflate_and_parse(self, payload: bytes) -> Any:
        """A compressed message, inflated and parsed (in a worker thread)."""
        assert self.method is not None
        data = self._decompress(memoryview(payload))
        try:
            return self.method.parse(data)
        except Exception as exc:
            raise _Status(_INTERNAL, f"Failed to parse the request: {exc}") from None

    def _decompress(self, payload: memoryview) -> bytes:
        """The message, inflated to at most the server's message limit (a small message that
        inflates past it is RESOURCE_EXHAUSTED, not memory spent)."""
        wbits = {b"gzip": 31, b"deflate": 15}.get(self.encoding or b"")
        if wbits is None:
            raise _Status(_UNIMPLEMENTED, "Compression algorithm "
                          f"'{(self.encoding or b'identity').decode()}' is not supported")
        limit = self.conn.server.max_message
        inflater = zlib.decompressobj(wbits)
        try:
            out = inflater.decompress(payload, limit + 1)
        except zlib.error as exc:
            raise _Status(_INTERNAL, f"Failed to decompress the request: {exc}") from None
        if len(out) > limit:
            raise _Status(_RESOURCE_EXHAUSTED,
                          f"Received message larger than max ({len(out)}+ vs. {limit})")
        return out

    # -- sending ---------------------------------------------------------------------------------
    async def send_message(self, payload: Any, flush: bool = True) -> None:
        """Send one message (its headers first if none went yet); ``flush=False`` leaves the
        bytes for the next write (a unary call's trailers follow at once). ``payload``: the
        serialized message, or a :class:`Serialized` one whose parts go to the socket as they
        are (a large tensor is not copied into frames)."""
        if self.closed:
            raise _Closed("the call is over")
        conn = self.conn
        algo = self.compress
        if not self.headers_sent:
            self.headers_sent = True
            conn.send_headers(self.sid, _RESPONSE_HEADERS if algo is None
                              else _COMPRESSED_HEADERS[algo], end_stream=False)
        if type(payload) is Serialized:
            if algo is None and payload.size > _SMALL_MESSAGE:
                conn.sends += 1
                await self._send_in_frames([_PREFIX.pack(0, payload.size), *payload.parts])
                if flush:
                    conn.flush()
                    if conn.write_paused:
                        await conn.writable()
                return
            payload = payload.SerializeToString()
        if algo is None:
            data = _PREFIX.pack(0, len(payload)) + payload
        else:
            # A large message is compressed off the loop: the other calls go on meanwhile.
            payload = (_compress(algo, payload) if len(payload) < _COMPRESS_OFF_LOOP
                       else await asyncio.to_thread(_compress, algo, payload))
            if self.closed:
                raise _Closed("the call is over")
            data = _PREFIX.pack(1, len(payload)) + payload
        size = len(data)
        conn.sends += 1
        if size <= self.send_window and size <= conn.send_window and size <= conn.peer_max_frame:
            self.send_window -= size
            conn.send_window -= size
            conn.out.append(_frame(_DATA, 0, self.sid, data))
        else:
            await self._send_in_frames([data])
        if flush:
            conn.flush()
            if conn.write_paused:  # the client is not reading: wait until it does
                await conn.writable()

    async def _send_in_frames(self, parts: list[Any]) -> None:
        """DATA frames of the bytes of ``parts``, as the client's windows allow. A frame is
        its header and views of the parts (no copy: the socket write takes them as they are)."""
        conn = self.conn
        views = [memoryview(p).cast("B") for p in parts]
        views.reverse()  # taken from the end
        view = views.pop()
        while True:
            if self.closed:
                raise _Closed("the call is over")
            if conn.write_paused:  # the client is not reading: wait until it does
                conn.flush()
                await conn.writable()
                if self.closed:
                    raise _Closed("the call is over")
            room = min(self.send_window, conn.send_window, conn.peer_max_frame)
            if room <= 0:  # the client's window is full: wait for its WINDOW_UPDATE
                conn.flush()
                self.window = asyncio.get_running_loop().create_future()
                try:
                    await self.window
                finally:
                    self.window = None
                continue
            header = len(conn.out)
            conn.out.append(b"")  # the frame's header, once its size is known
            size = 0
            while size < room:
                take = view[:room - size]
                size += len(take)
                conn.out.append(take)
                view = view[len(take):]
                if not view:
                    if not views:
                        break
                    view = views.pop()
            self.send_window -= size
            conn.send_window -= size
            conn.out[header] = _FRAME.pack(size >> 16, size & 0xFFFF, _DATA, 0, self.sid)
            conn.out_bytes += size
            # Each frame is data sent: as in gRPC core, the client's pings while a long answer
            # flows (its BDP probes) are no strikes, nor are they pings without data.
            conn.sends += 1
            if not view and not views:
                return

    def wake(self) -> None:
        if self.window is not None and not self.window.done():
            self.window.set_result(None)

    def _fail_window(self) -> None:
        """A send waiting for the client's window learns that the call is over."""
        if self.window is not None and not self.window.done():
            self.window.set_exception(_Closed("the call is over"))

    def finish(self, code: int, details: str = "") -> None:
        """Send the trailers (or a trailers-only response) and end the stream; a client still
        sending gets RST_STREAM(NO_ERROR) after them."""
        if self.closed:
            return
        self.closed = True
        self.cancel_deadline()
        if code == _OK and not details:
            trailers = _TRAILERS_OK
        else:
            trailers = _literal(b"grpc-status", str(code).encode())
            if details:
                # One HEADERS frame holds it (the client's frames are 16 KiB at least).
                message = quote(details, safe=_MESSAGE_SAFE)[:8192].encode()
                trailers += _literal(b"grpc-message", message)
        conn = self.conn
        if not self.headers_sent:
            self.headers_sent = True
            trailers = _RESPONSE_HEADERS + trailers
        conn.send_headers(self.sid, trailers, end_stream=True)
        if not self.ended:
            # The client is still sending (a stream): tell it to stop, as gRPC's own servers
            # do, so that its call ends on these trailers whatever happens to the connection.
            conn.out.append(_frame(_RST_STREAM, 0, self.sid, _U32.pack(_NO_ERROR)))
        conn.forget(self.sid)
        if conn.calls:
            conn.flush_soon()  # the answers of calls ending in this turn of the loop: one write
        else:
            conn.flush()  # no other call open: none can end with it, so no turn to wait for
        self.buf = bytearray()  # a message cut short: its bytes go now, not with the GC
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
        self.conn.forget(self.sid)
        self.buf = bytearray()
        self._fail_window()
        if self.task is not None:
            self.task.cancel()
        if self.messages is not None:
            self.messages.put_nowait(None)
        self.context.finish()

    def expire(self) -> None:
        """The client's deadline passed: answer DEADLINE_EXCEEDED and reset the stream."""
        self.deadline = None
        if self.task is not None:
            self.task.cancel()
        self._fail_window()
        # Then RST_STREAM NO_ERROR, as for any call (see finish): with CANCEL, the client's gRPC
        # library reported the reset ("Stream removed", CANCELLED in some) in most calls, not
        # the trailers' status.
        self.finish(_DEADLINE, "Deadline Exceeded")
        self.conn.flush()


class _Deferred:
    """A large compressed request message, inflated and parsed off the event loop when the
    call's handler comes to it (``await resolve(message)``)."""

    __slots__ = ("call", "payload")

    def __init__(self, call: _Call, payload: bytes) -> None:
        self.call, self.payload = call, payload


async def resolve(message: Any) -> Any:
    """The request message itself (a :class:`_Deferred` one is inflated in a thread)."""
    if type(message) is not _Deferred:
        return message
    payload, message.payload = message.payload, b""
    return await asyncio.to_thread(message.call.inflate_and_parse, payload)
