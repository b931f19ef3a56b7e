"""The janitor (``shm/janitor.py``) each server starts: once its server is gone without a
clean stop, it unlinks the segments of the prefix whose creators are dead; a live process's
segments of the same prefix stay. A clean stop ends it at once. Real processes, real /dev/shm.
"""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import textwrap
import time

import posix_ipc
import psutil
import pytest

from _models import segments, wait_until

pytestmark = pytest.mark.timeout(60)

# A stand-in server: starts a janitor, makes a segment of its own, says so, then sleeps.
SERVER = textwrap.dedent("""
    import os, sys, time
    import posix_ipc
    from tritonpy.shm import janitor
    prefix = sys.argv[1]
    proc = janitor.start(prefix, None)
    posix_ipc.SharedMemory(f"/{prefix}{os.getpid()}x{os.urandom(4).hex()}_0",
                           posix_ipc.O_CREX, size=4096).close_fd()
    print(proc.pid, flush=True)
    if sys.argv[2] == "clean":
        janitor.stop(proc)
        print("stopped", flush=True)
    time.sleep(60)
""")


def _segment(prefix: str, pid: int) -> str:
    name = f"{prefix}{pid}x{secrets.token_hex(4)}_0"
    posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, size=4096).close_fd()
    return name


@pytest.fixture
def prefix():
    p = f"tpyjan{secrets.token_hex(3)}_"
    yield p
    for name in segments(p):
        posix_ipc.unlink_shared_memory("/" + name)


def test_a_killed_servers_segments_go_and_a_live_ones_stay(prefix):
    mine = _segment(prefix, os.getpid())  # a live server of the same prefix
    server = subprocess.Popen([sys.executable, "-c", SERVER, prefix, "killed"],
                              stdout=subprocess.PIPE, text=True)
    try:
        janitor_pid = int(server.stdout.readline())
        theirs = [n for n in segments(prefix) if n != mine]
        assert len(theirs) == 1
        time.sleep(0.3)
        assert psutil.pid_exists(janitor_pid) and theirs[0] in segments(prefix)  # it waits
        os.kill(server.pid, signal.SIGKILL)
        server.wait(10)
        wait_until(lambda: segments(prefix) == [mine], 10, "the dead server's segment to go")
        wait_until(lambda: not psutil.pid_exists(janitor_pid)
                   or psutil.Process(janitor_pid).status() == psutil.STATUS_ZOMBIE,
                   10, "the janitor to exit")
    finally:
        if server.poll() is None:
            server.kill()
        server.wait()
        server.stdout.close()


def test_a_clean_stop_ends_the_janitor_at_once(prefix):
    server = subprocess.Popen([sys.executable, "-c", SERVER, prefix, "clean"],
                              stdout=subprocess.PIPE, text=True)
    try:
        janitor_pid = int(server.stdout.readline())
        started = time.monotonic()
        assert server.stdout.readline().strip() == "stopped"
        assert time.monotonic() - started < 2
        assert not psutil.pid_exists(janitor_pid) or psutil.Process(
            janitor_pid).status() == psutil.STATUS_ZOMBIE
        # Its server still runs: its segment is not the janitor's to take.
        assert len(segments(prefix)) == 1
    finally:
        server.kill()
        server.wait()
        server.stdout.close()
