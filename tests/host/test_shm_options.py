"""Shared-memory options that cannot work are refused at once, with a line naming them, and a
server killed while it reserves its first segment leaves nothing behind (found by QA: a
default size larger than /dev/shm was halved until it fitted, taking 12.5 GiB of it slowly; a
SIGKILL meanwhile left that segment; a missing fallback directory and a negative cap failed
with a traceback or a misleading "exhausted")."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import tritonpy
from _models import wait_until, write_model
from tritonpy.shm import list_segments
from tritonpy.shm.segment import PAGE, total_bytes

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("cap", ["-1", "1024"])
def test_a_negative_or_sub_page_pool_cap_is_refused(tmp_path: Path, cap: str) -> None:
    # (a cap of 1024 failed the start with a traceback: no first segment fits under it)
    with pytest.raises(tritonpy.InvalidArgumentError,
                       match=rf"shm-total-byte-cap must be 0 \(no cap\) or at least {PAGE} bytes "
                             rf"\(a page\), got {cap}"):
        tritonpy.Server(str(tmp_path), backend_config={"shm-total-byte-cap": cap})


@pytest.mark.parametrize("key", ["shm-default-byte-size", "shm-growth-byte-size"])
def test_a_segment_size_larger_than_dev_shm_is_refused_at_start(tmp_path: Path,
                                                                 shm_prefix: str,
                                                                 key: str) -> None:
    write_model(tmp_path, "double")
    size = total_bytes(None) + (1 << 20)
    server = tritonpy.Server(str(tmp_path), backend_config={
        "shm-region-prefix-name": shm_prefix, key: str(size)})
    t0 = time.monotonic()
    with pytest.raises(tritonpy.InvalidArgumentError,
                       match=rf"{key} \({size} bytes\) is larger than all of /dev/shm"):
        server.start()
    assert time.monotonic() - t0 < 5
    assert list_segments(shm_prefix) == []


def test_a_missing_fallback_directory_is_refused_at_start(tmp_path: Path,
                                                          shm_prefix: str) -> None:
    server = tritonpy.Server(str(tmp_path), backend_config={
        "shm-region-prefix-name": shm_prefix,
        "shm-fallback-directory": str(tmp_path / "nowhere")})
    with pytest.raises(tritonpy.InvalidArgumentError,
                       match="shm-fallback-directory '.*nowhere' is not a directory"):
        server.start()


def test_serve_says_so_in_one_line(tmp_path: Path, shm_prefix: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tritonpy", "serve", "--model-repository", str(tmp_path),
         "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", "--backend-config",
         f"python,shm-region-prefix-name={shm_prefix}",
         "--backend-config", f"python,shm-fallback-directory={tmp_path / 'nowhere'}"],
        capture_output=True, text=True, timeout=50)
    assert proc.returncode == 1
    assert "is not a directory" in proc.stderr and "Traceback" not in proc.stderr


_KILLED_WHILE_RESERVING = textwrap.dedent("""
    import sys, tritonpy
    tritonpy.Server(sys.argv[1], backend_config={
        "shm-region-prefix-name": sys.argv[2],
        "shm-default-byte-size": str(1 << 30)}).start()
""")


def test_a_server_killed_while_it_reserves_its_first_segment_leaves_nothing(
        tmp_path: Path, shm_prefix: str) -> None:
    # 1 GiB takes a moment to reserve (fallocate, then every page mapped): the host is killed
    # once the segment is there, before its start has returned.
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WHILE_RESERVING, str(tmp_path),
                             shm_prefix], start_new_session=True)
    try:
        deadline = time.monotonic() + 40
        while not list_segments(shm_prefix):
            assert proc.poll() is None and time.monotonic() < deadline, proc.poll()
            time.sleep(0.002)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    wait_until(lambda: list_segments(shm_prefix) == [], 10, "the janitor to remove it")


_HALVED = textwrap.dedent("""
    import logging, os, sys, tritonpy
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
    with open("/dev/shm/filler", "wb") as f:  # another tenant's 40 MiB
        os.posix_fallocate(f.fileno(), 0, 40 << 20)
    server = tritonpy.Server(sys.argv[1], backend_config={
        "shm-region-prefix-name": sys.argv[2], "shm-default-byte-size": str(48 << 20)})
    server.start()
    server.stop()
""")


def test_a_default_size_larger_than_the_room_left_is_halved_and_said(
        tmp_path: Path, shm_prefix: str) -> None:
    # (QA) In a 64 MiB /dev/shm with 40 MiB taken, a 48 MiB default started with a 24 MiB
    # first segment and said nothing (as documented: it serves what fits; Triton refuses).
    from tritonpy.stress import private_shm_unavailable

    reason = private_shm_unavailable(64 << 20)
    if reason:
        pytest.skip(f"needs a private /dev/shm: {reason}")
    write_model(tmp_path, "double")
    script = 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$0" -c "$1" "$2" "$3"'
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script, sys.executable, _HALVED,
                           str(tmp_path), shm_prefix], capture_output=True, text=True,
                          timeout=50)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import re

    said = re.search(r"the first shared-memory segment is (\d+) bytes, not "
                     r"shm-default-byte-size 50331648: /dev/shm has too little room free",
                     proc.stdout)
    assert said and int(said.group(1)) <= 24 << 20, proc.stdout


def test_a_cap_below_the_default_size_is_not_taken_for_a_lack_of_room(
        tmp_path: Path, shm_prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    caplog.set_level(logging.WARNING, logger="tritonpy")
    write_model(tmp_path, "double")
    server = tritonpy.Server(str(tmp_path), backend_config={
        "shm-region-prefix-name": shm_prefix, "shm-total-byte-cap": str(8 << 20)})
    server.start()
    try:
        assert server.pool.usage()["mapped_bytes"] == 8 << 20  # the cap, not the default
        assert not any("the first shared-memory segment" in r.getMessage()
                       for r in caplog.records)
    finally:
        server.stop()
