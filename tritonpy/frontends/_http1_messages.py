"""The messages of the HTTP/1.1 server (see ``_http1``): a parsed :class:`Request`, the
:class:`Response` a handler answers, :class:`BodyTooLarge`, and the request heads a server keeps
(``_KnownHead``) so that it does not parse one twice."""
from __future__ import annotations

from typing import AsyncGenerator, Awaitable, Callable, Sequence, Union

#: Request heads up to this size that were parsed once are kept, by their bytes, and not
#: parsed again (see ``_KnownHead``); at most ``KNOWN_HEADS`` of them, all forgotten when full.
KNOWN_HEAD_MAX = 4096
KNOWN_HEADS = 256

Buffer = Union[bytes, bytearray, memoryview]


class Request:
    """One parsed request: method, path as sent, headers (lower-case names), whole body;
    ``names``: each header's name as sent, by its lower-case one, where the server keeps them
    (:attr:`._http1.HTTPServer.keep_case`), else None."""

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

