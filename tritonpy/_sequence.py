"""Sequence batching: stateful models whose requests carry a correlation ID and START/END flags.

Behaviour follows Triton's sequence batcher (``sequence_batch_scheduler.cc``, behaviour only):

* Every instance has a number of sequence slots: ``max(1, max_batch_size)`` with the
  ``direct`` strategy, ``oldest.max_candidate_sequences`` (when set) with ``oldest``. A
  sequence is given a free slot at its START (lowest slot index first, so consecutive
  sequences spread over the instances) and keeps that instance until it ends; sequences that
  find no free slot wait, with all their requests, in a backlog that takes the next freed slot.
* A sequence has at most one request executing at a time, so its requests run in order.
  ``direct`` sends whatever slots are ready (waiting up to ``max_queue_delay_microseconds``
  for ``minimum_slot_utilization`` when that is set); ``oldest`` batches the ready sequences
  oldest first, as the dynamic batcher does with ``preferred_batch_size`` and its delay. As in
  the dynamic batcher, requests batched together have equal shapes (``batch_key``): with
  ``direct`` a ready sequence whose request differs from the first one's waits for a later
  batch; with ``oldest`` the first that differs ends the batch, sent at once.
* A queued request of a sequence that is answered before it runs (cancelled, or its
  ``timeout`` passed) ends its sequence when it comes to the head of the sequence's queue, as
  Triton ends a cancelled one: the requests before it run, those still queued after it are
  answered CANCELLED (or UNAVAILABLE, Triton's "timeout of the corresponding sequence has been
  expired"), and a later request needs START. The model never sees a sequence go on without
  a step, or without its START.
* The slot is freed when the END request has executed (with ``direct``, as Triton's, once it
  is in a batch: a backlogged sequence may take the slot in the next one), or when the
  sequence was idle (nothing queued or executing) for ``max_sequence_idle_microseconds``; a
  later request of a freed sequence without START gets Triton's error.
* The control and implicit-state inputs added to each request as it is sent: see
  :mod:`._sequence_controls`.
* Direct strategy: as in Triton, a sequence's request sits at its slot's place in the batch,
  so that a model may keep state by batch index. A slot below the highest one in a batch
  whose sequence sends nothing this time holds a "null" request (:class:`NullRequest`): READY,
  START and END false, correlation ID 0, zeros in the inputs, no state carried. The model
  answers it like any other; the answer goes nowhere, and it counts in the batch size of the
  execute's statistics, not as an inference (Triton counts it in its batch statistics too).
* Triton's test hooks, environment variables of the server read when a model loads:
  ``TRITONSERVER_DELAY_SCHEDULER=N`` holds the first batch until N requests are queued (with
  ``direct``, in the sequences holding a slot, over all instances, and then, when
  ``TRITONSERVER_BACKLOG_DELAY_SCHEDULER=M`` is set too, until M requests wait in the
  backlog; with ``oldest``, per instance, the sequences with a request waiting, as Triton's
  per-instance dynamic batcher, which holds one request of each sequence at a time, counts).
"""
from __future__ import annotations

import collections
import heapq
import itertools
import logging
import time
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from ._errors import (
    CancelledError,
    InternalError,
    InvalidArgumentError,
    TritonpyError,
    UnavailableError,
)
from ._request import HostRequest
from ._scheduler import Waker, batch_key, debug_count, delay_count, fail_queued, remove_queued
from ._sequence_controls import FLAG_END, FLAG_START, NullRequest, _Controls
from .shm.dtypes import triton_dtype_of

if TYPE_CHECKING:
    from ._instances import Instance
    from ._model import ModelRuntime

log = logging.getLogger("tritonpy.sequence")

# Triton's words for the requests of a sequence that ended when one of them timed out.
SEQUENCE_TIMEOUT = "timeout of the corresponding sequence has been expired"


class _Seq:
    """One sequence: its slot (once it has one) and its requests not yet sent."""

    __slots__ = ("corrid", "inst", "slot", "pending", "busy", "last", "open", "done_ns", "state")

    def __init__(self, corrid: int | str) -> None:
        self.corrid = corrid
        self.inst: Instance | None = None
        self.slot = -1
        self.pending: collections.deque[HostRequest] = collections.deque()
        self.busy = 0  # requests of it executing now (0 or 1)
        self.last = time.monotonic()
        self.open = True  # no END seen yet
        self.done_ns = 0  # its last request finished, or it got a slot (time.monotonic_ns)
        self.state: dict[str, Any] = {}  # implicit state carried to its next step, by input


def _ready_since(seq: _Seq) -> int:
    """When a sequence's next request became ready to run: it arrived, the one before it
    finished, or its backlogged sequence got a slot, whichever was latest."""
    return max(seq.pending[0].t_enqueue, seq.done_ns)



class SequenceBatcher:
    """The scheduler of a model with ``sequence_batching``."""

    owns_timeouts = False

    def __init__(self, rt: ModelRuntime) -> None:
        sb = rt.config.sequence_batching
        self.rt = rt
        self.name = rt.name
        self.oldest = sb.HasField("oldest")
        mbs = max(1, rt.max_batch_size)
        self.max_batch = mbs
        if self.oldest:
            cands = int(sb.oldest.max_candidate_sequences)
            self.slots = cands if cands > 0 else mbs
            self.delay_ns = int(sb.oldest.max_queue_delay_microseconds) * 1000
            self.preferred = frozenset(int(s) for s in sb.oldest.preferred_batch_size)
            self.max_preferred = max(self.preferred) if self.preferred else mbs
            self.min_util = 0.0
        else:
            self.slots = mbs
            self.delay_ns = int(sb.direct.max_queue_delay_microseconds) * 1000
            self.min_util = float(sb.direct.minimum_slot_utilization)
            self.preferred = frozenset()
            self.max_preferred = mbs
        self.idle_s = max(int(sb.max_sequence_idle_microseconds), 1) / 1e6
        self.key = batch_key(rt.config)
        # Direct strategy with batching: null requests fill the slots below a request's.
        self.sends_nulls = not self.oldest and mbs > 1
        # Direct strategy: a slot is freed when its sequence's END request is batched.
        self.early_release = not self.oldest and not sb.iterative_sequence
        self.iterative = bool(sb.iterative_sequence)
        self.controls = _Controls(rt.config, rt.model_dir)
        self.active: dict[int | str, _Seq] = {}  # open sequences by correlation ID
        self.by_inst: dict[Instance, list[_Seq]] = {}  # sequences holding a slot there
        # Heap of free slots: (slot, instance order, instance), so that slot 0 of every
        # instance fills before any slot 1.
        self.free: list[tuple[int, int, Instance]] = []
        self.order: dict[Instance, int] = {}
        self.fresh: dict[Instance, int] = {}  # per instance: its slots ever put in the heap
        self._orders = itertools.count()  # never reused: two instances never tie in the heap
        self.backlog: collections.deque[_Seq] = collections.deque()
        self.inflight: dict[int, _Seq] = {}  # request id -> its sequence
        self.n = 0
        self.waker = Waker(rt)
        self.reaper = Waker(rt, self._reap)  # ends sequences idle past their limit
        # Queued requests answered before they ran (cancel, timeout): id -> the error.
        self._aborted: dict[int, TritonpyError] = {}
        self._iter_ids = itertools.count(1)  # iterative requests without a correlation ID
        self.hold_until = delay_count(rt, "sequence batcher")  # queued requests to wait for
        self.backlog_hold_until = debug_count("TRITONSERVER_BACKLOG_DELAY_SCHEDULER")
        self.opened: set[Instance] = set()  # oldest: the instances whose gate has opened
        for inst in rt.instances:
            self.add_instance(inst)
        self.queue = self

    # -- instances added and removed by an update ------------------------------------------
    def holds(self, inst: Instance) -> bool:
        return bool(self.by_inst.get(inst))

    def add_instance(self, inst: Instance) -> None:
        """Give ``inst`` its slots; backlogged sequences take them at once. A passive one
        gets none: it never runs a request."""
        if inst.passive:
            return
        self.order[inst] = next(self._orders)
        self.by_inst[inst] = []
        # Its slots enter the heap one at a time: slot i+1 when slot i is first taken (a
        # config may give 2^31-1 candidate sequences an instance, or max_batch_size 2^31-1).
        heapq.heappush(self.free, (0, self.order[inst], inst))
        self.fresh[inst] = 1
        waiting = [s for s in self.backlog if s.open or s.pending]
        self.backlog.clear()
        for seq in waiting:
            self._assign(seq)

    def remove_instance(self, inst: Instance) -> list[HostRequest]:
        """Forget ``inst``. Sequences still on it (its stub died while retiring) end: their
        pending requests are returned, to be failed."""
        self.free = [f for f in self.free if f[2] is not inst]
        heapq.heapify(self.free)
        self.order.pop(inst, None)
        self.fresh.pop(inst, None)
        orphans: list[HostRequest] = []
        for seq in self.by_inst.pop(inst, []):
            if self.active.get(seq.corrid) is seq:
                del self.active[seq.corrid]
            seq.open = False
            self.n -= len(seq.pending)
            orphans.extend(seq.pending)
            seq.pending.clear()
        return orphans

    def instance_died(self, inst: Instance) -> None:
        """``inst``'s stub died (the caller holds the model lock, the batches it was running
        finished): the sequences holding its slots end, since what the model kept of them in
        that process is gone. Their queued requests are answered UNAVAILABLE, their slots are
        freed, and a later request of their IDs needs START: a restarted instance never sees
        a sequence go on that it did not start."""
        for seq in list(self.by_inst.get(inst, ())):
            self._end(seq, UnavailableError(
                f"sequence {seq.corrid} of model '{self.name}' ended: instance '{inst.name}', "
                "which held it, died; a new sequence needs the START flag"), "BACKEND")
            self._settle(seq)

    # -- the deque-like view -----------------------------------------------------------------
    def _all(self) -> Iterator[_Seq]:
        for seqs in self.by_inst.values():
            yield from seqs
        yield from self.backlog

    def __len__(self) -> int:
        return self.n

    def __bool__(self) -> bool:
        return self.n > 0

    def __iter__(self) -> Iterator[HostRequest]:
        for s in list(self._all()):
            yield from list(s.pending)

    def remove(self, req: HostRequest) -> None:
        remove_queued((s.pending for s in self._all()), req)
        self.n -= 1
        self._aborted.pop(req.id, None)

    def clear(self) -> None:
        for s in self._all():
            s.pending.clear()
        self.n = 0
        self._aborted.clear()

    def aborted(self, req: HostRequest, error: TritonpyError) -> None:
        """``req``, still queued, was answered ``error`` (cancel, timeout): its sequence ends
        when it comes to the head (``_settle``); at once for a sequence in the backlog whose
        first request it was (no slot is coming to settle it: its requests queued behind are
        answered now, and its next one needs START, as in Triton). The caller holds the model
        lock."""
        self._aborted[req.id] = error
        for seq in self.backlog:
            if seq.pending and seq.pending[0] is req:
                self._settle(seq)
                break

    def waits_for_slot(self, req: HostRequest) -> bool:
        """Whether ``req`` belongs to a sequence in the backlog (no slot yet)."""
        return any(req in seq.pending for seq in self.backlog)

    # -- queueing ----------------------------------------------------------------------------
    def add(self, req: HostRequest) -> TritonpyError | None:
        # Triton's order: the batch size first, then the correlation ID.
        if req.batch_size > 1:
            return InvalidArgumentError(
                f"inference request to model '{self.name}' must specify batch-size 1 due to "
                "requirements of sequence batcher")
        cid = req.correlation_id
        if cid is None or cid == 0 or cid == "" or isinstance(cid, bool):
            if self.iterative:
                self._add_alone(req)
                return None
            return InvalidArgumentError(
                f"inference request to model '{self.name}' must specify a non-zero or "
                "non-empty correlation ID")
        corr = self.controls.corrid
        if corr is not None and corr[2] != isinstance(cid, str):
            want = "a string" if corr[2] else "an integer"
            return InvalidArgumentError(
                f"inference request to model '{self.name}' has correlation ID {cid!r}, but "
                f"the model's CONTROL_SEQUENCE_CORRID input '{corr[0]}' needs {want} "
                "correlation ID")
        start = bool(req.flags & FLAG_START)
        seq = self.active.get(cid)
        if seq is None:
            if not start:
                return InvalidArgumentError(
                    f"inference request for sequence {cid} to model '{self.name}' must "
                    "specify the START flag on the first request of the sequence")
            seq = _Seq(cid)
            self.active[cid] = seq
            self._assign(seq)
        elif start:
            log.warning("sequence %s for model '%s' has a conflict. The previous sequence did "
                        "not end before this sequence start. Previous sequence will be "
                        "terminated early.", cid, self.name)
        seq.pending.append(req)
        seq.last = time.monotonic()
        self.n += 1
        if req.flags & FLAG_END:
            seq.open = False
            del self.active[cid]
        self._arm_reaper(seq.last + self.idle_s)
        return None

    def _add_alone(self, req: HostRequest) -> None:
        """An iterative-sequence request without a correlation ID: as in Triton, a sequence
        of its own, which ends when the request is released without RESCHEDULE. Triton gives
        it a new correlation ID (1, 2, ... per model) and the START flag; so does this."""
        req.correlation_id = next(self._iter_ids)
        req.flags = FLAG_START
        seq = _Seq(req.correlation_id)  # never in ``active``: nothing else can join it
        seq.open = False
        self._assign(seq)
        seq.pending.append(req)
        self.n += 1
        self._arm_reaper(seq.last + self.idle_s)
        return None

    def _assign(self, seq: _Seq) -> None:
        while self.free:
            slot, order, inst = heapq.heappop(self.free)
            if inst.state in ("STOPPED", "RETIRING"):
                continue
            fresh = self.fresh[inst]
            if slot == fresh - 1 and fresh < self.slots:  # the next slot never taken
                heapq.heappush(self.free, (fresh, order, inst))
                self.fresh[inst] = fresh + 1
            seq.inst, seq.slot = inst, slot
            self.by_inst[inst].append(seq)
            return
        self.backlog.append(seq)

    def _release(self, seq: _Seq) -> None:
        """Free ``seq``'s slot; the oldest backlogged sequence takes it."""
        inst = seq.inst
        if inst is None:
            return
        try:
            self.by_inst[inst].remove(seq)
        except ValueError:
            return
        if seq.open and self.active.get(seq.corrid) is seq:
            del self.active[seq.corrid]  # ended by the idle timeout
        seq.open = False
        seq.state = {}
        if inst.state == "RETIRING":  # removed by an update: its slots are not handed on
            if not self.by_inst[inst]:
                self.rt.retire_later(inst)
            return
        while self.backlog:
            nxt = self.backlog.popleft()
            if not nxt.open and not nxt.pending:
                continue  # every request of it was answered while it waited
            nxt.inst, nxt.slot = inst, seq.slot
            # Its next request joins the oldest-first batcher now, behind those already
            # there (as Triton's, measured), not at its arrival while it waited for a slot.
            nxt.done_ns = max(nxt.done_ns, time.monotonic_ns())
            self.by_inst[inst].append(nxt)
            return
        heapq.heappush(self.free, (seq.slot, self.order[inst], inst))

    def _settle(self, seq: _Seq) -> None:
        """Drop answered requests at the head; free the slot of an ended, empty sequence."""
        q = seq.pending
        while q and q[0].done:
            req = q.popleft()
            self.n -= 1
            if req.flags & FLAG_END and seq.open:
                seq.open = False
                if self.active.get(seq.corrid) is seq:
                    del self.active[seq.corrid]
            error = self._aborted.pop(req.id, None) if self._aborted else None
            if error is not None and (seq.open or q):
                # Ended at a request of it answered before it ran: the rest get the same kind
                # of error.
                if isinstance(error, CancelledError):
                    self._end(seq, CancelledError(
                        f"sequence {seq.corrid} was cancelled: a request of it was cancelled "
                        "before it ran"), "CANCELED")
                else:
                    self._end(seq, UnavailableError(SEQUENCE_TIMEOUT), "REJECTED")
        if not seq.open and not q and not seq.busy:
            self._release(seq)

    def _end(self, seq: _Seq, why: TritonpyError, reason: str) -> None:
        """End ``seq`` now: the requests still queued for it are answered ``why`` (from the
        timer thread: the caller holds the model lock; ``reason`` for the statistics), and a
        later request of its ID needs START."""
        if seq.open:
            seq.open = False
            if self.active.get(seq.corrid) is seq:
                del self.active[seq.corrid]
        rest = list(seq.pending)
        seq.pending.clear()
        self.n -= len(rest)
        for req in rest:
            self._aborted.pop(req.id, None)
        if rest:
            self.rt.server.timers.at(0.0, lambda: fail_queued(self.rt, rest, why, reason))

    # -- implicit state --------------------------------------------------------------------------
    def keep_state(self, req: HostRequest, outputs: list, wanted: Sequence[str]) -> list:
        """Take the state outputs out of a response of ``req`` (on the frames' loop, before its
        execute is finished, so before the sequence's next request is sent): they become the
        sequence's state for its next step. Returns the outputs for the caller: ``wanted``
        (what it asked for) keeps a state output the config lists. Raises InternalError for a
        state output of another data type than its state's, and then keeps no state of it."""
        states = self.controls.state_outputs
        kept = []
        new = {}
        for item in outputs:
            st = states.get(item[0])
            if st is None:
                kept.append(item)
                continue
            input_name, type_name, wire_type = st
            got = triton_dtype_of(item[1])
            if got != wire_type:
                raise InternalError(
                    f"model '{self.name}' returned state output '{item[0]}' as {got}, but its "
                    f"state '{input_name}' is {type_name}")
            new[input_name] = item[1]
            if item[0] in wanted:
                kept.append(item)
        if new:
            seq = self.inflight.get(req.id)
            if seq is not None:
                seq.state = {**seq.state, **new}
        return kept

    def requeue(self, reqs: list[HostRequest]) -> None:
        for req in reversed(reqs):
            seq = self.inflight.pop(req.id, None)
            if seq is None:
                continue
            if self.iterative:
                req.flags = 0  # as Triton: a rescheduled request is neither START nor END
            seq.busy -= 1
            seq.pending.appendleft(req)
            self.n += 1

    def finished(self, inst: Instance, batch: list[HostRequest]) -> None:
        now = time.monotonic()
        for req in batch:
            seq = self.inflight.pop(req.id, None)
            if seq is None:
                continue
            seq.busy -= 1
            seq.last = now
            seq.done_ns = time.monotonic_ns()
            if self.iterative and seq.open:
                # Released without RESCHEDULE (a rescheduled one was requeued): as Triton, an
                # iterative sequence ends with its request, and what else was queued for its
                # ID is cancelled.
                self._end(seq, CancelledError(
                    f"iterative sequence {seq.corrid} ended: its request was released without "
                    "RESCHEDULE"), "CANCELED")
            self._settle(seq)
        if self.by_inst.get(inst):
            self._arm_reaper(now + self.idle_s)

    # -- batch formation ---------------------------------------------------------------------
    def take(self, instances: list[Instance]) -> list[tuple[Instance, list[HostRequest]]]:
        plans: list[tuple[Instance, list[HostRequest]]] = []
        if not self.n:
            return plans
        if self.hold_until and not self.oldest and self._held():
            return plans
        # The instances holding sequences, a RETIRING one included: its sequences end there.
        for inst in self.by_inst:
            if self.hold_until and self.oldest and self._held(inst):
                continue
            while (inst.running < inst.capacity and inst.state in ("READY", "RETIRING")
                   and inst.admitted()):
                batch = self._form(inst)
                if not batch:
                    break
                inst.running += 1
                plans.append((inst, batch))
        return plans

    def _held(self, inst: Instance | None = None) -> bool:
        """Whether ``TRITONSERVER_DELAY_SCHEDULER`` still holds the batches (of ``inst``, with
        ``oldest``; of every instance with ``direct``, where the backlog may count too)."""
        if inst is not None:
            if inst in self.opened:
                return False
            if sum(1 for s in self.by_inst[inst] if s.pending) < self.hold_until:
                return True
            self.opened.add(inst)
            return False
        backlogged = sum(len(s.pending) for s in self.backlog)
        if self.n - backlogged < self.hold_until or backlogged < self.backlog_hold_until:
            return True
        self.hold_until = self.backlog_hold_until = 0
        return False

    def _form(self, inst: Instance) -> list[HostRequest] | None:
        seqs = self.by_inst.get(inst)
        if not seqs:
            return None
        ready = []
        for s in list(seqs):
            if s.busy:
                continue
            self._settle(s)
            if s.pending:
                ready.append(s)
        if not ready:
            return None
        if self.oldest:
            # As Triton's: a request joins the oldest-first batcher when it is its sequence's
            # next (its arrival, or its predecessor's end); its age and delay count from then.
            ready.sort(key=_ready_since)
        else:
            # direct: a sequence's slot is its place in the batch, as Triton's batch index.
            ready.sort(key=lambda s: s.slot)
        chosen = ready[:self.max_batch]
        n_ready = len(chosen)
        # direct: the batch spans the slots up to the highest one with a request ready, one
        # whose request cannot join included (a null takes its place), as Triton's.
        extent = chosen[-1].slot
        cut = False
        key = self.key
        if key is not None and len(chosen) > 1:
            first = key(chosen[0].pending[0])
            if self.oldest:
                # The first sequence whose request differs ends the batch, sent at once.
                for i, s in enumerate(chosen):
                    if key(s.pending[0]) != first:
                        chosen, cut = chosen[:i], True
                        break
            else:
                # direct: a slot whose request differs sits this batch out.
                chosen = [s for s in chosen if key(s.pending[0]) == first]
        if self.delay_ns and not cut:
            oldest = _ready_since(chosen[0]) if self.oldest else chosen[0].pending[0].t_enqueue
            if self.oldest:
                wait = len(chosen) < self.max_preferred and len(chosen) not in self.preferred
            else:
                # The slots left out for their shape count, as in Triton's utilization.
                wait = self.min_util > 0 and n_ready < self.min_util * self.slots
            if wait and time.monotonic_ns() - oldest < self.delay_ns:
                self.waker.arm((oldest + self.delay_ns) / 1e9)
                return None
        slots: Sequence[_Seq | None] = chosen
        if self.sends_nulls and extent >= len(chosen):
            # As Triton: each request at its slot's place, null requests in the other slots.
            by_slot = {s.slot: s for s in chosen}
            slots = [by_slot.get(i) for i in range(extent + 1)]
        like = chosen[0].pending[0]  # what a null request is made like
        batch: list[HostRequest] = []
        ended: list[_Seq] = []
        for seq in slots:
            if seq is None:
                batch.append(self._controlled(NullRequest(like), {}))
                continue
            req = seq.pending.popleft()
            self.n -= 1
            seq.busy += 1
            self.inflight[req.id] = seq
            if req.flags & FLAG_START and seq.state:
                seq.state = {}  # a new sequence under the same ID: its state starts again
            batch.append(self._controlled(req, seq.state))
            if self.early_release and req.flags & FLAG_END and not seq.pending:
                ended.append(seq)
        for seq in ended:
            # As Triton's direct batcher: a sequence's slot is free once its END request is
            # in a batch, for a backlogged sequence to take in the next one.
            self._release(seq)
        return batch

    def _controlled(self, req: HostRequest, state: dict[str, Any]) -> HostRequest:
        """``req`` with the control and state inputs the configuration names (in place of any
        it had: a request sent again)."""
        names = self.controls.names
        if names:
            inputs = [x for x in req.inputs if x[0] not in names]
            inputs.extend(self.controls.tensors(req, state))
            req.inputs = inputs
        return req

    # -- idle sequences ----------------------------------------------------------------------
    def _arm_reaper(self, deadline: float) -> None:
        self.reaper.arm(deadline)  # the caller holds the model lock

    def _reap(self) -> None:
        rt = self.rt
        kick = False
        with rt.lock:
            if rt.state not in ("READY", "UNLOADING"):
                return
            now = time.monotonic()
            nxt: float | None = None
            for seqs in list(self.by_inst.values()):
                for s in list(seqs):
                    if s.busy:
                        continue
                    self._settle(s)
                    if s.inst is None or s.pending:
                        continue
                    due = s.last + self.idle_s
                    if due <= now:
                        log.info("sequence %s of model '%s' idle for more than %g s: ended",
                                 s.corrid, self.name, self.idle_s)
                        self._release(s)
                        kick = True
                    elif nxt is None or due < nxt:
                        nxt = due
            if any(self.by_inst.values()):
                self._arm_reaper(nxt if nxt is not None else now + self.idle_s)
        if kick:
            rt.kick()


__all__ = ["SequenceBatcher"]
