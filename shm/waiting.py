"""How a process waits for its peer's next message: whether to poll first or sleep at once
(:class:`SpinPolicy`, which polls only while the machine has a CPU to spare:
:func:`cpus_busy`, :func:`usable_cpus`), and a watch for an event loop that stalls
(:class:`StallWatch`). The host and the stubs wait alike, so this lives beside the channel
they wait on."""
from __future__ import annotations

import functools
import math
import os
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import asyncio


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
