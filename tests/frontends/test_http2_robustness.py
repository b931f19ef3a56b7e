"""Our HTTP/2 gRPC server (``tritonpy.frontends._http2``) against clients that break the rules
of HTTP/2 mid-call: frames a well-behaved client never sends, with a raw socket."""
from __future__ import annotations

import struct
import time
from typing import Iterator

import grpc
import pytest
from google.protobuf.wrappers_pb2 import BytesValue
from test_http2 import (
    END_HEADERS,
    GOAWAY,
    HEADERS,
    PING,
    PROTOCOL_ERROR,
    RST_STREAM,
    Raw,
    Running,
    frame,
    _running,
    grpc_data,
    unary,
)

STREAM_CLOSED = 0x5
PUSH_PROMISE = 0x5


@pytest.fixture
def running() -> Iterator[Running]:
    yield from _running()


def test_data_after_end_stream_resets_its_stream_only(running: Running) -> None:
    """DATA on a stream its client already ended is a stream error (STREAM_CLOSED): the call is
    reset and its handler cancelled, not answered as if the client had sent two messages; the
    connection goes on serving."""
    raw = Raw(running.port)
    try:
        raw.send(frame(HEADERS, END_HEADERS, 1, raw.request_headers("/t.T/Slow"))
                 + grpc_data(1, BytesValue(value=b"30").SerializeToString()))
        assert running.toy.slow_started.wait(5)
        raw.send(grpc_data(1, BytesValue(value=b"30").SerializeToString()))
        got = raw.frames_until_quiet(1.0)
        on_1 = [(ftype, payload) for ftype, _, sid, payload in got if sid == 1]
        assert (RST_STREAM, struct.pack(">I", STREAM_CLOSED)) in on_1, got
        assert not [f for f in on_1 if f[0] == HEADERS], got  # no answer to a reset call
        assert running.toy.cancelled.wait(5)
        headers, data = raw.unary(3, "/t.T/Echo", BytesValue(value=b"hi").SerializeToString())
        assert headers.get("grpc-status") == "0" and data[5:] == BytesValue(
            value=b"hi").SerializeToString()
    finally:
        raw.close()
    with grpc.insecure_channel(running.address) as channel:
        assert unary(channel, "Echo")(BytesValue(value=b"ok"), timeout=10).value == b"ok"


def test_a_protocol_error_goaway_reaches_a_client_that_is_still_sending(
        running: Running) -> None:
    """The connection a client broke the rules on ends with GOAWAY (why) and then our FIN, read
    to the client's end: bytes it sends meanwhile are discarded, not answered with a TCP reset
    that could lose the GOAWAY."""
    raw = Raw(running.port)
    try:
        # The bad frame, then 340 KB that the server has not read when it stops reading.
        raw.send(frame(PUSH_PROMISE, END_HEADERS, 1, b"\0\0\0\2")
                 + frame(PING, 0, 0, b"12345678") * 20000)
        time.sleep(0.3)
        raw.send(frame(PING, 0, 0, b"12345678") * 1000)
        got = raw.frames_until_quiet(3.0)
        goaway = [payload for ftype, _, _, payload in got if ftype == GOAWAY]
        assert len(goaway) == 1 and struct.unpack(">I", goaway[0][4:8])[0] == PROTOCOL_ERROR
        assert raw.read_frame(1.0) is None  # our FIN
    finally:
        raw.close()
    with grpc.insecure_channel(running.address) as channel:
        assert unary(channel, "Echo")(BytesValue(value=b"ok"), timeout=10).value == b"ok"
