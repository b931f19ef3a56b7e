"""The state of one HTTP/1.1 connection, shared by its layers.

``_Connection`` (``_http1``) is one object made of layers, one module each; its MRO is
_Connection -> _Answering (``_http1_answer``) -> _Parsing (``_http1_parse``) ->
_ConnectionState -> asyncio.BufferedProtocol. Layers (mixins), not collaborator objects: every
layer reads and writes the same per-request state on each request (the parser's callbacks, the
queue, the transport), and a mixin adds no attribute hop or call layer to that path.
"""
from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING

import httptools

from ._http1_messages import Request, Response

if TYPE_CHECKING:
    from ._http1 import HTTPServer
    from ._http1_parse import _Compressed

#: Size of each connection's read buffer for heads and small bodies.
READ_SIZE = 65536


class _ConnectionState(asyncio.BufferedProtocol):
    """The state of a :class:`._http1._Connection` (see the module's doc for its layers)."""

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
