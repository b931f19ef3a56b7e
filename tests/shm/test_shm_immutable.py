"""Immutable handles on the real substrate: a tensor's kept shm copy, the host's read-only
views of it, a stub's copy-on-write views, and the page-map test that forwards an unwritten
view by handle and copies a written one; and which releases go to the owner at once."""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from tritonpy.shm import Peer, Pool, ProtocolError, SegmentMap, TensorTransport
from tritonpy.shm.transport import IMMUTABLE, KEEP_MIN_BYTES, URGENT_RELEASE_BYTES

N = KEEP_MIN_BYTES + 100


class Owner:
    """What the transport needs of a stub's pb_utils.Tensor: the ``_shm`` slot."""

    _shm = None


@pytest.fixture
def pools(shm_prefix: str) -> Iterator[tuple[Pool, Pool]]:
    # One map of every segment, as in the host: each side sees the other's blocks.
    seen = SegmentMap()
    a, b = Pool(prefix=shm_prefix + "a", segments=seen), Pool(prefix=shm_prefix + "b", segments=seen)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def test_owner_keeps_the_copy_of_its_second_send(pools) -> None:
    stub = TensorTransport(pools[0])
    peer, owner = Peer(), Owner()
    data = np.arange(N, dtype=np.uint8)
    first = stub.encode("x", data, peer, owner)
    assert len(first[3]) == 4 and owner._shm is True  # first send: an ordinary block
    second = stub.encode("x", data, peer, owner)
    assert second[3][4] == IMMUTABLE and isinstance(owner._shm, np.ndarray)
    assert stub.copies == 2 * N and stub.reuses == 0
    for _ in range(3):
        again = stub.encode("x", data, peer, owner)
        assert again[3][:2] == second[3][:2] and again[3][4] == IMMUTABLE
    assert stub.copies == 2 * N and stub.reuses == 3
    small = Owner()
    for _ in range(3):
        wire = stub.encode("s", np.zeros(KEEP_MIN_BYTES - 1, np.uint8), peer, small)
    assert len(wire[3]) == 4 and small._shm is None


def test_host_reads_an_immutable_block_read_only_and_forwards_it_as_such(pools) -> None:
    stub = TensorTransport(pools[0])
    host = TensorTransport(pools[1], private_views=False)
    owner = Owner()
    data = np.arange(N, dtype=np.uint8)
    for _ in range(2):
        wire = stub.encode("x", data, Peer(), owner)
    _, view = host.decode(wire, Peer())
    assert not view.flags.writeable and np.shares_memory(view, owner._shm)
    with pytest.raises(ValueError):
        view[0] = 1
    onward = host.encode("x", view, Peer())
    assert onward[3][4] == IMMUTABLE and host.forwards == 1 and host.copies == 0


def test_a_stub_view_is_private_and_goes_on_by_handle_until_written(pools) -> None:
    sender = TensorTransport(pools[0])
    receiver = TensorTransport(pools[1])
    owner = Owner()
    data = np.arange(N, dtype=np.uint8)
    for _ in range(2):
        wire = sender.encode("x", data, Peer(), owner)
    _, view = receiver.decode(wire, Peer())
    assert view.flags.writeable and not np.shares_memory(view, owner._shm)
    np.testing.assert_array_equal(view, data)
    read = int(view.astype(np.uint64).sum())  # reading maps the pages: still unwritten
    assert read == int(data.astype(np.uint64).sum())
    onward = receiver.encode("y", view, Peer())
    assert onward[3][:2] == wire[3][:2] and onward[3][4] == IMMUTABLE
    assert receiver.forwards == 1 and receiver.copies == 0
    tail = view[N // 2:]
    tail_wire = receiver.encode("t", tail, Peer())  # a part of it, at its offset
    assert tail_wire[3][1] == wire[3][1] + N // 2 and receiver.copies == 0

    view[N - 1] ^= 0xFF  # one byte on the last page
    np.testing.assert_array_equal(owner._shm, data)  # the kept copy is untouched
    written = receiver.encode("z", view, Peer())
    assert len(written[3]) == 4 and receiver.copies == N  # copied, with the change
    assert receiver.encode("h", view[:64 * 1024], Peer())[3][4] == IMMUTABLE  # clean pages
    _, again = receiver.decode(wire, Peer())  # a new view does not see the old one's write
    np.testing.assert_array_equal(again, data)
    del view, tail, again
    assert len(receiver.private) == 0


def test_without_a_page_map_a_private_view_is_copied(pools) -> None:
    sender = TensorTransport(pools[0])
    receiver = TensorTransport(pools[1])
    owner = Owner()
    for _ in range(2):
        wire = sender.encode("x", np.ones(N, np.uint8), Peer(), owner)
    _, view = receiver.decode(wire, Peer())
    receiver.private.enabled = False
    assert len(receiver.encode("y", view, Peer())[3]) == 4 and receiver.copies == N


def test_views_release_the_block_hop_by_hop(pools) -> None:
    sender = TensorTransport(pools[0])
    receiver = TensorTransport(pools[1])
    owner, peer = Owner(), Peer()
    for _ in range(2):
        wire = sender.encode("x", np.ones(N, np.uint8), peer, owner)
    eid = wire[3][3]
    back = Peer()
    _, view = receiver.decode(wire, back)
    del view
    assert back.take_owed() == [eid]  # not urgent: the owner keeps the block anyway


@pytest.mark.parametrize("sizes, urgent", [
    ([URGENT_RELEASE_BYTES], [True]),  # the owner may need the room for its next big tensor
    ([1 << 20], [False]),  # waits for a frame going to the owner anyway
    ([3 << 20, 3 << 20], [False, True]),  # what is owed adds up to it: all of it goes at once
    ([3 << 20, 3 << 20, 3 << 20], [False, True, False]),  # and counting starts again
])
def test_releases_go_at_once_once_they_add_up_to_a_big_block(pools, sizes: list[int],
                                                             urgent: list[bool]) -> None:
    sender, receiver = TensorTransport(pools[0]), TensorTransport(pools[1])
    wires = [sender.encode("x", np.ones(n, np.uint8), Peer()) for n in sizes]
    back = Peer()
    views = [receiver.decode(w, back)[1] for w in wires]
    assert not back.urgent and not back.lazy
    for wire, at_once in zip(wires, urgent):
        views.pop(0)  # the last view of that block dies: its release is owed
        assert (wire[3][3] in back.urgent) is at_once
        if at_once:  # the flusher takes them all
            assert back.take_owed() and not back.urgent and not back.lazy
    assert list(back.lazy) == ([wires[-1][3][3]] if not urgent[-1] else [])


@pytest.mark.parametrize("handle", [
    ["seg", 0, 10, 1, 2],  # an unknown flag
    ["seg", 0, 10, 1, 1, 1],  # too long
])
def test_malformed_immutable_handles_are_refused(pools, handle) -> None:
    tr = TensorTransport(pools[0])
    with pytest.raises(ProtocolError, match="bad data field"):
        tr.decode(["x", "UINT8", [10], handle], Peer())


def test_private_views_of_segments_in_a_fallback_directory(tmp_path, shm_prefix: str) -> None:
    seen = SegmentMap(str(tmp_path))
    a = Pool(prefix=shm_prefix + "a", directory=str(tmp_path), segments=seen)
    b = Pool(prefix=shm_prefix + "b", directory=str(tmp_path), segments=seen)
    try:
        sender, receiver = TensorTransport(a), TensorTransport(b)
        owner = Owner()
        data = np.arange(N, dtype=np.uint8)
        for _ in range(2):
            wire = sender.encode("x", data, Peer(), owner)
        _, view = receiver.decode(wire, Peer())
        np.testing.assert_array_equal(view, data)
        assert receiver.encode("y", view, Peer())[3][4] == IMMUTABLE
        view += 1
        np.testing.assert_array_equal(owner._shm, data)
        assert len(receiver.encode("z", view, Peer())[3]) == 4
        del view, owner
    finally:
        a.close()
        b.close()
    assert list(tmp_path.iterdir()) == []
