"""Event loops of the host: the frontends' own, and the one that reads the stubs' frames."""
from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable


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
