"""Our HTTP/2 gRPC server (``tritonpy.frontends._http2``) on its own, with toy methods: the real
``grpcio`` client for calls, deadlines, cancels and limits, and a raw socket for what a
misbehaving or slow client sends (protocol violations, a small receive window, PING)."""
from __future__ import annotations

import asyncio
import logging
import socket
import struct
import threading
import time
from typing import Any, AsyncIterator, Iterator

import grpc
import hpack
import pytest
from google.protobuf.wrappers_pb2 import BytesValue

from _models import wait_for
from tritonpy.frontends._h2_connection import MAX_COMPRESSED_BLOCK
from tritonpy.frontends._h2_grpc import Method
from tritonpy.frontends._h2_keepalive import KeepAlive
from tritonpy.frontends._http2 import Http2GrpcServer

MAX_MESSAGE = 1 << 16
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0, 1, 3, 4, 6, 7, 8, 9
END_STREAM, ACK, END_HEADERS, PADDED = 0x1, 0x1, 0x4, 0x8
PROTOCOL_ERROR, FRAME_SIZE_ERROR, COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 0x1, 0x6, 0x9, 0xB


class Toy:
    """The methods served, and what the test can see of their handlers."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()
        self.slow_started = threading.Event()

    async def echo(self, request: BytesValue, context: Any) -> BytesValue:
        return BytesValue(value=request.value)

    async def big(self, request: BytesValue, context: Any) -> BytesValue:
        return BytesValue(value=b"x" * int(request.value))

    async def slow(self, request: BytesValue, context: Any) -> BytesValue:
        self.slow_started.set()
        try:
            await asyncio.sleep(float(request.value))
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return BytesValue(value=b"done")

    async def stream(self, requests: AsyncIterator[BytesValue], context: Any) -> None:
        async for request in requests:
            await context.write(BytesValue(value=request.value[::-1]))


class Running:
    def __init__(self, server: Http2GrpcServer, loop: asyncio.AbstractEventLoop, port: int,
                 toy: Toy) -> None:
        self.server, self.loop, self.port, self.toy = server, loop, port, toy
        self.address = f"127.0.0.1:{port}"

    def stop(self, grace: float) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(grace), self.loop).result(grace + 10)


def _running(compression: str = "none", keepalive: KeepAlive | None = None) -> Iterator[Running]:
    toy = Toy()
    parse = BytesValue.FromString
    server = Http2GrpcServer({
        "/t.T/Echo": Method(toy.echo, parse, False),
        "/t.T/Big": Method(toy.big, parse, False, compressible=True),
        "/t.T/Slow": Method(toy.slow, parse, False),
        "/t.T/Stream": Method(toy.stream, parse, True),
    }, max_message=MAX_MESSAGE, compression=compression, keepalive=keepalive)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    port = asyncio.run_coroutine_threadsafe(server.start("127.0.0.1", 0), loop).result(10)
    run = Running(server, loop, port, toy)
    try:
        yield run
    finally:
        if server._server is not None:
            run.stop(1.0)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@pytest.fixture
def running() -> Iterator[Running]:
    yield from _running()


@pytest.fixture
def compressing() -> Iterator[Running]:
    yield from _running("low")


def unary(channel: grpc.Channel, name: str) -> Any:
    return channel.unary_unary(f"/t.T/{name}", request_serializer=BytesValue.SerializeToString,
                               response_deserializer=BytesValue.FromString)


def test_real_client_unary_and_bidirectional_stream(running: Running) -> None:
    with grpc.insecure_channel(running.address) as channel:
        assert unary(channel, "Echo")(BytesValue(value=b"hello")).value == b"hello"
        big = unary(channel, "Big")(BytesValue(value=b"3000000"))  # many frames, window updates
        assert big.value == b"x" * 3_000_000
        stream = channel.stream_stream("/t.T/Stream", request_serializer=BytesValue.SerializeToString,
                                       response_deserializer=BytesValue.FromString)
        answers = [r.value for r in stream(iter([BytesValue(value=v) for v in (b"ab", b"cde", b"")]))]
        assert answers == [b"ba", b"edc", b""]


def test_a_deadline_answers_deadline_exceeded_and_cancels_the_handler(running: Running) -> None:
    with grpc.insecure_channel(running.address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            unary(channel, "Slow")(BytesValue(value=b"30"), timeout=0.3)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert running.toy.cancelled.wait(5), "the handler went on after the deadline"
        assert unary(channel, "Echo")(BytesValue(value=b"after")).value == b"after"


def test_too_much_metadata_refuses_its_call_only(running: Running) -> None:
    # As gRPC core (Triton's server): a call whose metadata decodes past 16 KiB is refused
    # with RESOURCE_EXHAUSTED; the calls in flight on its connection go on, and new ones come.
    # (It used to end the connection with GOAWAY: every call of the channel failed.)
    with grpc.insecure_channel(running.address) as channel:
        slow = unary(channel, "Slow").future(BytesValue(value=b"0.5"), timeout=30)
        assert running.toy.slow_started.wait(5)
        for metadata in ([("x-big", "a" * 20000)],
                         [(f"x-h{i}", "b" * 200) for i in range(90)]):  # many small ones
            with pytest.raises(grpc.RpcError) as err:
                unary(channel, "Echo")(BytesValue(value=b"big"), metadata=metadata)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "received metadata size exceeds hard limit" in (err.value.details() or "")
        # Just under the limit is served.
        assert unary(channel, "Echo")(BytesValue(value=b"ok"),
                                      metadata=[("x-fits", "c" * 12000)]).value == b"ok"
        assert slow.result().value == b"done"
        assert unary(channel, "Echo")(BytesValue(value=b"after")).value == b"after"


def test_a_client_cancel_cancels_the_handler(running: Running,
                                             caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="tritonpy.frontends._http2")
    with grpc.insecure_channel(running.address) as channel:
        future = unary(channel, "Slow").future(BytesValue(value=b"30"))
        assert running.toy.slow_started.wait(5)
        future.cancel()
        assert running.toy.cancelled.wait(5), "the handler went on after the client's cancel"
        assert unary(channel, "Echo")(BytesValue(value=b"after")).value == b"after"
    # Verbose, in Triton's words (its QA L0_request_cancellation looks for them).
    assert any(r.getMessage().startswith("Cancellation notification received for slowHandler")
               for r in caplog.records), caplog.text


def test_a_message_over_the_limit_is_resource_exhausted(running: Running,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    with grpc.insecure_channel(running.address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            unary(channel, "Echo")(BytesValue(value=b"y" * (MAX_MESSAGE + 10)))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"vs. {MAX_MESSAGE}" in (err.value.details() or "")
        # A compressed message small on the wire that inflates past the limit: refused the
        # same way, without inflating it all (1 GB of zeros is ~1 MB of gzip).
        with pytest.raises(grpc.RpcError) as err:
            unary(channel, "Echo")(BytesValue(value=bytes(MAX_MESSAGE * 4)),
                                   compression=grpc.Compression.Gzip)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # The same connection serves on.
        assert unary(channel, "Echo")(BytesValue(value=b"ok")).value == b"ok"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize("value, seconds", [
    (b"100m", 0.1), (b"5S", 5.0), (b"99999999H", 99999999 * 3600.0),
    (b"123456789S", None), (b"5x", None), (b"S", None)])
def test_grpc_timeouts_are_read_as_grpc_writes_them(value: bytes, seconds: float | None) -> None:
    from tritonpy.frontends._h2_grpc import _parse_timeout

    assert _parse_timeout(value) == seconds


def test_unknown_method_and_compressed_requests(running: Running) -> None:
    with grpc.insecure_channel(running.address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            unary(channel, "Nope")(BytesValue(value=b""))
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "/t.T/Nope" in (err.value.details() or "")
        payload = b"compress me " * 1000
        for algorithm in (grpc.Compression.Gzip, grpc.Compression.Deflate):
            echoed = unary(channel, "Echo")(BytesValue(value=payload), compression=algorithm)
            assert echoed.value == payload


def test_large_compressed_messages_are_inflated_off_the_event_loop(
        running: Running, monkeypatch: pytest.MonkeyPatch) -> None:
    # Past INFLATE_ON_LOOP (64 KiB; 100 bytes here) a compressed message is inflated and parsed
    # in a worker thread when its handler comes to it: unary and stream calls get the same
    # answers, in order, and a message that inflates past the limit the same refusal.
    import random

    from tritonpy.frontends import _h2_call as _http2

    monkeypatch.setattr(_http2, "INFLATE_ON_LOOP", 100)
    inflated_on: list[str] = []
    real = _http2._Call.inflate_and_parse

    def spy(call: Any, payload: bytes) -> Any:
        inflated_on.append(threading.current_thread().name)
        return real(call, payload)

    monkeypatch.setattr(_http2._Call, "inflate_and_parse", spy)
    rng = random.Random(3)
    noise = bytes(rng.choice(b"ab") for _ in range(4000))  # ~500 bytes of gzip
    with grpc.insecure_channel(running.address) as channel:
        gz = grpc.Compression.Gzip
        assert unary(channel, "Echo")(BytesValue(value=noise), compression=gz).value == noise
        stream = channel.stream_stream("/t.T/Stream",
                                       request_serializer=BytesValue.SerializeToString,
                                       response_deserializer=BytesValue.FromString)
        sent = [noise[:3000 + i] for i in range(5)]
        got = [r.value for r in stream(iter(BytesValue(value=v) for v in sent), compression=gz)]
        assert got == [v[::-1] for v in sent]
        with pytest.raises(grpc.RpcError) as err:
            unary(channel, "Echo")(BytesValue(value=noise + bytes(MAX_MESSAGE)), compression=gz)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert unary(channel, "Echo")(BytesValue(value=b"ok")).value == b"ok"
    loop_thread = running.loop._thread_id  # type: ignore[attr-defined]
    assert len(inflated_on) == 7 and all(
        name != threading._active[loop_thread].name for name in inflated_on), inflated_on


def test_stop_lets_a_running_call_finish(running: Running) -> None:
    with grpc.insecure_channel(running.address) as channel:
        future = unary(channel, "Slow").future(BytesValue(value=b"0.5"))
        assert running.toy.slow_started.wait(5)
        started = time.monotonic()
        running.stop(5.0)
        assert future.result(5).value == b"done"
        assert time.monotonic() - started < 4
    with pytest.raises(OSError):  # the listener is closed
        socket.create_connection(("127.0.0.1", running.port), timeout=2).close()


# -- a raw HTTP/2 client ---------------------------------------------------------------------------
def frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + struct.pack(">BBI", ftype, flags, sid) + payload


def grpc_data(sid: int, message: bytes, flags: int = END_STREAM) -> bytes:
    """A DATA frame carrying one uncompressed gRPC message."""
    return frame(DATA, flags, sid, struct.pack(">BI", 0, len(message)) + message)


def setting(key: int, value: int) -> bytes:
    return struct.pack(">HI", key, value)


class Raw:
    """A socket speaking HTTP/2 frame by frame."""

    def __init__(self, port: int, preface: bytes = PREFACE, settings: bytes = b"") -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.buf = b""
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()
        self.sock.sendall(preface + (frame(SETTINGS, 0, 0, settings) if preface == PREFACE else b""))

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def request_headers(self, path: str, *extra: tuple[str, str]) -> bytes:
        return self.encoder.encode([(":method", "POST"), (":scheme", "http"), (":path", path),
                                    (":authority", "x"), ("content-type", "application/grpc"),
                                    ("te", "trailers"), *extra])

    def unary(self, sid: int, path: str, message: bytes, *extra: tuple[str, str]) -> tuple[
            dict[str, str], bytes]:
        """One call on stream ``sid``: its response headers, and its DATA bytes."""
        self.send(frame(HEADERS, END_HEADERS, sid, self.request_headers(path, *extra))
                  + grpc_data(sid, message))
        headers: dict[str, str] = {}
        data = b""
        while True:
            got = self.read_frame()
            assert got is not None, "the connection closed"
            ftype, flags, fsid, payload = got
            if fsid != sid:
                continue
            if ftype == HEADERS:
                headers.update(self.decoder.decode(payload))
            elif ftype == DATA:
                data += payload
            if flags & END_STREAM:
                return headers, data

    def read_frame(self, timeout: float = 5.0) -> tuple[int, int, int, bytes] | None:
        """The next frame, or None once the server closed the connection."""
        self.sock.settimeout(timeout)
        while True:
            if len(self.buf) >= 9:
                length = int.from_bytes(self.buf[:3], "big")
                if len(self.buf) >= 9 + length:
                    ftype, flags, sid = struct.unpack(">BBI", self.buf[3:9])
                    payload = self.buf[9:9 + length]
                    self.buf = self.buf[9 + length:]
                    return ftype, flags, sid & 0x7FFFFFFF, payload
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                return None
            self.buf += chunk

    def frames_until_quiet(self, quiet: float) -> list[tuple[int, int, int, bytes]]:
        out = []
        while True:
            try:
                got = self.read_frame(quiet)
            except socket.timeout:
                return out
            if got is None:
                return out
            out.append(got)

    def close(self) -> None:
        self.sock.close()


def test_ping_is_answered_with_its_payload(running: Running) -> None:
    raw = Raw(running.port)
    try:
        raw.send(frame(PING, 0, 0, b"12345678"))
        for _ in range(10):
            got = raw.read_frame()
            assert got is not None
            if got[0] == PING:
                assert got[1] & ACK and got[3] == b"12345678"
                break
        else:
            pytest.fail("no PING ACK")
    finally:
        raw.close()


def test_a_small_client_window_gets_the_answer_as_the_window_opens(running: Running) -> None:
    raw = Raw(running.port, settings=setting(0x4, 1000))  # SETTINGS_INITIAL_WINDOW_SIZE
    try:
        message = BytesValue(value=b"50000").SerializeToString()
        raw.send(frame(HEADERS, END_HEADERS, 1, raw.request_headers("/t.T/Big"))
                 + grpc_data(1, message))
        first = raw.frames_until_quiet(0.5)
        sent = sum(len(p) for t, _, sid, p in first if t == DATA and sid == 1)
        assert sent == 1000, "the server sent past the stream's window"
        raw.send(frame(WINDOW_UPDATE, 0, 1, struct.pack(">I", 100_000))
                 + frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 100_000)))
        rest = raw.frames_until_quiet(0.5)
        body = b"".join(p for t, _, sid, p in first + rest if t == DATA and sid == 1)
        flag, size = struct.unpack(">BI", body[:5])
        assert (flag, size) == (0, len(body) - 5)
        assert BytesValue.FromString(body[5:]).value == b"x" * 50000
        blocks = [(f, p) for t, f, sid, p in first + rest if t == HEADERS and sid == 1]
        trailers = dict(raw.decoder.decode(blocks[0][1]) + raw.decoder.decode(blocks[-1][1]))
        assert trailers["grpc-status"] == "0" and blocks[-1][0] & END_STREAM
    finally:
        raw.close()


def _violations() -> list[Any]:
    block = hpack.Encoder().encode([(":method", "POST"), (":path", "/t.T/Echo")])
    big = b"\x00" * (MAX_COMPRESSED_BLOCK // 2 + 1)
    opened = frame(HEADERS, END_HEADERS, 1, block)
    return [
        pytest.param(None, PROTOCOL_ERROR, id="not-a-preface"),
        pytest.param(opened + frame(DATA, PADDED, 1, b"\x09abc"), PROTOCOL_ERROR,
                     id="padding-too-long"),
        pytest.param(frame(DATA, 0, 5, b"abc"), PROTOCOL_ERROR, id="data-on-a-stream-never-opened"),
        pytest.param(frame(WINDOW_UPDATE, 0, 0, b"\x00\x00\x00\x00"), PROTOCOL_ERROR,
                     id="window-update-of-0"),
        pytest.param(frame(SETTINGS, 0, 1, b""), PROTOCOL_ERROR, id="settings-on-a-stream"),
        pytest.param(frame(PING, 0, 1, b"12345678"), PROTOCOL_ERROR, id="ping-on-a-stream"),
        pytest.param(frame(RST_STREAM, 0, 0, b"\x00\x00\x00\x08"), PROTOCOL_ERROR,
                     id="rst-stream-on-0"),
        pytest.param(frame(HEADERS, 0, 1, block[:1]) + frame(CONTINUATION, 0, 1, b"") * 70,
                     ENHANCE_YOUR_CALM, id="continuation-flood"),
        pytest.param(frame(DATA, 0, 0, b"abc"), PROTOCOL_ERROR, id="data-on-stream-0"),
        pytest.param(frame(WINDOW_UPDATE, 0, 0, b"\x00\x00\x01"), FRAME_SIZE_ERROR,
                     id="short-window-update"),
        pytest.param(frame(PING, 0, 0, b"1234"), FRAME_SIZE_ERROR, id="short-ping"),
        pytest.param(frame(CONTINUATION, END_HEADERS, 1, block), PROTOCOL_ERROR,
                     id="continuation-alone"),
        pytest.param(frame(HEADERS, END_HEADERS, 2, block), PROTOCOL_ERROR, id="even-stream"),
        pytest.param(frame(HEADERS, END_HEADERS, 1, b"\xff\xff\xff\xff\x0f"), COMPRESSION_ERROR,
                     id="bad-hpack"),
        pytest.param(frame(HEADERS, 0, 1, big) + frame(CONTINUATION, 0, 1, big), ENHANCE_YOUR_CALM,
                     id="header-block-too-big"),
    ]


@pytest.mark.parametrize("bad, code", _violations())
def test_a_protocol_violation_ends_only_its_connection(running: Running, bad: bytes | None,
                                                      code: int,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    with grpc.insecure_channel(running.address) as channel:
        assert unary(channel, "Echo")(BytesValue(value=b"before")).value == b"before"
        raw = Raw(running.port, preface=b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" if bad is None else PREFACE)
        try:
            if bad is not None:
                raw.send(bad)
            frames = []
            while (got := raw.read_frame()) is not None:  # until the server closes
                frames.append(got)
            goaways = [p for t, _, _, p in frames if t == GOAWAY]
            assert goaways, "no GOAWAY before the close"
            assert struct.unpack(">I", goaways[-1][4:8])[0] == code
        finally:
            raw.close()
        # Other connections are untouched.
        assert unary(channel, "Echo")(BytesValue(value=b"after")).value == b"after"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_responses_are_compressed_with_an_algorithm_the_client_accepts(
        compressing: Running) -> None:
    import gzip

    raw = Raw(compressing.port, settings=setting(0x4, 1 << 20))  # windows wide enough
    raw.send(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 1 << 20)))
    try:
        message = BytesValue(value=b"100000").SerializeToString()
        # Level low takes gzip first (gRPC core's ranking), when the client accepts it.
        headers, data = raw.unary(1, "/t.T/Big", message, ("grpc-accept-encoding",
                                                           "identity,deflate,gzip"))
        assert headers["grpc-encoding"] == "gzip" and headers["grpc-status"] == "0"
        flag, size = struct.unpack(">BI", data[:5])
        assert flag == 1 and size == len(data) - 5 < 1000  # 100,000 x's, compressed
        assert BytesValue.FromString(gzip.decompress(data[5:])).value == b"x" * 100_000
        # A client that accepts only deflate gets deflate; one that names none, plain bytes.
        headers, data = raw.unary(3, "/t.T/Big", message, ("grpc-accept-encoding", "deflate"))
        assert headers["grpc-encoding"] == "deflate" and data[0] == 1
        headers, data = raw.unary(5, "/t.T/Big", message)
        assert "grpc-encoding" not in headers and data[0] == 0
        assert BytesValue.FromString(data[5:]).value == b"x" * 100_000
        # A method that is not compressible answers plain bytes whatever the client accepts.
        headers, data = raw.unary(7, "/t.T/Echo", BytesValue(value=b"hi").SerializeToString(),
                                  ("grpc-accept-encoding", "gzip"))
        assert "grpc-encoding" not in headers and data[0] == 0
    finally:
        raw.close()
    # The real client reads compressed answers (over 1 MiB: compressed off the event loop).
    with grpc.insecure_channel(compressing.address) as channel:
        for size in (200_000, 3_000_000):
            assert unary(channel, "Big")(BytesValue(value=str(size).encode())).value == \
                b"x" * size


def test_a_client_that_sends_but_never_reads_is_not_read_either(running: Running) -> None:
    # Each request for an unknown method of a long name gets an answer ~40x its size. A client
    # that floods them without reading its answers: once our write buffer passes its mark
    # we stop reading its frames, so what the server holds for it stays bounded; others are
    # served meanwhile, and its close frees everything.
    from tritonpy.frontends import _h2_connection as _http2

    raw = Raw(running.port)
    raw.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
    encoder = hpack.Encoder()
    headers = [(":method", "POST"), (":scheme", "http"), (":path", "/t.T/" + "x" * 250),
               (":authority", "x"), ("content-type", "application/grpc")]
    flood = b"".join(frame(HEADERS, END_HEADERS | END_STREAM, sid, encoder.encode(headers))
                     for sid in range(1, 120_001, 2))
    raw.sock.settimeout(3.0)
    try:
        try:
            raw.sock.sendall(flood)  # ~1 MB asking for ~25 MB of answers
        except socket.timeout:
            pass  # the server stopped reading: what is left waits in the socket buffers
        conn = next(iter(running.server.connections))
        # (the wait is long for a loaded machine: the server answers ~60,000 frames first)
        assert wait_for(lambda: conn.write_paused, 30), "the server kept reading"
        held = conn.transport.get_write_buffer_size()
        assert held <= _http2._WRITE_HIGH + (1 << 20), held
        assert conn.last_sid < 119_999  # frames left unread
        with grpc.insecure_channel(running.address) as channel:
            assert unary(channel, "Echo")(BytesValue(value=b"served"), timeout=5).value == \
                b"served"
    finally:
        raw.close()
    assert wait_for(lambda: not running.server.connections, 5)


def test_streams_past_the_advertised_limit_are_refused(running: Running,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from tritonpy.frontends import _h2_connection as _http2

    monkeypatch.setattr(_http2, "MAX_STREAMS", 4)
    raw = Raw(running.port)
    try:
        message = BytesValue(value=b"30").SerializeToString()
        for sid in (1, 3, 5, 7, 9):  # five slow calls held open; the limit is four
            raw.send(frame(HEADERS, END_HEADERS, sid, raw.request_headers("/t.T/Slow"))
                     + grpc_data(sid, message))
        frames = raw.frames_until_quiet(0.5)
        settings = next(p for t, f, _, p in frames if t == SETTINGS and not f & ACK)
        advertised = dict(struct.iter_unpack(">HI", settings))
        assert advertised[0x3] == 4  # SETTINGS_MAX_CONCURRENT_STREAMS
        resets = [(sid, struct.unpack(">I", p)[0]) for t, _, sid, p in frames if t == RST_STREAM]
        assert resets == [(9, 0x7)]  # REFUSED_STREAM: the client may retry it
    finally:
        raw.close()


def test_a_connection_without_a_preface_is_closed(running: Running,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from tritonpy.frontends import _h2_connection as _http2

    monkeypatch.setattr(_http2, "PREFACE_TIMEOUT", 0.3)
    sock = socket.create_connection(("127.0.0.1", running.port), timeout=5)
    try:
        t0 = time.monotonic()
        got = b""
        try:
            while chunk := sock.recv(4096):  # our SETTINGS, then the close
                got += chunk
        except ConnectionResetError:
            pass
        assert time.monotonic() - t0 < 3
        assert got[3] == SETTINGS
    finally:
        sock.close()


def test_a_call_that_ends_while_its_client_still_sends_is_reset_after_its_trailers(
        running: Running) -> None:
    # As gRPC's own servers: trailers, then RST_STREAM(NO_ERROR), so that the client's call
    # ends on those trailers even if the connection closes next (a server stopping). Without
    # it a streaming client could see "Socket closed" instead of its last answers.
    raw = Raw(running.port)
    try:
        message = BytesValue(value=b"hi").SerializeToString()
        raw.send(frame(HEADERS, END_HEADERS, 1, raw.request_headers("/t.T/Echo"))
                 + grpc_data(1, message, 0))
        frames = [(t, f, p) for t, f, sid, p in raw.frames_until_quiet(0.5) if sid == 1]
        kinds = [t for t, _, _ in frames]
        assert kinds == [HEADERS, DATA, HEADERS, RST_STREAM], kinds
        assert frames[2][1] & END_STREAM and struct.unpack(">I", frames[3][2])[0] == 0
    finally:
        raw.close()


def test_a_deadline_on_a_stream_the_client_still_sends_on_resets_it_with_no_error(
        running: Running) -> None:
    # As gRPC's own servers: DEADLINE_EXCEEDED in the trailers, then RST_STREAM(NO_ERROR). It
    # was CANCEL, and the client's gRPC library then reported the reset in most calls
    # ("Stream removed", some CANCELLED) instead of "Deadline Exceeded" (Triton's QA
    # test_grpc_stream_infer and test_decoupled_timeout look for it).
    raw = Raw(running.port)
    try:
        raw.send(frame(HEADERS, END_HEADERS, 1, raw.request_headers(
            "/t.T/Stream", ("grpc-timeout", "200m"))))  # and nothing more: still sending
        frames = [(t, f, p) for t, f, sid, p in raw.frames_until_quiet(1.0) if sid == 1]
        assert [t for t, _, _ in frames] == [HEADERS, RST_STREAM], frames
        trailers = dict(raw.decoder.decode(frames[0][2]))
        assert (trailers["grpc-status"], trailers["grpc-message"]) == ("4", "Deadline Exceeded")
        assert struct.unpack(">I", frames[1][2])[0] == 0  # NO_ERROR
    finally:
        raw.close()


# -- keepalive, ping policy and connection age (KeepAlive: Triton's --grpc-keepalive-* flags) -----
def keepalive(**settings: Any) -> Iterator[Running]:
    return _running(keepalive=KeepAlive(**settings))


def answer_pings(raw: Raw, seconds: float) -> tuple[int, bool]:
    """Read for ``seconds``, answering the server's pings; (pings seen, connection still open)."""
    pings = 0
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        try:
            got = raw.read_frame(left)
        except socket.timeout:
            break
        if got is None:
            return pings, False
        if got[0] == PING and not got[1] & ACK:
            pings += 1
            raw.send(frame(PING, ACK, 0, got[3]))
    return pings, True


def test_keepalive_pings_a_silent_client_and_drops_one_that_does_not_answer() -> None:
    for running in keepalive(time_ms=200, timeout_ms=300, permit_without_calls=True,
                             max_pings_without_data=0):
        answering = Raw(running.port)
        try:
            pings, open_ = answer_pings(answering, 1.5)
            assert open_ and pings >= 3, pings  # one each ~200 ms of silence, answered
        finally:
            answering.close()
        silent = Raw(running.port)
        try:
            t0 = time.monotonic()
            frames = []
            while (got := silent.read_frame(5)) is not None:  # our SETTINGS, a PING, the close
                frames.append(got)
            elapsed = time.monotonic() - t0
            assert any(t == PING and not f & ACK for t, f, _, _ in frames), frames
            assert 0.4 < elapsed < 3, elapsed  # ~200 ms of silence, then 300 ms for the answer
            assert wait_for(lambda: not running.server.connections, 5)
        finally:
            silent.close()


def test_keepalive_pings_need_an_open_call_and_data_between_them() -> None:
    # gRPC's defaults: no pings while no call is open (permit_without_calls false), and at
    # most max_pings_without_data (2) until the server sends headers or data again.
    for running in keepalive(time_ms=100, timeout_ms=5000):
        raw = Raw(running.port)
        try:
            assert answer_pings(raw, 0.6) == (0, True)
            raw.send(frame(HEADERS, END_HEADERS, 1, raw.request_headers("/t.T/Stream")))
            assert answer_pings(raw, 1.0) == (2, True)
            message = BytesValue(value=b"ab").SerializeToString()
            raw.send(grpc_data(1, message, 0))
            assert answer_pings(raw, 1.0) == (2, True)  # the answer's data: two more
        finally:
            raw.close()


def test_pings_too_close_together_end_the_connection_with_too_many_pings(
        running: Running) -> None:
    # Default policy, no call open: a ping within two hours of the last is a strike; the
    # third strike ends the connection with GOAWAY ENHANCE_YOUR_CALM "too_many_pings".
    raw = Raw(running.port)
    try:
        for i in range(3):
            raw.send(frame(PING, 0, 0, b"%08d" % i))
        frames = raw.frames_until_quiet(0.3)
        assert sum(t == PING for t, *_ in frames) == 3 and not any(t == GOAWAY for t, *_ in frames)
        raw.send(frame(PING, 0, 0, b"%08d" % 3))
        frames = raw.frames_until_quiet(2)
        assert frames[0][0] == PING and frames[0][1] & ACK  # answered first, as Triton 2.51
        goaway = [p for t, _, _, p in frames if t == GOAWAY]
        assert goaway and struct.unpack(">I", goaway[0][4:8])[0] == ENHANCE_YOUR_CALM
        assert goaway[0][8:] == b"too_many_pings"
        assert raw.read_frame(2) is None  # closed
    finally:
        raw.close()
    # Headers or data sent by the server between pings clear the strikes.
    raw = Raw(running.port)
    try:
        for i in range(6):
            raw.send(frame(PING, 0, 0, b"%08d" % i))
            headers, _ = raw.unary(2 * i + 1, "/t.T/Echo", b"")
            assert headers.get("grpc-status") == "0"
        frames = raw.frames_until_quiet(0.3)
        assert not any(t == GOAWAY for t, *_ in frames)
    finally:
        raw.close()
    # The real client's own pings (BDP probes with its calls) are never struck.
    with grpc.insecure_channel(running.address) as channel:
        echo = unary(channel, "Echo")
        for i in range(200):
            assert echo(BytesValue(value=b"y" * (i * 300)), timeout=10).value == b"y" * (i * 300)


def test_pings_while_a_long_answer_flows_are_not_strikes(running: Running) -> None:
    # The client pings (gRPC's BDP probes) as it reads one large answer frame by frame: each
    # DATA frame sent between two pings clears the strikes, as in gRPC core. Counted per
    # message, a 512 MiB answer over gRPC ended with GOAWAY too_many_pings (QA L0_large_payload).
    raw = Raw(running.port, settings=setting(0x4, 1000))  # SETTINGS_INITIAL_WINDOW_SIZE
    try:
        raw.send(frame(HEADERS, END_HEADERS, 1, raw.request_headers("/t.T/Big"))
                 + grpc_data(1, BytesValue(value=b"20000").SerializeToString()))
        frames = raw.frames_until_quiet(0.3)
        for i in range(12):  # a ping, then room for one more frame of the answer
            raw.send(frame(PING, 0, 0, b"%08d" % i))
            raw.send(frame(WINDOW_UPDATE, 0, 1, struct.pack(">I", 1000)))
            frames += raw.frames_until_quiet(0.1)
        assert not any(t == GOAWAY for t, *_ in frames), frames
        raw.send(frame(WINDOW_UPDATE, 0, 1, struct.pack(">I", 100_000)))
        frames += raw.frames_until_quiet(0.5)
        body = b"".join(p for t, _, sid, p in frames if t == DATA and sid == 1)
        assert BytesValue.FromString(body[5:]).value == b"x" * 20000
        assert not any(t == GOAWAY for t, *_ in frames)
    finally:
        raw.close()


def test_max_ping_strikes_zero_allows_any_pings() -> None:
    for running in keepalive(max_ping_strikes=0):
        raw = Raw(running.port)
        try:
            for i in range(20):
                raw.send(frame(PING, 0, 0, b"%08d" % i))
            frames = raw.frames_until_quiet(0.5)
            assert sum(t == PING and f & ACK for t, f, _, _ in frames) == 20
            assert not any(t == GOAWAY for t, *_ in frames)
        finally:
            raw.close()


def test_a_connection_past_its_maximum_age_is_drained_then_closed() -> None:
    for running in keepalive(max_connection_age_ms=300, max_connection_age_grace_ms=1500):
        # A call open at the GOAWAY finishes; a call opened after it is refused (the client
        # retries it on a new connection); the connection closes when its last call ends.
        raw = Raw(running.port)
        try:
            message = BytesValue(value=b"0.8").SerializeToString()
            t0 = time.monotonic()
            raw.send(frame(HEADERS, END_HEADERS, 1, raw.request_headers("/t.T/Slow"))
                     + grpc_data(1, message))
            while (got := raw.read_frame()) is not None and got[0] != GOAWAY:
                pass
            assert got is not None, "closed without a GOAWAY"
            assert 0.25 < time.monotonic() - t0 < 0.6
            assert struct.unpack(">II", got[3][:8]) == (1, 0)  # last stream 1, NO_ERROR
            raw.send(frame(HEADERS, END_HEADERS | END_STREAM, 3, raw.request_headers("/t.T/Echo")))
            frames = []
            while (got := raw.read_frame()) is not None:
                frames.append(got)
            closed_after = time.monotonic() - t0
            assert (RST_STREAM, 3, struct.pack(">I", 0x7)) in [(t, s, p) for t, _, s, p in frames]
            trailers = [p for t, f, s, p in frames if t == HEADERS and s == 1 and f & END_STREAM]
            assert trailers and dict(raw.decoder.decode(trailers[0]))["grpc-status"] == "0"
            assert 0.8 < closed_after < 1.4, closed_after  # at the call's end, not the grace's
        finally:
            raw.close()
        # A call still open when the grace period ends is cut with its connection.
        raw = Raw(running.port)
        try:
            message = BytesValue(value=b"30").SerializeToString()
            t0 = time.monotonic()
            raw.send(frame(HEADERS, END_HEADERS, 1, raw.request_headers("/t.T/Slow"))
                     + grpc_data(1, message))
            while raw.read_frame() is not None:
                pass
            assert 1.5 < time.monotonic() - t0 < 3.5
        finally:
            raw.close()
        # The real client moves to new connections as the old ones age, losing no call.
        with grpc.insecure_channel(running.address) as channel:
            echo = unary(channel, "Echo")
            end = time.monotonic() + 1.5
            calls = 0
            while time.monotonic() < end:
                assert echo(BytesValue(value=b"z"), timeout=10).value == b"z"
                calls += 1
            assert calls > 10
