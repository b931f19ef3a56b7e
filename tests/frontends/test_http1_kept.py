"""What the HTTP/1.1 server keeps between requests (``tritonpy.frontends._http1``): the task
that answers a connection's requests, which waits between them, and the response heads it
wrote before. Neither may show: each answer is the one a fresh build would write, and a
connection that goes away takes its task, and itself, with it."""
from __future__ import annotations

import asyncio
import gc
import weakref
from typing import Any

from _models import wait_for
from test_http1 import closed_by_server, connect, post, read_response, serving
from tritonpy.frontends._http1_messages import KNOWN_HEADS, Request, Response


async def sized(req: Request) -> Response:
    """An answer whose status, type, headers and size all follow the path ``/<status>/<n>``."""
    _, status, n = req.path.split("/")
    headers = {"X-N": n} if int(n) % 2 else None
    return Response(int(status), b"x" * int(n), "text/plain" if int(n) % 3 else None, headers)


def _expected(status: int, n: int) -> dict[str, str]:
    headers = {"content-length": str(n)}
    if n % 3:
        headers["content-type"] = "text/plain"
    if n % 2:
        headers["x-n"] = str(n)
    return headers


def test_kept_response_heads_are_the_ones_built_for_each_answer() -> None:
    """Answers that differ in status, type, headers, size, keep-alive or HTTP version each get
    their own head, the second time as the first, and past the number of heads kept."""
    with serving(sized) as running:
        sock = connect(running)
        buf = bytearray()
        for _ in range(2):
            for n in range(KNOWN_HEADS + 10):
                status = (200, 404)[n % 2]
                sock.sendall(post(f"/{status}/{n}", b""))
                got_status, headers, body = read_response(sock, buf)
                assert (got_status, headers, body) == (status, _expected(status, n), b"x" * n)
        # The same answers on a connection that closes after them, and over HTTP/1.0 kept
        # open: those heads say so, and are kept apart from the others.
        for version, extra, connection in (("1.1", "Connection: close", "close"),
                                           ("1.0", "Connection: keep-alive", "keep-alive")):
            for _ in range(2):
                last = connect(running)
                last.sendall(post("/200/5", b"", extra, version=version))
                status, headers, body = read_response(last)
                assert (status, body) == (200, b"xxxxx")
                assert headers == {**_expected(200, 5), "connection": connection}
                if connection == "close":
                    assert closed_by_server(last)
                last.close()
        sock.sendall(post("/200/5", b""))
        assert read_response(sock, buf)[1] == _expected(200, 5)
        sock.close()


def test_a_connection_takes_its_task_and_itself_along_when_it_goes() -> None:
    """Between requests a connection's task waits for the next one; when the client goes away
    the task ends, and the connection is freed without the garbage collector (no cycle)."""
    with serving(sized) as running:
        socks = [connect(running) for _ in range(3)]
        for sock in socks:
            for _ in range(3):
                sock.sendall(post("/200/4", b""))
                assert read_response(sock)[2] == b"xxxx"
        conns = list(running.server.connections)
        assert len(conns) == 3 and all(c.task is not None and c.idle is not None for c in conns)
        tasks = [c.task for c in conns]

        def serving_tasks() -> list[Any]:
            return asyncio.run_coroutine_threadsafe(_tasks(), running.loop).result(5)

        assert len(serving_tasks()) == 3
        refs = [weakref.ref(c) for c in conns]
        del conns
        gc.disable()
        try:
            for sock in socks:
                sock.close()
            assert wait_for(lambda: not running.server.connections)
            assert wait_for(lambda: not serving_tasks())
            assert all(t is not None and t.cancelled() for t in tasks)
            del tasks
            assert wait_for(lambda: all(ref() is None for ref in refs), 5)
        finally:
            gc.enable()


async def _tasks() -> list[asyncio.Task[Any]]:
    """The tasks of the server's connections still running on this loop."""
    return [t for t in asyncio.all_tasks() if "_serve" in repr(t.get_coro())]
