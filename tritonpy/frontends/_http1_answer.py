"""The answering side of an HTTP/1.1 connection: the queue of parsed requests answered in
order by one task, the writing of responses (whole, compressed, or streamed in chunks), flow
control, and the closing of the connection."""
from __future__ import annotations

import asyncio
import logging
import time
import zlib
from http import HTTPStatus
from typing import AsyncGenerator

from ._http1_messages import Request, Response
from ._http1_parse import _Compressed, _Parsing

log = logging.getLogger("tritonpy.frontends._http1")

#: Requests parsed ahead on one connection before it stops reading (pipelining backpressure).
MAX_PIPELINED = 16
#: Bodies up to this size go out in one write with their head.
SMALL_BODY = 16384

_PHRASES = {s.value: s.phrase for s in HTTPStatus}
_PHRASES[405] = "Not Allowed"  # Triton's (libevhtp's) words


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


class _Answering(_Parsing):
    """The answering of a :class:`._http1._Connection`'s requests, in order, and its close (a
    layer: see ``_http1_state``)."""

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
                # Not kept while the connection waits for its next request: the answer's
                # tensors may be views of a stub's shared memory, which it could not give
                # back (a full /dev/shm reclaims idle segments), and the request's its inputs.
                del item, response
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

