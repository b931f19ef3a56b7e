"""One client connection of :mod:`._http2`'s server (an ``asyncio.Protocol``): frames in
(preface, headers and CONTINUATION, HPACK decoding, DATA and flow control, SETTINGS, PING,
RST_STREAM, GOAWAY), frames out (one write per turn of the loop), back-pressure, and the
calls it opens, refuses and forgets; keepalive and age are :class:`ConnectionKeepAlive`'s.
"""
from __future__ import annotations

import asyncio
import logging
import random
from typing import TYPE_CHECKING, Any

import hpack

from . import _h2_frames
from ._h2_call import _Call
from ._h2_frames import (_ACK, _COMPRESSION_ERROR, _CONTINUATION, _DATA, _DEFAULT_WINDOW,
                         _END_HEADERS, _END_STREAM, _ENHANCE_YOUR_CALM, _FLOW_CONTROL_ERROR,
                         _FRAME_SIZE_ERROR, _GOAWAY, _HEADERS, _INITIAL_WINDOW_SIZE,
                         _MAX_CONCURRENT_STREAMS, _MAX_FRAME, _MAX_FRAME_SIZE, _MAX_WINDOW,
                         _NO_ERROR, _PADDED, _PING, _PREFACE, _PRIORITY_FLAG, _PROTOCOL_ERROR,
                         _PUSH_PROMISE, _REFUSED_STREAM, _RST_STREAM, _SETTINGS, _STREAM_CLOSED,
                         _TABLE_SIZE_0, _WINDOW, _WINDOW_UPDATE, _ConnectionError, _frame, _padding)
from ._h2_grpc import (_INTERNAL, _NOT_METADATA, _RESOURCE_EXHAUSTED, _SMALL_MESSAGE, _UNAVAILABLE,
                       _UNIMPLEMENTED, _algorithm, _Closed, _parse_timeout, _Status)
from ._h2_keepalive import _KEEPALIVE_PING, ConnectionKeepAlive

if TYPE_CHECKING:
    from ._http2 import Http2GrpcServer

# The server's one logger, named as before the split (log settings and tests name it).
log = logging.getLogger("tritonpy.frontends._http2")

# The structs are bound by assignment, not imported by name: CPython 3.11 compiles
# ``name.method(...)`` on a global an import statement bound as an attribute load and a call (a
# bound method made at each call), on any other global as LOAD_METHOD, as before the split.
_FRAME, _SETTING, _U32 = _h2_frames._FRAME, _h2_frames._SETTING, _h2_frames._U32

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
_HIGH_BYTES = bytes(range(0x80, 0x100))


class _Connection(ConnectionKeepAlive, asyncio.Protocol):
    """One client connection: frames in, frames out (keepalive and age: the mixin's)."""

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

    # -- a call's end, and closing (keepalive and age: ConnectionKeepAlive) -----------------------
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

