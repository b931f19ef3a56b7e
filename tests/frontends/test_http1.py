"""The HTTP/1.1 server under the KServe frontend (``tritonpy.frontends._http1``), over real
sockets: keep-alive, pipelining, ``Expect: 100-continue``, body limits, compression both ways,
malformed requests, disconnects, idle connections and the drain on stop."""
from __future__ import annotations

import asyncio
import gc
import gzip
import hashlib
import random
import socket
import threading
import time
import weakref
import zlib
from collections.abc import AsyncGenerator, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import psutil
import pytest

from _models import wait_for
from tritonpy.frontends import new_event_loop
from tritonpy.frontends._http1 import HTTPServer
from tritonpy.frontends._http1_answer import _coding
from tritonpy.frontends._http1_messages import BodyTooLarge, Request, Response
from tritonpy.frontends._http1_parse import LARGE_BODY, MAX_HEAD

LIMIT = 1000


class Running:
    """An HTTPServer on its own loop in a thread; ``port`` to connect to."""

    def __init__(self, server: HTTPServer, loop: asyncio.AbstractEventLoop, port: int) -> None:
        self.server, self.loop, self.port = server, loop, port

    def stop(self, timeout: float) -> float:
        """Run ``server.stop(timeout)``; the seconds it took."""
        t0 = time.monotonic()
        asyncio.run_coroutine_threadsafe(self.server.stop(timeout), self.loop).result(timeout + 10)
        return time.monotonic() - t0


def _refused(err: BaseException) -> Response:
    if isinstance(err, BodyTooLarge):
        return Response(400, f"too large: {err.size}".encode(), "text/plain")
    return Response(400, f"refused: {err}".encode(), "text/plain")


@contextmanager
def serving(handler: Callable[[Request], Any], max_body: int = LIMIT,
            loop_factory: Callable[[], asyncio.AbstractEventLoop] = new_event_loop,
            **kw: Any) -> Iterator[Running]:
    """Serve ``handler`` on 127.0.0.1 (a free port) until the block ends."""
    loop = loop_factory()
    server = HTTPServer(handler, _refused, max_body, **kw)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    loop.run_until_complete(server.start(sock))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    running = Running(server, loop, port)
    try:
        yield running
    finally:
        if server._server is not None:
            running.stop(1.0)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


async def echo(req: Request) -> Response:
    """Method, path and body back, so a test sees what the server parsed."""
    return Response(200, f"{req.method} {req.path} ".encode() + req.body, "text/plain",
                    {"X-Seen-Type": req.headers.get("content-type", "-")})


async def until_cancelled(cancelled: threading.Event) -> Response:
    """A handler body that never answers; sets ``cancelled`` when it is cancelled."""
    try:
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        cancelled.set()
        raise
    return Response(200)


def connect(running: Running) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", running.port), timeout=10)
    return sock


def read_response(sock: socket.socket, buf: bytearray | None = None) -> tuple[int, dict[str, str], bytes]:
    """One response off the socket: (status, headers with lower-case names, body)."""
    data = buf if buf is not None else bytearray()
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a response; got {bytes(data)!r}")
        data += chunk
    head, _, rest = bytes(data).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    body = bytearray(rest)
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed inside a body")
        body += chunk
    data[:] = body[length:]
    return status, headers, bytes(body[:length])


def closed_by_server(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def post(path: str, body: bytes, *extra: str, version: str = "1.1") -> bytes:
    head = [f"POST {path} HTTP/{version}", "Host: t", f"Content-Length: {len(body)}", *extra]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def expect_continue_then_chunked(sock: socket.socket) -> None:
    """A body sent after ``100 Continue``, then a chunked one, on ``sock`` (served by echo)."""
    sock.sendall(b"POST /c HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
    assert sock.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"
    sock.sendall(b"hello")
    assert read_response(sock)[2] == b"POST /c hello"
    sock.sendall(b"POST /c HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
                 b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
    assert read_response(sock)[2] == b"POST /c abcde"


@pytest.mark.parametrize("loop_factory", [new_event_loop, asyncio.new_event_loop],
                         ids=["uvloop", "asyncio"])
def test_connections_answer_without_nagle_delay_on_either_loop(loop_factory) -> None:
    # On asyncio's own loop (an embedder's, or no uvloop) a connection accepted from a socket
    # made with protocol 0 had no TCP_NODELAY: each pipelined batch's last answer waited for
    # the client's delayed ACK, about 40 ms (found splitting _http1.py).
    with serving(echo, loop_factory=loop_factory) as running:
        sock = connect(running)
        try:
            sock.sendall(post("/a", b"x"))
            assert read_response(sock)[0] == 200
            (conn,) = running.server.connections
            server_side = conn.transport.get_extra_info("socket")
            assert server_side.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        finally:
            sock.close()


def test_keep_alive_and_http10_close() -> None:
    with serving(echo) as running:
        sock = connect(running)
        for i in range(3):
            sock.sendall(post("/v2/a%20b?x=1", f"body{i}".encode(), "Content-Type: text/x"))
            status, headers, body = read_response(sock)
            assert (status, body) == (200, f"POST /v2/a%20b body{i}".encode())
            assert headers["x-seen-type"] == "text/x" and "connection" not in headers
        sock.close()
        sock = connect(running)
        sock.sendall(post("/old", b"x", version="1.0"))
        status, headers, body = read_response(sock)
        assert (status, body, headers["connection"]) == (200, b"POST /old x", "close")
        assert closed_by_server(sock)
        sock.close()
        # HTTP/1.0 asking to keep the connection: it stays, and the answer says so (a 1.0
        # client assumes a close otherwise); twice, the second through the kept head.
        sock = connect(running)
        for i in range(2):
            sock.sendall(post("/old", b"k%d" % i, "Connection: keep-alive", version="1.0"))
            status, headers, body = read_response(sock)
            assert (status, body, headers["connection"]) == (200, b"POST /old k%d" % i,
                                                            "keep-alive")
        sock.close()


def test_pipelined_requests_answer_in_order() -> None:
    async def slow_first(req: Request) -> Response:
        if req.body == b"slow":
            await asyncio.sleep(0.3)
        return await echo(req)

    with serving(slow_first) as running:
        sock = connect(running)
        sock.sendall(b"".join(post("/p", b) for b in (b"slow", b"fast", b"last")))
        buf = bytearray()
        bodies = [read_response(sock, buf)[2] for _ in range(3)]
        assert bodies == [b"POST /p slow", b"POST /p fast", b"POST /p last"]
        sock.close()


def test_a_head_seen_before_is_answered_as_the_first_time() -> None:
    """A request head is parsed once and kept by its bytes (``_KnownHead``): requests that
    send the same head again get exactly what a parse would give them, whatever their bodies,
    however they are cut or pipelined, and only plain heads are kept (no Expect, no
    compression, no chunked body, no upgrade)."""
    seen: list[tuple[str, str, dict[str, str], bytes, bool]] = []

    async def record(req: Request) -> Response:
        seen.append((req.method, req.path, dict(req.headers), bytes(req.body), req.http10))
        req.headers["x-added-by-handler"] = "1"  # must not reach the next request
        return await echo(req)

    head = ("Content-Type: text/x", "X-Kind: a%20b")
    with serving(record) as running:
        sock = connect(running)
        for i in range(3):  # the second and third take the kept head
            sock.sendall(post("/v2/a%20b?x=1", b"body%d" % i, *head))
            assert read_response(sock)[2] == b"POST /v2/a%%20b body%d" % i
        assert len(running.server.known_heads) == 1
        want = {"host": "t", "content-length": "5", "content-type": "text/x", "x-kind": "a%20b"}
        assert seen == [("POST", "/v2/a%20b", want, b"body%d" % i, False) for i in range(3)]
        # Pipelined behind each other in one write, then cut anywhere: a head with its body,
        # a body split after the head, a head split in two.
        wire = b"".join(post("/v2/a%20b?x=1", b"pipe%d" % i, *head) for i in range(4))
        for cut in (0, len(wire) // 4 * 1 + 3, len(wire) // 2, len(wire) - 2, 7):
            sock.sendall(wire[:cut])
            time.sleep(0.02)  # two reads, not one
            sock.sendall(wire[cut:])
            buf = bytearray()
            assert [read_response(sock, buf)[2] for _ in range(4)] == [
                b"POST /v2/a%%20b pipe%d" % i for i in range(4)]
        # The same head with a body of another length is another head.
        sock.sendall(post("/v2/a%20b?x=1", b"longer body", *head))
        assert read_response(sock)[2] == b"POST /v2/a%20b longer body"
        assert all(len(s[2]) == 4 for s in seen)  # the handler's header never carried over
        # Heads that need more than their bytes are parsed every time.
        for _ in range(2):
            expect_continue_then_chunked(sock)
            sock.sendall(post("/z", gzip.compress(b"packed"), "Content-Encoding: gzip"))
            assert read_response(sock)[2] == b"POST /z packed"
        assert len(running.server.known_heads) == 2
        sock.close()
        # HTTP/1.0 closes after each answer, kept head or not.
        for _ in range(2):
            sock = connect(running)
            sock.sendall(post("/old", b"x", version="1.0"))
            status, headers, body = read_response(sock)
            assert (status, body, headers["connection"]) == (200, b"POST /old x", "close")
            assert closed_by_server(sock)
            sock.close()
        assert seen[-1] == ("POST", "/old", {"host": "t", "content-length": "1"}, b"x", True)


def test_large_bodies_in_pieces_and_pipelined() -> None:
    """Bodies over LARGE_BODY are read straight into one buffer: whatever the pieces they come
    in, with a request pipelined right behind, each handler sees exactly its own body."""
    async def digest(req: Request) -> Response:
        return Response(200, f"{req.method} {len(req.body)} {hashlib.sha256(req.body).hexdigest()}".encode())

    rng = random.Random(7)
    bodies = [rng.randbytes(LARGE_BODY + 1), b"small", rng.randbytes(3 * LARGE_BODY + 17), b""]
    wire = b"".join(post("/b", b) for b in bodies)
    with serving(digest, max_body=4 * LARGE_BODY) as running:
        for piece_sizes in ((len(wire),), (1, 7, 100, 5000), (LARGE_BODY - 3, 65536 * 2 + 1)):
            sock = connect(running)
            at = 0
            while at < len(wire):
                size = piece_sizes[rng.randrange(len(piece_sizes))]
                sock.sendall(wire[at:at + size])
                at += size
            buf = bytearray()
            got = [read_response(sock, buf)[2] for _ in bodies]
            assert got == [f"POST {len(b)} {hashlib.sha256(b).hexdigest()}".encode() for b in bodies]
            sock.close()


_H2C = ("Connection: Upgrade, HTTP2-Settings", "Upgrade: h2c",
        "HTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA")  # as curl --http2 sends them


def test_a_request_asking_to_upgrade_to_h2c_is_answered_in_http11() -> None:
    """As Triton 2.51 (libevhtp, measured with ``curl --http2``): the upgrade is ignored, the
    request is answered in HTTP/1.1, body and all, and the connection goes on. httptools
    stopped at the end of such a head: the body was lost (an infer ran on an empty body) and
    a 400 "protocol upgrades are not supported" followed, closing the connection."""
    async def seen(req: Request) -> Response:
        digest = hashlib.sha256(req.body).hexdigest()[:16]
        return Response(200, f"{req.method} {req.path} {len(req.body)} {digest} "
                             f"{req.headers.get('connection', '-')}".encode())

    def want(method: str, body: bytes, connection: str = "-") -> bytes:
        return f"{method} /u {len(body)} {hashlib.sha256(body).hexdigest()[:16]} {connection}".encode()

    big = random.Random(3).randbytes(3 * LARGE_BODY + 5)
    get = ("GET /u HTTP/1.1\r\nHost: t\r\n" + "\r\n".join(_H2C) + "\r\n\r\n").encode()
    chunked = ("POST /u HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n"
               + "\r\n".join(_H2C) + "\r\n\r\n").encode() + b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
    wire = (post("/u", b'{"inputs": []}', *_H2C) + get + post("/u", big, *_H2C) + chunked
            + post("/u", b"plain") + post("/u", b"x", "Connection: keep-alive, Upgrade", "Upgrade: h2c"))
    expected = [want("POST", b'{"inputs": []}'), want("GET", b""), want("POST", big),
                want("POST", b"abcde"), want("POST", b"plain"), want("POST", b"x", "keep-alive")]
    with serving(seen, max_body=4 * LARGE_BODY) as running:
        for piece in (len(wire), 1000, 7):
            sock = connect(running)
            for at in range(0, len(wire), piece):
                sock.sendall(wire[at:at + piece])
            buf = bytearray()
            answers = [read_response(sock, buf) for _ in expected]
            assert [(status, body) for status, _, body in answers] == [(200, b) for b in expected]
            assert all("connection" not in headers for _, headers, _ in answers)
            sock.sendall(post("/u", b"after"))  # the connection goes on
            assert read_response(sock, buf)[2] == want("POST", b"after")
            sock.close()


def test_a_body_holds_memory_for_what_arrived_not_what_was_announced() -> None:
    """Connections that announce a large Content-Length and send a little hold about what they
    sent (a client must not make the server allocate the announced size per connection), and
    let go of it, with the connection itself, as soon as they close; a large body sent whole
    still arrives intact."""
    async def digest(req: Request) -> Response:
        return Response(200, f"{len(req.body)} {hashlib.sha256(req.body).hexdigest()}".encode())

    announced, sent, count = 48 << 20, 70_000, 6
    head = f"POST /b HTTP/1.1\r\nHost: t\r\nContent-Length: {announced}\r\n\r\n".encode()
    process = psutil.Process()
    with serving(digest, max_body=64 << 20) as running:
        rss = process.memory_info().rss
        socks = [connect(running) for _ in range(count)]
        for sock in socks:
            sock.sendall(head + b"x" * sent)

        def conns() -> list[Any]:
            return [c for c in list(running.server.connections) if c.size >= sent]

        assert wait_for(lambda: len(conns()) == count)
        held = [len(c.buffer) for c in conns()]
        assert max(held) <= 1 << 20, held
        assert process.memory_info().rss - rss < announced // 2
        # More of one body: its buffer grows with it, by doubling, not to the announced size.
        socks[0].sendall(b"y" * (5 << 20))
        assert wait_for(lambda: [c for c in conns() if c.size >= sent + (5 << 20)])
        first = [c for c in conns() if c.size >= sent + (5 << 20)]
        assert sent + (5 << 20) <= len(first[0].buffer) <= 2 * (sent + (5 << 20))
        # Closed: the buffers go at once, and the connections with them (no cycle left for the
        # garbage collector, which is off here, to find).
        refs = [weakref.ref(c) for c in conns()]
        del first
        gc.disable()
        try:
            for sock in socks:
                sock.close()
            assert wait_for(lambda: not running.server.connections)
            assert wait_for(lambda: all(ref() is None for ref in refs), 5), \
                [len(c.buffer or b"") for c in (ref() for ref in refs) if c is not None]
        finally:
            gc.enable()
        body = random.Random(3).randbytes(24 << 20)
        sock = connect(running)
        sock.sendall(post("/b", body))
        assert read_response(sock)[2] == f"{len(body)} {hashlib.sha256(body).hexdigest()}".encode()
        sock.close()


def test_expect_continue_and_chunked_body() -> None:
    with serving(echo) as running:
        sock = connect(running)
        expect_continue_then_chunked(sock)
        # Too large with Expect: answered before the body, and the connection is closed.
        sock.sendall(b"POST /c HTTP/1.1\r\nHost: t\r\nContent-Length: 5000\r\nExpect: 100-continue\r\n\r\n")
        status, headers, body = read_response(sock)
        assert (status, body, headers["connection"]) == (400, b"too large: 5000", "close")
        assert closed_by_server(sock)
        sock.close()


def test_body_over_the_limit_is_refused_and_the_connection_survives() -> None:
    calls: list[bytes] = []

    async def record(req: Request) -> Response:
        calls.append(req.body)
        return await echo(req)

    with serving(record) as running:
        sock = connect(running)
        sock.sendall(post("/big", b"x" * (LIMIT + 1)))
        assert read_response(sock)[:3:2] == (400, f"too large: {LIMIT + 1}".encode())
        chunks = b"".join(b"%x\r\n%s\r\n" % (300, b"y" * 300) for _ in range(4))
        sock.sendall(b"POST /big HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n")
        assert read_response(sock)[:3:2] == (400, b"too large: 1200")
        sock.sendall(post("/ok", b"small"))
        assert read_response(sock)[2] == b"POST /ok small"
        assert calls == [b"small"]  # the handler never saw the refused bodies
        sock.close()


def test_compressed_request_and_response_bodies() -> None:
    async def big(req: Request) -> Response:
        resp = Response(200, req.body * 3, "text/plain")
        resp.compress = True
        return resp

    with serving(big) as running:
        sock = connect(running)
        payload = b"tensor bytes " * 20
        for coding, packed in (("gzip", gzip.compress(payload)), ("deflate", zlib.compress(payload)),
                               ("deflate", zlib.compress(payload)[2:-4])):  # raw deflate too
            sock.sendall(post("/z", packed, f"Content-Encoding: {coding}", f"Accept-Encoding: {coding}"))
            status, headers, body = read_response(sock)
            assert status == 200 and headers["content-encoding"] == coding
            inflated = gzip.decompress(body) if coding == "gzip" else zlib.decompress(body)
            assert inflated == payload * 3
        sock.sendall(post("/z", payload))  # no Accept-Encoding: plain
        status, headers, body = read_response(sock)
        assert "content-encoding" not in headers and body == payload * 3
        sock.sendall(post("/z", payload, "Accept-Encoding: gzip;q=0"))  # refused: plain
        status, headers, body = read_response(sock)
        assert "content-encoding" not in headers and body == payload * 3
        sock.sendall(post("/z", payload, "Accept-Encoding: gzip;q=0.2, deflate;q=0.9"))
        status, headers, body = read_response(sock)
        assert headers["content-encoding"] == "deflate" and zlib.decompress(body) == payload * 3
        # A body that does not inflate, and one that inflates past the limit.
        sock.sendall(post("/z", b"not gzip", "Content-Encoding: gzip"))
        status, _, body = read_response(sock)
        assert status == 400 and body.startswith(b"refused: failed to decompress the gzip request body")
        sock.sendall(post("/z", gzip.compress(b"\0" * (LIMIT * 5)), "Content-Encoding: gzip"))
        assert read_response(sock)[2] == f"too large: {LIMIT + 1}".encode()
        sock.close()


def test_a_large_compressed_body_is_inflated_off_the_event_loop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A body can inflate to ~1000x its size (seconds of CPU): past INFLATE_ON_LOOP (64 KiB; 100
    # bytes here) it is inflated in a worker thread, its answer and the errors unchanged, and
    # pipelined requests still answered in order.
    from tritonpy.frontends import _http1_parse as _http1

    monkeypatch.setattr(_http1, "INFLATE_ON_LOOP", 100)
    inflated_on: list[str] = []
    real = _http1._decompress

    def spy(body: Any, coding: str, limit: int) -> bytes:
        inflated_on.append(threading.current_thread().name)
        return real(body, coding, limit)

    monkeypatch.setattr(_http1, "_decompress", spy)

    async def handler(req: Request) -> Response:
        return Response(200, hashlib.sha256(req.body).hexdigest().encode(), "text/plain")

    payload = random.Random(7).randbytes(600)  # incompressible: 600+ bytes of gzip
    with serving(handler) as running:
        sock = connect(running)
        sock.sendall(post("/z", gzip.compress(payload), "Content-Encoding: gzip")
                     + post("/z", b"plain")
                     + post("/z", b"not gzip" * 20, "Content-Encoding: gzip")
                     + post("/z", gzip.compress(payload + bytes(LIMIT)), "Content-Encoding: gzip")
                     + post("/z", gzip.compress(b"small"), "Content-Encoding: gzip"))
        buf = bytearray()
        answers = [read_response(sock, buf)[::2] for _ in range(5)]
        sock.close()
    assert answers == [
        (200, hashlib.sha256(payload).hexdigest().encode()),
        (200, hashlib.sha256(b"plain").hexdigest().encode()),
        (400, b"refused: failed to decompress the gzip request body: Error -3 while "
              b"decompressing data: incorrect header check"),
        (400, f"too large: {LIMIT + 1}".encode()),
        (200, hashlib.sha256(b"small").hexdigest().encode()),
    ]
    on_loop = ["(run_forever)" in name for name in inflated_on]  # serving()'s loop thread
    assert sorted(on_loop) == [False, False, False, True], inflated_on  # the small one only


def test_malformed_request_gets_400_and_close() -> None:
    with serving(echo) as running:
        sock = connect(running)
        sock.sendall(b"POST /x HTTP/1.1\r\nContent-Length: nope\r\n\r\n")
        status, headers, body = read_response(sock)
        assert status == 400 and body.startswith(b"refused: malformed HTTP request")
        assert headers["connection"] == "close" and closed_by_server(sock)
        sock.close()
        sock = connect(running)  # the server itself goes on
        sock.sendall(post("/after", b""))
        assert read_response(sock)[2] == b"POST /after "
        sock.close()


@pytest.mark.parametrize("head", [
    b"GET /" + b"a" * (MAX_HEAD + 1) + b" HTTP/1.1\r\nHost: t\r\n\r\n",
    b"GET / HTTP/1.1\r\n" + b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 100) for i in range(MAX_HEAD // 100)) + b"\r\n",
])
def test_oversized_request_head_is_refused(head: bytes) -> None:
    with serving(echo) as running:
        sock = connect(running)
        sock.sendall(head)
        status, _, body = read_response(sock)
        assert (status, body) == (400, f"refused: the request head exceeds {MAX_HEAD} bytes".encode())
        assert closed_by_server(sock)
        sock.close()


def test_handler_bug_answers_500_and_the_connection_goes_on() -> None:
    async def buggy(req: Request) -> Response:
        if req.path == "/bug":
            raise KeyError("oops")
        return await echo(req)

    with serving(buggy) as running:
        sock = connect(running)
        sock.sendall(post("/bug", b""))
        assert read_response(sock)[0] == 500
        sock.sendall(post("/fine", b""))
        assert read_response(sock)[:3:2] == (200, b"POST /fine ")
        sock.close()


def test_client_disconnect_cancels_the_handler() -> None:
    started, cancelled = threading.Event(), threading.Event()

    async def forever(req: Request) -> Response:
        started.set()
        return await until_cancelled(cancelled)

    with serving(forever) as running:
        sock = connect(running)
        sock.sendall(post("/hang", b""))
        assert started.wait(10)
        sock.close()
        assert cancelled.wait(10)


def test_idle_connection_is_closed() -> None:
    with serving(echo, keepalive_timeout=0.2) as running:
        sock = connect(running)
        sock.sendall(post("/once", b""))
        read_response(sock)
        t0 = time.monotonic()
        assert closed_by_server(sock)
        assert time.monotonic() - t0 < 2.0
        sock.close()


def test_stop_drains_then_cancels_and_closes_every_connection() -> None:
    release = threading.Event()
    cancelled = threading.Event()

    async def handler(req: Request) -> Response:
        if req.path == "/warm":
            return Response(200)
        if req.path == "/quick":
            while not release.is_set():
                await asyncio.sleep(0.01)
            return Response(200, b"done")
        return await until_cancelled(cancelled)

    with serving(handler) as running:
        idle, quick, stuck = connect(running), connect(running), connect(running)
        idle.sendall(post("/warm", b""))
        read_response(idle)
        quick.sendall(post("/quick", b""))
        stuck.sendall(post("/stuck", b""))
        time.sleep(0.2)
        threading.Timer(0.3, release.set).start()
        took = running.stop(1.0)
        assert 0.9 <= took < 3.0
        status, headers, body = read_response(quick)
        assert (status, body, headers["connection"]) == (200, b"done", "close")
        assert cancelled.is_set()
        for sock in (idle, quick, stuck):
            assert closed_by_server(sock)
            sock.close()
        with pytest.raises(OSError):
            connect(running).close()


def test_stop_closes_a_keep_alive_connection_once_its_slow_read_answer_is_written() -> None:
    # QA round 14: an 8 MiB answer still in the write buffer when the stop began (its client
    # not reading yet) kept the connection open, and the stop waiting, for the whole timeout
    # after the client had read it all.
    big = b"x" * (8 << 20)

    async def handler(req: Request) -> Response:
        return Response(200, big)

    with serving(handler) as running:
        sock = connect(running)
        sock.sendall(post("/big", b""))
        time.sleep(0.5)  # answered, keep-alive, most of it waiting in the server's buffer
        took: list[float] = []
        stopper = threading.Thread(target=lambda: took.append(running.stop(10.0)))
        stopper.start()
        time.sleep(0.3)
        status, headers, body = read_response(sock)
        assert (status, len(body)) == (200, len(big))
        stopper.join(15)
        assert took and took[0] < 3.0, took
        assert closed_by_server(sock)
        sock.close()


def test_streamed_responses() -> None:
    """A handler's stream goes out chunk by chunk: chunked over HTTP/1.1, raw then close over
    HTTP/1.0; a stream that fails half-way cuts the connection (no last chunk); a client that
    goes away closes the stream."""
    closed = threading.Event()

    async def stream(kind: str) -> AsyncGenerator[bytes, None]:
        try:
            yield b"one "
            yield b""
            yield b"two"
            if kind == "/broken":
                raise RuntimeError("half-way")
            if kind == "/endless":
                while True:
                    await asyncio.sleep(0.01)
                    yield b"more"
        finally:
            closed.set()

    async def handler(req: Request) -> Response:
        return Response(200, content_type="text/plain", stream=stream(req.path))

    with serving(handler) as running:
        sock = connect(running)
        sock.sendall(post("/ok", b"") + post("/ok", b""))
        data = b""
        while data.count(b"0\r\n\r\n") < 2:
            data += sock.recv(4096)
        one = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n" \
              b"4\r\none \r\n3\r\ntwo\r\n0\r\n\r\n"
        assert data == one * 2  # keep-alive: both answered on one connection
        sock.close()
        sock = connect(running)
        sock.sendall(post("/ok", b"", version="1.0"))
        data = b""
        while chunk := sock.recv(4096):
            data += chunk
        assert data.endswith(b"Connection: close\r\n\r\none two")
        sock.close()
        sock = connect(running)
        sock.sendall(post("/broken", b""))
        data = b""
        while chunk := sock.recv(4096):
            data += chunk
        assert data.endswith(b"3\r\ntwo\r\n")  # cut, and the connection closed
        sock.close()
        closed.clear()
        sock = connect(running)
        sock.sendall(post("/endless", b""))
        data = b""
        while b"more" not in data:
            data += sock.recv(4096)
        sock.close()
        assert closed.wait(10)


def test_a_client_that_reads_nothing_is_cut_off() -> None:
    """A response waits in the transport for at most ``stall_timeout`` seconds of no progress:
    its parts may be views of shared memory that nothing else could then reuse."""
    big = np.zeros(32 << 20, np.uint8)
    freed = threading.Event()

    async def handler(req: Request) -> Response:
        view = big[:]  # released when the transport lets go of the part
        weakref.finalize(view, freed.set)
        return Response(200, b"head", "application/octet-stream", parts=[view.data])

    with serving(handler, stall_timeout=0.5) as running:
        sock = connect(running)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(post("/big", b""))
        assert freed.wait(10), "the stalled response still holds its parts"
        assert wait_for(lambda: not running.server.connections, 5)
        sock.close()


@pytest.mark.parametrize("accept, coding", [
    ("gzip", "gzip"), ("deflate", "deflate"), ("gzip, deflate", "gzip"),
    ("deflate;q=1.0, gzip;q=0.5", "deflate"), ("gzip;q=0", None), ("gzip;q=0, deflate", "deflate"),
    ("*", "gzip"), ("*;q=0", None), ("identity", None), ("br", None), ("GZIP", "gzip"),
    ("gzip;q=bad, deflate;q=0.1", "deflate"), ("", None),
])
def test_accept_encoding_q_values_choose_the_response_coding(accept: str, coding: str | None) -> None:
    assert _coding(accept) == coding
