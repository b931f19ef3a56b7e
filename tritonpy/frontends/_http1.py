"""A lean HTTP/1.1 server for the KServe frontend: httptools' parser (llhttp) under an asyncio
Protocol.

Why not aiohttp's web server, which served this endpoint before: on a 2-vCPU machine its
request/response machinery cost 110-190 µs of CPU per small request, against 30-60 µs for this
protocol answering the same request (both on uvloop, driven by tritonclient). That was the
largest single cost of an HTTP inference. The frontend needs little of a framework: one handler,
whole bodies (the binary tensor extension slices tensors out of them), keep-alive, pipelining in
order, gzip/deflate both ways, ``Expect: 100-continue``, a body-size limit, cancellation of the
handler when its client disconnects, and a drain on stop. That is what this module does.
"""
from __future__ import annotations

import asyncio
import logging
import re
import socket
import time
import zlib
from collections import deque
from http import HTTPStatus
from typing import AsyncGenerator, Awaitable, Callable, Sequence, Union, cast

import httptools

from .._loop import wait_all

log = logging.getLogger(__name__)

#: Idle keep-alive connections are closed after this many seconds (aiohttp's default).
KEEPALIVE_TIMEOUT = 75.0
#: A client that reads nothing of its response for this long is disconnected.
STALL_TIMEOUT = 60.0
#: Requests parsed ahead on one connection before it stops reading (pipelining backpressure).
MAX_PIPELINED = 16
#: A body announced larger than this is read straight into one buffer (see ``_Connection``).
LARGE_BODY = 65536
#: That buffer starts at this size (or the body's, if smaller) and doubles as the body arrives:
#: what a connection holds follows what its client sent, not what it announced (a client could
#: otherwise make the server allocate ``max_body`` bytes per connection with a few headers).
BODY_START = 262144
#: Size of each connection's read buffer for heads and small bodies.
READ_SIZE = 65536
#: Bodies up to this size go out in one write with their head.
SMALL_BODY = 16384
#: A compressed request body larger than this is inflated off the event loop (a body can
#: inflate to ~1000 times its size: seconds of CPU for the largest ones).
INFLATE_ON_LOOP = 65536
#: Content-Encodings of a request body that are understood ("" and identity: none).
_CODINGS = frozenset(("", "identity", "gzip", "deflate"))
#: Largest request head (URL and headers) accepted; a longer one is refused and the
#: connection closed, so a client cannot grow a connection's memory without end.
MAX_HEAD = 65536
#: Request heads up to this size that were parsed once are kept, by their bytes, and not
#: parsed again (see ``_KnownHead``); at most ``KNOWN_HEADS`` of them, all forgotten when full.
KNOWN_HEAD_MAX = 4096
KNOWN_HEADS = 256

Buffer = Union[bytes, bytearray, memoryview]

_PHRASES = {s.value: s.phrase for s in HTTPStatus}
_PHRASES[405] = "Not Allowed"  # Triton's (libevhtp's) words
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"

# A method token as Triton's HTTP parser (libevhtp) takes one it does not know: capital
# letters and '_' (FOO, PATCHX; Triton closes without an answer at a lowercase letter, a digit
# or '-'). llhttp knows a fixed list; a request with another one is read with a stand-in of
# that list (see _unknown_method) and routed with its own, as Triton routes it (404 or 405).
_METHOD_TOKEN = re.compile(rb"[\r\n]*([A-Z_]+) ")
_METHOD_PART = re.compile(rb"[\r\n]*[A-Z_]*\Z")  # a method token cut by the end of a read
_STAND_IN = b"PUT"
#: The most of a request's method kept back, its end not read yet (see _feed).
MAX_METHOD = 1024


class _Counter:
    """A parser callback object that only counts the requests that end (see _unknown_method)."""

    def __init__(self) -> None:
        self.done = 0

    def on_message_complete(self) -> None:
        self.done += 1


def _request_start(data: Buffer, done: int) -> int:
    """Where in ``data`` (which starts with a request) the request after the first ``done``
    ones starts: the shortest part of it in which ``done`` requests end, found by parsing it
    again (only where a method was refused or cut: never on the usual path)."""
    whole = bytes(data)
    low, high = 0, len(whole)
    while low < high:
        mid = (low + high) // 2
        counter = _Counter()
        probe = httptools.HttpRequestParser(counter)
        if hasattr(probe, "set_dangerous_leniencies"):  # as _Connection._new_parser's
            probe.set_dangerous_leniencies(lenient_chunked_length=True)
        try:
            probe.feed_data(whole[:mid])
        except httptools.HttpParserError:
            pass
        if counter.done >= done:
            high = mid
        else:
            low = mid + 1
    return low


class Request:
    """One parsed request: method, path as sent, headers (lower-case names), whole body;
    ``names``: each header's name as sent, by its lower-case one, where the server keeps them
    (:attr:`HTTPServer.keep_case`), else None."""

    __slots__ = ("method", "path", "headers", "body", "http10", "received", "names")

    def __init__(self, method: str, path: str, headers: dict[str, str], body: bytes | bytearray,
                 http10: bool = False, received: tuple[int, int] = (0, 0),
                 names: dict[str, str] | None = None) -> None:
        self.method = method
        self.path = path
        self.headers = headers
        self.body = body
        self.http10 = http10
        self.received = received  # time.monotonic_ns() when it began and finished arriving
        self.names = names


class Response:
    """What a handler answers.

    ``parts``: buffers sent after ``body`` without joining them first (a large tensor goes
    from its array to the socket with no copy; the buffers must stay unchanged until sent).
    ``stream``: the body comes from this iterator instead, chunk by chunk as it yields
    (chunked transfer encoding); it is closed when the client goes away.
    ``compress``: gzip/deflate the body when the client accepts it.
    """

    __slots__ = ("status", "body", "parts", "stream", "content_type", "headers", "compress",
                 "on_sent")

    def __init__(self, status: int = 200, body: bytes = b"", content_type: str | None = None,
                 headers: dict[str, str] | None = None, parts: Sequence[Buffer] = (),
                 stream: AsyncGenerator[bytes, None] | None = None) -> None:
        self.status = status
        self.body = body
        self.parts = parts
        self.stream = stream
        self.content_type = content_type
        self.headers = headers
        self.compress = False
        # Called with time.monotonic_ns() before and after the response is written (tracing).
        self.on_sent: Callable[[int, int], None] | None = None


Handler = Callable[[Request], Awaitable[Response]]


class _KnownHead:
    """What a request head said, kept by its bytes: a client sends each request of one kind
    with the same head, byte for byte (tritonclient does), and a head seen before is not
    parsed again. Only plain heads are kept: a whole body of at most ``LARGE_BODY`` bytes by
    Content-Length (or none), not compressed, no Expect, no Upgrade, no Transfer-Encoding."""

    __slots__ = ("method", "path", "headers", "length", "keep_alive", "http10", "names")

    def __init__(self, method: str, path: str, headers: dict[str, str], length: int,
                 keep_alive: bool, http10: bool, names: dict[str, str] | None) -> None:
        self.method, self.path, self.headers = method, path, headers
        self.length, self.keep_alive, self.http10 = length, keep_alive, http10
        self.names = names


class BodyTooLarge(Exception):
    """Raised to the handler's error hook for a body over the limit (see ``HTTPServer``)."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size


def _decompress(body: bytes | bytearray, coding: str, limit: int) -> bytes:
    """A gzip or deflate request body, inflated to at most ``limit`` bytes."""
    if coding == "gzip":
        wbits = 16 + zlib.MAX_WBITS
    elif body[:1] and (body[0] & 0x0F) == 8:  # a zlib header (what deflate should be)
        wbits = zlib.MAX_WBITS
    else:  # raw deflate, as some clients send it
        wbits = -zlib.MAX_WBITS
    inflater = zlib.decompressobj(wbits)
    out = inflater.decompress(body, limit + 1)
    if len(out) > limit:
        raise BodyTooLarge(len(out))
    if not inflater.eof:
        raise ValueError("truncated compressed body")
    # A gzip body may be several members, one after the other (RFC 1952, 2.2): each inflates
    # to the next part. Anything else after the end is refused: the body up to there would
    # answer a request other than the one sent.
    rest = inflater.unused_data
    parts = [out]
    size = len(out)
    while rest:
        if coding != "gzip" or not rest.startswith(b"\x1f\x8b"):
            raise ValueError(f"{len(rest)} bytes of trailing data after the compressed body")
        inflater = zlib.decompressobj(wbits)
        part = inflater.decompress(rest, limit + 1 - size)
        size += len(part)
        if size > limit:
            raise BodyTooLarge(size)
        if not inflater.eof:
            raise ValueError("truncated compressed body")
        parts.append(part)
        rest = inflater.unused_data
    return out if len(parts) == 1 else b"".join(parts)


class _Compressed:
    """A request whose body is still gzip or deflate."""

    __slots__ = ("request", "coding", "limit")

    def __init__(self, request: Request, coding: str, limit: int) -> None:
        self.request, self.coding, self.limit = request, coding, limit

    def inflate(self) -> Request | BaseException:
        """The request with its body inflated, or the error to answer instead."""
        try:
            self.request.body = _decompress(self.request.body, self.coding, self.limit)
        except BodyTooLarge as exc:
            return exc
        except (zlib.error, ValueError) as exc:
            return ValueError(f"failed to decompress the {self.coding} request body: {exc}")
        return self.request


def _coding(accept: str) -> str | None:
    """The coding of gzip/deflate that an Accept-Encoding value prefers (its q-values read: a
    coding at q=0 is refused, ``*`` stands for the ones not named), or None."""
    q: dict[str, float] = {}
    for item in accept.lower().split(","):
        name, _, params = item.partition(";")
        name = name.strip()
        weight = 1.0
        for param in params.split(";"):
            key, _, value = param.partition("=")
            if key.strip() == "q":
                try:
                    weight = float(value)
                except ValueError:
                    weight = 0.0
        if name:
            q[name] = weight
    best, best_q = None, 0.0
    for coding in ("gzip", "deflate"):
        weight = q.get(coding, q.get("*", 0.0))
        if weight > best_q:
            best, best_q = coding, weight
    return best


def _compress(body: bytes, accept: str) -> tuple[bytes, str] | None:
    """The body in the coding of gzip/deflate that ``accept`` prefers, or None."""
    coding = _coding(accept) if accept else None
    if coding == "gzip":
        out = zlib.compressobj(wbits=16 + zlib.MAX_WBITS)
        return out.compress(body) + out.flush(), "gzip"
    if coding == "deflate":
        return zlib.compress(body), "deflate"
    return None


def _head(response: Response, extra: list[str], keep_alive: bool, http10: bool = False) -> bytes:
    """A response's status line and headers, ``extra`` (framing) among them; an HTTP/1.0
    connection kept open is told so (its client assumes a close otherwise)."""
    lines = [f"HTTP/1.1 {response.status} {_PHRASES.get(response.status, 'Unknown')}"]
    if response.content_type is not None:
        lines.append(f"Content-Type: {response.content_type}")
    if response.headers:
        lines.extend(f"{k}: {v}" for k, v in response.headers.items())
    lines.extend(extra)
    if not keep_alive:
        lines.append("Connection: close")
    elif http10:
        lines.append("Connection: keep-alive")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class _Connection(asyncio.BufferedProtocol):
    """One client connection: parse, queue, answer in order, one handler task at a time.

    A buffered protocol: the loop reads into our buffers. Head and small bodies are read into
    a scratch buffer and parsed; a large body with a Content-Length gets one buffer, and once
    the parser has seen the head, the rest of the body is read straight into it (no copy per
    chunk, and no churn of chunk-sized allocations: a 16 MiB body took 3x the CPU through
    httptools' per-chunk bytes objects). That buffer starts at ``BODY_START`` bytes and doubles
    whenever it is full, up to the announced length, which it then has exactly; growing resizes
    it in place (realloc, which remaps a large block rather than copying it).
    """

    def __init__(self, server: HTTPServer) -> None:
        self.server = server
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        # None once the connection is lost: the parser holds our bound callbacks, and the cycle
        # would keep the connection (and its buffers) alive until the garbage collector ran.
        self.parser: httptools.HttpRequestParser | None = self._new_parser()
        self.pending: deque[tuple[Request | BaseException | _Compressed | Response, bool]] = deque()
        # The task that answers the queued requests in order. It lives as long as the
        # connection, waiting on ``idle`` between requests: a task per request cost more (its
        # creation, and asyncio's registry of tasks, a WeakSet, in Python, on 3.11).
        self.task: asyncio.Task[None] | None = None
        self.idle: asyncio.Future[None] | None = None
        self.closing = False
        self.paused = False
        self.writable: asyncio.Future[None] | None = None
        # One timer per connection, not one per request (creating a timer costs more than the
        # rest of a request's parsing): each tick closes the connection if no request began
        # since the last one, so an idle connection goes after 1-2 keep-alive timeouts.
        self.idle_timer: asyncio.TimerHandle | None = None
        self.active = False
        self.t_begin = 0  # when the request being read began to arrive (monotonic ns)
        # The request being parsed.
        self.url = b""
        self.headers: dict[str, str] = {}
        self.names: dict[str, str] | None = None  # see Request.names
        self.head_size = 0
        self.head_error = ""
        self.chunks: list[bytes] = []
        self.buffer: bytearray | None = None
        self.size = 0
        self.length = 0  # the Content-Length of a body read into ``buffer``
        self.too_large = False
        self.keep_alive = True
        self.method = ""
        self.method_override: str | None = None  # the method _unknown_method stood in for
        # A request whose method the last read cut (see _feed): parsed again from its first
        # byte with the next read.
        self.method_start = b""
        self.messages = 0  # requests whose end the parser reached (see _unknown_method)
        self.http10 = False
        # The head of a request that asks to switch protocols, less the upgrade, to read again
        # (see _feed); None for any other.
        self.upgrade_head: bytes | None = None
        self.scratch_bytes = bytearray(READ_SIZE)
        self.scratch = memoryview(self.scratch_bytes)
        # Whether the parser is inside a request (between its first byte and its end), and the
        # bytes of the head it is about to parse when they may be kept (see _known).
        self.in_message = False
        self.head_key: bytes | None = None
        # The free part of ``buffer``, while the body is read straight into it; empty when the
        # buffer is full and must grow before the next read.
        self.direct: memoryview | None = None

    def _new_parser(self) -> httptools.HttpRequestParser:
        parser = httptools.HttpRequestParser(self)
        # A body with both Content-Length and Transfer-Encoding: chunked is read as chunked
        # (as Triton does, and as RFC 9112 allows), and the connection closes after it.
        if hasattr(parser, "set_dangerous_leniencies"):
            parser.set_dangerous_leniencies(lenient_chunked_length=True)
        return parser

    # -- asyncio.BufferedProtocol --------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transport does not subclass asyncio.Transport. Both loops set TCP_NODELAY.
        self.transport = cast(asyncio.Transport, transport)
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

    # -- httptools callbacks -------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.in_message = True
        self.t_begin = time.monotonic_ns()
        self.url = b""
        self.headers = {}
        self.names = {} if self.server.keep_case else None
        self.head_size = 0
        self.chunks = []
        self.buffer = None
        self.size = 0
        self.too_large = False
        self.active = True

    def _grow_head(self, size: int) -> None:
        self.head_size += size
        if self.head_size > MAX_HEAD:
            # httptools reports a callback's exception as a bare "callback error": keep ours.
            self.head_error = f"the request head exceeds {MAX_HEAD} bytes"
            raise ValueError(self.head_error)

    def on_url(self, url: bytes) -> None:
        self._grow_head(len(url))
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.head_size += len(name) + len(value) + 4  # _grow_head, inline: once per header
        if self.head_size > MAX_HEAD:
            self._grow_head(0)
        key = name.decode("latin-1").lower()
        if self.names is not None:
            self.names[key] = name.decode("latin-1")
        text = value.decode("latin-1")
        old = self.headers.get(key)
        self.headers[key] = text if old is None else f"{old}, {text}"

    def on_headers_complete(self) -> None:
        parser = self.parser
        assert parser is not None  # it is the one calling
        key, self.head_key = self.head_key, None
        self.keep_alive = parser.should_keep_alive() and not (
            "transfer-encoding" in self.headers and "content-length" in self.headers)
        self.method = parser.get_method().decode("latin-1")
        stood_in = self.method_override is not None
        if stood_in:
            self.method, self.method_override = self.method_override, None  # type: ignore[assignment]
        if self.method == "CONNECT":
            # What follows its head is a tunnel's bytes, not requests: one answer, then close
            # (answering it as a request, then its tunnel as a malformed one, sent two).
            self._refuse_head("the CONNECT method is not supported")
        codings = self.headers.get("transfer-encoding")
        if codings is not None:
            self._check_transfer_codings(codings)
        if "upgrade" in self.headers and parser.should_upgrade():
            self.upgrade_head = self._head_without_upgrade(parser.get_http_version(), stood_in)
            return  # read again without it, body and all (see _feed)
        self.http10 = parser.get_http_version() == "1.0"
        text = self.headers.get("content-length", "")
        length = int(text) if text.isdigit() else 0
        if length > self.server.max_body:
            self.too_large = True
        elif length > LARGE_BODY and "transfer-encoding" not in self.headers:
            # What arrived with the head (at most READ_SIZE) fits; the rest grows it.
            self.length = length
            self.buffer = bytearray(min(length, BODY_START))
        if self.headers.get("expect", "").lower() == "100-continue" and self.transport is not None:
            if self.too_large:
                # Answer now; the client sends no body, so the connection cannot be reused.
                self.closing = True
                self._enqueue(BodyTooLarge(length), keep_alive=False)
                self.transport.pause_reading()
                self.paused = True
            else:
                self.transport.write(_CONTINUE)
        if key is not None and self.buffer is None and not self.too_large and not (
                self.method == "CONNECT"
                or {"expect", "transfer-encoding", "upgrade"} & self.headers.keys()
                or self.headers.get("content-encoding", "identity").lower() != "identity"
                or text and not text.isdigit()):
            known = self.server.known_heads
            if len(known) >= KNOWN_HEADS:
                known.clear()
            known[key] = _KnownHead(self.method, self._path(), dict(self.headers), length,
                                    self.keep_alive, self.http10, self.names)

    def _refuse_head(self, reason: str) -> None:
        """Stop the parser at this head: ``reason`` is answered with 400, then the connection
        closes (httptools reports a callback's exception as a bare "callback error")."""
        self.head_error = reason
        raise ValueError(reason)

    def _check_transfer_codings(self, value: str) -> None:
        """Refuse a Transfer-Encoding other than chunked, alone or last (RFC 9112, 6.3: any
        other leaves the body's length unknown). The parser would otherwise read its body
        until the client closes, with Content-Length or without: it was never answered."""
        codings = [c.strip().lower() for c in value.split(",")]
        if codings[-1] != "chunked":
            self._refuse_head(f"unsupported Transfer-Encoding '{value}': the body must be "
                              "sent with Content-Length or chunked")
        if len(codings) > 1:
            # gzip, deflate: framed by chunks, but nothing here would decode them.
            self._refuse_head(f"unsupported Transfer-Encoding '{value}': only chunked is "
                              "supported (compress with Content-Encoding)")

    def _head_without_upgrade(self, version: str, stood_in: bool = False) -> bytes:
        """The request's head as it came, less its ``Upgrade`` header and token (with the
        stand-in method again where llhttp does not know the request's own, ``stood_in``)."""
        method = self.method.encode("latin-1")
        if stood_in:
            method, self.method_override = _STAND_IN, self.method
        lines = [b"%s %s HTTP/%s" % (method, self.url, version.encode())]
        for name, value in self.headers.items():
            if name == "upgrade":
                continue
            if name == "connection":
                value = ", ".join(t for t in (t.strip() for t in value.split(","))
                                  if t and t.lower() not in ("upgrade", "http2-settings"))
                if not value:
                    continue
            lines.append(f"{name}: {value}".encode("latin-1"))
        return b"\r\n".join(lines) + b"\r\n\r\n"

    def on_body(self, body: bytes) -> None:
        self.size += len(body)
        if self.too_large:
            return  # counted, not kept
        if self.size > self.server.max_body:
            self.too_large = True
            self.chunks = []
            self.buffer = None
            return
        if self.buffer is not None:
            # Past its end, the assignment extends the buffer.
            self.buffer[self.size - len(body):self.size] = body
        else:
            self.chunks.append(body)

    def on_message_complete(self) -> None:
        self.messages += 1
        self._message_done()

    def _unknown_method(self, data: Buffer, done: int) -> bytes | None:
        """The bytes to parse again after llhttp refused a request's method: ``data`` from
        that request on, its method replaced by a stand-in (``method_override`` keeps it);
        empty when the method is cut by the end of ``data`` (kept back until the rest comes);
        None when it is no method token (a lowercase one, say): the request is malformed.

        ``data`` starts with a request, and ``done`` requests in it ended before the refused
        one (see _request_start)."""
        whole = bytes(data)
        start = _request_start(whole, done)
        found = _METHOD_TOKEN.match(whole, start)
        if found is not None:
            self.method_override = found.group(1).decode("latin-1")
            return _STAND_IN + whole[found.end(1):]
        if _METHOD_PART.match(whole, start) and len(whole) - start <= MAX_METHOD:
            self.method_start = whole[start:]
            return b""
        return None

    def _path(self) -> str:
        """The request's path as sent (percent escapes kept: a router splits it first, then
        decodes each part, so ``%2F`` never splits a name), without its query; an absolute-form
        target (``http://host/v2/...``, which HTTP/1.1 servers must take) is cut to its path."""
        path = self.url.decode("latin-1").partition("?")[0]
        if not path.startswith("/"):
            scheme, sep, rest = path.partition("://")
            if sep and scheme.lower() in ("http", "https"):
                path = "/" + rest.partition("/")[2]
        return path

    def _message_done(self) -> None:
        self.in_message = False
        if self.closing or self.upgrade_head is not None:
            return
        keep_alive = self.keep_alive and not self.server.stopping
        if self.too_large:
            self._enqueue(BodyTooLarge(max(self.size, int(self.headers.get("content-length", 0) or 0))),
                          keep_alive)
            return
        body: bytes | bytearray
        if self.buffer is not None:
            body, self.buffer = self.buffer, None
        else:
            body = self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)
            self.chunks = []
        coding = self.headers.get("content-encoding", "").lower()
        request = Request(self.method, self._path(), self.headers, body, self.http10,
                          (self.t_begin, time.monotonic_ns()), self.names)
        if coding not in _CODINGS:
            # Triton's answer (measured with 2.51), and the codings it would take.
            self._enqueue(Response(501, b'{"error":"Unsupported compression type"}',
                                   "application/json", {"Accept-Encoding": "gzip, deflate"}),
                          keep_alive)
            return
        if coding in ("gzip", "deflate") and body:
            compressed = _Compressed(request, coding, self.server.max_body)
            # A large one (up to ~1000x its size) is inflated off the loop, in its turn.
            self._enqueue(compressed if len(body) > INFLATE_ON_LOOP else compressed.inflate(),
                          keep_alive)
            return
        self._enqueue(request, keep_alive)

    # -- answering -----------------------------------------------------------------------

    def _enqueue(self, item: Request | BaseException | _Compressed | Response,
                 keep_alive: bool) -> None:
        self.pending.append((item, keep_alive))
        idle = self.idle
        if idle is not None:
            self.idle = None
            if not idle.done():
                idle.set_result(None)
        elif self.task is None:
            self.task = self.loop.create_task(self._serve())
        elif len(self.pending) >= MAX_PIPELINED and not self.paused and self.transport is not None:
            self.transport.pause_reading()
            self.paused = True

    def _busy(self) -> bool:
        """Whether a request is being answered, or waits to be."""
        return (self.task is not None and self.idle is None) or bool(self.pending)

    async def _serve(self) -> None:
        try:
            while True:
                if not self.pending:
                    if self.closing:
                        return
                    idle = self.idle = self.loop.create_future()
                    try:
                        await idle  # the next request (_enqueue), or a cancel (_close)
                    finally:
                        self.idle = None
                    continue
                item, keep_alive = self.pending.popleft()
                if isinstance(item, _Compressed):
                    item = await asyncio.to_thread(item.inflate)
                if self.paused and not self.closing and len(self.pending) < MAX_PIPELINED // 2:
                    assert self.transport is not None
                    self.transport.resume_reading()
                    self.paused = False
                http10 = False
                if isinstance(item, Request):
                    accept = item.headers.get("accept-encoding", "")
                    head_only = item.method == "HEAD"
                    http10 = item.http10
                    # The handler awaited here, not through a coroutine of the server's: one
                    # frame less on each request's stack, at each suspension and resumption.
                    try:
                        response = await self.server.handler(item)
                    except asyncio.CancelledError:
                        raise
                    except Exception:
                        response = self.server.failed(item)
                elif isinstance(item, Response):  # answered before it reached the handler
                    accept, head_only, response = "", False, item
                else:
                    accept, head_only = "", False
                    response = self.server.error(item)
                if self.server.stopping:
                    keep_alive = False
                if response.stream is not None:
                    keep_alive = await self._write_stream(response, response.stream,
                                                          keep_alive and not http10, chunked=not http10)
                elif response.on_sent is None:
                    self._write(response, accept, head_only, keep_alive, http10)
                else:
                    t_send = time.monotonic_ns()
                    try:
                        self._write(response, accept, head_only, keep_alive, http10)
                    finally:
                        response.on_sent(t_send, time.monotonic_ns())
                if not keep_alive:
                    self._close()
                    return
                if self.writable is not None and not self.writable.done():
                    await self._drained()  # the client reads slowly: do not queue more on it
                    if self.server.stopping:  # began meanwhile: its idle close has passed
                        self._close()
                        return
        except asyncio.CancelledError:
            self._close()
            raise
        finally:
            self.task = None

    def _write(self, response: Response, accept: str, head_only: bool, keep_alive: bool,
               http10: bool = False) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        body, parts = response.body, response.parts
        coding = ""
        if response.compress and accept and (body or parts):
            packed = _compress(b"".join([body, *parts]) if parts else body, accept)
            if packed is not None:
                body, parts = packed[0], ()
                coding = packed[1]
        size = len(body)
        for part in parts:
            size += part.nbytes if type(part) is memoryview else memoryview(part).nbytes
        if coding:
            head = _head(response, [f"Content-Encoding: {coding}", f"Content-Length: {size}"],
                         keep_alive, http10)
        else:
            head = self.server.head(response, size, keep_alive, http10)
        if head_only or not size:
            transport.write(head)
        elif size <= SMALL_BODY:
            transport.write(b"".join([head, body, *parts]))
        else:
            transport.writelines([head, body, *parts])

    async def _write_stream(self, response: Response, stream: AsyncGenerator[bytes, None],
                            keep_alive: bool, chunked: bool) -> bool:
        """Send the head, then each chunk the stream yields as it comes; whether the connection
        can still be used (not when the stream failed half-way: the client must see the cut)."""
        transport = self.transport
        if transport is None or transport.is_closing():
            await stream.aclose()
            return False
        # Chunks that come in one turn of the loop (responses that queued up while the loop was
        # busy) go out in one write at its end, not a syscall each.
        out = [_head(response, ["Transfer-Encoding: chunked"] if chunked else [], keep_alive)]
        flush_at: list[asyncio.Handle] = []

        def flush() -> None:
            flush_at.clear()
            if out and not transport.is_closing():
                transport.write(b"".join(out))
            out.clear()

        try:
            async for chunk in stream:
                if not chunk:
                    continue
                if transport.is_closing():
                    return False
                out.append(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
                if not flush_at:
                    flush_at.append(self.loop.call_soon(flush))
                if self.writable is not None and not self.writable.done():
                    await self._drained()
            if chunked:
                out.append(b"0\r\n\r\n")
            flush()
            return keep_alive
        except Exception:
            log.exception("HTTP response stream failed; closing the connection")
            flush()  # what was sent before the failure: the client sees where it was cut
            return False
        finally:
            for handle in flush_at:
                handle.cancel()
            await stream.aclose()

    async def _drained(self) -> None:
        """Wait until the transport takes more; abort a client that reads nothing for
        ``stall_timeout`` seconds. What waits to be sent may be views of shared memory (output
        tensors go out unjoined), so a stalled client must not hold them for ever."""
        writable, transport = self.writable, self.transport
        assert writable is not None and transport is not None
        timeout = self.server.stall_timeout
        left = transport.get_write_buffer_size()
        since = self.loop.time()
        while not writable.done():
            await asyncio.wait({writable}, timeout=min(timeout, 10.0))
            if writable.done():
                return
            now, size = self.loop.time(), transport.get_write_buffer_size()
            if size < left:
                left, since = size, now
            elif now - since >= timeout:
                log.warning("HTTP client read nothing for %.0f s; closing its connection", timeout)
                self.closing = True
                self.pending.clear()
                transport.abort()  # drop what is buffered now; connection_lost follows
                return

    def _fail_parse(self, reason: str) -> None:
        """A request the parser refused: answer 400 after those already queued, then close."""
        if self.closing:
            return
        self.closing = True
        if self.transport is not None:
            self.transport.pause_reading()
        self.pending.append((ValueError(reason), False))
        if self.task is None or self.idle is not None:
            # Nothing is queued ahead of it: write the answer now.
            item, _ = self.pending.popleft()
            assert isinstance(item, BaseException)
            self._write(self.server.error(item), "", False, keep_alive=False)
            self._close()

    def _close(self) -> None:
        self.closing = True
        self.pending.clear()
        if self.idle is not None and self.task is not None:
            self.task.cancel()  # it waits for a request that will not come
        if self.transport is not None:
            self.transport.close()

    def _arm_idle_timer(self) -> None:
        if self.idle_timer is not None:
            self.idle_timer.cancel()
        self.idle_timer = self.loop.call_later(self.server.keepalive_timeout, self._idle_close)

    def _idle_close(self) -> None:
        self.idle_timer = None
        if self.active or self._busy():
            self.active = False
            self._arm_idle_timer()
        else:
            self._close()

    def close_if_idle(self) -> None:
        """On stop: close now unless a request is being answered (that one closes after)."""
        if not self._busy():
            self._close()


class HTTPServer:
    """Serve ``handler`` on a bound socket.

    Args:
        handler: answers every request; it should turn its own errors into a Response.
        error: answers what never reached the handler: a :class:`BodyTooLarge`, a body that
            does not decompress, a malformed request (``ValueError``).
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
