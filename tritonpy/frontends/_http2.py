"""A gRPC server on HTTP/2, written for the frontends' asyncio loop.

``grpc.aio``'s server costs ~150 µs of CPU per unary call on a 2-vCPU VM before any work is
done, and makes its client spend ~120 µs more (many small writes and pings); the ``h2`` state
machine alone costs ~80 µs a call. This module frames HTTP/2 itself (RFC 9113), only what a
gRPC server needs, with ``hpack`` for request headers (decoded blocks that only index the table
are cached: a client's repeated calls send the same few bytes). It writes a call's headers,
message and trailers in one send, and runs the servicer methods of
:class:`~tritonpy.frontends.grpc.GRPCService` through a small context with the parts of
``grpc.aio.ServicerContext`` they use (``abort``, ``write``, ``add_done_callback``).

Served: unary and bidirectional-streaming calls, deadlines (``grpc-timeout``), compressed
requests (gzip, deflate), flow control both ways, padding, CONTINUATION, PING, SETTINGS,
RST_STREAM (a client's cancel), GOAWAY both ways and a drained stop; TLS (ALPN h2, client
certificates as the given context asks); responses compressed at a level, for the methods that
allow it, with an algorithm the client accepts; a method restricted to calls that carry a
header; a call's metadata handed to the handlers that ask for it; keepalive pings, gRPC core's
ping-strike policy and a maximum connection age (:class:`KeepAlive`, Triton's flags). Response headers never use the
HPACK dynamic table (its size is set to 0 once per connection). Not served: server push,
priorities (ignored), reflection.
"""
from __future__ import annotations

import asyncio
import gzip
import logging
import random
import struct
import zlib
from dataclasses import dataclass, fields
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence
from urllib.parse import quote

import grpc
import hpack

from .._loop import wait_all

log = logging.getLogger(__name__)

_PREFIX = struct.Struct(">BI")  # a gRPC message: compressed flag, length
_FRAME = struct.Struct(">BHBBI")  # length (24 bits: high byte, low 16), type, flags, stream
_SETTING = struct.Struct(">HI")
_U32 = struct.Struct(">I")
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# Frame types and flags.
_DATA, _HEADERS, _PRIORITY, _RST_STREAM, _SETTINGS, _PUSH_PROMISE, _PING, _GOAWAY, \
    _WINDOW_UPDATE, _CONTINUATION = range(10)
_END_STREAM, _ACK, _END_HEADERS, _PADDED, _PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
# Error codes and settings.
_NO_ERROR, _PROTOCOL_ERROR, _FLOW_CONTROL_ERROR, _STREAM_CLOSED, _FRAME_SIZE_ERROR, \
    _REFUSED_STREAM, _COMPRESSION_ERROR, _ENHANCE_YOUR_CALM = \
    0x0, 0x1, 0x3, 0x5, 0x6, 0x7, 0x9, 0xB
_INITIAL_WINDOW_SIZE, _MAX_FRAME_SIZE, _MAX_CONCURRENT_STREAMS = 0x4, 0x5, 0x3
_DEFAULT_WINDOW = 65535
#: Our receive windows: large, so a client sending big tensors rarely waits for an update.
_WINDOW = 1 << 24
_MAX_FRAME = (1 << 24) - 1
_MAX_WINDOW = (1 << 31) - 1
#: The most metadata a call may have, decoded (names and values, 32 bytes more each, as HTTP/2
#: counts a header list): gRPC's own hard limit. A call past it alone is refused
#: (RESOURCE_EXHAUSTED, gRPC core's words); the other calls of its connection go on.
MAX_HEADER_BLOCK = 1 << 14
#: A header block past this, compressed, or decoding past ``_MAX_DECODED``, ends the connection
#: (GOAWAY): past what any call could use, it is an attack on the server's memory.
MAX_COMPRESSED_BLOCK = 1 << 16
_MAX_DECODED = 1 << 18
#: Streams open at once on a connection (advertised; more are refused with REFUSED_STREAM).
MAX_STREAMS = 4096
#: A connection whose client preface has not come by then is closed.
PREFACE_TIMEOUT = 10.0
#: Write buffer (bytes) past which a connection stops reading its client's frames until the
#: client reads what it was sent: a client that sends but never reads costs bounded memory.
_WRITE_HIGH = 1 << 22
_MAX_CONTINUATIONS = 64
#: On stop, how long a client gets to close its end after ours is closed.
_CLOSE_WAIT = 1.0
#: A compressed request message larger than this is inflated off the event loop (a message
#: can inflate to ~1000 times its size: seconds of CPU for the largest ones).
INFLATE_ON_LOOP = 65536
#: The payload of our keepalive pings (a client's own pings carry theirs).
_KEEPALIVE_PING = b"tpy-keep"
#: A ping received while no call is open, without ``permit_without_calls``, is a strike unless
#: the last came this long before (gRPC core's rule).
_IDLE_PING_INTERVAL = 7200.0
#: The largest request message, in bytes (Triton's, gRPC's signed 32-bit limit).
MAX_MESSAGE_SIZE = (1 << 31) - 1
_HIGH_BYTES = bytes(range(0x80, 0x100))
#: Request headers that are HTTP/2 or gRPC plumbing, not a call's metadata.
_NOT_METADATA = frozenset((b"te", b"content-type", b"user-agent"))
_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
_OK = 0
_UNKNOWN = grpc.StatusCode.UNKNOWN.value[0]
_DEADLINE = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
_UNIMPLEMENTED = grpc.StatusCode.UNIMPLEMENTED.value[0]
_INTERNAL = grpc.StatusCode.INTERNAL.value[0]
_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
_RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
#: Printable ASCII but '%': what a grpc-message carries as is (the rest is percent-encoded).
_MESSAGE_SAFE = " !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~"


def _hpack_int(value: int, prefix_bits: int, first: int) -> bytes:
    """An HPACK integer (RFC 7541 §5.1) with ``first``'s high bits before its prefix."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _literal(name: bytes, value: bytes) -> bytes:
    """A header field as a literal without indexing, with a new name, no Huffman coding."""
    return b"\0" + _hpack_int(len(name), 7, 0) + name + _hpack_int(len(value), 7, 0) + value


_STATUS_200 = b"\x88"  # static table entry 8, ":status: 200"
_TABLE_SIZE_0 = b"\x20"  # a dynamic table size update to 0: ours stays empty
_RESPONSE_HEADERS = (_STATUS_200 + _literal(b"content-type", b"application/grpc")
                     + _literal(b"grpc-accept-encoding", b"identity,deflate,gzip"))
_TRAILERS_OK = _literal(b"grpc-status", b"0")
#: Response headers of a call whose messages are compressed, by algorithm.
_COMPRESSED_HEADERS = {algo: _RESPONSE_HEADERS + _literal(b"grpc-encoding", algo)
                       for algo in (b"gzip", b"deflate")}
#: Triton's --grpc-infer-response-compression-level: the algorithm for each level among those
#: the client accepts, as gRPC's core ranks them (gzip, then deflate: low takes the first, medium
#: the middle one, high the last).
COMPRESSION_LEVELS = ("none", "low", "medium", "high")
_COMPRESS_OFF_LOOP = 1 << 20
#: A response message larger than this goes to the socket as views of its parts, framed
#: without a copy (a copy of a few KiB costs less than the views and the writev).
_SMALL_MESSAGE = 1 << 16


def _algorithm(level: str, accepted: bytes | None) -> bytes | None:
    """The algorithm to compress a response with at ``level`` for a client that accepts
    ``accepted`` (its grpc-accept-encoding), or None."""
    if level == "none" or not accepted:
        return None
    names = {a.strip() for a in accepted.split(b",")}
    ranked = [a for a in (b"gzip", b"deflate") if a in names]
    if not ranked:
        return None
    return ranked[{"low": 0, "medium": len(ranked) // 2, "high": len(ranked) - 1}[level]]


def _compress(algo: bytes, payload: bytes) -> bytes:
    if algo == b"gzip":
        return gzip.compress(payload, compresslevel=6)
    return zlib.compress(payload)


class Serialized:
    """A response message serialized already, as parts to send one after the other (the
    large tensors of a response need not be copied into one buffer)."""

    __slots__ = ("parts", "size")

    def __init__(self, parts: list[Any], size: int) -> None:
        self.parts, self.size = parts, size

    def SerializeToString(self) -> bytes:  # noqa: N802 (protobuf's name)
        return b"".join(self.parts)


def _frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return _FRAME.pack(n >> 16, n & 0xFFFF, ftype, flags, sid) + payload


class Method:
    """One RPC: its handler (a servicer's bound method), how to read its requests and write its
    responses, whether the client streams (bidirectional) or sends one request, and whether
    its responses are compressed at the server's compression level (inference calls)."""

    __slots__ = ("handler", "parse", "streaming", "compressible", "restricted", "metadata")

    def __init__(self, handler: Callable[..., Awaitable[Any]], parse: Callable[[Any], Any],
                 streaming: bool, compressible: bool = False,
                 restricted: tuple[str, str] | None = None, metadata: bool = False) -> None:
        self.handler, self.parse, self.streaming = handler, parse, streaming
        self.compressible = compressible
        # (header, value) a call must carry, else it is refused UNAVAILABLE (Triton's
        # --grpc-restricted-protocol); the header is already the full, prefixed name.
        self.restricted = (None if restricted is None
                           else (restricted[0].lower().encode(), restricted[1].encode()))
        # Whether its handler sees the call's metadata (context.metadata).
        self.metadata = metadata


class _Closed(Exception):
    """The call is over (cancelled, reset by the client, or the connection is gone)."""


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


@dataclass(frozen=True)
class KeepAlive:
    """The keepalive and ping policy of gRPC core's servers, in the terms (milliseconds) and
    with the defaults of Triton's ``--grpc-keepalive-*``, ``--grpc-http2-*`` and
    ``--grpc-max-connection-age*`` flags.

    - Once a connection has been silent for ``time_ms``, the server pings it, if a call is open
      (or ``permit_without_calls``) and fewer than ``max_pings_without_data`` pings (0: no
      limit) went since it last sent headers or data; a ping not answered within
      ``timeout_ms`` closes the connection (a client gone without a word).
    - A client ping that comes sooner than ``min_recv_ping_interval_without_data_ms`` after the
      last one (two hours while no call is open, unless ``permit_without_calls``), with no
      headers or data sent by the server between, is a strike; past ``max_ping_strikes``
      strikes (0: no limit) the connection ends with GOAWAY ENHANCE_YOUR_CALM
      ``too_many_pings``.
    - ``max_connection_age_ms`` (0: none), give or take 10%, after a connection opened, it gets
      GOAWAY: its open calls go on, new ones are refused (REFUSED_STREAM, which clients retry
      on a new connection), and it closes when the last call ends or
      ``max_connection_age_grace_ms`` (0: no limit) later.
    """

    time_ms: int = 7_200_000
    timeout_ms: int = 20_000
    permit_without_calls: bool = False
    max_pings_without_data: int = 2
    min_recv_ping_interval_without_data_ms: int = 300_000
    max_ping_strikes: int = 2
    max_connection_age_ms: int = 0
    max_connection_age_grace_ms: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type != "bool" and (not isinstance(value, int) or value < 0):
                raise ValueError(f"keepalive {f.name} must be a whole number >= 0, "
                                 f"not {value!r}")
        if self.time_ms < 1 or self.timeout_ms < 1:
            raise ValueError("keepalive time_ms and timeout_ms must be at least 1")


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


class _Status(Exception):
    """End the call with this gRPC status (before or outside a handler)."""

    def __init__(self, code: int, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _ConnectionError(Exception):
    """The client broke the protocol: GOAWAY with this error code (and ``debug`` data), then
    close."""

    def __init__(self, code: int, message: str, debug: bytes = b"") -> None:
        super().__init__(message)
        self.code = code
        self.debug = debug


class _Connection(asyncio.Protocol):
    """One client connection: frames in, frames out."""

    def __init__(self, server: Http2GrpcServer) -> None:
        self.server = server
        self.transport: Any = None
        self.calls: dict[int, _Call] = {}
        self.inbuf = bytearray()
        self.preface = False  # the client's preface has arrived
        self.decoder = hpack.Decoder(max_header_list_size=_MAX_DECODED)
        self.header_cache: dict[bytes, tuple[list[tuple[bytes, bytes]], int]] = {}
        self.continued: tuple[int, bytearray, bool] | None = None  # a header block in parts
        self.out: list[Any] = []  # what the next write sends: frames, or frame headers and views
        self.out_bytes = 0  # of which views of large messages (see _send_in_frames)
        self.flush_pending = False
        self.table_size_sent = False
        self.send_window = _DEFAULT_WINDOW  # the connection's window the client allows us
        self.peer_window = _DEFAULT_WINDOW  # its initial window for each stream
        self.peer_max_frame = 16384
        self.unacked = 0  # bytes received since our last connection WINDOW_UPDATE
        self.last_sid = 0
        self.continuations = 0  # CONTINUATION frames of the header block in parts
        self.write_paused = False  # the client is not reading: we stop reading it too
        self.drained: asyncio.Future[None] | None = None  # writers waiting for resume_writing
        self.preface_timer: asyncio.TimerHandle | None = None
        self.eof_sent = False  # stopping: our side is closed, the client's is read to its end
        self.loop = loop = asyncio.get_running_loop()
        self.lost: asyncio.Future[None] = loop.create_future()
        self.clock = loop.time
        # Keepalive and ping policy (KeepAlive): "since we last sent headers or data" is
        # ``sends`` moving on from the mark each policy took.
        self.sends = 0
        self.last_read = self.clock()
        self.keepalive_timer: asyncio.TimerHandle | None = None
        self.watchdog: asyncio.TimerHandle | None = None
        self.pings_without_data = 0
        self.ping_mark = 0
        self.ping_recv_at: float | None = None
        self.ping_strikes = 0
        self.strike_mark = 0
        self.going_away = False  # past its maximum age: open calls go on, new ones are refused
        self.age_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.server.connections.add(self)
        transport.set_write_buffer_limits(high=_WRITE_HIGH)
        self.preface_timer = asyncio.get_running_loop().call_later(
            PREFACE_TIMEOUT, self._no_preface)
        settings = b"".join(_SETTING.pack(k, v) for k, v in (
            (_MAX_CONCURRENT_STREAMS, MAX_STREAMS), (_INITIAL_WINDOW_SIZE, _WINDOW),
            (_MAX_FRAME_SIZE, _MAX_FRAME)))
        self.out.append(_frame(_SETTINGS, 0, 0, settings))
        self.out.append(_frame(_WINDOW_UPDATE, 0, 0, _U32.pack(_WINDOW - _DEFAULT_WINDOW)))
        self.flush()
        keepalive = self.server.keepalive
        loop = asyncio.get_running_loop()
        self.keepalive_timer = loop.call_later(keepalive.time_ms / 1000, self._keepalive)
        if keepalive.max_connection_age_ms:
            age = keepalive.max_connection_age_ms / 1000 * random.uniform(0.9, 1.1)
            self.age_timer = loop.call_later(age, self._too_old)

    def _no_preface(self) -> None:
        self.preface_timer = None
        if not self.preface and self.transport is not None:
            log.debug("gRPC connection closed: no client preface within %g s", PREFACE_TIMEOUT)
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        if not self.lost.done():
            self.lost.set_result(None)
        for timer in (self.preface_timer, self.keepalive_timer, self.watchdog, self.age_timer):
            if timer is not None:
                timer.cancel()
        self.preface_timer = self.keepalive_timer = self.watchdog = self.age_timer = None
        for call in list(self.calls.values()):
            call.abandon()
        self.transport = None
        self.inbuf = bytearray()
        self.out.clear()
        self.out_bytes = 0
        self._wake_writers(_Closed("the connection is gone"))

    # -- keepalive and connection age -------------------------------------------------------------
    def _keepalive(self) -> None:
        """The keepalive period is up: ping a silent client (KeepAlive says when)."""
        self.keepalive_timer = None
        if self.transport is None:
            return
        keepalive = self.server.keepalive
        period = keepalive.time_ms / 1000
        loop = asyncio.get_running_loop()
        silent = self.clock() - self.last_read
        if silent < period:  # heard from meanwhile: count the period from then
            self.keepalive_timer = loop.call_later(period - silent, self._keepalive)
            return
        if self.sends != self.ping_mark:
            self.ping_mark = self.sends
            self.pings_without_data = 0
        limit = keepalive.max_pings_without_data
        if (self.calls or keepalive.permit_without_calls) and (
                not limit or self.pings_without_data < limit):
            self.pings_without_data += 1
            self.out.append(_frame(_PING, 0, 0, _KEEPALIVE_PING))
            self.flush()
            # The next period starts with the answer.
            self.watchdog = loop.call_later(keepalive.timeout_ms / 1000, self._no_ping_answer)
            return
        self.keepalive_timer = loop.call_later(period, self._keepalive)

    def _ping_answered(self) -> None:
        if self.watchdog is None:
            return  # a late answer, or one to a ping we did not send
        self.watchdog.cancel()
        self.watchdog = None
        self.keepalive_timer = asyncio.get_running_loop().call_later(
            self.server.keepalive.time_ms / 1000, self._keepalive)

    def _no_ping_answer(self) -> None:
        self.watchdog = None
        if self.transport is not None:
            log.debug("gRPC connection closed: no answer to a keepalive ping within %g s",
                      self.server.keepalive.timeout_ms / 1000)
            self.transport.abort()

    def _ping_received(self) -> None:
        """Count a strike for a ping that comes too soon (KeepAlive's policy)."""
        keepalive = self.server.keepalive
        if self.sends != self.strike_mark:  # we sent headers or data since: start over
            self.strike_mark = self.sends
            self.ping_recv_at = None
            self.ping_strikes = 0
        now = self.clock()
        last, self.ping_recv_at = self.ping_recv_at, now
        if last is None:
            return
        interval = (keepalive.min_recv_ping_interval_without_data_ms / 1000
                    if self.calls or keepalive.permit_without_calls else _IDLE_PING_INTERVAL)
        if now - last < interval:
            self.ping_strikes += 1
            if keepalive.max_ping_strikes and self.ping_strikes > keepalive.max_ping_strikes:
                raise _ConnectionError(_ENHANCE_YOUR_CALM,
                                       f"{self.ping_strikes} pings too close together",
                                       b"too_many_pings")

    def _too_old(self) -> None:
        """Past the maximum age: GOAWAY; the open calls go on for the grace period."""
        self.age_timer = None
        if self.transport is None or self.going_away:
            return
        self.going_away = True
        self.goaway()
        if not self.calls:
            self.close_soon()
            return
        grace = self.server.keepalive.max_connection_age_grace_ms
        if grace:
            self.age_timer = asyncio.get_running_loop().call_later(grace / 1000,
                                                                   self._grace_over)

    def _grace_over(self) -> None:
        self.age_timer = None
        if self.transport is not None:
            log.debug("gRPC connection closed: %d calls still open past its age's grace period",
                      len(self.calls))
            self._close_drained()

    def forget(self, sid: int) -> None:
        """A call is over: drop it; a connection past its age closes with its last call."""
        self.calls.pop(sid, None)
        if self.going_away and not self.calls:
            self.close_soon()

    def close_soon(self) -> None:
        """Close once what this turn of the loop wrote has gone (a call's trailers)."""
        asyncio.get_running_loop().call_soon(self._close_drained)

    def _close_drained(self) -> None:
        if self.transport is not None:
            self.flush()
            self.transport.close()

    # -- back-pressure -----------------------------------------------------------------------------
    def pause_writing(self) -> None:
        """The client reads slower than we write: stop reading its frames (each may call for
        an answer) until it catches up."""
        self.write_paused = True
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake_writers(None)
        if self.transport is not None:
            self.transport.resume_reading()
            if self.inbuf:
                self._process()  # frames left unread when writing paused

    def _wake_writers(self, exc: BaseException | None) -> None:
        waiter, self.drained = self.drained, None
        if waiter is not None and not waiter.done():
            if exc is None:
                waiter.set_result(None)
            else:
                waiter.set_exception(exc)
                waiter.exception()  # retrieved: no "never retrieved" warning if none waits

    async def writable(self) -> None:
        """Wait while the client is not reading what it was sent."""
        if not self.write_paused or self.transport is None:
            return
        if self.drained is None:
            self.drained = asyncio.get_running_loop().create_future()
        await asyncio.shield(self.drained)

    # -- writing ---------------------------------------------------------------------------------
    def flush(self) -> None:
        out = self.out
        if self.eof_sent:
            out.clear()
            self.out_bytes = 0
            return
        if out:
            large = self.out_bytes > _SMALL_MESSAGE
            self.out_bytes = 0
            if large and self.transport is not None:
                # Views of a large message: handed to the socket as they are (writev).
                self.transport.writelines(out)
                self.out = []
                return
            data = out[0] if len(out) == 1 else b"".join(out)
            out.clear()
            if self.transport is not None:
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

    def send_headers(self, sid: int, block: bytes, end_stream: bool) -> None:
        if not self.table_size_sent:
            self.table_size_sent = True
            block = _TABLE_SIZE_0 + block
        flags = _END_HEADERS | (_END_STREAM if end_stream else 0)
        self.sends += 1
        self.out.append(_frame(_HEADERS, flags, sid, block))

    def goaway(self, code: int = _NO_ERROR, debug: bytes = b"") -> None:
        """Tell the client this connection takes no new calls (or why it is dropped)."""
        self.out.append(_frame(_GOAWAY, 0, 0, _U32.pack(self.last_sid) + _U32.pack(code) + debug))
        self.flush()

    # -- reading ---------------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self.eof_sent:  # stopping: read to the client's end, nothing more is answered
            return
        try:
            self.inbuf += data
        except BufferError:  # (see _process)
            self.inbuf = self.inbuf + data
        self.last_read = self.clock()
        if not self.write_paused:
            self._process()

    def _process(self) -> None:
        buf = self.inbuf
        try:
            pos = self._frames(buf)
        except _ConnectionError as exc:
            log.debug("gRPC connection dropped: %s", exc)
            self.goaway(exc.code, exc.debug)
            self._drop()
            self.inbuf = bytearray()  # not clear(): the error's traceback may still view it
            return
        if pos:
            try:
                del buf[:pos]
            except BufferError:  # a view of it is still alive (an error's traceback, say)
                self.inbuf = bytearray(buf[pos:])
        self.flush()

    def _drop(self) -> None:
        """After our GOAWAY for a broken rule: end the calls, close our side and read the
        client's to its end (discarded) for up to ``_CLOSE_WAIT``, then reset. Closing with its
        bytes still unread would reset the connection, and the client could lose the GOAWAY
        that says why (gRPC's clients slow their keepalive pings on ``too_many_pings``)."""
        transport = self.transport
        if transport is None or self.eof_sent:
            return
        for call in list(self.calls.values()):
            call.abandon()
        self.eof_sent = True
        try:
            if not transport.can_write_eof():
                raise OSError("no half-close on this transport")
            transport.write_eof()
        except OSError:  # TLS, or the client is gone already
            transport.close()
            return
        transport.resume_reading()  # paused if the client was not reading: read its end now
        self.loop.call_later(_CLOSE_WAIT, self._abort)

    def _abort(self) -> None:
        """A client that broke the rules and then neither read nor closed its end: reset."""
        if self.transport is not None:
            self.transport.abort()

    def _frames(self, buf: bytearray) -> int:
        """Handle every whole frame in ``buf``; return how many bytes they took."""
        pos = 0
        if not self.preface:
            if len(buf) < len(_PREFACE):
                return 0
            if buf[:len(_PREFACE)] != _PREFACE:
                raise _ConnectionError(_PROTOCOL_ERROR, "not an HTTP/2 connection preface")
            self.preface = True
            if self.preface_timer is not None:
                self.preface_timer.cancel()
                self.preface_timer = None
            pos = len(_PREFACE)
        total = len(buf)
        handled = 0
        while total - pos >= 9 and not self.write_paused:
            handled += 1
            if handled % 64 == 0:
                self.flush()  # answers so far: may pause us (pause_writing) if unread
            high, low, ftype, flags, sid = _FRAME.unpack_from(buf, pos)
            length = (high << 16) | low
            if length > _MAX_FRAME:
                raise _ConnectionError(_FRAME_SIZE_ERROR, f"a frame of {length} bytes")
            end = pos + 9 + length
            if end > total:
                break
            sid &= 0x7FFFFFFF
            if self.continued is not None and ftype != _CONTINUATION:
                raise _ConnectionError(_PROTOCOL_ERROR, "a header block was interrupted")
            if ftype == _DATA:
                with memoryview(buf) as view:
                    self._data(sid, flags, view[pos + 9:end], length)
            else:
                self._control(ftype, flags, sid, bytes(buf[pos + 9:end]))
            pos = end
        return pos

    def _control(self, ftype: int, flags: int, sid: int, payload: bytes) -> None:
        if ftype == _HEADERS:
            if sid == 0:
                raise _ConnectionError(_PROTOCOL_ERROR, "HEADERS on stream 0")
            start = 1 if flags & _PADDED else 0
            if flags & _PRIORITY_FLAG:
                start += 5
            block = payload[start:len(payload) - _padding(flags, payload, start)]
            if len(block) > MAX_COMPRESSED_BLOCK:
                raise _ConnectionError(_ENHANCE_YOUR_CALM,
                                       f"a header block over {MAX_COMPRESSED_BLOCK} bytes")
            if flags & _END_HEADERS:
                self._headers(sid, block, bool(flags & _END_STREAM))
            else:
                self.continued = (sid, bytearray(block), bool(flags & _END_STREAM))
                self.continuations = 0
        elif ftype == _CONTINUATION:
            if self.continued is None or self.continued[0] != sid:
                raise _ConnectionError(_PROTOCOL_ERROR, "an unexpected CONTINUATION frame")
            self.continued[1].extend(payload)
            self.continuations += 1
            if self.continuations > _MAX_CONTINUATIONS:
                raise _ConnectionError(_ENHANCE_YOUR_CALM,
                                       f"a header block in over {_MAX_CONTINUATIONS} frames")
            if len(self.continued[1]) > MAX_COMPRESSED_BLOCK:
                raise _ConnectionError(_ENHANCE_YOUR_CALM,
                                       f"a header block over {MAX_COMPRESSED_BLOCK} bytes")
            if flags & _END_HEADERS:
                csid, parts, end_stream = self.continued
                self.continued = None
                self._headers(csid, bytes(parts), end_stream)
        elif ftype == _SETTINGS:
            if sid != 0:
                raise _ConnectionError(_PROTOCOL_ERROR, "SETTINGS on a stream")
            if not flags & _ACK:
                self._settings(payload)
        elif ftype == _WINDOW_UPDATE:
            if len(payload) != 4:
                raise _ConnectionError(_FRAME_SIZE_ERROR, "a WINDOW_UPDATE of the wrong size")
            increment = _U32.unpack(payload)[0] & 0x7FFFFFFF
            if increment == 0:
                raise _ConnectionError(_PROTOCOL_ERROR, "a WINDOW_UPDATE of 0")
            if sid == 0:
                self.send_window += increment
                if self.send_window > _MAX_WINDOW:
                    raise _ConnectionError(_FLOW_CONTROL_ERROR, "the connection window overflowed")
                for each in list(self.calls.values()):
                    each.wake()
            else:
                target = self.calls.get(sid)
                if target is not None:
                    target.send_window += increment
                    if target.send_window > _MAX_WINDOW:
                        self.out.append(_frame(_RST_STREAM, 0, sid, _U32.pack(_FLOW_CONTROL_ERROR)))
                        target.abandon()
                    else:
                        target.wake()
        elif ftype == _PING:
            if sid != 0:
                raise _ConnectionError(_PROTOCOL_ERROR, "PING on a stream")
            if len(payload) != 8:
                raise _ConnectionError(_FRAME_SIZE_ERROR, "a PING that is not 8 bytes")
            if not flags & _ACK:
                self.out.append(_frame(_PING, _ACK, 0, payload))  # answered even if struck
                self._ping_received()
            elif payload == _KEEPALIVE_PING:
                self._ping_answered()
        elif ftype == _RST_STREAM:
            if len(payload) != 4:
                raise _ConnectionError(_FRAME_SIZE_ERROR, "a RST_STREAM that is not 4 bytes")
            if sid == 0:
                raise _ConnectionError(_PROTOCOL_ERROR, "RST_STREAM on stream 0")
            reset = self.calls.get(sid)
            if reset is not None:
                if (reset.method is not None and not reset.closed
                        and log.isEnabledFor(logging.DEBUG)):  # Triton's verbose line
                    log.debug("Cancellation notification received for %sHandler, stream %d",
                              getattr(reset.method.handler, "__name__", "?"), sid)
                reset.abandon()
        elif ftype == _GOAWAY:
            if not self.calls and self.transport is not None:
                self.transport.close()
        elif ftype == _PUSH_PROMISE:
            raise _ConnectionError(_PROTOCOL_ERROR, "a client sent PUSH_PROMISE")
        # PRIORITY and unknown frame types are ignored, as RFC 9113 asks.

    def _settings(self, payload: bytes) -> None:
        if len(payload) % 6:
            raise _ConnectionError(_FRAME_SIZE_ERROR, "a SETTINGS frame of the wrong size")
        for offset in range(0, len(payload), 6):
            key, value = _SETTING.unpack_from(payload, offset)
            if key == _INITIAL_WINDOW_SIZE:
                if value > _MAX_WINDOW:
                    raise _ConnectionError(_FLOW_CONTROL_ERROR, "an initial window over 2^31-1")
                delta = value - self.peer_window
                self.peer_window = value
                for call in list(self.calls.values()):
                    call.send_window += delta
                    call.wake()
            elif key == _MAX_FRAME_SIZE:
                if not 16384 <= value <= _MAX_FRAME:
                    raise _ConnectionError(_PROTOCOL_ERROR, f"a max frame size of {value}")
                self.peer_max_frame = value
        self.out.append(_frame(_SETTINGS, _ACK, 0))

    def _decode(self, block: bytes) -> tuple[list[tuple[bytes, bytes]], int]:
        """The block's headers, and their size as HTTP/2 counts a header list."""
        # A block of indexed fields only (every byte has its high bit set) leaves the HPACK
        # table as it was, so the same bytes decode the same way until a block changes it.
        indexed = not block.translate(None, _HIGH_BYTES)
        if indexed:
            cached = self.header_cache.get(block)
            if cached is not None:
                return cached
        else:
            self.header_cache.clear()
        try:
            headers = [(bytes(n), bytes(v)) for n, v in self.decoder.decode(block, raw=True)]
        except hpack.HPACKError as exc:
            raise _ConnectionError(_COMPRESSION_ERROR, f"bad header block: {exc}") from None
        decoded = headers, sum(len(n) + len(v) for n, v in headers) + 32 * len(headers)
        if indexed and len(self.header_cache) < 64:
            self.header_cache[block] = decoded
        return decoded

    def _headers(self, sid: int, block: bytes, end_stream: bool) -> None:
        headers, size = self._decode(block)
        if sid in self.calls or sid <= self.last_sid:  # trailers, or a stream already over
            if end_stream:
                self._ended(sid)
            return
        if sid % 2 == 0:
            raise _ConnectionError(_PROTOCOL_ERROR, f"a client opened even stream {sid}")
        self.last_sid = sid
        if len(self.calls) >= MAX_STREAMS or self.going_away:
            # Past what we advertised, or after our GOAWAY: refused (the client may retry it
            # elsewhere), not served.
            self.out.append(_frame(_RST_STREAM, 0, sid, _U32.pack(_REFUSED_STREAM)))
            return
        self._request(sid, headers, size, end_stream)
        if end_stream:
            self._ended(sid)

    def _request(self, sid: int, headers: list[tuple[bytes, bytes]], size: int,
                 end_stream: bool) -> None:
        if size > MAX_HEADER_BLOCK:
            # Decoded (the HPACK table stays right), then refused: this call only.
            call = _Call(self, sid, None, None, None)
            call.ended = end_stream
            self.calls[sid] = call
            call.finish(_RESOURCE_EXHAUSTED, "received metadata size exceeds hard limit "
                                             f"({size} vs. {MAX_HEADER_BLOCK})")
            return
        path = encoding = timeout = accepted = None
        for name, value in headers:
            if name == b":path":
                path = value
            elif name == b"grpc-encoding":
                encoding = value
            elif name == b"grpc-timeout":
                timeout = value
            elif name == b"grpc-accept-encoding":
                accepted = value
        method = self.server.methods.get(path) if path is not None else None
        compress = None
        level = self.server.compression
        if method is not None and method.compressible and level != "none":
            compress = _algorithm(level, accepted)
        call = _Call(self, sid, method, encoding if encoding != b"identity" else None, compress)
        call.ended = end_stream  # a refusal below then needs no RST_STREAM after its trailers
        self.calls[sid] = call
        if method is None:
            shown = (path or b"")[:256].decode(errors="replace")
            call.finish(_UNIMPLEMENTED, f"Method not found: {shown}")
            return
        if method.restricted is not None and method.restricted not in headers:
            call.finish(_UNAVAILABLE, "This protocol is restricted, expecting header "
                                      f"'{method.restricted[0].decode()}'")
            return
        if method.metadata:
            call.context.metadata = [
                (name.decode(errors="replace"), value.decode(errors="replace"))
                for name, value in headers
                if name[:1] != b":" and name not in _NOT_METADATA and not name.startswith(b"grpc-")]
        if self.server.stopping:
            call.finish(_UNAVAILABLE, "the server is stopping")
            return
        if timeout is not None:
            seconds = _parse_timeout(timeout)
            if seconds is not None:
                call.deadline = asyncio.get_running_loop().call_later(seconds, call.expire)
        if method.streaming:
            call.messages = asyncio.Queue()
            call.task = self.loop.create_task(self.server.run_streaming(call))

    def _data(self, sid: int, flags: int, payload: memoryview, length: int) -> None:
        # Flow control counts the whole payload, padding included; our windows are refilled
        # once half of them is used.
        if sid == 0 or sid > self.last_sid:
            raise _ConnectionError(_PROTOCOL_ERROR, f"DATA on stream {sid}, never opened")
        self.unacked += length
        if self.unacked >= _WINDOW // 2:
            self.out.append(_frame(_WINDOW_UPDATE, 0, 0, _U32.pack(self.unacked)))
            self.unacked = 0
        if flags & _PADDED:
            payload = payload[1:len(payload) - _padding(flags, payload, 1)]
        call = self.calls.get(sid)
        if call is not None and call.ended:
            # The client ended this stream already (half-closed): a stream error (RFC 9113
            # §5.1), not more request bytes for its call.
            self.out.append(_frame(_RST_STREAM, 0, sid, _U32.pack(_STREAM_CLOSED)))
            call.abandon()
            return
        if call is not None and not call.closed and call.method is not None:
            call.unacked += length
            if call.unacked >= _WINDOW // 2 and not flags & _END_STREAM:
                self.out.append(_frame(_WINDOW_UPDATE, 0, sid, _U32.pack(call.unacked)))
                call.unacked = 0
            self._messages(call, payload)
        if flags & _END_STREAM:
            self._ended(sid)

    def _messages(self, call: _Call, payload: memoryview) -> None:
        try:
            messages = call.feed(payload)
        except _Status as exc:
            self._refuse(call, exc.code, exc.details)
            return
        except Exception as exc:  # a message that does not parse
            self._refuse(call, _INTERNAL, f"Failed to parse the request: {exc}")
            return
        if not messages:
            return
        if call.messages is not None:
            for m in messages:
                call.messages.put_nowait(m)
        elif call.task is None and len(messages) == 1:
            # (create_task: ensure_future's checks cost ~5 µs of every call)
            call.task = self.loop.create_task(self.server.run_unary(call, messages[0]))
        else:
            self._refuse(call, _UNIMPLEMENTED, "a unary method got more than one request message")

    def _refuse(self, call: _Call, code: int, details: str) -> None:
        """End a call for what its client sent (finish tells a client still sending to stop)."""
        call.finish(code, details)
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


def _padding(flags: int, payload: Any, start: int) -> int:
    """How many bytes of padding end a frame whose payload's first ``start`` bytes are fields
    (the pad length first, when PADDED is set)."""
    if not flags & _PADDED:
        if len(payload) < start:
            raise _ConnectionError(_FRAME_SIZE_ERROR, "a frame too short for its fields")
        return 0
    if not payload or payload[0] > len(payload) - start:
        raise _ConnectionError(_PROTOCOL_ERROR, "padding longer than its frame")
    return int(payload[0])


def _parse_timeout(value: bytes) -> float | None:
    """A grpc-timeout in seconds: at most 8 digits and a unit (gRPC's form); None when it is
    not one (the call then has no deadline)."""
    unit = _TIMEOUT_UNITS.get(value[-1:])
    digits = value[:-1]
    if unit is None or not digits.isdigit() or len(digits) > 8:
        return None
    return int(digits) * unit


class Http2GrpcServer:
    """Serve ``methods`` (path → :class:`Method`) on ``host:port``.

    A request message over ``max_message`` bytes is answered RESOURCE_EXHAUSTED. The responses
    of compressible methods are compressed at ``compression`` (one of
    :data:`COMPRESSION_LEVELS`) with an algorithm the client accepts. ``ssl`` (a server
    context) serves TLS, its ALPN set to ``h2``. ``keepalive``: the ping policy and connection
    age (:class:`KeepAlive`; gRPC's and Triton's defaults when None). ``cut``: set, a
    :meth:`stop` waits no more for the calls in flight (a second signal).
    """

    def __init__(self, methods: dict[str, Method], max_message: int = MAX_MESSAGE_SIZE,
                 compression: str = "none", ssl: Any = None,
                 keepalive: KeepAlive | None = None, cut: asyncio.Event | None = None) -> None:
        if compression not in COMPRESSION_LEVELS:
            raise ValueError(f"compression level must be one of {COMPRESSION_LEVELS}, "
                             f"not {compression!r}")
        self.methods = {path.encode(): m for path, m in methods.items()}
        self.max_message = max_message
        self.compression = compression
        self.ssl = ssl
        self.keepalive = keepalive or KeepAlive()
        if ssl is not None:
            ssl.set_alpn_protocols(["h2"])
        self.connections: set[_Connection] = set()
        self.stopping = False
        self.cut = cut or asyncio.Event()  # set: a stop ends at once (see stop())
        self._server: asyncio.AbstractServer | None = None

    async def start(self, host: str, port: int, reuse_port: bool = False) -> int:
        """Listen (with SO_REUSEPORT when asked); return the port (the one picked when
        ``port`` is 0)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port,
                                                reuse_address=True, reuse_port=reuse_port or None,
                                                ssl=self.ssl, backlog=1024)
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self, grace: float) -> None:
        """Take no new calls, give the running ones ``grace`` seconds, cancel the rest."""
        self.stopping = True  # new calls are refused (UNAVAILABLE) from now on
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.goaway()  # the calls already open go on
        tasks = [c.task for conn in self.connections for c in conn.calls.values()
                 if c.task is not None and not c.task.done()]
        pending = await wait_all(tasks, grace, self.cut)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=1.0)
        # Our last bytes, then our end of each connection (FIN), reading on until the client
        # closes its own: closing a socket with bytes still coming in sends a reset, and the
        # client may then lose answers it had not read yet.
        closing = []
        for conn in list(self.connections):
            conn.flush()
            transport = conn.transport
            if transport is None:
                continue
            conn.eof_sent = True
            try:
                if not transport.can_write_eof():
                    raise OSError("no half-close on this transport")
                transport.write_eof()
                closing.append(conn.lost)
            except OSError:  # TLS, or the client is gone already
                transport.close()
        if closing:
            await asyncio.wait(closing, timeout=_CLOSE_WAIT)
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.close()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def run_unary(self, call: _Call, request: Any) -> None:
        assert call.method is not None
        context = call.context
        try:
            if type(request) is _Deferred:
                request = await resolve(request)
            response = await call.method.handler(request, context)
            if not call.closed:
                await call.send_message(response if type(response) is Serialized
                                        else response.SerializeToString(), flush=False)
        except grpc.aio.AbortError:
            call.finish(context.code or _UNKNOWN, context.details)
            return
        except _Status as exc:  # a compressed request that did not inflate or parse
            call.finish(exc.code, exc.details)
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
                yield await resolve(message)

        try:
            await call.method.handler(requests(), context)
        except grpc.aio.AbortError:
            call.finish(context.code or _UNKNOWN, context.details)
            return
        except _Status as exc:  # a compressed request that did not inflate or parse
            call.finish(exc.code, exc.details)
            return
        except (asyncio.CancelledError, _Closed):
            return
        except Exception as exc:
            log.exception("gRPC stream failed")
            call.finish(_UNKNOWN, f"Unexpected {type(exc).__name__}: {exc}")
            return
        call.finish(_OK)
