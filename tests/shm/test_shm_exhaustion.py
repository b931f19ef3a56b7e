"""A full /dev/shm or a pool cap gives ShmExhaustedError on that allocation, never SIGBUS."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from _helpers import MiB

from tritonpy.shm import Pool, ShmExhaustedError

# Runs inside a private mount namespace whose /dev/shm is an 8 MiB tmpfs.
_IN_NAMESPACE = textwrap.dedent("""
    import json, sys
    import numpy as np
    from tritonpy.shm import Pool, ShmExhaustedError
    MiB = 1 << 20
    out = {}
    pool = Pool(prefix=sys.argv[1], default_size=MiB, growth_size=MiB)
    first = pool.new_array(np.uint8, (4096,))
    first[:] = 1
    try:
        pool.new_array(np.uint8, (16 * MiB,))
    except ShmExhaustedError as exc:
        out["big"] = {"asked": exc.asked, "free": exc.free, "msg": str(exc)}
    blocks = []
    try:
        while True:
            b = pool.new_array(np.uint8, (MiB // 2,))
            b[:] = 7  # touch every page: a reservation that lied would SIGBUS here
            blocks.append(b)
    except ShmExhaustedError as exc:
        out["fill"] = {"asked": exc.asked, "free": exc.free, "msg": str(exc),
                       "held": sum(b.nbytes for b in blocks)}
    smalls = []
    for i in range(200):  # small blocks still come out of the segments we have
        s = pool.new_array(np.uint8, (1000,))
        s[:] = i % 256
        smalls.append(s)
    out["smalls_ok"] = all(int(s[0]) == i % 256 for i, s in enumerate(smalls))
    del blocks, smalls
    out["after_free"] = pool.new_array(np.uint8, (MiB // 2,)).nbytes
    # The hook runs once per full /dev/shm: False keeps the error, True tries once more.
    pool.reap(force=True)
    other = Pool(prefix=sys.argv[1] + "o", default_size=MiB, growth_size=MiB)
    held = other.new_array(np.uint8, (6 * MiB,))  # room another process holds, say
    asked = []
    pool.on_exhausted = lambda n: asked.append(n) or False
    try:
        pool.new_array(np.uint8, (5 * MiB,))
    except ShmExhaustedError:
        out["hook_false"] = asked[:]
    def give_back(n):
        global held
        asked.append(n)
        held = None  # its block goes, then the idle segment
        other.reap(force=True)
        return True
    pool.on_exhausted = give_back
    out["hook_true"] = pool.new_array(np.uint8, (5 * MiB,)).nbytes, asked[1:]
    # Room held for good by another process: the first allocation waits for it in vain, the
    # next ones within NO_ROOM_S fail at once (the hook still runs: it gives back what it can).
    import tritonpy.shm.pool as pool_module
    import time
    pool_module.RECLAIM_WAIT_S = 1.0
    pool_module.NO_ROOM_S = 0.5
    pool.reap(force=True)
    other.reap(force=True)
    hog = other.new_array(np.uint8, (6 * MiB,))
    calls = []
    pool.on_exhausted = lambda n: calls.append(n) or True
    spent = []
    for _ in range(3):
        start = time.monotonic()
        try:
            pool.new_array(np.uint8, (5 * MiB,))
        except ShmExhaustedError:
            spent.append(time.monotonic() - start)
    out["no_room"] = spent, len(calls)
    time.sleep(0.6)
    try:  # larger than /dev/shm: fails at once, and starts no such spell
        pool.new_array(np.uint8, (64 * MiB,))
    except ShmExhaustedError:
        pass
    start = time.monotonic()
    try:
        pool.new_array(np.uint8, (5 * MiB,))
    except ShmExhaustedError:
        out["no_room_after"] = time.monotonic() - start
    del hog
    other.close()
    pool.close()
    print(json.dumps(out))
""")


def _namespace_unavailable() -> str | None:
    if shutil.which("unshare") is None:
        return "unshare(1) is not installed"
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=8m tmpfs /dev/shm"],
        capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"cannot mount a private /dev/shm here: {probe.stderr.strip() or probe.returncode}"
    return None


def _in_8_mib_dev_shm(code: str, prefix: str) -> dict:
    """What ``code`` printed last (JSON), run with ``prefix`` in a private 8 MiB /dev/shm;
    skips where no such mount can be made."""
    reason = _namespace_unavailable()
    if reason:
        pytest.skip(reason)
    script = ("mount -t tmpfs -o size=8m tmpfs /dev/shm && "
              'exec "$0" -c "$1" "$2"')
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", script, sys.executable, code, prefix],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"rc={proc.returncode} (SIGBUS is -7): {proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_full_dev_shm_raises_not_sigbus(shm_prefix: str) -> None:
    out = _in_8_mib_dev_shm(_IN_NAMESPACE, shm_prefix)
    big = out["big"]
    assert big["asked"] == 16 * MiB and 0 < big["free"] <= 8 * MiB
    assert f"asked for {16 * MiB} bytes" in big["msg"] and f"{big['free']} bytes free" in big["msg"]
    assert "raise the limit (e.g. docker --shm-size) or send smaller tensors" in big["msg"]
    fill = out["fill"]  # the last segments tried were smaller than a growth step (see below)
    assert fill["asked"] == MiB // 2 and fill["free"] < MiB // 2
    assert f"{fill['free']} bytes free" in fill["msg"]
    assert 6 * MiB <= fill["held"] <= 8 * MiB
    assert out["smalls_ok"] and out["after_free"] == MiB // 2
    assert out["hook_false"] == [5 * MiB]
    assert out["hook_true"] == [5 * MiB, [5 * MiB]]
    spent, hooked = out["no_room"]
    assert len(spent) == 3 and hooked == 3
    assert spent[0] >= 1.0 and spent[1] < 0.5 and spent[2] < 0.5, spent
    assert out["no_room_after"] >= 1.0  # past NO_ROOM_S it waits again


# In an 8 MiB /dev/shm with 6 MiB held by another process: a block that needs a new segment
# of a pool whose growth step (4 MiB) no longer fits.
_SMALLER_SEGMENT = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    from tritonpy.shm import Pool, ShmExhaustedError
    MiB = 1 << 20
    other = Pool(prefix=sys.argv[1] + "o", default_size=MiB, growth_size=MiB)
    held = other.new_array(np.uint8, (6 * MiB,))
    held[:] = 1
    pool = Pool(prefix=sys.argv[1], default_size=4 * MiB, growth_size=4 * MiB)
    out = {}
    try:
        block = pool.new_array(np.uint8, (MiB,))
        block[:] = 7  # every page: a segment that lied about its room would SIGBUS here
        out["served"] = int(block.sum()) == 7 * MiB
        out["mapped"] = pool.usage()["mapped_bytes"]
    except ShmExhaustedError as exc:
        out["refused"] = str(exc)
    pool.close()
    other.close()
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_a_block_is_served_from_a_smaller_segment_when_a_growth_step_does_not_fit(
        shm_prefix: str) -> None:
    # A 1 MB tensor was refused with 12 MiB free, because a new segment is 16 MiB.
    out = _in_8_mib_dev_shm(_SMALLER_SEGMENT, shm_prefix)
    assert out.get("served") and MiB <= out["mapped"] <= 2 * MiB, out  # a half, or less


# After a 5 MiB block found no room even once the others were asked (the pool fails such
# blocks at once for NO_ROOM_S), a 2 MiB one whose room comes back 50 ms after the ask.
_SMALLER_AFTER_NO_ROOM = textwrap.dedent("""
    import json, sys, threading, time
    import numpy as np
    import tritonpy.shm.pool as pool_module
    from tritonpy.shm import Pool, ShmExhaustedError
    MiB = 1 << 20
    pool_module.RECLAIM_WAIT_S = 1.0
    other = Pool(prefix=sys.argv[1] + "o", default_size=MiB, growth_size=MiB)
    hog = [other.new_array(np.uint8, (13 * MiB // 2,))]
    pool = Pool(prefix=sys.argv[1], default_size=MiB, growth_size=MiB,
                on_exhausted=lambda n: True)
    out = {}
    try:
        pool.new_array(np.uint8, (5 * MiB,))
    except ShmExhaustedError:
        out["big"] = "refused"

    def give_back(n):
        def later():
            hog.clear()
            other.reap(force=True)
        threading.Timer(0.05, later).start()
        return True

    pool.on_exhausted = give_back
    block = None
    try:
        block = pool.new_array(np.uint8, (2 * MiB,))
        block[:] = 1
        out["smaller"] = "served"
    except ShmExhaustedError as exc:
        out["smaller"] = "refused: " + str(exc)
    del block
    pool.close()
    other.close()
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_a_smaller_block_waits_for_room_after_a_bigger_one_found_none(shm_prefix: str) -> None:
    # It was refused at once ("0 bytes free") for a second after the bigger one, though the
    # room it needed came back a moment after its own ask.
    out = _in_8_mib_dev_shm(_SMALLER_AFTER_NO_ROOM, shm_prefix)
    assert out == {"big": "refused", "smaller": "served"}, out


# A pool in a fallback directory (shm-fallback-directory) on a full 4 MiB filesystem.
_FULL_FALLBACK = textwrap.dedent("""
    import json, os, subprocess, sys, tempfile
    import numpy as np
    from tritonpy.shm import Pool, ShmExhaustedError
    MiB = 1 << 20
    where = tempfile.mkdtemp()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", where], check=True)
    pool = Pool(prefix=sys.argv[1], default_size=MiB, growth_size=MiB, directory=where)
    try:
        pool.new_array(np.uint8, (8 * MiB,))
    except ShmExhaustedError as exc:
        print(json.dumps({"where": where, "msg": str(exc)}))
    pool.close()
    subprocess.run(["umount", where], check=True)
    os.rmdir(where)
""")


@pytest.mark.slow
def test_a_full_fallback_directory_is_named_without_the_docker_hint(shm_prefix: str) -> None:
    # The hint was "e.g. docker --shm-size" wherever the pool's files were.
    out = _in_8_mib_dev_shm(_FULL_FALLBACK, shm_prefix)
    assert f"asked for {8 * MiB} bytes in {out['where']}" in out["msg"]
    assert f"free space on the filesystem of {out['where']} or send smaller tensors" in out["msg"]
    assert "docker" not in out["msg"]


def test_pool_cap_raises_the_same_error(shm_prefix: str) -> None:
    asked: list[int] = []  # the reclaim hook is for a full /dev/shm, not for the cap
    pool = Pool(prefix=shm_prefix, default_size=MiB, growth_size=MiB, cap=4 * MiB,
                on_exhausted=lambda n: asked.append(n) or True)
    try:
        blocks = [pool.new_array(np.uint8, (MiB,)) for _ in range(4)]
        with pytest.raises(ShmExhaustedError) as info:
            pool.new_array(np.uint8, (1,))
        assert asked == []
        assert info.value.asked == MiB and info.value.free == 0
        assert "pool cap" in str(info.value) and f"asked for {MiB} bytes" in str(info.value)
        assert "raise the pool cap (backend config shm-total-byte-cap)" in str(info.value)
        assert f"asked for {MiB} bytes in the pool, 0 bytes free" in str(info.value)
        assert "docker" not in str(info.value)
        with pytest.raises(MemoryError):  # callers that only know builtins catch it too
            pool.new_array(np.uint8, (8 * MiB,))
        assert pool.usage()["mapped_bytes"] == 4 * MiB

        del blocks[1:]  # three segments go idle: the cap reaps them for a bigger block
        big = pool.new_array(np.uint8, (3 * MiB,))
        assert pool.usage()["mapped_bytes"] == 4 * MiB
        assert len(pool.take_dropped()) == 3
        with pytest.raises(ShmExhaustedError) as info:
            pool.new_array(np.uint8, (2 * MiB,))
        assert info.value.asked == 2 * MiB and info.value.free == 0
        del big, blocks
        small = pool.new_array(np.uint8, (100,))  # and it goes on
        assert small.nbytes == 100
    finally:
        pool.close()


def test_a_cap_under_the_segment_size_still_serves_what_fits(shm_prefix: str) -> None:
    # The default and growth sizes (16 MiB) exceed the cap (6 MiB): segments shrink to what
    # the cap leaves instead of refusing every allocation (a server with a small cap and the
    # default sizes used to fail at start).
    pool = Pool(prefix=shm_prefix, default_size=16 * MiB, growth_size=16 * MiB, cap=6 * MiB)
    try:
        first = pool.new_array(np.uint8, (MiB,))
        assert pool.usage()["mapped_bytes"] == 6 * MiB
        rest = pool.new_array(np.uint8, (5 * MiB,))
        with pytest.raises(ShmExhaustedError, match="pool cap"):
            pool.new_array(np.uint8, (MiB,))
        del first, rest
        again = pool.new_array(np.uint8, (6 * MiB,))
        assert again.nbytes == 6 * MiB
        del again
        with pytest.raises(ShmExhaustedError, match="pool cap"):
            pool.new_array(np.uint8, (7 * MiB,))
    finally:
        pool.close()
