"""Event loops of the host: the frontends' own, and the one that reads the stubs' frames."""
from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback
from typing import Any, Callable

log = logging.getLogger(__name__)

#: The frame loop running nothing for this long is logged, with where its thread is. Nothing
#: on it may wait (it reads every stub's answers and, under ``tritonpy serve``, serves every
#: HTTP and gRPC request), so a loop that stops is a bug, and the log says where it is stuck
#: instead of the server going silent.
STALL_S = 5.0


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
    """

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._thread: threading.Thread | None = None
        if loop is None:
            loop = new_event_loop()
            self._thread = threading.Thread(target=loop.run_forever, name="tritonpy-frames",
                                            daemon=True)
            self._thread.start()
        self.loop = loop
        # The stall watch (check_stall): when the ping now waiting for the loop was sent
        # (None: none waits), whether this stall was logged, and the loop's thread.
        self._ping_sent: float | None = None
        self._stall_logged = False
        self._ident = self._thread.ident if self._thread is not None else None
        if self._ident is None:  # a given loop: its thread, as soon as it runs
            loop.call_soon_threadsafe(self._learn_thread)

    def _learn_thread(self) -> None:
        self._ident = threading.get_ident()

    def check_stall(self) -> None:
        """Called about once a second from another thread (the server's maintenance): ping
        the loop; log once when the ping has waited :data:`STALL_S`, with the stack of the
        loop's thread, and again when the loop runs again."""
        now = time.monotonic()
        sent = self._ping_sent
        if sent is None:
            self._ping_sent = now
            try:
                self.loop.call_soon_threadsafe(self._pong, now)
            except RuntimeError:  # the loop is closed: nothing to watch any more
                self._ping_sent = None
            return
        if not self._stall_logged and now - sent >= STALL_S:
            self._stall_logged = True
            log.error("the event loop that reads the stubs' frames has run nothing for %.0f s "
                      "(under tritonpy serve it also serves HTTP and gRPC: every request "
                      "waits). Its thread is in:\n%s", now - sent, self._where())

    def _pong(self, sent: float) -> None:
        self._ident = threading.get_ident()
        if self._stall_logged:
            log.warning("the event loop that reads the stubs' frames runs again, after %.1f s",
                        time.monotonic() - sent)
            self._stall_logged = False
        self._ping_sent = None

    def _where(self) -> str:
        ident = self._ident
        frame = sys._current_frames().get(ident) if ident is not None else None
        if frame is None:
            return "  (not known: the loop has not run since the server started)"
        return "".join(traceback.format_stack(frame)).rstrip("\n")

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
