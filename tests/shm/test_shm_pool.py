"""The pool allocator, segments, the segment map and the transport, inside one process."""
from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from _helpers import MiB

from tritonpy.shm import (
    INLINE_LIMIT,
    Peer,
    Pool,
    ProtocolError,
    Segment,
    SegmentMap,
    TensorTransport,
    list_segments,
)
from tritonpy.shm.pool import ALIGN


@pytest.fixture
def pool(shm_prefix: str) -> Iterator[Pool]:
    p = Pool(prefix=shm_prefix, default_size=MiB, growth_size=MiB, idle_seconds=0.05)
    try:
        yield p
    finally:
        p.close()
        p.segments.close()


def test_blocks_are_aligned_and_coalesce(pool: Pool) -> None:
    blocks = [pool.allocate(n) for n in (1, 100, 64, 1000)]
    offsets = [off for _, off in blocks]
    assert all(off % ALIGN == 0 for off in offsets)
    assert offsets == sorted(offsets) and len(set(offsets)) == 4
    assert pool.usage()["used_bytes"] == 64 + 128 + 64 + 1024
    for i in (1, 0, 3, 2):  # out of order: neighbours merge both ways
        seg, off = blocks[i]
        pool.free(seg, off, (1, 100, 64, 1000)[i])
    assert pool.usage()["used_bytes"] == 0
    # one free run again: the whole segment can be handed out in one piece
    seg, off = pool.allocate(MiB)
    assert off == 0 and pool.usage()["segments"] == 1
    pool.free(seg, off, MiB)


def test_grows_by_whole_segments_without_moving_blocks(pool: Pool) -> None:
    a = pool.new_array(np.uint8, (MiB - 4096,))
    a[:] = 1
    addr = a.__array_interface__["data"][0]
    b = pool.new_array(np.uint8, (8192,))  # does not fit: a second segment
    assert pool.usage()["segments"] == 2 and pool.usage()["mapped_bytes"] == 2 * MiB
    assert a.__array_interface__["data"][0] == addr and (a == 1).all()
    c = pool.new_array(np.uint8, (3 * MiB,))  # bigger than the growth size: its own segment
    assert pool.usage()["segments"] == 3
    assert pool.usage()["mapped_bytes"] == 5 * MiB
    del a, b, c
    assert pool.usage()["used_bytes"] == 0


def test_big_block_segment_is_reused_then_reaped(pool: Pool) -> None:
    c = pool.new_array(np.uint8, (3 * MiB,))
    names = pool.segment_names()
    del c
    c = pool.new_array(np.uint8, (3 * MiB,))  # the same dedicated segment again
    assert pool.segment_names() == names
    del c
    time.sleep(0.06)
    assert pool.reap() == names  # the first segment is a big tensor's: not kept warm
    assert pool.take_dropped() == names and pool.take_dropped() == []
    assert list_segments(pool.prefix) == []


def test_first_segment_is_kept_warm(pool: Pool) -> None:
    a = pool.new_array(np.uint8, (MiB,))
    b = pool.new_array(np.uint8, (MiB,))
    first, second = pool.segment_names()
    del a, b
    time.sleep(0.06)
    assert pool.reap() == [second]
    assert pool.segment_names() == [first]
    assert os.path.exists(f"/dev/shm/{first}") and not os.path.exists(f"/dev/shm/{second}")


def test_block_freed_with_its_last_view(pool: Pool) -> None:
    a = pool.new_array(np.float32, (4, 1024))
    views = [a[1:], a.T, a.reshape(-1)[::7], memoryview(a)]
    del a
    assert all(isinstance(v, np.ndarray) for v in views[:-1])
    used = pool.usage()["used_bytes"]
    assert used == 16384
    while views:
        assert pool.usage()["used_bytes"] == used
        views.pop()
    assert pool.usage()["used_bytes"] == 0


def test_close_with_live_views_keeps_them_valid(shm_prefix: str) -> None:
    pool = Pool(prefix=shm_prefix, default_size=MiB)
    a = pool.new_array(np.int32, (1000,))
    a[:] = np.arange(1000)
    pool.close()
    assert list_segments(pool.prefix) == []  # unlinked at once ...
    assert (a == np.arange(1000)).all()  # ... while the mapping lives on with the view
    del a  # its late free is a no-op
    with pytest.raises(RuntimeError):
        pool.new_array(np.uint8, (10,))
    pool.segments.close()


def test_free_from_a_finalizer_inside_the_pool_lock_does_not_deadlock(pool: Pool) -> None:
    """The cyclic GC may run a block's finalizer while this thread holds the pool's lock."""
    class Cycle:
        pass

    c = Cycle()
    c.self = c  # type: ignore[attr-defined]
    c.arr = pool.new_array(np.uint8, (4096,))  # type: ignore[attr-defined]
    del c

    def collect_under_lock() -> None:
        with pool._lock:
            gc.collect()

    t = threading.Thread(target=collect_under_lock, daemon=True)
    t.start()
    t.join(5)
    assert not t.is_alive(), "free() deadlocked on the pool lock"
    assert pool.usage()["used_bytes"] == 0


def test_segment_names_are_checked(shm_prefix: str) -> None:
    for bad in ["", ".", "..", "../x", "a/b", "/abs", ".hidden", "x" * 201, "sp ace", "é"]:
        with pytest.raises(ProtocolError):
            Segment.attach(bad)
        with pytest.raises(ProtocolError):
            Segment.create(bad, 4096)
    with pytest.raises(ProtocolError):
        Segment.attach(shm_prefix + "does-not-exist")
    empty = f"/dev/shm/{shm_prefix}empty"
    open(empty, "wb").close()
    try:
        with pytest.raises(ProtocolError):
            Segment.attach(shm_prefix + "empty")
    finally:
        os.unlink(empty)


def test_segment_create_attach_close(shm_prefix: str) -> None:
    seg = Segment.create(shm_prefix + "s", 5000)
    try:
        assert seg.size == 8192 and seg.owner
        with pytest.raises(Exception):
            Segment.create(shm_prefix + "s", 4096)  # names are exclusive
        other = Segment.attach(shm_prefix + "s")
        assert other.size == seg.size and not other.owner
        seg.mm[:5] = b"hello"
        view = np.frombuffer(other.mm, np.uint8, 5)
        assert bytes(view) == b"hello"
        assert other.close() is False  # a live view keeps it mapped
        del view
        assert other.close() is True
        other.unlink()  # not the owner: a no-op
        assert os.path.exists(f"/dev/shm/{shm_prefix}s")
    finally:
        seg.unlink()
        seg.unlink()  # idempotent
        seg.close()
    assert not os.path.exists(f"/dev/shm/{shm_prefix}s")


def test_segment_map_locate(pool: Pool) -> None:
    a = pool.new_array(np.float64, (100,))
    seg, off = pool.segments.locate(a)
    assert seg.name == pool.segment_names()[0]
    assert pool.segments.locate(a[10:]) == (seg, off + 80)
    assert pool.segments.locate(a[::2]) is None  # not contiguous: must be copied
    assert pool.segments.locate(np.zeros(100)) is None  # private memory
    assert SegmentMap().locate(a) is None


def test_fallback_directory(tmp_path, shm_prefix: str) -> None:
    pool = Pool(prefix=shm_prefix, default_size=MiB, directory=str(tmp_path))
    try:
        a = pool.new_array(np.int16, (10,))
        a[:] = 3
        (name,) = pool.segment_names()
        assert os.path.exists(tmp_path / name) and list_segments(shm_prefix) == []
        peer_map = SegmentMap(str(tmp_path))
        tx = TensorTransport(pool, inline_limit=0)
        rx = TensorTransport(Pool(prefix=shm_prefix, directory=str(tmp_path)), peer_map)
        wire = tx.encode("a", a, Peer())
        _, b = rx.decode(wire, Peer())
        assert (b == 3).all() and tx.forwards == 1
        del b
        peer_map.close()
        rx.pool.close()
    finally:
        del a
        pool.close()
    assert list(tmp_path.iterdir()) == []


def test_transport_inline_limit_and_counters(pool: Pool) -> None:
    tx = TensorTransport(pool)
    peer = Peer()
    small = np.zeros(INLINE_LIMIT, np.uint8)
    assert isinstance(tx.encode("s", small, peer)[3], bytes)
    big = np.zeros(INLINE_LIMIT + 1, np.uint8)
    wire = tx.encode("b", big, peer)
    assert isinstance(wire[3], list) and tx.copies == big.nbytes and tx.forwards == 0
    strings = np.array([b"x" * 1000] * 100, dtype=object)
    wire = tx.encode("s", strings, peer)
    assert isinstance(wire[3], list)
    assert tx.forwards == 0 and tx.copies == big.nbytes + 100 * 1004  # a copy, not a forward
    assert peer.outstanding == 2
    _, back = tx.decode(wire, peer)  # BYTES are decoded by copy: released at once
    assert back.tolist() == strings.tolist()
    assert peer.take_owed() == [wire[3][3]]


def test_peer_bookkeeping() -> None:
    peer = Peer("p")
    ids = [peer.export(object()) for _ in range(5)]
    assert len(set(ids)) == 5 and peer.outstanding == 5
    peer.release(ids[:2] + [12345])  # unknown ids are ignored
    assert peer.outstanding == 3
    peer.owe_release(7)
    assert peer.take_owed() == [7] and peer.take_owed() == []
    assert peer.drop_all() == 3 and peer.outstanding == 0 and not peer.alive
    peer.owe_release(8)  # to a dead peer: nothing is owed any more
    assert peer.take_owed() == []


def test_a_segment_removed_behind_the_pools_back_is_replaced(pool: Pool) -> None:
    # rm /dev/shm/*, or systemd's RemoveIPC=yes at the server user's logout: peers open
    # segments by name, so every block carved from one that lost its name would fail to reach
    # them (QA: every 1-16 MiB request failed until a restart, with a traceback).
    from tritonpy.shm import SegmentGoneError

    a = pool.new_array(np.uint8, (4096,))
    a[:] = 5
    (old,) = pool.segment_names()
    assert pool.drop_lost() == []  # nothing lost: nothing dropped
    os.unlink(os.path.join("/dev/shm", old))
    with pytest.raises(SegmentGoneError, match=f"segment {old} does not exist: it was removed"):
        SegmentMap().get(old)  # what a peer meets
    assert pool.drop_lost() == [old]
    b = pool.new_array(np.uint8, (4096,))
    (new,) = pool.segment_names()
    assert new != old
    peer = SegmentMap()
    try:
        assert peer.get(new).size >= 4096  # a peer reaches the new one
    finally:
        peer.close()
    # The old block stays valid, and found, while it lives (a handle is not made into it: a
    # transport copies it out, see test_shm_exchange), and the segment with it.
    assert (a == 5).all()
    seg, _ = pool.segments.locate(a)  # type: ignore[misc]
    assert seg.name == old and seg.gone
    assert pool.take_dropped() == []
    del a, b
    gc.collect()
    assert pool.reap() == [old]  # let go once its last block died: peers are told then
    assert pool.take_dropped() == [old]
    assert pool.drop_lost() == []


def test_a_segment_replaced_under_its_name_is_lost_and_the_stranger_left_alone(
        pool: Pool) -> None:
    pool.new_array(np.uint8, (16,))
    (old,) = pool.segment_names()
    path = os.path.join("/dev/shm", old)
    os.unlink(path)
    with open(path, "wb") as f:  # someone else's file, under our name
        f.write(b"not ours")
    try:
        assert pool.drop_lost() == [old]
        pool.close()  # unlinks its own segments: never the stranger's file
        with open(path, "rb") as f:
            assert f.read() == b"not ours"
    finally:
        os.unlink(path)


def test_a_tensor_in_a_removed_segment_is_sent_by_copy(pool: Pool, shm_prefix: str) -> None:
    # (QA) A handle into a segment whose name was removed cannot be opened by a peer that has
    # not mapped it yet: once the pool knows it lost the name, a tensor still there goes by
    # copy into a segment a peer can open.
    tx = TensorTransport(pool, inline_limit=0)
    a = pool.new_array(np.uint8, (8192,))
    a[:] = 3
    (old,) = pool.segment_names()
    assert tx.encode("a", a, Peer())[3][0] == old  # by handle, into its own segment
    os.unlink(os.path.join("/dev/shm", old))
    assert pool.drop_lost() == [old]
    wire = tx.encode("a", a, Peer())
    assert wire[3][0] != old
    peer_map = SegmentMap()
    rx = TensorTransport(Pool(prefix=shm_prefix), peer_map)
    try:
        _, b = rx.decode(wire, Peer())
        assert (b == 3).all()
        del b
    finally:
        rx.pool.close()
        peer_map.close()
