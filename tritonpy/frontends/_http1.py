"""A lean HTTP/1.1 server for the KServe frontend: httptools' parser (llhttp) under an asyncio
Protocol.

Why not aiohttp's web server, which served this endpoint before: on a 2-vCPU machine its
request/response machinery cost 110-190 µs of CPU per small request, against 30-60 µs for this
protocol answering the same request (both on uvloop, driven by tritonclient). That was the
largest single cost of an HTTP inference. The frontend needs little of a framework: one handler,
whole bodies (the binary tensor extension slices tensors out of them), keep-alive, pipelining in
order, gzip/deflate both ways, ``Expect: 100-continue``, a body-size limit, cancellation of the
handler when its client disconnects, and a drain on stop. That is what this module does.

Its modules: this one (the server, and a connection's transport side: buffers, reads, flow
control), ``_http1_messages`` (Request, Response), ``_http1_state`` (a connection's state, and
the order of its layers), ``_http1_parse`` (httptools' callbacks: parsing, limits,
decompression) and ``_http1_answer`` (answering in order, writing, streaming, closing).
"""
from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import Callable, cast

import httptools

from .._loop import wait_all
from ._http1_answer import _Answering, _head
from ._http1_messages import (KNOWN_HEAD_MAX, KNOWN_HEADS, Buffer, Handler, Request, Response,
                              _KnownHead)
from ._http1_parse import MAX_METHOD, _request_start

log = logging.getLogger(__name__)

#: Idle keep-alive connections are closed after this many seconds (aiohttp's default).
KEEPALIVE_TIMEOUT = 75.0
#: A client that reads nothing of its response for this long is disconnected.
STALL_TIMEOUT = 60.0


class _Connection(_Answering):
    """One client connection: parse, queue, answer in order, one handler task at a time.

    A buffered protocol: the loop reads into our buffers. Head and small bodies are read into
    a scratch buffer and parsed; a large body with a Content-Length gets one buffer, and once
    the parser has seen the head, the rest of the body is read straight into it (no copy per
    chunk, and no churn of chunk-sized allocations: a 16 MiB body took 3x the CPU through
    httptools' per-chunk bytes objects). That buffer starts at ``BODY_START`` bytes and doubles
    whenever it is full, up to the announced length, which it then has exactly; growing resizes
    it in place (realloc, which remaps a large block rather than copying it).
    """

    # -- asyncio.BufferedProtocol --------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transport does not subclass asyncio.Transport.
        self.transport = cast(asyncio.Transport, transport)
        _no_delay(transport)
        self.server.connections.add(self)
        self._arm_idle_timer()

    def get_buffer(self, sizehint: int) -> memoryview:
        # No local names ``direct``: a view held here would stop _grow resizing the buffer.
        if self.direct is None:
            return self.scratch
        return self.direct if self.direct else self._grow()

    def _grow(self) -> memoryview:
        """Double the full body buffer (up to the announced length); its free part.

        Done here, not in ``buffer_updated``: there the loop may still hold the view it read
        into, and a bytearray with a live view cannot be resized."""
        buffer = self.buffer
        assert buffer is not None
        have = len(buffer)
        self.direct = None  # our own view of it goes first
        size = min(self.length, 2 * have)
        try:
            # In place (realloc), filled with a copy of what is there rather than zeros: no
            # temporary, and the body overwrites it as it arrives.
            if size == 2 * have:
                buffer *= 2
            else:
                buffer += buffer[:size - have]
        except BufferError:  # a view of it outlived its read: move to a new buffer
            grown = bytearray(size)
            grown[:have] = buffer
            self.buffer = buffer = grown
        direct = self.direct = memoryview(buffer)[have:]
        return direct

    def buffer_updated(self, nbytes: int) -> None:
        direct = self.direct
        if direct is not None:
            self.size += nbytes
            if self.size < self.length:
                self.direct = direct[nbytes:]  # empty when full: get_buffer grows it
                return
            # The body is complete. The parser never saw its bytes: the next request starts
            # on a new one.
            self.direct = None
            self.parser = self._new_parser()
            self._message_done()
            return
        start = (0 if self.in_message or self.parser is None or self.method_start
                 else self._known(nbytes))
        if start < nbytes:
            self._feed(self.scratch[start:nbytes])

    def _known(self, nbytes: int) -> int:
        """Answer the whole requests at the start of the scratch buffer whose heads were parsed
        before (``_KnownHead``); how many bytes they took. The parser takes the rest, from a
        request's first byte: an unknown head, a body not all here, or anything else."""
        buf, view = self.scratch_bytes, self.scratch  # (a view's slice is not a copy)
        known = self.server.known_heads
        pos = 0
        while not self.closing:
            end = buf.find(b"\r\n\r\n", pos, min(nbytes, pos + KNOWN_HEAD_MAX))
            if end < 0:
                return pos
            end += 4
            key = bytes(view[pos:end])
            head = known.get(key)
            if head is None:
                self.head_key = key  # the parser reads it next: kept if plain
                return pos
            stop = end + head.length
            if stop > nbytes:
                return pos
            now = time.monotonic_ns()
            self.active = True
            keep_alive = head.keep_alive and not self.server.stopping
            self._enqueue(Request(head.method, head.path, dict(head.headers),
                                  bytes(view[end:stop]), head.http10, (now, now), head.names),
                          keep_alive)
            pos = stop
            if not keep_alive or pos == nbytes:
                return pos
        return pos

    def _feed(self, data: Buffer) -> None:
        if self.method_start:
            data, self.method_start = self.method_start + bytes(data), b""
        head = b""
        while True:
            parser = self.parser
            if parser is None:  # the connection is lost
                return
            # Whether ``data`` starts with a request, and how many ended before it.
            at_start, before = not self.in_message and not head, self.messages
            try:
                if head:
                    parser.feed_data(head)
                parser.feed_data(data)
                break
            except httptools.HttpParserUpgrade as exc:
                head, self.upgrade_head = self.upgrade_head or b"", None
                if not head:  # CONNECT
                    self._fail_parse("protocol upgrades are not supported")
                    return
                # As Triton's (libevhtp), a request that asks to switch protocols is answered
                # as if it had not asked, in HTTP/1.1, and the connection goes on in it
                # (``curl --http2`` sends ``Upgrade: h2c``). llhttp stops at the end of its
                # head (httptools skips the body of an upgrade, to leave it to the new
                # protocol): a new parser reads the head again without the upgrade, then the
                # rest: its body and whatever follows.
                self.parser = self._new_parser()
                data = memoryview(data)[int(exc.args[0]):]
            except httptools.HttpParserError as exc:
                rest = None
                if isinstance(exc, httptools.HttpParserInvalidMethodError) and at_start \
                        and not self.head_error:
                    rest = self._unknown_method(data, self.messages - before)
                if rest is None:
                    self._fail_parse(self.head_error or f"malformed HTTP request: {exc}")
                    return
                # The refused request is read again from its first byte by a new parser.
                self.parser, data, head = self._new_parser(), rest, b""
                self.in_message = False
        if self.in_message and not self.url and not self.closing and not head:
            # The read ended inside a request's method, which llhttp may refuse once the rest
            # comes (an unknown one, routed as Triton routes it, see _unknown_method), where
            # the request's start is no longer known: it is read again from its first byte
            # with the next read. (A method cut by a read is rare: a slow client's.)
            start = _request_start(data, self.messages - before)
            if len(data) - start <= MAX_METHOD:
                self.method_start = bytes(data[start:])
                self.parser, self.in_message = self._new_parser(), False
        if self.buffer is not None and not self.closing:
            # The head of a large body is parsed and its body is not all here yet.
            self.direct = memoryview(self.buffer)[self.size:]

    # No eof_received: the default closes the transport, so a client that shuts down its
    # sending side counts as gone and its handler is cancelled. A half-close cannot be told from
    # a close here, and cancelling the work of a client that went away matters more.

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self.closing = True
        self.pending.clear()
        # Let go of a body half read (up to max_body) now, and break the cycle through the
        # parser so that the connection itself goes as soon as the loop lets go of it.
        self.buffer = self.direct = None
        self.chunks = []
        self.parser = None
        if self.idle_timer is not None:
            self.idle_timer.cancel()
        if self.task is not None:
            # The client is gone: cancel its handler, which cancels its inference.
            self.task.cancel()
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)

    def pause_writing(self) -> None:
        if self.writable is None or self.writable.done():
            self.writable = self.loop.create_future()

    def resume_writing(self) -> None:
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)


def _no_delay(transport: asyncio.BaseTransport) -> None:
    """TCP_NODELAY on a connection: without it Nagle's algorithm holds the last part of an
    answer until the client ACKs the one before, which a client delays by up to 40 ms. uvloop
    sets it on every TCP connection; asyncio's own loop only on a socket made with
    ``IPPROTO_TCP`` as its protocol (``socket.socket()`` leaves it 0), so a server on asyncio's
    loop answered each pipelined batch about 40 ms late. Once per connection."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:  # the connection is already gone: connection_lost follows
            pass


class HTTPServer:
    """Serve ``handler`` on a bound socket.

    Args:
        handler: answers every request; it should turn its own errors into a Response.
        error: answers what never reached the handler: a
            :class:`._http1_messages.BodyTooLarge`, a body that does not decompress, a
            malformed request (``ValueError``).
        max_body: largest request body kept, in bytes, after decompression; a larger one is
            read and dropped, and answered by ``error``.
        keepalive_timeout: seconds an idle connection is kept open.
        stall_timeout: seconds a client may read nothing of a response before its
            connection is aborted.
        cut: set, a :meth:`stop` waits no more for the requests in flight (a second signal).
    """

    def __init__(self, handler: Handler, error: Callable[[BaseException], Response], max_body: int,
                 keepalive_timeout: float = KEEPALIVE_TIMEOUT,
                 stall_timeout: float = STALL_TIMEOUT, cut: asyncio.Event | None = None) -> None:
        self.handler = handler
        self.error = error
        self.max_body = max_body
        self.keepalive_timeout = keepalive_timeout
        self.stall_timeout = stall_timeout
        self.connections: set[_Connection] = set()
        self.stopping = False
        self.cut = cut or asyncio.Event()  # set: a stop ends at once (see stop())
        # Whether requests keep their headers' names as sent (Request.names): for headers
        # forwarded to models, which Triton forwards under the client's own names.
        self.keep_case = False
        # Request heads parsed before, by their bytes (see _KnownHead); shared by connections.
        self.known_heads: dict[bytes, _KnownHead] = {}
        # Response heads written before, by what they say (see head()).
        self.heads: dict[tuple, bytes] = {}
        self._server: asyncio.AbstractServer | None = None
        self.loop: asyncio.AbstractEventLoop  # set by start()

    async def start(self, sock: socket.socket, backlog: int = 1024) -> None:
        """Start accepting connections on ``sock`` (bound, not yet listening)."""
        self.loop = asyncio.get_running_loop()
        self._server = await self.loop.create_server(lambda: _Connection(self), sock=sock,
                                                     backlog=backlog)

    def failed(self, request: Request) -> Response:
        """The answer to a request whose handler raised (a bug: the handler should turn its
        errors into a Response), from inside the ``except``: logged, and 500 instead of
        dropping the connection."""
        log.exception("HTTP %s %s failed", request.method, request.path)
        return Response(500, b'{"error":"internal server error"}', "application/json")

    def head(self, response: Response, size: int, keep_alive: bool, http10: bool) -> bytes:
        """The head of a whole ``size``-byte response, not compressed: built once for each
        status, type, headers, size and connection, then kept (a client's requests of one kind
        get answers alike; at most ``KNOWN_HEADS`` kept, all forgotten when full)."""
        headers = response.headers
        key = (response.status, response.content_type, size, keep_alive, http10,
               tuple(headers.items()) if headers else None)
        heads = self.heads
        try:
            head = heads.get(key)
        except TypeError:  # a header value that cannot be hashed: not kept
            return _head(response, [f"Content-Length: {size}"], keep_alive, http10)
        if head is None:
            head = _head(response, [f"Content-Length: {size}"], keep_alive, http10)
            if len(heads) >= KNOWN_HEADS:
                heads.clear()
            heads[key] = head
        return head

    async def stop(self, timeout: float) -> None:
        """Stop accepting; answer what is in flight for up to ``timeout`` seconds (or until
        :attr:`cut` is set), then cancel it (which cancels the inferences); close every
        connection."""
        if self._server is None:
            return
        self.stopping = True
        self._server.close()
        for conn in list(self.connections):
            conn.close_if_idle()
        busy = [c.task for c in self.connections if c.task is not None and c.idle is None]
        rest = await wait_all(busy, timeout, self.cut)
        for task in rest:
            task.cancel()
        if rest:
            await asyncio.wait(rest)
        for conn in list(self.connections):
            if conn.transport is not None:
                # A client that is not reading would keep a closing transport open for ever.
                if conn.transport.get_write_buffer_size():
                    conn.transport.abort()
                else:
                    conn.transport.close()
        await self._server.wait_closed()
        self._server = None
