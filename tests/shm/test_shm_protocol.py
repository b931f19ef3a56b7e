"""Malformed frames and out-of-range handles are ProtocolErrors, never crashes; large frames
spill through shm."""
from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import msgpack
import numpy as np
import pytest
from _helpers import MiB, wait_for

from tritonpy.shm import (
    FRAME_LIMIT,
    Channel,
    ChannelClosedError,
    Cmd,
    Peer,
    Pool,
    ProtocolError,
    TensorTransport,
    socket_pair,
)
from tritonpy.shm.transport import URGENT_RELEASE_BYTES


class Pair:
    """A Channel on one end of a real socket pair; the test writes raw datagrams at it."""

    def __init__(self, prefix: str) -> None:
        self.pool = Pool(prefix=prefix, default_size=MiB)
        self.transport = TensorTransport(self.pool)
        ours, self.raw = socket_pair()
        self.channel = Channel(ours, self.transport, name="under-test")
        self.keep: list[np.ndarray] = []

    def feed(self, data: bytes) -> None:
        self.raw.send(data)

    def feed_frame(self, cmd: int, call_id: int = 0, body: object = None) -> None:
        self.raw.send(msgpack.packb([cmd, call_id, body], use_bin_type=True))

    def still_works(self) -> None:
        self.feed_frame(int(Cmd.PING), 77, {"x": 1})
        assert self.channel.recv() == [int(Cmd.PING), 77, {"x": 1}]

    def close(self) -> None:
        self.keep.clear()
        self.channel.close()
        self.raw.close()
        self.pool.close()
        self.transport.segments.close()


@pytest.fixture
def pair(shm_prefix: str) -> Iterator[Pair]:
    p = Pair(shm_prefix)
    try:
        yield p
    finally:
        p.close()


GARBAGE = [
    b"\xc1",  # a byte msgpack never uses
    b"\x93\x01",  # an array of 3 cut short
    os.urandom(64),
    msgpack.packb({"cmd": 1}),  # not an array
    msgpack.packb([1, 2]),  # wrong arity
    msgpack.packb([1, 2, 3, 4]),
    msgpack.packb(["EXECUTE", 0, None]),  # command not an int
    msgpack.packb([10, "id", None]),  # call id not an int
    msgpack.packb([999, 0, None]),  # unknown command
    msgpack.packb([-1, 0, None]),
    msgpack.packb([1, 0, None]) + b"trailing",
    msgpack.packb([int(Cmd.RELEASE), 0, "not a list"]),
    msgpack.packb([int(Cmd.RELEASE), 0, [1, "two", [3]]]),
]


@pytest.mark.parametrize("data", GARBAGE, ids=range(len(GARBAGE)))
def test_malformed_frame_is_rejected_and_channel_goes_on(pair: Pair, data: bytes) -> None:
    pair.feed(data)
    with pytest.raises(ProtocolError):
        pair.channel.recv()
    pair.still_works()


def test_oversized_datagram_is_rejected(pair: Pair) -> None:
    pair.raw.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * FRAME_LIMIT)
    pair.feed(msgpack.packb([int(Cmd.PING), 0, b"x" * (FRAME_LIMIT + 4096)]))
    with pytest.raises(ProtocolError, match="frame limit"):
        pair.channel.recv()
    pair.still_works()


def _spill_target(pair: Pair, payload: bytes) -> list:
    block = pair.pool.new_array(np.uint8, (len(payload),))
    block[:] = np.frombuffer(payload, np.uint8)
    seg, off = pair.transport.segments.locate(block)
    pair.keep.append(block)  # alive until the pair closes
    return [seg.name, off, len(payload)]


def test_bad_spill_frames(pair: Pair) -> None:
    good = msgpack.packb([int(Cmd.PING), 5, "spilled"])
    name, off, n = _spill_target(pair, good)
    size = pair.pool.usage()["mapped_bytes"]
    nested = _spill_target(pair, msgpack.packb([int(Cmd.SPILL), 0, [name, off, n, 1]]))
    junk = _spill_target(pair, b"\xc1\xc1\xc1\xc1")
    bad_bodies = [
        "not a list", [name, off, n], [name, off, n, 1, 2], [name, "0", n, 1],
        [name, off, n, None], [name, -64, n, 1], [name, off, 0, 1], [name, size, 16, 1],
        [name, off, size * 2, 1], ["../" + name, off, n, 1], ["a/b", off, n, 1], ["..", 0, 4, 1],
        [".", 0, 4, 1], ["", 0, 4, 1], [123, 0, 4, 1], [name + "-missing", 0, 4, 1],
        [*nested, 1], [*junk, 1],
    ]
    for body in bad_bodies:
        pair.feed_frame(int(Cmd.SPILL), 0, body)
        with pytest.raises(ProtocolError):
            pair.channel.recv()
    pair.feed_frame(int(Cmd.SPILL), 0, [name, off, n, 9])
    assert pair.channel.recv() == [int(Cmd.PING), 5, "spilled"]
    pair.still_works()


def test_unknown_segment_in_dropped_is_ignored(pair: Pair) -> None:
    pair.feed_frame(int(Cmd.DROPPED), 0, ["no-such-segment", 5, None, "../x"])
    assert pair.channel.recv()[0] == Cmd.DROPPED
    pair.still_works()


def test_spilled_release_batch_is_applied(pair: Pair) -> None:
    """A RELEASE frame too big for a datagram still releases (it is not handed to the caller)."""
    peer = pair.channel.peer
    ids = [peer.export(object()) for _ in range(30_000)]
    body = msgpack.packb([int(Cmd.RELEASE), 0, ids])
    assert len(body) > FRAME_LIMIT
    name, off, n = _spill_target(pair, body)
    pair.feed_frame(int(Cmd.SPILL), 0, [name, off, n, 1])
    pair.still_works()  # the RELEASE was consumed inside recv()
    assert peer.outstanding == 0


# -- out-of-range handles ------------------------------------------------------------------------
@pytest.fixture
def target(shm_prefix: str) -> Iterator[tuple[TensorTransport, str, int]]:
    """A receiving transport and a real segment (of its own pool) to point handles at."""
    pool = Pool(prefix=shm_prefix, default_size=MiB)
    transport = TensorTransport(pool)
    block = pool.new_array(np.uint8, (4096,))
    seg, _ = transport.segments.locate(block)
    try:
        yield transport, seg.name, seg.size
    finally:
        del block
        pool.close()
        transport.segments.close()


def _bad_handles(seg: str, size: int) -> list:
    return [
        ["t", "FP32", [4], [seg, size, 16, 1]],  # offset past the end
        ["t", "FP32", [4], [seg, size - 8, 16, 2]],  # runs past the end
        ["t", "FP32", [4], [seg, -16, 16, 3]],  # negative offset
        ["t", "FP32", [4], [seg, 0, 15, 4]],  # wrong nbytes for the shape
        ["t", "FP32", [4], [seg, 0, 32, 5]],
        ["t", "FP32", [2, 2], [seg, 0, -16, 6]],
        ["t", "BYTES", [3], [seg, 0, 4, 7]],  # too few elements in the buffer
        ["t", "BYTES", [1], [seg, size - 2, 4, 8]],
        ["t", "FP128", [4], [seg, 0, 16, 9]],  # bad dtypes
        ["t", "TYPE_FP32", [4], [seg, 0, 16, 10]],
        ["t", "STRING", [4], [seg, 0, 16, 11]],
        ["t", "BF16", [4], [seg, 0, 16, 12]],  # BF16 is 2 bytes an element
        ["t", 11, [4], [seg, 0, 16, 13]],
        ["t", "FP32", [1 << 41], [seg, 0, 16, 14]],  # huge shapes
        ["t", "FP32", [1 << 30, 1 << 30], [seg, 0, 16, 15]],
        ["t", "FP32", [-4], [seg, 0, 16, 16]],
        ["t", "FP32", [1] * 65, [seg, 0, 4, 17]],
        ["t", "FP32", ["4"], [seg, 0, 16, 18]],
        ["t", "FP32", 4, [seg, 0, 16, 19]],
        ["t", "FP32", [4], ["../" + seg, 0, 16, 20]],  # bad segment names
        ["t", "FP32", [4], ["a/b", 0, 16, 21]],
        ["t", "FP32", [4], ["..", 0, 16, 22]],
        ["t", "FP32", [4], [".", 0, 16, 23]],
        ["t", "FP32", [4], ["", 0, 16, 24]],
        ["t", "FP32", [4], ["/" + seg, 0, 16, 25]],
        ["t", "FP32", [4], [seg + "-gone", 0, 16, 26]],
        ["t", "FP32", [4], [None, 0, 16, 27]],
        ["t", "FP32", [4], [seg, 0.0, 16, 28]],  # bad field types
        ["t", "FP32", [4], [seg, 0, 16]],
        ["t", "FP32", [4], 12345],
        ["t", "FP32", [4], b"\x00" * 15],  # inline: wrong length
        ["t", "FP32", [4]],
        [1, "FP32", [4], b"\x00" * 16],
        "not a list",
    ]


def test_out_of_range_handles_are_rejected(target) -> None:
    transport, seg, size = target
    peer = Peer("evil")
    for wire in _bad_handles(seg, size):
        with pytest.raises(ProtocolError):
            transport.decode(wire, peer)
    # a handle that named a real export but was rejected is still released to its owner
    owed = set(peer.take_owed())
    assert {1, 2, 3, 4, 5, 6, 7, 8, 26} <= owed
    # and a good handle to the same place decodes afterwards
    name, arr = transport.decode(["t", "UINT8", [16], [seg, 0, 16, 99]], peer)
    assert arr.shape == (16,)


def test_decode_many_rejects_a_non_list(target) -> None:
    transport, _, _ = target
    with pytest.raises(ProtocolError):
        transport.decode_many({"a": 1}, Peer())


# -- across processes ---------------------------------------------------------------------------
def test_child_survives_garbage_and_bad_handles(shm_child) -> None:
    child = shm_child()
    for data in GARBAGE:
        child.channel.sock.send(data)
    block = child.pool.new_array(np.uint8, (1,))
    bad = ["t", "FP32", [4], [child.pool.segment_names()[0], 1 << 40, 16, 1]]
    with pytest.raises(AssertionError, match="ProtocolError"):
        child.call("echo", inputs=[bad])
    stats = child.call("stats")
    assert len(stats["errors"]) == len(GARBAGE) + 1
    back = child.decode(child.send_tensors("echo", {"x": np.arange(10)})["outputs"])
    assert np.array_equal(back["x"], np.arange(10))
    del block


@pytest.mark.parametrize("size", [FRAME_LIMIT - 1200, FRAME_LIMIT, 3 * MiB])
def test_large_frames_spill_and_arrive_intact(shm_child, size: int) -> None:
    child = shm_child()
    blob = os.urandom(size)
    payload = {"blob": blob, "nested": [{"k": "v" * 100}] * 10, "n": size}
    framed = msgpack.packb([int(Cmd.EXECUTE), 1, {"op": "echo", "payload": payload}],
                           use_bin_type=True)
    assert (len(framed) > FRAME_LIMIT) == (size >= FRAME_LIMIT)
    reply = child.call("echo", payload=payload)
    assert reply["payload"] == payload
    # the spill blocks (ours to the child, the child's to us) are all given back
    assert wait_for(lambda: child.used() == 0)
    assert wait_for(lambda: child.call("stats")["usage"]["used_bytes"] == 0)
    spilled = size >= FRAME_LIMIT
    assert (child.pool.usage()["peak_bytes"] > 0) == spilled


def test_send_after_peer_closed_raises(shm_child) -> None:
    child = shm_child()
    child.channel.sock.shutdown(socket.SHUT_RDWR)
    assert child.next_frame(timeout=5) is None
    with pytest.raises(ChannelClosedError):
        child.channel.send(Cmd.PING, 1, None)


def test_last_frames_of_a_peer_that_closed_with_frames_unread(pair: Pair) -> None:
    # A stub that answers FINALIZE and exits while a RELEASE of ours is still unread in its
    # socket: the kernel reports ECONNRESET before the reply it sent; the reply still arrives,
    # then the end of the channel.
    pair.channel.send(Cmd.RELEASE, 0, [1, 2, 3])  # never read by the peer
    pair.feed_frame(int(Cmd.REPLY), 9, {"ok": True})
    pair.raw.close()
    assert pair.channel.recv() == [int(Cmd.REPLY), 9, {"ok": True}]
    assert pair.channel.recv() is None and pair.channel.closed


def test_releases_ride_along_on_the_next_frame(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    import tritonpy.shm.channel as channel_module

    monkeypatch.setattr(channel_module, "RELEASE_DELAY_S", 30.0)  # the flusher stays out of it
    peer = pair.channel.peer
    for eid in (5, 6, 7):
        peer.owe_release(eid)
    carried = []
    for call_id in (1, 2):  # the first takes them all, unless the flusher held one back
        pair.channel.send(Cmd.REPLY, call_id, {"ok": True})
        frame = msgpack.unpackb(pair.raw.recv(4096))
        assert frame[:3] == [int(Cmd.REPLY), call_id, {"ok": True}]
        carried += frame[3] if len(frame) == 4 else []
    assert sorted(carried) == [5, 6, 7]
    pair.channel.send(Cmd.REPLY, 3, {"ok": True})  # nothing owed: a plain frame
    assert msgpack.unpackb(pair.raw.recv(4096)) == [int(Cmd.REPLY), 3, {"ok": True}]
    assert pair.channel.release_frames_sent == 0


def test_a_big_blocks_release_goes_at_once(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    import tritonpy.shm.channel as channel_module

    monkeypatch.setattr(channel_module, "RELEASE_DELAY_S", 30.0)
    pair.channel.peer.owe_release(9, URGENT_RELEASE_BYTES)
    pair.raw.settimeout(5)
    assert msgpack.unpackb(pair.raw.recv(4096)) == [int(Cmd.RELEASE), 0, [9]]


def test_carried_releases_are_applied_and_checked(pair: Pair) -> None:
    peer = pair.channel.peer
    keep = [np.zeros(4) for _ in range(2)]
    ids = [peer.export(k) for k in keep]
    pair.raw.send(msgpack.packb([int(Cmd.PING), 3, None, ids]))
    assert pair.channel.recv() == [int(Cmd.PING), 3, None]  # handed on without the ids
    assert peer.outstanding == 0
    pair.raw.send(msgpack.packb([int(Cmd.PING), 4, None, ["x"]]))
    with pytest.raises(ProtocolError, match="carried releases"):
        pair.channel.recv()
    pair.still_works()


def test_releases_carried_by_a_spilled_frame_are_applied(pair: Pair) -> None:
    peer = pair.channel.peer
    ids = [peer.export(object()) for _ in range(3)]
    body = msgpack.packb([int(Cmd.PING), 8, "x" * (FRAME_LIMIT + 10), ids])
    name, off, n = _spill_target(pair, body)
    pair.feed_frame(int(Cmd.SPILL), 0, [name, off, n, 1])
    assert pair.channel.recv() == [int(Cmd.PING), 8, "x" * (FRAME_LIMIT + 10)]
    assert peer.outstanding == 0


def test_a_frame_that_spills_still_carries_what_is_owed(pair: Pair,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import tritonpy.shm.channel as channel_module

    monkeypatch.setattr(channel_module, "RELEASE_DELAY_S", 30.0)
    pair.channel.peer.owe_release(4)
    big = "y" * (FRAME_LIMIT + 10)
    pair.channel.send(Cmd.REPLY, 6, {"big": big})
    outer = msgpack.unpackb(pair.raw.recv(4096))
    assert outer[0] == int(Cmd.SPILL)
    seg_name, off, nbytes, _ = outer[2]
    seg = pair.transport.segments.get(seg_name)  # the sender's own pool segment
    inner = msgpack.unpackb(bytes(memoryview(seg.mm)[off:off + nbytes]))
    assert inner == [int(Cmd.REPLY), 6, {"big": big}, [4]]


def test_releases_a_frame_cannot_carry_are_queued_for_the_flusher(pair: Pair) -> None:
    import tritonpy.shm.channel as channel_module

    n = channel_module.CARRY_MAX + 300
    owed = list(range(1, n + 1))
    # Taken as a frame takes them (the flusher may have taken some first: those it sends).
    for eid in owed:
        pair.channel.peer.owe_release(eid)
    carried = pair.channel._take_releases(channel_module.CARRY_MAX)
    assert len(carried) <= channel_module.CARRY_MAX
    pair.raw.settimeout(5)
    sent = set(carried)
    while len(sent) < n:  # the rest goes out in RELEASE frames, without any other frame
        frame = msgpack.unpackb(pair.raw.recv(1 << 16))
        assert frame[0] == int(Cmd.RELEASE)
        sent |= set(frame[2])
    assert sent == set(owed)


def test_a_non_blocking_channel_keeps_what_its_peer_cannot_take_yet_in_order(pair: Pair) -> None:
    # The host's end is read by an event loop, which must never block: 20,000 frames to a peer
    # that reads none are kept (not lost, which they were: the send failed), and a thread that
    # may wait sends behind them, once they have gone.
    import threading

    wanted: list[int] = []
    pair.channel.use_backlog(lambda: wanted.append(1), may_wait=lambda: not on_loop.is_set())
    on_loop = threading.Event()
    on_loop.set()  # this thread plays the loop: its sends never wait
    for i in range(20_000):
        pair.channel.send(Cmd.PING, i, None)
    assert wanted == [1]  # the owner was asked once to flush when the socket is writable
    assert pair.channel._backlog  # the socket's buffer is full: the rest waits in order
    on_loop.clear()
    waiter = threading.Thread(target=pair.channel.send, args=(Cmd.PING, 20_000, None))
    waiter.start()
    pair.raw.settimeout(5)
    got = []
    while len(got) < 20_001:
        pair.channel.flush_backlog()  # what the loop does when the socket is writable
        got.append(msgpack.unpackb(pair.raw.recv(FRAME_LIMIT))[1])
    waiter.join(5)
    assert got == list(range(20_001))
    assert not waiter.is_alive() and not pair.channel._backlog


def test_a_waiting_sender_makes_progress_without_the_loop(pair: Pair) -> None:
    # The owner's loop may be gone (stopping): a thread that may wait flushes the backlog
    # itself as the peer reads, instead of waiting for ever.
    import threading

    pair.channel.use_backlog(lambda: None, may_wait=lambda: threading.current_thread().name == "w")
    for i in range(5_000):
        pair.channel.send(Cmd.PING, i, None)  # this thread does not wait: kept in the backlog
    assert pair.channel._backlog
    waiter = threading.Thread(target=pair.channel.send, args=(Cmd.PING, 5_000, None), name="w")
    waiter.start()
    pair.raw.settimeout(5)
    got = [msgpack.unpackb(pair.raw.recv(FRAME_LIMIT))[1] for _ in range(5_001)]  # no flush here
    waiter.join(5)
    assert got == list(range(5_001)) and not waiter.is_alive()
