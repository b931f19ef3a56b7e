"""Suite-wide guards and the shared-memory fixtures.

* The session fails if it leaves anything in ``/dev/shm`` named ``tritonpy_*`` or ``tpyt*``, or
  leaves a child process of the test process alive. Leftovers are removed (children killed) so
  that one leak does not poison the next run.
* ``shm_prefix`` gives each test its own segment prefix (``tpyt<8 hex>_``) and fails the test if
  any segment of that prefix is left when it ends. Tests that create segments, or start
  processes that do, pass this prefix to every ``Pool`` so that parallel workers (xdist) and
  concurrent sessions on the same machine never see each other's segments.
* Tests marked ``gpu`` are skipped, with the reason, where cupy or a CUDA device is missing.
* Every other test runs its servers as on a machine without GPUs (``TRITONPY_GPU_COUNT=0``),
  whatever this one has: what they expect (auto-completed instance groups, the extensions
  listed, CUDA shared memory refused) was measured on a Triton without one. A ``gpu`` test sees
  the machine's GPUs.
"""
from __future__ import annotations

import functools
import os
import re
import secrets
import time
from collections.abc import Iterator

import psutil
import pytest

# The GPU count servers see (see the module doc). The machine's own setting, if any, is kept
# aside by the session's first process: its xdist workers inherit the environment it changed.
_KEPT = "TRITONPY_TESTS_MACHINE_GPU_COUNT"
os.environ.setdefault(_KEPT, os.environ.get("TRITONPY_GPU_COUNT", "unset"))
os.environ["TRITONPY_GPU_COUNT"] = "0"

SHM_DIR = "/dev/shm"
GUARDED_PREFIXES = ("tritonpy_", "tpyt")
# Pool segment names end in "<pid>x<hex>_<n>": the creator's pid.
_CREATOR = re.compile(r"(\d+)x[0-9a-f]+_\d+$")
# Prefixes handed out by shm_prefix in this process; "tpyt" names of any other prefix belong to
# another xdist worker or another session and are not this session's to judge.
_ISSUED: set[str] = set()
_ISSUED_NAME = re.compile(r"^tpyt[0-9a-f]{8}_")
# Process-wide helpers that the standard library keeps for the whole session by design.
_STDLIB_DAEMONS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def shm_entries(prefixes: tuple[str, ...] = GUARDED_PREFIXES) -> set[str]:
    """Names in /dev/shm that start with one of ``prefixes``."""
    try:
        return {e for e in os.listdir(SHM_DIR) if e.startswith(prefixes)}
    except OSError:
        return set()


def _unlink_all(names: set[str]) -> None:
    for name in names:
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except OSError:
            pass


def _is_descendant(pid: int, me: int) -> bool:
    try:
        return any(p.pid == me for p in psutil.Process(pid).parents())
    except psutil.Error:
        return False


def _session_leaks(before: set[str]) -> set[str]:
    """Guarded segments this session (this process and its descendants) left behind."""
    me = os.getpid()
    leaks = set()
    for name in shm_entries() - before:
        if _ISSUED_NAME.match(name):
            if name[:13] in _ISSUED:
                leaks.add(name)
            continue
        m = _CREATOR.search(name)
        if m is None:
            leaks.add(name)  # not a pool name: nobody but a test of ours made it
            continue
        pid = int(m.group(1))
        # A live process that is not ours belongs to a concurrent session; a dead creator is
        # counted (a leak is a leak, whoever's it is).
        if pid == me or not psutil.pid_exists(pid) or _is_descendant(pid, me):
            leaks.add(name)
    return leaks


def _live_children() -> list[psutil.Process]:
    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            cmdline = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if any(d in cmdline for d in _STDLIB_DAEMONS):
            continue
        out.append(child)
    return out


def _wait_until_clean(check, grace: float):  # type: ignore[no-untyped-def]
    """Poll ``check()`` until it returns nothing or ``grace`` seconds pass; its last result."""
    deadline = time.monotonic() + grace
    found = check()
    while found and time.monotonic() < deadline:
        time.sleep(0.05)
        found = check()
    return found


@pytest.fixture(scope="session", autouse=True)
def _no_leaks_at_exit() -> Iterator[None]:
    """Fail the run if it leaves guarded segments in /dev/shm or child processes alive."""
    before = shm_entries()
    yield
    problems = []
    children = _wait_until_clean(_live_children, 1.0)
    if children:
        desc = []
        for child in children:
            try:
                desc.append(f"{child.pid} {' '.join(child.cmdline())[:120]}")
                child.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(children, timeout=5)
        problems.append(f"{len(children)} child process(es) left alive (killed): {desc}")
    leaks = _wait_until_clean(lambda: _session_leaks(before), 1.0)
    if leaks:
        _unlink_all(leaks)
        problems.append(f"{len(leaks)} shared-memory segment(s) left in {SHM_DIR} "
                        f"(removed): {sorted(leaks)}")
    if problems:
        pytest.fail("the test session leaked resources: " + "; ".join(problems), pytrace=False)


@pytest.fixture
def shm_prefix() -> Iterator[str]:
    """A segment prefix unique to this test; the test fails if it leaves any such segment.

    Leftovers are unlinked before failing, so a failed test never leaks into the next one.
    """
    prefix = f"tpyt{secrets.token_hex(4)}_"
    _ISSUED.add(prefix)
    yield prefix
    # A short grace for children that are still unlinking on their way out.
    left = _wait_until_clean(lambda: shm_entries((prefix,)), 0.5)
    if left:
        _unlink_all(left)
        pytest.fail(f"test left {len(left)} shared-memory segment(s) in {SHM_DIR}: "
                    f"{sorted(left)}", pytrace=False)


@functools.lru_cache(maxsize=None)
def _gpu_unavailable() -> str | None:
    try:
        import cupy  # type: ignore[import-not-found]
    except Exception as exc:  # ImportError, or a CUDA library that fails to load
        return f"cupy is not importable ({type(exc).__name__}: {exc})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return f"no usable CUDA runtime ({type(exc).__name__}: {exc})"
    return None if n > 0 else "no CUDA device visible"


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is not None:
        reason = _gpu_unavailable()
        if reason is not None:
            pytest.skip(f"gpu test: {reason}")


@pytest.fixture(autouse=True)
def _machine_gpus_for_gpu_tests(request: pytest.FixtureRequest,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("gpu") is None:
        return
    if os.environ[_KEPT] == "unset":
        monkeypatch.delenv("TRITONPY_GPU_COUNT")
    else:
        monkeypatch.setenv("TRITONPY_GPU_COUNT", os.environ[_KEPT])


@pytest.fixture
def shm_child(shm_prefix: str) -> Iterator:  # type: ignore[type-arg]
    """A factory of peer processes on real Channels (``_helpers.Child``), all closed after.

    Each child and the parent-side pool use this test's ``shm_prefix``.
    """
    from _helpers import Child

    children: list[Child] = []

    def make(**kwargs):  # type: ignore[no-untyped-def]
        child = Child(shm_prefix, **kwargs)
        children.append(child)
        return child

    try:
        yield make
    finally:
        for child in children:
            child.close()
