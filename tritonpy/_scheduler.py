"""Batch formation for one model: plain FIFO and Triton's dynamic batcher.

A :class:`~tritonpy._model.ModelRuntime` owns one scheduler and calls it under its own lock:
``add`` queues a validated request (or returns the error that rejects it), ``take`` hands out
``(instance, batch)`` plans for every free instance, ``requeue`` puts rescheduled requests back
at the front, ``finished`` is told when a batch has left an instance. ``queue`` is a
deque-like view of what is waiting (``len``, iteration, ``remove``, ``clear``) for the drain,
unload and BLS deadlock paths.

The FIFO scheduler is the hot path of every model without ``dynamic_batching`` or
``sequence_batching``: one deque, no timer and no allocation per request beyond the plan.

The dynamic batcher follows Triton's rules (``dynamic_batch_scheduler.cc``, behaviour only):
requests are taken in priority-level order (FIFO within a level, requests whose queue timeout
passed under a DELAY policy after the others of their level, in arrival order); a batch grows up to
``max_batch_size``; a preferred batch size found on the way is sent at once; otherwise a
batch that cannot reach the largest preferred size waits for the oldest request's
``max_queue_delay_microseconds`` (zero: never waits). A timer wakes the batcher exactly when
the oldest request's delay ends, so no request waits longer than its delay for an instance
that is free. A batch holds only requests whose variable-size inputs have the same shapes
(apart from the batch dimension) unless the input allows a ragged batch, and, in a model with
optional inputs, the same inputs: the first request that differs ends the batch, which is then
sent at once, as Triton does (so a model may concatenate its requests' inputs).

Triton's test hook ``TRITONSERVER_DELAY_SCHEDULER=N`` (an environment variable of the server,
read when a model loads) holds a batcher's first batch until N requests are queued, so that
tests can queue requests one by one and see them batched together; after that the batcher
works as without it (:func:`debug_count`, :func:`delay_count`).
"""
from __future__ import annotations

import bisect
import collections
import logging
import os
import re
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Hashable, Iterable, Iterator

from ._errors import TritonpyError, UnavailableError
from .validation import request_prefix

if TYPE_CHECKING:
    from ._instances import Instance
    from ._model import ModelRuntime
    from ._request import HostRequest

log = logging.getLogger("tritonpy.scheduler")

REQUEST_TIMEOUT = "Request timeout expired"
QUEUE_FULL = "Exceeds maximum queue size"


def debug_count(name: str) -> int:
    """The count Triton's test hook environment variable ``name`` gives, read as C's atoi
    reads it (leading blanks, a sign, digits; anything else is 0). A negative count, which
    Triton turns into a wait that never ends, is 0 here: the hook is off."""
    m = re.match(r"\s*([+-]?\d+)", os.environ.get(name, ""))
    return max(0, int(m.group(1))) if m else 0


def delay_count(rt: ModelRuntime, what: str) -> int:
    """``TRITONSERVER_DELAY_SCHEDULER`` for a batcher of ``rt`` loading now: how many requests
    its first batch waits for (0: none), said in the log. A batcher sets its count to 0 once
    reached, as Triton's batcher threads stop counting once they have started."""
    count = debug_count("TRITONSERVER_DELAY_SCHEDULER")
    if count:
        log.info("Delaying %s for %s until %d queued requests...", what, rt.name, count)
    return count


def remove_queued(queues: Iterable[collections.deque[HostRequest]], req: HostRequest) -> None:
    """Take ``req`` out of whichever of ``queues`` holds it; ValueError if none does."""
    for dq in queues:
        try:
            dq.remove(req)
            return
        except ValueError:
            continue
    raise ValueError("request is not queued")


def fail_queued(rt: ModelRuntime, reqs: list[HostRequest], error: TritonpyError,
                reason: str) -> None:
    """Answer ``error`` to requests taken off a queue before they ran, counted as failures
    for ``reason`` (Triton's REJECTED, CANCELED, ...). Call it without the model lock held (a
    caller that holds it: ``rt.server.timers.at(0.0, ...)``)."""
    stats = rt.stats
    for req in reqs:
        if not req.done:
            stats.request_failed(time.monotonic_ns() - req.t_enqueue, reason)
            req.fail(error)
    rt.withdraw_if_idle()


def batch_key(config: Any) -> Callable[[HostRequest], Hashable] | None:
    """What requests batched together must share, as a function of a request, or None when
    any requests may share a batch.

    As Triton's batchers: the shapes (batch dimension aside) of the inputs with a variable-size
    dimension that do not set ``allow_ragged_batch``, and, in a model with an optional input,
    which of the inputs the request has.
    """
    inputs = config.input
    equal = frozenset(io.name for io in inputs
                      if not io.allow_ragged_batch and any(d < 0 for d in io.dims))
    declared = frozenset(io.name for io in inputs) if any(io.optional for io in inputs) else None
    if not equal and declared is None:
        return None

    def key(req: HostRequest) -> Hashable:
        shapes = tuple(sorted((name, tuple(arr.shape[1:])) for name, arr in req.inputs
                              if name in equal))
        if declared is None:
            return shapes
        # Control inputs a sequence batcher adds are not the request's own.
        return shapes, frozenset(name for name, _ in req.inputs if name in declared)

    return key


def _free_instance(instances: list[Instance]) -> Instance | None:
    """The free instance with the least work in flight, the first of equals: an instance
    running ``async def execute`` takes several requests at once, but an idle one comes first,
    as each of Triton's instances takes the next request when it is free."""
    best = None
    for inst in instances:
        if inst.free():
            if not inst.running:
                return inst
            if best is None or inst.running < best.running:
                best = inst
    return best


class Unbound:
    """A scheduler that ties no request to an instance: an instance update adds and removes
    instances without telling it."""

    sends_nulls = False  # see SequenceBatcher

    def holds(self, inst: Instance) -> bool:
        """Whether work is bound to ``inst`` (a sequence's slot) even while it is idle."""
        return False

    def add_instance(self, inst: Instance) -> None:
        pass

    def remove_instance(self, inst: Instance) -> list[HostRequest]:
        """Forget ``inst``; returns the requests that were bound to it (to be failed)."""
        return []

    def instance_died(self, inst: Instance) -> None:
        """``inst``'s stub died, its batches in flight finished (the caller holds the model
        lock): nothing is bound to an instance here."""


class FifoScheduler(Unbound):
    """One request per ``execute``, in arrival order, to the first free instance."""

    owns_timeouts = False

    def __init__(self, rt: ModelRuntime) -> None:
        self.rt = rt
        self.queue: collections.deque[HostRequest] = collections.deque()

    def add(self, req: HostRequest) -> TritonpyError | None:
        self.queue.append(req)
        return None

    def take(self, instances: list[Instance]) -> list[tuple[Instance, list[HostRequest]]]:
        plans = []
        q = self.queue
        while q:
            inst = _free_instance(instances)
            if inst is None:
                break
            req = q.popleft()
            if req.done:
                continue
            inst.running += 1
            plans.append((inst, [req]))
        return plans

    def requeue(self, reqs: list[HostRequest]) -> None:
        self.queue.extendleft(reversed(reqs))

    def finished(self, inst: Instance, batch: list[HostRequest]) -> None:
        pass


class _Level:
    """One priority level: its queue, its delayed queue and its queue policy."""

    __slots__ = ("queue", "delayed", "reject", "timeout_us", "override", "max_size")

    def __init__(self, policy: Any) -> None:
        self.queue: collections.deque[HostRequest] = collections.deque()
        self.delayed: collections.deque[HostRequest] = collections.deque()
        self.reject = int(policy.timeout_action) == 0  # REJECT; 1 is DELAY
        self.timeout_us = int(policy.default_timeout_microseconds)
        self.override = bool(policy.allow_timeout_override)
        self.max_size = int(policy.max_queue_size)

    def __len__(self) -> int:
        return len(self.queue) + len(self.delayed)


class Waker:
    """Calls ``fire`` (``rt.kick`` unless given) at the earliest deadline asked for, while the
    model serves (one pending timer at a time, re-armed only for an earlier deadline)."""

    def __init__(self, rt: ModelRuntime, fire: Callable[[], None] | None = None) -> None:
        self.rt = rt
        self.fire = fire if fire is not None else rt.kick
        self.at: float | None = None

    def arm(self, deadline: float) -> None:
        """Wake at ``deadline`` (time.monotonic seconds); caller holds the model lock."""
        if self.at is not None and self.at <= deadline:
            return
        self.at = deadline
        self.rt.server.timers.at(deadline, lambda d=deadline: self._fire(d))

    def _fire(self, deadline: float) -> None:
        rt = self.rt
        with rt.lock:
            if self.at != deadline:
                return  # superseded by an earlier wake that already ran, or re-armed
            self.at = None
        if rt.state in ("READY", "UNLOADING"):
            self.fire()


class DynamicBatcher(Unbound):
    """Triton's dynamic batcher for a model with ``dynamic_batching``. For a model that does
    not batch (max_batch_size 0) each batch is one request, and its queue policy (queue size,
    timeouts, priority levels) applies, as in Triton 2.51 (measured: a full queue rejects)."""

    owns_timeouts = True

    def __init__(self, rt: ModelRuntime) -> None:
        db = rt.config.dynamic_batching
        self.rt = rt
        self.max_batch = max(1, rt.max_batch_size)
        self.preferred = frozenset(int(s) for s in db.preferred_batch_size)
        self.max_preferred = max(self.preferred) if self.preferred else self.max_batch
        self.delay_ns = int(db.max_queue_delay_microseconds) * 1000
        n_levels = int(db.priority_levels)
        self.n_levels = n_levels
        self.default_level = int(db.default_priority_level) if n_levels else 0
        self.policies = db.priority_queue_policy
        self.default_policy = db.default_queue_policy
        # The levels that hold requests, in priority order (a config may declare 2^64-1
        # levels, as upstream's L0_config_json does: only those in use exist), and their
        # priorities; without priority levels, one level that stays.
        self.levels = [_Level(db.default_queue_policy)]
        self.priorities = [0]
        self.by_priority: dict[int, _Level] = {}
        self.n = 0  # entries in every level (done ones included until they are passed)
        self.waker = Waker(rt)
        self.key = batch_key(rt.config)
        self.preserve = bool(db.preserve_ordering)
        self._order: collections.deque[list] = collections.deque()
        self._order_lock = threading.Lock()
        self.queue = self  # the deque-like view is the batcher itself
        self.hold_until = delay_count(rt, "batcher")  # queued requests the first batch waits for
        # Batches formed while no instance was free, taken in order (Triton's payloads); the
        # last one may still grow while ``open`` (not saturated), as Triton's batcher goes on
        # filling the payload no instance has taken yet.
        self.payloads: collections.deque[list[HostRequest]] = collections.deque()
        self.open = False
        self.n_formed = 0  # requests in them
        # As Triton's: only a queue with no policy to apply while requests wait (no priority
        # levels, timeout or size cap) forms batches ahead; another forms one when an
        # instance is free to take it. So does one without a queue delay: requests that come
        # together behind a busy instance reach Triton's batcher together (measured: 7 with
        # preferred sizes 2 and 4 ran 4 + 2 + 1), where forming a batch at each arrival
        # would close it at the first preferred size.
        policy = db.default_queue_policy
        self.ahead = (not n_levels and not policy.default_timeout_microseconds
                      and not policy.allow_timeout_override and not policy.max_queue_size
                      and self.delay_ns > 0)

    # -- the deque-like view (the batches formed ahead count as queued) ---------------------
    def __len__(self) -> int:
        return self.n + self.n_formed

    def __bool__(self) -> bool:
        return self.n + self.n_formed > 0

    def __iter__(self) -> Iterator[HostRequest]:
        for batch in list(self.payloads):
            yield from list(batch)
        for lv in self.levels:
            yield from lv.queue
            yield from lv.delayed

    def remove(self, req: HostRequest) -> None:
        for batch in self.payloads:
            if req in batch:
                batch.remove(req)
                self.n_formed -= 1
                return
        remove_queued((dq for lv in self.levels for dq in (lv.queue, lv.delayed)), req)
        self.n -= 1

    def clear(self) -> None:
        for lv in self.levels:
            lv.queue.clear()
            lv.delayed.clear()
        self.n = 0
        self.payloads.clear()
        self.open = False
        self.n_formed = 0

    # -- queueing ----------------------------------------------------------------------------
    def _level(self, req: HostRequest) -> _Level:
        if not self.n_levels:
            return self.levels[0]
        p = req.priority
        if not 0 < p <= self.n_levels:
            p = self.default_level
        lv = self.by_priority.get(p)
        if lv is None:
            if not self.by_priority:  # the first level in use takes the place of none
                self.levels.clear()
                self.priorities.clear()
            lv = self.by_priority[p] = _Level(
                self.policies[p] if p in self.policies else self.default_policy)
            i = bisect.bisect(self.priorities, p)
            self.priorities.insert(i, p)
            self.levels.insert(i, lv)
        return lv

    def _drop_empty(self) -> None:
        """Forget the levels left empty (with priority levels: a level exists while in use)."""
        for i in range(len(self.levels) - 1, -1, -1):
            if not self.levels[i] and len(self.levels) > 1:
                del self.by_priority[self.priorities[i]]
                del self.levels[i]
                del self.priorities[i]

    def add(self, req: HostRequest) -> TritonpyError | None:
        lv = self._level(req)
        if lv.max_size and len(lv) >= lv.max_size:
            # Requests already answered (cancelled, timed out) still sit in the deques.
            self._purge(lv)
            if len(lv) >= lv.max_size:
                # Triton's words, with its request id prefix (measured with 2.51).
                return UnavailableError(request_prefix(req.request_id) + QUEUE_FULL)
        timeout_us = lv.timeout_us
        if lv.override and req.timeout_us and (not timeout_us or req.timeout_us < timeout_us):
            # A request may shorten the default timeout, never lengthen it (as Triton); with
            # no default it sets its own, so a request is never queued past its timeout.
            timeout_us = req.timeout_us
        if self.preserve:
            self._delegate(req)
        lv.queue.append(req)
        self.n += 1
        if timeout_us:
            req.queue_deadline = deadline = req.t_enqueue + timeout_us * 1000
            self.rt.server.timers.at_request(deadline / 1e9, req, self._expired)
        return None

    def _purge(self, lv: _Level) -> None:
        for attr in ("queue", "delayed"):
            dq: collections.deque[HostRequest] = getattr(lv, attr)
            live = collections.deque(r for r in dq if not r.done)
            self.n -= len(dq) - len(live)
            setattr(lv, attr, live)

    def _expired(self, req: HostRequest) -> None:
        """The request's queue timeout passed: reject it, or move it behind its level. Then
        the requests it leaves may make a batch that goes at once (without it, a preferred
        size), as Triton forms one again (measured with 2.51)."""
        with self.rt.lock:
            if req.done:
                return
            try:
                rejected = self._apply_policy(req)
            except ValueError:
                return  # dispatched already, or delayed already
        if rejected:
            self._reject([req])
        self.rt.kick()

    def _apply_policy(self, req: HostRequest) -> bool:
        """Take ``req``, whose queue timeout passed, off its level's queue (ValueError if it is
        not there): True when rejected (to answer without the lock), False when delayed."""
        lv = self._level(req)
        lv.queue.remove(req)
        if lv.reject:
            self.n -= 1
            return True
        # The delayed run in arrival order, whichever timed out first: Triton finds them
        # timed out as it walks its queue in that order (measured with 2.51).
        delayed = lv.delayed
        i = len(delayed)
        while i and delayed[i - 1].t_enqueue > req.t_enqueue:
            i -= 1
        delayed.insert(i, req)
        return False

    def _reject(self, reqs: list[HostRequest]) -> None:
        """Answer requests taken off the queue because their timeout passed (no lock held)."""
        fail_queued(self.rt, reqs, UnavailableError(REQUEST_TIMEOUT), "REJECTED")

    def _expire(self, expired: list[HostRequest]) -> None:
        """The queue policy for ``expired`` requests that batch formation found, as Triton
        applies it when it forms a batch. The rejected ones are answered from the timer thread
        (the caller holds the model lock); their own timers, still armed, then find them gone
        from the queue."""
        rejected = [req for req in expired if self._apply_policy(req)]
        if rejected:
            self.rt.server.timers.at(0.0, lambda: self._reject(rejected))

    def requeue(self, reqs: list[HostRequest]) -> None:
        for req in reversed(reqs):
            self._level(req).queue.appendleft(req)
            self.n += 1

    def finished(self, inst: Instance, batch: list[HostRequest]) -> None:
        pass

    # -- batch formation ---------------------------------------------------------------------
    def take(self, instances: list[Instance]) -> list[tuple[Instance, list[HostRequest]]]:
        """Batches for the free instances: those formed ahead first, in order, then new ones.
        While no instance is free, what is queued is formed into batches ahead, as Triton's
        batcher fills its payloads as requests come (up to twice as many batches as there are
        instances): the batch an instance takes next is the one Triton's would."""
        plans: list[tuple[Instance, list[HostRequest]]] = []
        if self.hold_until:
            if self.n < self.hold_until:
                return plans
            self.hold_until = 0
        while True:
            while self.payloads:
                inst = _free_instance(instances)
                if inst is None:
                    break
                formed = self.payloads.popleft()
                self.n_formed -= len(formed)
                if not self.payloads:
                    self.open = False  # taken: the next batch is a new one
                batch = [r for r in formed if not r.done]
                if batch:
                    inst.running += 1
                    plans.append((inst, batch))
            if not self.n or not (self.ahead or _free_instance(instances)):
                return plans
            if not self._form(len(instances)):
                return plans

    def _candidates(self, now: int, expired: list[HostRequest]) -> Iterator[HostRequest]:
        """Live requests in batch order; those whose queue timeout has passed go to
        ``expired`` instead (the queue policy applies to them, not to the delayed ones)."""
        for lv in self.levels:
            for req in lv.queue:
                if req.done:
                    continue
                deadline = req.queue_deadline
                if deadline and now > deadline:
                    expired.append(req)
                    continue
                yield req
            for req in lv.delayed:
                if not req.done:
                    yield req

    def _form(self, n_instances: int) -> bool:
        """Move the requests that make (or grow) the next batch from the queue to the batches
        formed; False when none can go now (too few yet: the waker is armed)."""
        while True:
            grow = self.payloads[-1] if self.open and self.payloads else None
            if grow is None and len(self.payloads) >= 2 * max(1, n_instances):
                return False  # as Triton's: so many formed ahead already
            expired: list[HostRequest] = []
            chosen, saturated = self._choose(self._candidates(time.monotonic_ns(), expired),
                                             grow)
            if expired:
                # Found on the way (only requests up to the batch's end are looked at): take
                # them out of the queue and choose again from what is left.
                self._expire(expired)
                continue
            if not chosen:
                if grow is not None and saturated:
                    # Closed by a request that cannot join it (another shape, past the
                    # maximum), as Triton's: that request starts the next batch.
                    self.open = False
                    continue
                return False
            self._pop(len(chosen))
            if grow is not None:
                grow.extend(chosen)
            else:
                self.payloads.append(chosen)
            self.n_formed += len(chosen)
            self.open = not saturated
            return True

    def _choose(self, candidates: Iterator[HostRequest],
                grow: list[HostRequest] | None) -> tuple[list[HostRequest] | None, bool]:
        """Triton's dynamic batch: the requests from ``candidates`` (still queued) that make
        the next batch, or join ``grow`` (a batch formed ahead and not taken yet), or None to
        wait; and whether that batch is saturated (it grows no more)."""
        base = sum(r.batch_size or 1 for r in grow) if grow else 0
        pending: list[HostRequest] = []
        size = 0
        best = 0  # number of pending requests making the best batch seen so far
        send_now = saturated = False
        oldest = 0
        preferred = self.preferred
        key = self.key
        first: Hashable = key(grow[0]) if key is not None and grow else None
        for req in candidates:
            bs = req.batch_size or 1
            if pending or grow:
                if best == 0 and base + size + bs > self.max_preferred:
                    # As Triton's: past the largest preferred size, the batch is saturated,
                    # and (this request while none is preferred yet) one more may join it.
                    best = len(pending)
                    saturated = True
                if base + size + bs > self.max_batch:
                    send_now = True
                    break
                if key is not None and key(req) != first:
                    send_now = True  # a different shape ends the batch (Triton's rule)
                    break
            elif key is not None:
                first = key(req)
            pending.append(req)
            size += bs
            if not oldest or req.t_enqueue < oldest:
                oldest = req.t_enqueue
            if base + size in preferred:
                best = len(pending)
        if not pending:
            for lv in self.levels:
                self._purge(lv)
            return None, saturated
        delay = self.delay_ns
        exceeded = bool(delay) and time.monotonic_ns() - oldest >= delay
        if best and not exceeded:
            return pending[:best], saturated or not delay
        if send_now or base + size >= self.max_preferred:
            return pending, True
        if exceeded or not delay:
            return pending, saturated
        self.waker.arm((oldest + delay) / 1e9)
        return None, saturated

    def _pop(self, count: int) -> None:
        """Remove the first ``count`` live requests in order (and the answered ones between)."""
        for lv in self.levels:
            for dq in (lv.queue, lv.delayed):
                while count and dq:
                    req = dq.popleft()
                    self.n -= 1
                    if not req.done:
                        count -= 1
                if not count:
                    break
            if not count:
                break
        if self.by_priority:
            self._drop_empty()

    # -- preserve_ordering -------------------------------------------------------------------
    def _delegate(self, req: HostRequest) -> None:
        """Hold ``req``'s responses until every earlier request has answered in full."""
        slot: list = [req, req.sink, []]
        with self._order_lock:
            self._order.append(slot)
        order, lock = self._order, self._order_lock

        def sink(r: Any, outputs: Any, error: Any, parameters: Any, final: bool) -> None:
            with lock:
                slot[2].append((outputs, error, parameters, final))
                while order and order[0][2]:
                    head = order[0]
                    items, head[2] = head[2], []
                    trace = head[0].trace
                    for item in items:
                        if trace is not None and not trace.parent_id:
                            # As Triton 2.51 (measured): complete when released to the caller.
                            trace.at("INFER_RESPONSE_COMPLETE")
                        head[1](head[0], *item)
                    if items[-1][3]:
                        order.popleft()
                    else:
                        break

        sink.completes_later = True  # type: ignore[attr-defined]  # (see HostRequest.respond)
        req.sink = sink


def make_scheduler(rt: ModelRuntime) -> Any:
    """The scheduler a model's configuration asks for."""
    cfg = rt.config
    if cfg.HasField("sequence_batching"):
        from ._sequence import SequenceBatcher

        return SequenceBatcher(rt)
    if cfg.HasField("dynamic_batching"):
        return DynamicBatcher(rt)
    return FifoScheduler(rt)


__all__ = ["DynamicBatcher", "FifoScheduler", "Waker", "batch_key", "debug_count", "delay_count",
           "fail_queued", "make_scheduler"]
