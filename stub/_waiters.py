"""Reply slots of the stub's calls to the host, and the state of paced streams.

A :class:`Waiter` is where a reply to one stub->host call (or the responses of a decoupled BLS
stream, or a paced sender's go-ahead) lands, whichever thread reads it off the socket.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import asyncio


class Waiter:
    """A reply slot for one stub->host call.

    Sync callers poll ``ready()`` while reading the socket themselves, or sleep on ``sig`` while
    another thread reads and delivers; an async single reply completes ``future`` on the
    caller's event loop. An async decoupled stream keeps its replies in ``items`` too, so that
    it can be iterated with a plain ``for`` (as Triton's docs do) as well as ``async for``;
    ``wake`` tells a waiting ``async for`` that an item has arrived. ``drop`` takes the replies
    nobody will read (their tensors' blocks must still go back): set once a stream's reader is
    gone, and up front for a single async reply, whose awaiting task may be cancelled. ``pace``:
    what a decoupled BLS stream's reader took, for its producer's pacing (see StreamPace).
    """

    __slots__ = ("items", "sig", "loop", "future", "wake", "drop", "pace")

    def __init__(self, stream: bool = False, loop: asyncio.AbstractEventLoop | None = None):
        self.items: collections.deque[Any] = collections.deque()
        self.sig = threading.Lock()
        self.sig.acquire()
        self.loop = loop
        self.future: asyncio.Future | None = None
        self.wake: asyncio.Event | None = None
        self.drop: Callable[[Any], None] | None = None
        self.pace: StreamPace | None = None
        if loop is not None:  # an async caller: asyncio is imported already
            if stream:
                import asyncio

                self.wake = asyncio.Event()
            else:
                self.future = loop.create_future()

    def deliver(self, body: Any) -> bool:
        """Hand over one reply; returns True when no more replies are expected."""
        final = not isinstance(body, dict) or body.get("final", True)
        pace = self.pace
        if pace is not None:
            pace.held = False  # (a response after HELD: the producer goes on)
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

    def stream_pace(self) -> StreamPace:
        """This stream's StreamPace, made by whoever needs it first (its reader, or the
        reader of the host's frames at a HELD)."""
        pace = self.pace
        if pace is None:
            with _pace_made:
                pace = self.pace
                if pace is None:
                    pace = self.pace = StreamPace()
        return pace

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
            # Given back: taken, as far as the producer's pacing goes (it goes on to its end).
            self.stream_pace().took(0, not items)


_pace_made = threading.Lock()


class StreamPace:
    """What the model reading a decoupled BLS stream took of it, for the pacing of the stream's
    producer (see the host's ``_bls._StreamPacing``): every response the model takes (or the
    stub gives back unread, the model having dropped the stream) counts. Nothing is reported
    until the producer first waits for it (HELD, which gives its limits); from then on the
    count goes to the host (``report``) as the host's own streams acknowledge (see
    ``tritonpy._request._Pacing._took``): in batches of a quarter of the limits while the
    producer sends, of an eighth while it waits, and while it waits, once the model has taken
    all that arrived, or a second after the last report (the host cancels a stream whose reader
    takes nothing for a long while)."""

    __slots__ = ("lock", "taken", "reported", "nbytes", "held", "max_bytes", "max_count",
                 "report", "last")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.taken = 0
        self.reported = 0
        self.nbytes = 0  # of the responses taken since the last report
        self.held = False  # the producer waits (HELD, and no response since)
        self.max_bytes = self.max_count = 1
        self.report: Callable[[int], None] | None = None  # once the producer waited
        self.last = 0.0  # time.monotonic() of the last report

    def took(self, nbytes: int, drained: bool) -> None:
        """One more response taken, holding ``nbytes`` of tensors (``drained``: none left)."""
        with self.lock:
            self.taken += 1
            self.nbytes += nbytes
            report = self.report
            if report is None:
                return
            part = 8 if self.held else 4
            if not (self.taken - self.reported >= self.max_count // part
                    or self.nbytes >= self.max_bytes // part
                    or self.held and (drained or time.monotonic() - self.last >= 1.0)):
                return
            taken = self._reported()
        report(taken)

    def on_held(self, max_bytes: int, max_count: int, report: Callable[[int], None]) -> None:
        """The producer waits for the reader: report what it took now, and from now on."""
        with self.lock:
            self.max_bytes, self.max_count = max(max_bytes, 1), max(max_count, 1)
            self.report = report
            self.held = True
            if self.taken == self.reported:
                return
            taken = self._reported()
        report(taken)

    def _reported(self) -> int:
        self.reported = self.taken
        self.nbytes = 0
        self.last = time.monotonic()
        return self.taken


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
