"""The server's timers: request deadlines, and the checks of streams whose model waits to send
(``_request._Pacing``). One thread and a heap, started on the first deadline."""
from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
import weakref
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from ._request import HostRequest


class Timers:
    """Request deadlines: one thread, a heap, and a condition (cheap when there are none)."""

    # The server stops: its paced streams are paced no more (see _Pacing.unpace).
    draining = False

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._cv = threading.Condition(threading.Lock())
        self._seq = itertools.count()
        self._stop = False
        self._thread: threading.Thread | None = None

    def at(self, deadline: float, fn: Callable[[], None]) -> None:
        with self._cv:
            if self._thread is None:
                thread = threading.Thread(target=self._run, name="tritonpy-timers", daemon=True)
                thread.start()  # (raises where no thread can be had: the next at() tries again)
                self._thread = thread
            entry = (deadline, next(self._seq), fn)
            heapq.heappush(self._heap, entry)
            if self._heap[0] is entry:  # a later deadline than the head wakes nobody
                self._cv.notify()

    def at_request(self, deadline: float, req: HostRequest,
                   fn: Callable[[HostRequest], None]) -> None:
        """``fn(req)`` at ``deadline`` if ``req`` is still alive then. Held by weak reference:
        a finished request (and its inputs, maybe shm blocks) is freed without waiting for
        its deadline; one that is queued or executing is held elsewhere."""
        ref = weakref.ref(req)

        def fire() -> None:
            r = ref()
            if r is not None:
                fn(r)

        self.at(deadline, fire)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stop and (not self._heap or self._heap[0][0] > time.monotonic()):
                    # At most a day at a time: a deadline years away (a client's huge
                    # timeout) is past what the platform's clock can wait for at once.
                    wait = (min(self._heap[0][0] - time.monotonic(), 86400.0) if self._heap
                            else None)
                    self._cv.wait(wait)
                if self._stop:
                    return
                _, _, fn = heapq.heappop(self._heap)
            try:
                fn()
            except Exception:  # a timer callback must not kill the timer thread
                logging.getLogger("tritonpy").exception("timer callback failed")
            # Drop it now: waiting with it bound would keep its request (and the request's
            # input tensors, maybe shm blocks) alive until the next timer fires.
            del fn

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
