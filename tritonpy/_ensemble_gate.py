"""Back-pressure in an ensemble (``ensemble_scheduling.max_inflight_requests``, a newer
Triton's; 2.51 refuses the field): at most that many requests run at each step at once, across
all of the ensemble's requests (:class:`_StepGate`); a step request beyond it waits in the host,
in order, until one of that step's requests ends. A decoupled step that streams faster than the
steps after it consume is paced as a client's stream is (``_request._Pacing``): its model's
``response_sender.send`` waits once that many of its responses wait to be let into the next
steps, as Triton's producer waits, so neither the step requests nor their tensors pile up
(:class:`_StepPacing`, :class:`_Owed`). A decoupled ensemble's own consumer (a client's
stream, or a BLS caller's) paces its decoupled steps the same way, with or without that limit
(:class:`_ConsumerPacing`). The ensemble's requests (``_ensemble._Context``) use them.
"""
from __future__ import annotations

import collections
import threading
from typing import Callable

from . import _request
from ._request import HostRequest, _Pacing, tensor_bytes

RUN, WAIT, GONE = range(3)


class _StepGate:
    """``max_inflight_requests`` at one step: the step requests running (ids), and those
    waiting for room, oldest first, each with what to call once it is let in."""

    __slots__ = ("limit", "lock", "running", "waiting")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.lock = threading.Lock()
        self.running: set[int] = set()
        self.waiting: collections.deque[tuple[HostRequest, Callable[[], None] | None]] = (
            collections.deque())

    def enter(self, sreq: HostRequest, then: Callable[[], None] | None) -> int:
        """RUN: ``sreq`` may run now; WAIT: it waits its turn (see :meth:`leave`); GONE: it
        ended already (cancelled before it was launched). Under the lock, as :meth:`leave`
        is: a request that ends meanwhile is either seen here as ended or found running."""
        with self.lock:
            if sreq.done:
                return GONE
            if len(self.running) < self.limit and not self.waiting:
                self.running.add(sreq.id)
                return RUN
            self.waiting.append((sreq, then))
            return WAIT

    def leave(self, sreq: HostRequest) -> list[tuple[HostRequest, Callable[[], None] | None]]:
        """``sreq`` ended (its final response, or it was cancelled while it waited): the
        waiting requests it makes room for, to be submitted by the caller, outside any lock.
        A request that ended while it waited is dropped (its tensors with it), its ``then``
        returned to be called all the same."""
        with self.lock:
            if sreq.id not in self.running:
                for i, (r, then) in enumerate(self.waiting):
                    if r is sreq:
                        del self.waiting[i]
                        return [(r, then)] if then is not None else []
                return []
            self.running.discard(sreq.id)
            let_in = []
            while self.waiting and len(self.running) < self.limit:
                r, then = self.waiting.popleft()
                if not r.done:
                    self.running.add(r.id)
                let_in.append((r, then))
            return let_in


class _StepPacing(_Pacing):
    """Back-pressure on a decoupled step of an ensemble: its stub may have ``limit`` responses
    (and ``limit_bytes`` of their tensors) that the ensemble has not taken yet (let into the
    steps after it under ``max_inflight_requests``); its model's next send waits there. The
    stub is told what was taken in batches of a quarter of the limits, and of each response
    while its model waits. Where the ensemble's consumer paces the step (``consumer``), a
    batch is told only while that consumer has not too much to read, and is withheld until it
    has read (see :class:`_ConsumerPacing`). No stall is watched for here: the steps after it
    always move on, and the consumer's own pacing watches the consumer."""

    #: The ensemble's consumer, where it paces this step, and the ensemble's request (a BLS
    #: caller's stream: the BLS deadlock detector follows a held step to its reader).
    consumer: _ConsumerPacing | None = None
    outer: HostRequest | None = None

    def __init__(self, limit: int, limit_bytes: int = 1 << 62) -> None:
        self.request = None
        self._limit = limit
        self._limit_bytes = limit_bytes  # (max_inflight_requests alone counts requests only)
        self._batch = max(1, limit // 4)
        self._batch_bytes = max(1, limit_bytes // 4)

    def start(self, req: HostRequest) -> None:
        self.request = req
        self.pace(req, None)

    def limits(self) -> list[int]:
        return [self._limit_bytes, self._limit]

    def took(self, nbytes: int = 0) -> None:
        """One more of the step's responses (``nbytes`` of tensors) has all its next step
        requests let in."""
        with self._pace_lock:
            self._taken += 1
            self._bytes_since_ack += nbytes
            if (not self._held and self._taken - self._acked < self._batch
                    and self._bytes_since_ack < self._batch_bytes):
                return
        self.tell()

    def held(self) -> None:
        """Its model waits to send (HELD): from now on each response taken is told."""
        with self._pace_lock:
            self._held = True
        self.tell()

    def tell(self) -> None:
        """Tell the stub what was taken so far, unless the consumer withholds it."""
        consumer = self.consumer
        if consumer is not None and not consumer.admits(self):
            return
        with self._pace_lock:
            taken = self._taken
            if taken <= self._acked:
                return
            self._acked = taken
            self._bytes_since_ack = 0
        self._ack(taken)


class _Owed:
    """One response of a paced step, taken (``took`` called) once its ``left`` step requests
    are let in."""

    __slots__ = ("took", "left", "lock")

    def __init__(self, took: Callable[[], None], left: int) -> None:
        self.took = took
        self.left = left
        self.lock = threading.Lock()

    def one(self) -> None:
        with self.lock:
            self.left -= 1
            if self.left:
                return
        self.took()


class _ConsumerPacing:
    """Back-pressure from a decoupled ensemble's consumer to its decoupled steps.

    The ensemble's request is paced by its consumer as any decoupled model's is
    (``_request._Pacing``: a client's stream, or a BLS caller's), but it runs in no stub: the
    consumer's takes come here (``on_taken``). Each decoupled step is paced as under
    ``max_inflight_requests`` (:class:`_StepPacing`, at ``HOLD_RESPONSES`` and ``HOLD_BYTES``,
    as a decoupled model is for its own client), and what it has had taken is told to its stub
    only while the consumer has less than half of those limits of the ensemble's responses
    left to read. Past that it is withheld (the step "owes") until the consumer reads. So a
    step's model waits in ``send`` as a decoupled model does for its own client, and what waits
    for a slow consumer stays bounded (the ensemble held every response the steps made).
    A consumer that reads nothing for ``HELD_STALLED_S`` meanwhile has the request cancelled,
    as a client of a decoupled model has.

    Only what waits for the consumer counts, never the steps between (a postprocessor's queue,
    or another decoupled step's): those may wait for the step's own execute to end (a rate
    limiter's resource it holds, a BLS call to its instance), and counting them made such
    pipelines wait for each other; ``max_inflight_requests`` bounds them, as in Triton. Nothing
    owed waits for ever on a consumer that reads: its counts come in batches
    (``_Pacing._took``: every quarter of the limits, an eighth once told HELD, and when it has
    read all), so what is known unread is at most a batch (under the halves) more than what is.
    The check is made once a batch, not once a response: a step's stub goes no further than its
    limits without being told.
    """

    __slots__ = ("consumer", "lock", "sizes", "unread_bytes", "taken", "owed", "off")

    def __init__(self, consumer: _Pacing) -> None:
        self.consumer = consumer
        self.lock = threading.Lock()
        self.sizes: collections.deque[int] = collections.deque()  # of each response not read
        self.unread_bytes = 0
        self.taken = 0  # the ensemble's responses the consumer took, as it last told
        self.owed: set[_StepPacing] = set()  # steps whose stubs are not told meanwhile
        self.off = False  # no more pacing (the server stops, a BLS caller waits elsewhere)
        consumer.on_taken = self._consumer_took

    def pace(self, sreq: HostRequest, limit: int) -> None:
        """Pace decoupled step request ``sreq`` (``limit``: its ``max_inflight_requests``, 0
        for none) by this consumer."""
        most = _request.HOLD_RESPONSES  # (read at each use: a test lowers the limits)
        pacing = _StepPacing(min(limit, most) if limit else most, _request.HOLD_BYTES)
        pacing.consumer = self
        pacing.outer = self.consumer.request
        pacing.start(sreq)

    def emitted(self, outputs: list) -> None:
        """A response of the ensemble goes to the consumer (before it does: the consumer's
        count of it may come at once)."""
        nbytes = tensor_bytes(outputs)
        with self.lock:
            self.sizes.append(nbytes)
            self.unread_bytes += nbytes

    def stepped(self) -> None:
        """A step's response went through the ensemble while a step owes: the consumer is told
        it is HELD again (it reports its takes more often then, and is watched for a stall),
        as a response the ensemble gave it since the last time cleared that."""
        if self.owed and not self.off:
            self.consumer.held()

    def _within(self) -> bool:
        """Whether the consumer's unread responses are under the limits (caller holds the
        lock)."""
        return self.off or (len(self.sizes) <= _request.HOLD_RESPONSES // 2
                            and self.unread_bytes <= _request.HOLD_BYTES // 2)

    def admits(self, step: _StepPacing) -> bool:
        """Whether ``step``'s stub may be told what was taken now; if not, it owes."""
        with self.lock:
            if self._within():
                return True
            self.owed.add(step)
        self.consumer.held()  # (reports more often now, watched for a stall)
        return False

    def _consumer_took(self, taken: int) -> None:
        """The consumer took ``taken`` of the ensemble's responses so far (-1: pacing ends)."""
        with self.lock:
            if taken < 0:
                self.off = True
            else:
                sizes = self.sizes
                for _ in range(min(taken - self.taken, len(sizes))):
                    self.unread_bytes -= sizes.popleft()
                self.taken = max(self.taken, taken)
            if not self.owed or not self._within():
                return
            owed, self.owed = self.owed, set()
        for step in owed:
            step.tell()

    def stop(self) -> None:
        """The ensemble's request is over: whatever is owed is told."""
        self._consumer_took(-1)
