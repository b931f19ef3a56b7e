"""The HTTP/1.1 frontend of ``tritonpy serve`` against malformed and hostile clients, over raw
sockets: every request gets one answer (never a hang), the server goes on serving, and it holds
no file descriptor for a client that went away."""
from __future__ import annotations

import gzip
import json
import os
import socket
import struct
import time
import zlib
from collections.abc import Iterator

import pytest
from _models import new_prefix, wait_for, write_model
from _serve import Serve, free_ports

BODY = json.dumps({"inputs": [{"name": "IN", "datatype": "FP32", "shape": [2],
                               "data": [1, 2]}]}).encode()
READY = b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n"


def infer(body: bytes, *headers: str) -> bytes:
    """An inference request of model ``m`` with ``body`` as is; ``headers`` replace the
    Content-Length when one of them frames the body."""
    lines = ["POST /v2/models/m/infer HTTP/1.1", "Host: x", *headers]
    if not any(h.lower().startswith(("content-length", "transfer-encoding")) for h in headers):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def chunked(body: bytes, size: int = 16) -> bytes:
    chunks = [body[i:i + size] for i in range(0, len(body), size)]
    return b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"


def exchange(port: int, data: bytes, wait: float = 5.0) -> tuple[list[tuple[int, bytes]], bool]:
    """Send ``data``; the responses read until the server closes or ``wait`` seconds pass
    with nothing more, as (status, body); whether the server closed the connection."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(data)
        sock.settimeout(wait)
        buf, closed = b"", False
        while True:
            try:
                chunk = sock.recv(65536)
            except socket.timeout:
                break
            except ConnectionResetError:
                closed = True
                break
            if not chunk:
                closed = True
                break
            buf += chunk
    responses = []
    while buf:
        head, sep, buf = buf.partition(b"\r\n\r\n")
        assert sep, f"a cut response head: {head!r}"
        lines = head.decode("latin-1").split("\r\n")
        fields = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:])}
        length = int(fields.get("content-length", "0"))
        responses.append((int(lines[0].split()[1]), buf[:length]))
        buf = buf[length:]
    return responses, closed


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Serve, int]]:
    work = tmp_path_factory.mktemp("http1robust")
    write_model(work / "repo", "m")
    http, grpc, metrics = free_ports(3)
    s = Serve(["--model-repository", str(work / "repo"), "--http-port", str(http),
               "--grpc-port", str(grpc), "--metrics-port", str(metrics)], new_prefix(), work)
    try:
        s.endpoints()
        yield s, http
    finally:
        s.close()


def serves(port: int) -> None:
    """The server still answers a plain request on a new connection."""
    responses, _ = exchange(port, READY + infer(BODY), wait=0.5)
    assert [r[0] for r in responses] == [200, 200], responses
    assert json.loads(responses[1][1])["outputs"][0]["data"] == [2.0, 4.0]


@pytest.mark.parametrize("request_bytes", [
    infer(BODY, "Transfer-Encoding: identity", f"Content-Length: {len(BODY)}"),
    infer(BODY, "Transfer-Encoding: foo", f"Content-Length: {len(BODY)}"),
    infer(BODY, "Transfer-Encoding: identity"),
    infer(chunked(gzip.compress(BODY)), "Transfer-Encoding: gzip, chunked"),
], ids=["identity+length", "unknown+length", "identity", "gzip,chunked"])
def test_a_transfer_coding_other_than_chunked_is_refused_at_once(
        server: tuple[Serve, int], request_bytes: bytes) -> None:
    # With a Content-Length, the parser used to read the body until the client closed: the
    # request was never answered (up to two keep-alive timeouts, 75-150 s).
    _, port = server
    t0 = time.monotonic()
    responses, closed = exchange(port, request_bytes + READY)
    assert time.monotonic() - t0 < 3
    assert closed and [r[0] for r in responses] == [400], responses
    assert b"Transfer-Encoding" in responses[0][1]
    serves(port)


def test_connect_gets_one_answer_then_the_connection_closes(server: tuple[Serve, int]) -> None:
    # It used to get two: a 405 for the request, then a 400 for its tunnel.
    _, port = server
    responses, closed = exchange(port, b"CONNECT /v2/models/m HTTP/1.1\r\nHost: x\r\n\r\n" + READY)
    assert closed and responses == [(400, b'{"error":"the CONNECT method is not supported"}')]
    serves(port)


def test_a_gzip_body_of_several_members_is_inflated_whole(server: tuple[Serve, int]) -> None:
    # Only the first member was inflated: the body was cut where it ended.
    _, port = server
    body = gzip.compress(BODY[:20]) + gzip.compress(BODY[20:40]) + gzip.compress(BODY[40:])
    responses, closed = exchange(port, infer(body, "Content-Encoding: gzip"), wait=0.5)
    assert not closed and [r[0] for r in responses] == [200], responses
    assert json.loads(responses[0][1])["outputs"][0]["data"] == [2.0, 4.0]


@pytest.mark.parametrize("coding, body", [
    ("gzip", gzip.compress(BODY) + b"garbage"),
    ("deflate", zlib.compress(BODY) + b"garbage"),
    ("gzip", gzip.compress(BODY) + gzip.compress(BODY)[:-4]),
], ids=["gzip+garbage", "deflate+garbage", "gzip+cut-member"])
def test_a_compressed_body_with_bytes_after_its_end_is_refused(
        server: tuple[Serve, int], coding: str, body: bytes) -> None:
    # The bytes after the end were dropped, and the request answered as if they were not sent.
    _, port = server
    responses, closed = exchange(port, infer(body, f"Content-Encoding: {coding}") + READY,
                                 wait=0.5)
    assert not closed and [r[0] for r in responses] == [400, 200], responses
    error = json.loads(responses[0][1])["error"]
    assert error.startswith(f"failed to decompress the {coding} request body: "), error
    serves(port)


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_hostile_clients_leave_nothing_behind(server: tuple[Serve, int]) -> None:
    """Malformed requests, clients that go away half-way or reset, and 500 connections opened
    at once: each answered or dropped, and the server holds no descriptor for any of them."""
    s, port = server
    serves(port)
    before = fds(s.proc.pid)
    malformed = [b"GARBAGE\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n", b"GET /v2 HTTP/1.1\r\nBad Name: v\r\n\r\n",
                 b"GET /v2 HTTP/1.1\r\nX: a\x00b\r\n\r\n", b"GET /v2 HTTP/1.1\r\nX: a\r\n b\r\n\r\n",
                 infer(BODY, "Content-Length: -5"), infer(BODY, "Content-Length: 5, 5"),
                 infer(b"zz\r\nabc\r\n0\r\n\r\n", "Transfer-Encoding: chunked"),
                 b"GET /v2/" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n",
                 b"GET /v2 HTTP/1.1\r\n" + b"X: v\r\n" * 12000 + b"\r\n"]
    for data in malformed:
        responses, closed = exchange(port, data + READY)
        assert closed and [r[0] for r in responses] == [400], (data[:40], responses)
    whole = infer(BODY)
    for cut in (10, len(whole) // 2, len(whole) - 3):  # half a request, then gone
        for _ in range(20):
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.sendall(whole[:cut])
    for _ in range(20):  # a whole request, then a reset before its answer
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.sendall(whole)
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(500)]
    try:
        for sock in socks:
            sock.sendall(whole)
        for sock in socks:
            sock.settimeout(30)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 OK\r\n")
    finally:
        for sock in socks:
            sock.close()
    serves(port)
    assert wait_for(lambda: fds(s.proc.pid) <= before), (fds(s.proc.pid), before)
