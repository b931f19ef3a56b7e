"""A server's janitor stopped by a signal (SIGSTOP, a debugger) does not hold up the server's
stop, and still does its last sweep: it used to cost every stop its whole 5 s wait, and then a
SIGKILL before the sweep."""
from __future__ import annotations

import os
import signal
import time

import pytest
from _models import fp32, infer, serving, write_model

pytestmark = pytest.mark.timeout(60)


def test_a_stopped_janitor_is_let_go_on_at_stop(tmp_path, shm_prefix: str) -> None:
    write_model(tmp_path, "m")
    with serving(tmp_path, shm_prefix) as srv:
        assert infer(srv.model("m"), {"IN": fp32(1)}).error is None
        janitor = srv._janitor  # its Popen: the exit status is the server's to read
        os.kill(janitor.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            srv.stop()
            took = time.monotonic() - t0
        finally:
            try:
                os.kill(janitor.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    assert took < 3, f"stop took {took:.1f} s"
    # It ended by itself, after its sweep (0), not killed (-9).
    assert janitor.returncode == 0
