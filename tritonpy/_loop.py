"""Event loops of the host: the frontends' own, and the one that reads the stubs' frames."""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from typing import Any, Callable

from .shm.channel import POLL_CHECK_EVERY
from .shm.waiting import SpinPolicy, StallWatch, cpus_busy

log = logging.getLogger(__name__)

#: Default of the ``loop-stall-seconds`` backend option: an event loop of the host or of a
#: stub's ``async def execute`` that runs nothing for this long is logged, with where its
#: thread is.
STALL_S = 5.0


#: Activity that comes within this share of a :class:`LoopSpinner`'s window after the last
#: activity it recorded is not recorded: it would move the window's end by as little, and
#: recording it (twice a request, under load every few microseconds) cost more than the rest
#: of the host's bookkeeping of a request's turn.
REARM_SHARE = 1 / 8


#: A :class:`LoopSpinner` does not poll while more than this share of the recent client
#: requests began with another in flight (a moving mean over about the last 8).
OVERLAP_MAX = 0.1


class LoopSpinner:
    """Keeps an event loop polling for up to a :class:`SpinPolicy` window after its last
    activity (:meth:`arm`), rather than sleeping in the kernel: a callback that yields the CPU
    and schedules itself again, so each turn of the loop polls its sockets without waiting.
    It stops at the window's end, as soon as the machine is busy, or as soon as the frontends'
    client requests overlap (:attr:`overlap`).

    Polling pays for one client at a time, whose every request waits for the host's and the
    stub's wake-ups. Several clients at once keep the CPUs busy between them, and the loop's
    polls took CPU from them. Alternating runs on a 2-vCPU VM, tritonclient's HTTP clients,
    medians of 4: 4 clients 4,009 infer/s polling, 4,710 not; 16 clients 5,012 and 5,349 (the
    stubs' own polling, kept, made no difference there); one client 2,534 polling, 2,175 not.
    The requests in flight do not tell the two apart: with 4 Python clients, 52 % of the
    requests found none other in the server, as the clients' own work kept the rest."""

    def __init__(self, loop: asyncio.AbstractEventLoop, window_s: float) -> None:
        self.loop = loop
        self.policy = SpinPolicy(window_s)
        #: Client requests in flight on the frontends that share this loop (kept by them:
        #: :meth:`FrameLoop.request_began`), and the moving share of those that began while
        #: another was in flight.
        self.requests = 0
        self.overlap = 0.0
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
        if not self._spinning and self.overlap < OVERLAP_MAX and self.policy.worth():
            self._spinning = True
            self._ticks = 0
            self.loop.call_soon(self._tick)

    def _tick(self) -> None:
        self._ticks += 1
        if time.perf_counter() > self._until or self.overlap >= OVERLAP_MAX or (
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
        # The loop's thread, once it has run (see request_began).
        self._ident = self._thread.ident if self._thread is not None else None
        if self._ident is None:
            try:
                loop.call_soon_threadsafe(self._learn_thread)
            except RuntimeError:  # closed already: no request will run on it
                pass

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

    def request_began(self) -> bool:
        """A frontend's client request begins; whether it was counted (only on the loop's
        thread: frontends on a loop of their own do not make this loop poll). A counted one
        must end with :meth:`request_ended`. See :attr:`LoopSpinner.requests`. (The thread is
        told by its id: asking asyncio for the running loop costs a getpid() syscall on
        Python 3.11, and this runs every request.)"""
        if threading.get_ident() != self._ident:
            return False
        spinner = self._spinner
        spinner.requests += 1
        spinner.overlap += ((spinner.requests > 1) - spinner.overlap) * 0.125
        return True

    def _learn_thread(self) -> None:
        self._ident = threading.get_ident()

    def request_ended(self) -> None:
        """A client request counted by :meth:`request_began` has ended."""
        self._spinner.requests -= 1

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


async def wait_all(tasks: list[asyncio.Task[Any]], timeout: float,
                   cut: asyncio.Event) -> set[asyncio.Task[Any]]:
    """Wait until every one of ``tasks`` is done, ``timeout`` seconds pass, or ``cut`` is set
    (a stop told to end at once); the tasks not done then."""
    if not tasks:
        return set()
    cutter = asyncio.ensure_future(cut.wait())
    everything = asyncio.ensure_future(asyncio.wait(tasks))
    try:
        await asyncio.wait({cutter, everything}, timeout=timeout,
                           return_when=asyncio.FIRST_COMPLETED)
    finally:
        cutter.cancel()
        everything.cancel()
    return {t for t in tasks if not t.done()}
