"""A peer killed with SIGKILL mid-stream, and the orphan sweep."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from _helpers import MiB, wait_for

from tritonpy.shm import Cmd, list_segments, sweep_orphans
from tritonpy.shm.sweep import owner_pid

_MAKE_SEGMENT = textwrap.dedent("""
    import os, sys
    from tritonpy.shm import Pool
    pool = Pool(prefix=sys.argv[1], default_size=1 << 20)
    block = pool.new_array("uint8", (10,))
    print(pool.segment_names()[0], flush=True)
    if sys.argv[2] == "exit":
        os._exit(0)  # no cleanup: leaves an orphan
    sys.stdin.read()  # stay alive until told
""")


def _segment_maker(prefix: str, mode: str) -> tuple[subprocess.Popen, str]:
    """A process that makes one segment of ``prefix``, then exits at once or on stdin EOF."""
    proc = subprocess.Popen([sys.executable, "-c", _MAKE_SEGMENT, prefix, mode],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    try:
        return proc, proc.stdout.readline().strip()
    finally:
        proc.stdout.close()


def _finish(proc: subprocess.Popen | None) -> None:
    if proc is None:
        return
    if proc.stdin is not None:
        proc.stdin.close()
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def test_peer_killed_mid_stream(shm_child, shm_prefix: str) -> None:
    child = shm_child()
    base = child.used()
    # the child holds some of our blocks ...
    child.send_tensors("hold", {f"h{i}": np.full(MiB, i, np.uint8) for i in range(3)})
    assert child.channel.peer.outstanding == 3 and child.used() >= base + 3 * MiB
    # ... and streams its own blocks at us until it is killed
    child.channel.send(Cmd.EXECUTE, 999, {"op": "stream", "nbytes": 128 * 1024, "cid": 999})
    kept = []
    for _ in range(20):
        msg = child.next_frame(timeout=10)
        assert msg[0] == Cmd.RESPONSE_SEND
        arr = child.decode(msg[2]["outputs"])["s"]
        assert (arr == msg[2]["i"] % 251).all()
        if len(kept) < 5:
            kept.append((msg[2]["i"], arr))
    child_segments = set(list_segments(shm_prefix)) - set(child.pool.segment_names())
    assert child_segments, "the child made no segments"

    killed_at = time.monotonic()
    child.kill()
    # the reader drains what was already queued, then recv() returns None
    while True:
        msg = child.next_frame(timeout=5)
        if msg is None:
            break
    assert child.closed_at is not None
    assert child.closed_at - killed_at < 1.0, "peer death was not noticed promptly"

    # What the dead peer held is ours again.
    assert child.channel.peer.drop_all() == 3
    assert child.used() == base
    # Its segments are orphans now (it is a zombie until we wait: dead_pids says it is gone).
    removed = sweep_orphans(shm_prefix, dead_pids={child.pid})
    assert set(removed) >= child_segments
    assert all(owner_pid(name, shm_prefix) == child.pid for name in removed)
    assert set(list_segments(shm_prefix)) == set(child.pool.segment_names())
    # Views we kept of its blocks stay valid: the mapping outlives the name.
    for i, arr in kept:
        assert (arr == i % 251).all()
    del kept, arr
    child.proc.wait(timeout=5)


def test_sweep_removes_only_orphans(shm_prefix: str) -> None:
    from tritonpy.shm import Pool

    mine = Pool(prefix=shm_prefix, default_size=MiB)
    live_proc = dead_proc = None
    try:
        keep = mine.new_array(np.uint8, (10,))
        live_proc, live_seg = _segment_maker(shm_prefix, "stay")
        dead_proc, dead_seg = _segment_maker(shm_prefix, "exit")
        dead_proc.wait(timeout=10)
        assert set(list_segments(shm_prefix)) == {*mine.segment_names(), live_seg, dead_seg}

        assert sweep_orphans(shm_prefix) == [dead_seg]
        assert set(list_segments(shm_prefix)) == {*mine.segment_names(), live_seg}

        live_proc.stdin.close()  # it exits without cleaning up, as a crash would
        live_proc.wait(timeout=10)
        assert sweep_orphans(shm_prefix) == [live_seg]
        assert list_segments(shm_prefix) == mine.segment_names()
        del keep
    finally:
        _finish(live_proc)
        _finish(dead_proc)
        mine.close()
        sweep_orphans(shm_prefix)


def test_sweep_treats_a_zombie_as_gone(shm_prefix: str) -> None:
    proc, seg = _segment_maker(shm_prefix, "exit")
    try:
        # not reaped yet: the pid still exists, as a zombie
        assert wait_for(lambda: _is_zombie(proc.pid), timeout=10)
        assert sweep_orphans(shm_prefix) == [seg]
    finally:
        _finish(proc)
        sweep_orphans(shm_prefix)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


@pytest.mark.parametrize("name", ["tpytx_notapid", "unrelated_123x1_0"])
def test_sweep_ignores_names_it_cannot_read(shm_prefix: str, name: str) -> None:
    path = f"/dev/shm/{shm_prefix}{name}"
    open(path, "wb").close()
    try:
        assert sweep_orphans(shm_prefix) == []
        assert os.path.exists(path)
    finally:
        os.unlink(path)
