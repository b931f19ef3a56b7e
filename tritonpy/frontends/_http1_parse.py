"""The request side of an HTTP/1.1 connection: httptools' callbacks, the limits and checks of
a request head, methods llhttp does not know, and the inflation of compressed bodies."""
from __future__ import annotations

import re
import time
import zlib
from typing import TYPE_CHECKING

import httptools

from ._http1_messages import KNOWN_HEADS, BodyTooLarge, Buffer, Request, Response, _KnownHead
from ._http1_state import _ConnectionState

#: A body announced larger than this is read straight into one buffer (see ``_Connection``).
LARGE_BODY = 65536
#: That buffer starts at this size (or the body's, if smaller) and doubles as the body arrives:
#: what a connection holds follows what its client sent, not what it announced (a client could
#: otherwise make the server allocate ``max_body`` bytes per connection with a few headers).
BODY_START = 262144
#: A compressed request body larger than this is inflated off the event loop (a body can
#: inflate to ~1000 times its size: seconds of CPU for the largest ones).
INFLATE_ON_LOOP = 65536
#: Content-Encodings of a request body that are understood ("" and identity: none).
_CODINGS = frozenset(("", "identity", "gzip", "deflate"))
#: Largest request head (URL and headers) accepted; a longer one is refused and the
#: connection closed, so a client cannot grow a connection's memory without end.
MAX_HEAD = 65536

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


class _Parsing(_ConnectionState):
    """The httptools callbacks of a :class:`._http1._Connection`: each request parsed, checked
    and queued (a layer: see ``_http1_state``)."""

    if TYPE_CHECKING:
        def _enqueue(self, item: Request | BaseException | _Compressed | Response,
                     keep_alive: bool) -> None: ...  # (_Answering's, the layer above)

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
