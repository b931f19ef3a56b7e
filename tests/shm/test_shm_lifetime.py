"""Block lifetime across processes: freed exactly when the last view dies, forwarding, RELEASE
batching, and DROPPED segments."""
from __future__ import annotations

import os
import time

import numpy as np
from _helpers import MiB, digest, mapped_segments, wait_for

from tritonpy.shm import Cmd


def test_block_freed_only_when_last_view_dies_in_receiver(shm_child) -> None:
    child = shm_child()
    base = child.used()
    kept = np.arange(MiB // 8, dtype=np.float64)
    reply = child.send_tensors("hold", {"kept": kept}, key="kept", slice=True)
    # the child keeps only a strided slice of the view it got: the block must stay
    kept_digest = reply["digests"][0]
    assert kept_digest == digest(kept[1:][::2])
    held = child.used()
    assert held >= base + kept.nbytes
    assert child.channel.peer.outstanding == 1

    # Other blocks come and go meanwhile, reusing the freed space again and again.
    offsets = []
    for i in range(6):
        other = np.full(MiB // 8, float(i))
        wire = child.transport.encode("other", other, child.channel.peer)
        offsets.append(wire[3][1])
        reply = child.call("echo", inputs=[wire])
        assert reply["digests"]["other"] == digest(other)
        assert wait_for(lambda: child.used() == held), "the echoed block was not given back"
        # the kept view is still valid and unchanged in the child
        assert child.call("check", key="kept")["digests"] == [kept_digest]
    assert len(set(offsets)) == 1, f"freed space was not reused: offsets {offsets}"

    time.sleep(0.2)  # no release can be in flight: the child still holds its slice
    assert child.used() == held and child.channel.peer.outstanding == 1

    child.call("drop", key="kept")
    assert wait_for(lambda: child.used() == base), "the block was not freed after the release"
    assert child.channel.peer.outstanding == 0


def test_view_kept_by_receiver_stays_valid_while_sender_reuses_space(shm_child) -> None:
    """Mirror image: the parent keeps one view of a child block while the child reuses."""
    child = shm_child()
    specs = [["INT32", 256 * 1024]] * 4
    got = child.decode(child.call("make", specs=specs, seed=1)["outputs"])
    where = {n: child.transport.segments.locate(a)[1] for n, a in got.items()}
    kept = got["t2"][10:-10]  # a slice: the base view must live on through it
    expected = kept.copy()
    del got
    assert wait_for(lambda: child.call("stats")["usage"]["used_bytes"] == 256 * 1024)

    again = child.decode(child.call("make", specs=specs, seed=7)["outputs"])
    new_where = {child.transport.segments.locate(a)[1] for a in again.values()}
    assert {where["t0"], where["t1"], where["t3"]} <= new_where  # freed space reused
    assert where["t2"] not in new_where  # the kept block was not handed out again
    assert np.array_equal(kept, expected)
    del again
    assert wait_for(lambda: child.call("stats")["usage"]["used_bytes"] == 256 * 1024)
    del kept
    assert wait_for(lambda: child.call("stats")["usage"]["used_bytes"] == 0)


def test_array_in_shm_is_forwarded_not_copied_and_chain_releases(shm_child) -> None:
    """A -> B -> A: a pool array crosses twice without a copy; releases chain back."""
    child = shm_child()
    base = child.used()
    x = child.pool.new_array(np.int64, (MiB // 8,))
    x[:] = np.arange(x.size)
    reply = child.send_tensors("echo", {"x": x}, mode="forward")
    assert child.transport.copies == 0 and child.transport.forwards == 1
    stats = child.call("stats")
    assert stats["forwards"] == 1 and stats["copies"] == 0  # B forwarded A's block back
    w = child.decode(reply["outputs"])["x"]
    # the round trip came back to the very same memory
    assert w.__array_interface__["data"][0] == x.__array_interface__["data"][0]
    assert np.array_equal(w, np.arange(x.size))

    del x  # A's own reference: B's view (exported back to us) still pins the block
    time.sleep(0.2)
    assert child.used() == base + MiB
    del w  # our view of B's forward dies -> B releases its view -> B releases ours
    assert wait_for(lambda: child.used() == base)
    assert child.call("stats")["outstanding"] == 0


def test_forwarding_a_received_view_to_its_owner(shm_child) -> None:
    """A view received from B, sent back to B, is a handle into B's own segment."""
    child = shm_child()
    v = child.decode(child.call("make", specs=[["FP32", MiB]])["outputs"])["t0"]
    before = child.transport.copies
    reply = child.send_tensors("echo", {"v": v}, mode="forward")
    assert child.transport.copies == before and child.transport.forwards == 1
    assert reply["digests"]["v"] == digest(v)
    back = child.decode(reply["outputs"])["v"]
    assert back.__array_interface__["data"][0] == v.__array_interface__["data"][0]
    del v, back
    assert wait_for(lambda: child.call("stats")["usage"]["used_bytes"] == 0)
    assert wait_for(lambda: child.channel.peer.outstanding == 0)


def test_releases_are_batched(shm_child) -> None:
    child = shm_child(inline_limit=0)  # every tensor by handle, cheaply
    n = 300
    arrays = {f"a{i}": np.full(16, i, dtype=np.int32) for i in range(n)}
    child.send_tensors("hold", arrays, key="many")
    assert child.channel.peer.outstanding == n
    frames_before = child.channel.frames_received
    child.call("drop", key="many")
    assert wait_for(lambda: child.channel.peer.outstanding == 0)
    assert child.used() == 0
    # RELEASE frames of their own, or none when the reply to "drop" carried them along
    release_frames = child.channel.frames_received - frames_before - 1  # minus the reply
    assert release_frames <= 10, f"{n} releases took {release_frames} frames"


def test_idle_segment_dropped_and_unmapped_by_peer(shm_child, shm_prefix: str) -> None:
    child = shm_child(pool={"default_size": MiB, "growth_size": MiB, "idle_seconds": 0.1})
    small = child.pool.new_array(np.uint8, (100,))  # keeps the first segment busy
    child.send_tensors("echo", {"big": np.ones(3 * MiB, np.uint8)})  # a segment of its own
    names = child.pool.segment_names()
    assert len(names) == 2
    big_seg = names[1]
    assert big_seg in mapped_segments(child.pid, shm_prefix)  # the child mapped it
    assert wait_for(lambda: child.used() == 128)

    time.sleep(0.15)
    assert child.pool.reap() == [big_seg]
    assert not os.path.exists(f"/dev/shm/{big_seg}")
    assert big_seg in mapped_segments(child.pid, shm_prefix)  # unlinked, still mapped there

    child.channel.send(Cmd.DROPPED, 0, child.pool.take_dropped())
    stats = child.call("stats")  # frames are handled in order: DROPPED came first
    assert big_seg not in stats["segments"]
    assert big_seg not in mapped_segments(child.pid, shm_prefix)
    assert set(stats["owned"]) <= set(stats["segments"])  # its own are untouched
    del small


def test_dropped_never_unmaps_the_receivers_own_segment(shm_child) -> None:
    child = shm_child()
    v = child.decode(child.call("make", specs=[["UINT8", MiB]])["outputs"])["t0"]
    own = child.call("stats")["owned"]
    del v
    child.channel.send(Cmd.DROPPED, 0, own + ["never-existed", 42])
    stats = child.call("stats")
    assert set(own) <= set(stats["segments"])
    # and the child's pool still works on them
    again = child.decode(child.call("make", specs=[["UINT8", MiB]])["outputs"])["t0"]
    assert again.nbytes == MiB
