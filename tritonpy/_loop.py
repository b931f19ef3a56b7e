"""Event loops of the host: the frontends' own, and the one that reads the stubs' frames."""
from __future__ import annotations

import asyncio
import functools
import logging
import math
import os
import sys
import threading
import time
import traceback
from typing import Any, Callable

from .shm.channel import POLL_CHECK_EVERY

log = logging.getLogger(__name__)

#: Default of the ``loop-stall-seconds`` backend option: an event loop of the host or of a
#: stub's ``async def execute`` that runs nothing for this long is logged, with where its
#: thread is.
STALL_S = 5.0


class StallWatch:
    """Watches an event loop from another thread for a stall: nothing it runs may block.

    :meth:`check`, called about once a second, pings the loop. A ping that has waited
    ``after`` seconds is reported once, through ``report(seconds, where)``: how long the loop
    has run nothing, and the stack of its thread. The loop's next turn reports the end of the
    stall, ``where`` None.

    Args:
        loop: the loop to watch.
        after: seconds (0 or less: never report).
        report: called on the checking thread for a stall, on the loop for its end.
        ident: the loop's thread (None: learnt as soon as the loop runs).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, after: float,
                 report: Callable[[float, str | None], None], ident: int | None = None) -> None:
        self.loop = loop
        self.after = after
        self._report = report
        self._ident = ident
        # When the ping now waiting for the loop was sent (None: none waits); whether this
        # stall was reported.
        self._sent: float | None = None
        self._reported = False
        if ident is None and after > 0:
            try:
                loop.call_soon_threadsafe(self._learn_thread)
            except RuntimeError:  # closed already: nothing to watch
                pass

    def _learn_thread(self) -> None:
        self._ident = threading.get_ident()

    def check(self) -> None:
        """Ping the loop; report a ping that waited too long (see the class)."""
        if self.after <= 0:
            return
        now = time.monotonic()
        sent = self._sent
        if sent is None:
            self._sent = now
            try:
                self.loop.call_soon_threadsafe(self._pong, now)
            except RuntimeError:  # the loop is closed
                self._sent = None
            return
        if not self._reported and now - sent >= self.after:
            self._reported = True
            self._report(now - sent, self._where())

    def _pong(self, sent: float) -> None:
        self._ident = threading.get_ident()
        if self._reported:
            self._reported = False
            self._report(time.monotonic() - sent, None)
        self._sent = None

    def _where(self) -> str:
        ident = self._ident
        frame = sys._current_frames().get(ident) if ident is not None else None
        if frame is None:
            return "  (not known: the loop has not run since it was started)"
        return "".join(traceback.format_stack(frame)).rstrip("\n")


def _read(path: str) -> str | None:
    try:
        with open(path) as fh:
            return fh.read()
    except (OSError, UnicodeDecodeError):
        return None


def _quota_at(directory: str, v2: bool) -> float | None:
    """The CPU quota (in CPUs) set on one cgroup directory, or None."""
    try:
        if v2:  # cpu.max: "<quota> <period>", or "max <period>"
            text = _read(os.path.join(directory, "cpu.max"))
            if text is None or text.split()[0] == "max":
                return None
            quota, period = (int(v) for v in text.split()[:2])
        else:  # cgroup v1: cpu.cfs_quota_us is -1 without a quota
            quota = int(_read(os.path.join(directory, "cpu.cfs_quota_us")) or "-1")
            period = int(_read(os.path.join(directory, "cpu.cfs_period_us")) or "0")
    except (ValueError, IndexError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def cgroup_cpu_quota(mountinfo: str = "/proc/self/mountinfo",
                     cgroup: str = "/proc/self/cgroup") -> float | None:
    """The tightest CPU quota (in CPUs, maybe fractional) of this process's cgroup and every
    cgroup above it that this process can see: ``docker --cpus``, a Kubernetes CPU limit.
    cgroup v2's ``cpu.max`` or v1's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``; None when
    there is none, or nothing can be read."""
    paths: dict[str, str] = {}  # controller (or "" for cgroup v2) -> this process's cgroup
    for line in (_read(cgroup) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for name in parts[1].split(",") if parts[1] else [""]:
                paths[name] = parts[2]
    best: float | None = None
    for line in (_read(mountinfo) or "").splitlines():
        fields, sep, tail = line.partition(" - ")
        mount, rest = fields.split(), tail.split()
        if not sep or len(mount) < 5 or len(rest) < 3:
            continue
        root, point, fstype = mount[3], mount[4], rest[0]
        if fstype == "cgroup2" and "" in paths:
            v2, path = True, paths[""]
        elif fstype == "cgroup" and "cpu" in rest[2].split(",") and "cpu" in paths:
            v2, path = False, paths["cpu"]
        else:
            continue
        # A container sees its own cgroup as the root of the mount (mountinfo's root field).
        if root != "/" and (path == root or path.startswith(root + "/")):
            path = path[len(root):]
        directory = os.path.normpath(point + "/" + path)
        while directory.startswith(point):
            quota = _quota_at(directory, v2)
            if quota is not None and (best is None or quota < best):
                best = quota
            if directory == point:
                break
            directory = os.path.dirname(directory)
    return best


def usable_cpus() -> int:
    """The CPUs this process's server may keep busy: its affinity (``taskset``, a cpuset),
    capped by a cgroup CPU quota rounded down (a 1.5-CPU quota counts as 1): past its quota a
    cgroup is stopped until the next period (100 ms by default). Under a 1-CPU quota on this
    2-CPU VM, a host and a stub that polled made the in-process round trip's p99.9 28-32 ms
    (throttled), against 0.3-0.6 ms with neither polling (p50 71-75 µs against 110-120 µs)."""
    cpus = len(os.sched_getaffinity(0))
    quota = cgroup_cpu_quota()
    return min(cpus, max(1, math.floor(quota))) if quota is not None else cpus


#: The CPUs that polling may count on (see :func:`usable_cpus`).
_CPUS = usable_cpus()
#: CPU pressure (``/proc/pressure/cpu``, "some"): the share of time in which some runnable
#: thread waited for a CPU. Above this share, polling would take CPU from others.
PRESSURE_MAX = 0.3
#: The share is re-measured at most this often (seconds): a moving mean over such intervals.
PRESSURE_EVERY_S = 0.01


class _CpuLoad:
    """What :func:`cpus_busy` reads: CPU pressure where the kernel has it, else the number of
    threads runnable now (``/proc/loadavg``). One per process, opened on first use."""

    def __init__(self) -> None:
        self.pressure = self._open("/proc/pressure/cpu")
        self.loadavg = None if self.pressure is not None else self._open("/proc/loadavg")
        self.at = 0.0  # when the pressure was last read (perf_counter seconds)
        self.total = 0  # its "some" total then (µs)
        self.share = 0.0  # moving mean of the share of time under pressure

    @staticmethod
    def _open(path: str) -> int | None:
        try:
            fd = os.open(path, os.O_RDONLY)
            os.pread(fd, 256, 0)  # PSI can be compiled in but off: reading it fails then
            return fd
        except OSError:
            return None

    def busy(self) -> bool:
        if self.pressure is not None:
            now = time.perf_counter()
            if now - self.at >= PRESSURE_EVERY_S:
                try:
                    text = os.pread(self.pressure, 256, 0)
                    total = int(text.split(b"total=", 1)[1].split(b"\n", 1)[0])
                except (OSError, ValueError, IndexError):
                    return True
                if self.at:
                    self.share += ((total - self.total) / 1e6 / (now - self.at) - self.share) / 2
                self.at, self.total = now, total
            return self.share > PRESSURE_MAX
        if self.loadavg is None:
            return False
        try:
            running = int(os.pread(self.loadavg, 64, 0).split()[3].split(b"/")[0])
        except (OSError, ValueError, IndexError):
            return True
        return running > _CPUS + 1


@functools.cache
def _cpu_load() -> _CpuLoad:
    return _CpuLoad()


def cpus_busy() -> bool:
    """Whether the machine has no CPU to spare now, so that a thread that polls instead of
    sleeping would take a share of a CPU from someone: some runnable thread waited for a CPU
    more than :data:`PRESSURE_MAX` of the time lately (the kernel's CPU pressure, measured every
    :data:`PRESSURE_EVERY_S`). Where the kernel has no pressure figures: more threads runnable
    now than CPUs and one more (one more: with one client at a time, the client, the host and
    a stub take turns, and two of them often run at once for a moment)."""
    return _cpu_load().busy()


class SpinPolicy:
    """Whether a thread that waits for its next message should poll for it first, for up to
    ``window_s`` (the ``idle-spin-microseconds`` and ``bls-spin-microseconds`` options),
    rather than sleep at once.

    A sleeping process costs whoever sends it the next message a CPU wake-up: tens of
    microseconds on a virtual machine, on that message's critical path, and as much again
    before it runs. Polling is worth it while its recent waits (the moving mean of the last
    few, each counted at most ``longest`` windows long) came within ``within`` windows, and
    while the machine has a CPU to spare (:func:`cpus_busy`). Never on a single CPU (see
    :func:`usable_cpus`: a 1-CPU cgroup quota counts as one): the sender could not run
    meanwhile.
    """

    def __init__(self, window_s: float, within: float = 1.0, longest: float = 4.0) -> None:
        self.window = window_s if _CPUS > 1 else 0.0
        self.within = within * self.window
        self.longest = longest * self.window if self.window else 0.0
        self.mean = 0.0  # seconds

    def worth(self) -> bool:
        return 0 < self.window and self.mean <= self.within and not cpus_busy()

    def waited(self, seconds: float) -> None:
        """A wait (polled or slept) took ``seconds``."""
        self.mean += (min(seconds, self.longest) - self.mean) * 0.25


#: Activity that comes within this share of a :class:`LoopSpinner`'s window after the last
#: activity it recorded is not recorded: it would move the window's end by as little, and
#: recording it (twice a request, under load every few microseconds) cost more than the rest
#: of the host's bookkeeping of a request's turn.
REARM_SHARE = 1 / 8


class LoopSpinner:
    """Keeps an event loop polling for up to a :class:`SpinPolicy` window after its last
    activity (:meth:`arm`), rather than sleeping in the kernel: a callback that yields the CPU
    and schedules itself again, so each turn of the loop polls its sockets without waiting.
    It stops at the window's end, or as soon as the machine is busy."""

    def __init__(self, loop: asyncio.AbstractEventLoop, window_s: float) -> None:
        self.loop = loop
        self.policy = SpinPolicy(window_s)
        self._until = 0.0
        self._last = 0.0  # the last activity (perf_counter seconds)
        # Activity before then is not recorded (see REARM_SHARE).
        self.next_arm = 0.0
        self._spinning = False
        self._ticks = 0

    def arm(self, now: float | None = None) -> None:
        """Activity now (``now``: its perf_counter time, if read already), on the loop's thread
        (a request sent to a stub, an answer sent to a client): more will likely follow soon."""
        if now is None:
            now = time.perf_counter()
        if self._last:
            self.policy.waited(now - self._last)
        self._last = now
        self._until = now + self.policy.window
        self.next_arm = now + self.policy.window * REARM_SHARE
        if not self._spinning and self.policy.worth():
            self._spinning = True
            self._ticks = 0
            self.loop.call_soon(self._tick)

    def _tick(self) -> None:
        self._ticks += 1
        if time.perf_counter() > self._until or (
                not self._ticks % POLL_CHECK_EVERY and cpus_busy()):
            self._spinning = False
            return
        os.sched_yield()
        self.loop.call_soon(self._tick)


def log_stalls(what: str, consequence: str) -> Callable[[float, str | None], None]:
    """A :class:`StallWatch` report to the host log: the stall at ERROR (``what`` has run
    nothing for so long: ``consequence``, and where its thread is), its end at WARNING."""
    def report(seconds: float, where: str | None) -> None:
        if where is None:
            log.warning("%s runs again, after %.1f s", what, seconds)
        else:
            log.error("%s has run nothing for %.0f s: %s. Its thread is in:\n%s", what, seconds,
                      consequence, where)
    return report


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop (about 60-80 µs of CPU less per HTTP request than asyncio's own on a
    2-vCPU machine), or asyncio's where uvloop is not installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run_loop(main: Any) -> Any:
    """``asyncio.run(main)`` on the loop of :func:`new_event_loop`."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


#: How often :meth:`FrameLoop.start_thread` tries again to start a thread that could not start.
THREAD_RETRY_S = 0.2
#: What a failed thread start (``RuntimeError: can't start new thread``) means.
THREAD_LIMIT_HINT = ("too many processes and threads (RLIMIT_NPROC of this user, or the "
                     "cgroup's pids.max: docker --pids-limit)")


class FrameLoop:
    """The event loop on which the host reads every stub's frames.

    A frame is handled where it is read: a response is delivered, a BLS call routed. When the
    loop is the frontends' own (``tritonpy serve``), a response reaches the HTTP or gRPC
    request waiting for it with no hand-off between threads. Given no loop, it runs one of its
    own in a thread.

    What runs on it must never wait for a stub's answer: that answer would be read here.
    :meth:`StubProcess.call <tritonpy._stubproc.StubProcess.call>` refuses to, on this thread.

    Args:
        loop: a running loop to read on, which outlives every stub (None: a loop of its own).
        stall_s: a loop that runs nothing for this long is logged (:class:`StallWatch`, which
            the server's maintenance checks; 0: never).
        spin_s: how long the loop polls after the host's activity (:meth:`spin`; 0: never).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None,
                 stall_s: float = STALL_S, spin_s: float = 0.0) -> None:
        self._thread: threading.Thread | None = None
        if loop is None:
            loop = new_event_loop()
            self._thread = threading.Thread(target=loop.run_forever, name="tritonpy-frames",
                                            daemon=True)
            self._thread.start()
        self.loop = loop
        self.stall = StallWatch(
            loop, stall_s,
            log_stalls("the event loop that reads the stubs' frames",
                       "every stub's answers wait, and under tritonpy serve every HTTP and gRPC "
                       "request"),
            self._thread.ident if self._thread is not None else None)
        self._spinner = LoopSpinner(loop, spin_s)

    def spin(self) -> None:
        """Activity of the host's: keep the loop polling for a while (``idle-spin-microseconds``,
        see :class:`LoopSpinner`), so that the answer to what it just sent, or the next request,
        finds it awake. Only on the loop's thread (elsewhere it does nothing)."""
        spinner = self._spinner
        if not spinner.policy.window:
            return
        now = time.perf_counter()
        # Recorded a moment ago (see REARM_SHARE): nothing to do, not even to find out which
        # thread this is. (on_loop(), inline: this runs twice a request.)
        if now >= spinner.next_arm and asyncio._get_running_loop() is self.loop:
            spinner.arm(now)

    def on_loop(self) -> bool:
        """Whether the calling thread is the one that reads the frames."""
        return asyncio._get_running_loop() is self.loop

    def watch(self, fd: int, callback: Callable[[], None]) -> None:
        """Call ``callback`` on the loop whenever ``fd`` is readable (from any thread)."""
        self.loop.call_soon_threadsafe(self.loop.add_reader, fd, callback)

    def writable(self, fd: int, callback: Callable[[], bool]) -> None:
        """Call ``callback`` on the loop whenever ``fd`` is writable, until it returns True
        (from any thread)."""
        def check() -> None:
            if callback():
                self.loop.remove_writer(fd)

        def add() -> None:
            try:
                self.loop.add_writer(fd, check)
            except (OSError, ValueError):  # closed meanwhile: nothing to write to any more
                pass

        if self.on_loop():
            add()
        else:
            self.loop.call_soon_threadsafe(add)

    def start_thread(self, make: Callable[[], threading.Thread], what: str,
                     started: Callable[[threading.Thread], None] | None = None) -> None:
        """Start a thread ``make()`` builds, for work that must not be lost (``what`` it is
        for, for the log); ``started(thread)`` once it runs. When no thread can be started now
        (the process, its user or its cgroup has as many tasks as RLIMIT_NPROC or pids.max
        allows), it is tried again every :data:`THREAD_RETRY_S` from the loop until it starts,
        or the loop closes: with a new Thread each time (Python 3.13 refuses to start again
        one whose start failed)."""
        def attempt() -> bool:
            thread = make()
            try:
                thread.start()
            except RuntimeError:
                return False
            if started is not None:
                started(thread)
            return True

        if attempt():
            return
        log.error("cannot start a thread for %s: %s; trying again every %g s", what,
                  THREAD_LIMIT_HINT, THREAD_RETRY_S)

        def retry() -> None:
            if not attempt():
                self.loop.call_later(THREAD_RETRY_S, retry)
                return
            log.warning("started the thread for %s at last", what)

        try:
            self.loop.call_soon_threadsafe(self.loop.call_later, THREAD_RETRY_S, retry)
        except RuntimeError:  # the loop is closed: the server has stopped
            pass

    def unwatch(self, fd: int) -> None:
        """Stop watching ``fd`` (readable and writable); on the loop's thread."""
        self.loop.remove_reader(fd)
        self.loop.remove_writer(fd)

    def close(self) -> None:
        """Stop and close a loop of its own (a given loop is its owner's to close)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        thread.join(timeout=5)
        if not thread.is_alive():
            self.loop.close()
