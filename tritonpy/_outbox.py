"""An outbox: work made under an owner's lock, run after it is released, in the order it was
made, by one thread at a time.

Used where the order of what leaves matters and the thread that makes it should not hold the
lock while it goes: an ensemble request's responses (a consumer may call back into the
request from its delivery), and the batches a model version sends its stubs (an instance may
take its next request while its execute runs: two threads each sending the one they took
could reach the stub in the other order).
"""
from __future__ import annotations

import collections
import logging
import threading
from typing import Any, Callable, Generic, TypeVar

_T = TypeVar("_T", bound=tuple)
log = logging.getLogger("tritonpy")


class Outbox(Generic[_T]):
    """Items put under ``lock`` (the owner's), run by :meth:`drain` outside it. A thread that
    finds another draining leaves its items to it (one that leads back to the owner, on the
    draining thread, finds them run next), so nobody waits and nothing overtakes."""

    __slots__ = ("lock", "items", "_busy", "_what")

    def __init__(self, lock: threading.Lock, what: str) -> None:
        self.lock = lock
        self.items: collections.deque[_T] = collections.deque()  # put under the lock
        self._busy = False
        self._what = what  # for the log, should running one fail

    def drain(self, run: Callable[..., Any]) -> None:
        """``run(*item)`` for the items put so far (and any put meanwhile), in order, unless
        another thread is at it. One that raises is logged; the items after it still run."""
        items = self.items
        while True:
            with self.lock:
                if self._busy or not items:
                    return
                self._busy = True
                item = items.popleft()
            try:
                run(*item)
            except Exception:  # a fault of tritonpy's or of a consumer's
                log.exception("%s failed", self._what)
            finally:
                self._busy = False
