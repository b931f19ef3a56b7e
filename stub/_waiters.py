"""Reply slots of the stub's calls to the host, and the state of a paced request.

A :class:`Waiter` is where a reply to one stub->host call (or the responses of a decoupled BLS
stream, or a paced sender's go-ahead) lands, whichever thread reads it off the socket.
"""
from __future__ import annotations

import asyncio
import collections
import threading
from typing import Any, Callable


class Waiter:
    """A reply slot for one stub->host call.

    Sync callers poll ``ready()`` while reading the socket themselves, or sleep on ``sig`` while
    another thread reads and delivers; an async single reply completes ``future`` on the
    caller's event loop. An async decoupled stream keeps its replies in ``items`` too, so that
    it can be iterated with a plain ``for`` (as Triton's docs do) as well as ``async for``;
    ``wake`` tells a waiting ``async for`` that an item has arrived. ``drop`` takes the replies
    nobody will read (their tensors' blocks must still go back): set once a stream's reader is
    gone, and up front for a single async reply, whose awaiting task may be cancelled.
    """

    __slots__ = ("items", "sig", "loop", "future", "wake", "drop")

    def __init__(self, stream: bool = False, loop: asyncio.AbstractEventLoop | None = None):
        self.items: collections.deque[Any] = collections.deque()
        self.sig = threading.Lock()
        self.sig.acquire()
        self.loop = loop
        self.future: asyncio.Future | None = None
        self.wake: asyncio.Event | None = None
        self.drop: Callable[[Any], None] | None = None
        if loop is not None:
            if stream:
                self.wake = asyncio.Event()
            else:
                self.future = loop.create_future()

    def deliver(self, body: Any) -> bool:
        """Hand over one reply; returns True when no more replies are expected."""
        final = not isinstance(body, dict) or body.get("final", True)
        if self.future is not None:
            assert self.loop is not None
            try:
                self.loop.call_soon_threadsafe(_set_result, self, body)
            except RuntimeError:  # the loop is closed: nobody will read it
                if self.drop is not None:
                    self.drop(body)
            return final
        self.items.append(body)
        if self.drop is not None:
            self._drain()
            return final
        try:
            self.sig.release()
        except RuntimeError:  # already signalled
            pass
        if self.wake is not None:
            assert self.loop is not None
            self.loop.call_soon_threadsafe(self.wake.set)
        return final

    def ready(self) -> bool:
        return bool(self.items)

    def abandon(self, drop: Callable[[Any], None]) -> None:
        """The reader is gone: replies queued, and those still to come, go to ``drop``."""
        self.drop = drop
        self._drain()

    def _drain(self) -> None:
        # popleft is atomic: of deliver() and abandon() racing, each reply is dropped once.
        items, drop = self.items, self.drop
        assert drop is not None
        while True:
            try:
                body = items.popleft()
            except IndexError:
                return
            drop(body)


async def first_item(w: Waiter) -> None:
    """Wait (on the event loop) until a stream waiter holds a reply."""
    assert w.wake is not None
    while not w.items:
        w.wake.clear()
        if w.items:
            break
        await w.wake.wait()


def _set_result(w: Waiter, body: Any) -> None:
    fut = w.future
    assert fut is not None
    if not fut.done():
        fut.set_result(body)
    elif w.drop is not None:  # the awaiting task was cancelled
        w.drop(body)


class Pace:
    """A paced request's responses that its consumer has not taken yet (back-pressure)."""

    __slots__ = ("max_bytes", "max_count", "sizes", "unread", "acked", "waiter")

    def __init__(self, max_bytes: int, max_count: int) -> None:
        self.max_bytes = max_bytes
        self.max_count = max(max_count, 1)
        self.sizes: collections.deque[int] = collections.deque()  # bytes of each, oldest first
        self.unread = 0  # their sum
        self.acked = 0  # responses the consumer took (the host's last ACK)
        self.waiter: Waiter | None = None  # senders waiting for the consumer (HELD sent)
