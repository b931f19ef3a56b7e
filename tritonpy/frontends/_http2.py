"""A gRPC server on HTTP/2, written for the frontends' asyncio loop.

``grpc.aio``'s server costs ~150 µs of CPU per unary call on a 2-vCPU VM before any work is
done, and makes its client spend ~120 µs more (many small writes and pings); the ``h2`` state
machine alone costs ~80 µs a call. This module frames HTTP/2 itself (RFC 9113), only what a
gRPC server needs, with ``hpack`` for request headers (decoded blocks that only index the table
are cached: a client's repeated calls send the same few bytes). It writes a call's headers,
message and trailers in one send, and runs the servicer methods of
:class:`~tritonpy.frontends._grpc_service.GRPCService` through a small context with the parts of
``grpc.aio.ServicerContext`` they use (``abort``, ``write``, ``add_done_callback``).

Served: unary and bidirectional-streaming calls, deadlines (``grpc-timeout``), compressed
requests (gzip, deflate), flow control both ways, padding, CONTINUATION, PING, SETTINGS,
RST_STREAM (a client's cancel), GOAWAY both ways and a drained stop; TLS (ALPN h2, client
certificates as the given context asks); responses compressed at a level, for the methods that
allow it, with an algorithm the client accepts; a method restricted to calls that carry a
header; a call's metadata handed to the handlers that ask for it; keepalive pings, gRPC core's
ping-strike policy and a maximum connection age (:class:`._h2_keepalive.KeepAlive`, Triton's
flags). Response headers never use the HPACK dynamic table (its size is set to 0 once per
connection). Not served: server push, priorities (ignored), reflection.

The server in parts: :mod:`._h2_frames` (HTTP/2 framing, the HPACK we write),
:mod:`._h2_grpc` (gRPC on HTTP/2: message prefix, statuses, compression, :class:`Method`),
:mod:`._h2_call` (one call, an HTTP/2 stream, and its :class:`~._h2_call.Context`),
:mod:`._h2_connection` (one connection: frames in and out, flow control, back-pressure),
:mod:`._h2_keepalive` (:class:`KeepAlive`, and a connection's pings and age); here: the
server, its start and stop, and the run of each call's handler.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator

import grpc

from .._loop import wait_all
from ._h2_call import _Call, _Deferred, resolve
from ._h2_connection import _CLOSE_WAIT, _Connection
from ._h2_grpc import (_OK, _UNKNOWN, COMPRESSION_LEVELS, MAX_MESSAGE_SIZE, Method, Serialized,
                       _Closed, _Status)
from ._h2_keepalive import KeepAlive

log = logging.getLogger(__name__)


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
