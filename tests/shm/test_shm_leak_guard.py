"""The suite's own guards (tests/conftest.py) catch what they promise to catch."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import psutil

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)

_LEAKY = textwrap.dedent("""
    import os, subprocess, sys
    import pytest

    def test_leaves_a_segment(shm_prefix):
        open(f"/dev/shm/{shm_prefix}left", "wb").close()

    def test_clean(shm_prefix):
        pass

    def test_leaves_a_child_and_a_segment():
        proc = subprocess.Popen(["sleep", "60"])
        print("CHILD", proc.pid, "SELF", os.getpid())
        open(f"/dev/shm/tritonpy_{os.getpid()}x1a_0", "wb").close()
        proc.returncode = 0  # keep Popen.__del__ quiet: the guard must find it anyway

    @pytest.mark.gpu
    def test_needs_a_gpu():
        pass
""")


def _machine_has_a_gpu() -> bool:
    probe = "import cupy, sys; sys.exit(0 if cupy.cuda.runtime.getDeviceCount() > 0 else 1)"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True,
                          timeout=60).returncode == 0


def test_guards_fail_the_run_and_clean_up(tmp_path) -> None:
    shutil.copy(os.path.join(TESTS, "conftest.py"), tmp_path / "conftest.py")
    shutil.copy(os.path.join(ROOT, "pytest.ini"), tmp_path / "pytest.ini")
    (tmp_path / "pytest.ini").write_text(
        (tmp_path / "pytest.ini").read_text().replace("testpaths = tests", "testpaths = ."))
    (tmp_path / "test_leaky.py").write_text(_LEAKY)
    before = set(os.listdir("/dev/shm"))
    # Only the plugins the suite itself uses: another one on the machine (pytest-benchmark
    # warns under xdist) would fail the inner run under the suite's warnings-as-errors.
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "xdist.plugin",
         "-p", "pytest_timeout", "-s", "-rA", "-n0"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "test left 1 shared-memory segment(s)" in out and "left']" in out
    assert "1 child process(es) left alive (killed)" in out
    assert "tritonpy_" in out and "segment(s) left in /dev/shm (removed)" in out
    if _machine_has_a_gpu():  # where conftest.py does not skip it
        assert "PASSED test_leaky.py::test_needs_a_gpu" in out
    else:
        assert "SKIPPED" in out and "gpu test:" in out
    assert "PASSED test_leaky.py::test_clean" in out
    child_pid = int(out.split("CHILD ", 1)[1].split()[0])
    assert not psutil.pid_exists(child_pid) or psutil.Process(child_pid).status() == "zombie"
    inner_pid = int(out.split("SELF ", 1)[1].split()[0])
    new = set(os.listdir("/dev/shm")) - before
    assert not {n for n in new if n.endswith("_left") or n.startswith(f"tritonpy_{inner_pid}x")}
