"""Back-pressure in an ensemble (``ensemble_scheduling.max_inflight_requests``, a newer
Triton's; 2.51 refuses the field): at most that many requests run at each step at once, across
all of the ensemble's requests (:class:`_StepGate`); a step request beyond it waits in the host,
in order, until one of that step's requests ends. A decoupled step that streams faster than the
steps after it consume is paced as a client's stream is (``_request._Pacing``): its model's
``response_sender.send`` waits once that many of its responses wait to be let into the next
steps, as Triton's producer waits, so neither the step requests nor their tensors pile up
(:class:`_StepPacing`, :class:`_Owed`). The ensemble's requests (``_ensemble._Context``) use
them.
"""
from __future__ import annotations

import collections
import threading
from typing import Callable

from ._request import HostRequest, _Pacing

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
    """Back-pressure on a decoupled step under ``max_inflight_requests``: its stub may have
    ``limit`` responses that the steps after it have not let in yet; its model's next send
    waits there. No stall is watched for: the steps after it always move on."""

    def __init__(self, limit: int) -> None:
        self.request = None
        self._limit = limit
        self._batch = max(1, limit // 4)

    def start(self, req: HostRequest) -> None:
        self.request = req
        self.pace(req, None)

    def limits(self) -> list[int]:
        # No bound on bytes: the limit counts requests, as Triton's.
        return [1 << 62, self._limit]

    def took(self) -> None:
        """One more of the step's responses has all its next step requests let in."""
        with self._pace_lock:
            self._taken += 1
            if not self._held and self._taken - self._acked < self._batch:
                return
            taken = self._acked = self._taken
        self._ack(taken)


class _Owed:
    """One response of a paced step, taken once its ``left`` step requests are let in."""

    __slots__ = ("pacer", "left", "lock")

    def __init__(self, pacer: _StepPacing, left: int) -> None:
        self.pacer = pacer
        self.left = left
        self.lock = threading.Lock()

    def one(self) -> None:
        with self.lock:
            self.left -= 1
            if self.left:
                return
        self.pacer.took()
