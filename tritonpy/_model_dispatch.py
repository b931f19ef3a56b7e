"""The request path of a loaded model version, host to stub: submit, queue, batch formation
(through its scheduler), the execute message to an instance's stub, cancellation, timeouts
and the end of an execute. The hottest path of the host: see STYLE.md rule 13 before adding
a call or an attribute look-up per request here.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import msgpack

from tritonpy.shm import Cmd, ShmExhaustedError
from tritonpy.shm._errors import NO_SPACE, FdLimitError
from tritonpy.shm.messages import RequestBody
from tritonpy.shm.segment import could_fit

from ._errors import (
    CancelledError,
    InternalError,
    InvalidArgumentError,
    TritonpyError,
    UnavailableError,
)
from ._instances import Instance
from ._outbox import Outbox
from ._request import HostRequest
from ._runtime_base import READY, UNAVAILABLE, RuntimeBase
from ._scheduler import REQUEST_TIMEOUT
from ._sequence import SEQUENCE_TIMEOUT

if TYPE_CHECKING:
    from ._model import ModelRuntime

log = logging.getLogger("tritonpy.model")
# A request whose inputs find /dev/shm full on the frame loop is queued again this often, for
# this long (see ModelDispatch._retry_later).
SHM_RETRY_EVERY_S = 0.05
SHM_RETRY_FOR_S = 0.25


class ModelDispatch(RuntimeBase):
    """The request path of :class:`~tritonpy._model.ModelRuntime`, one of its bases (never
    made on its own). A base class of its own module rather than a collaborator object: every
    method here reads and writes the version's state under its one lock (queue, scheduler,
    instances, statistics), and a collaborator would add an attribute look-up per request on
    the host's hottest path; an inherited method costs nothing more to call.
    """

    # Set by ModelRuntime.__init__ (see there), read by the request and response paths.
    sched: Any
    sched_is_sequence: bool
    _outbox: Outbox[tuple[Instance, list[HostRequest]]]
    state_outputs: list[str]
    all_and_states: list[str]
    _held: dict[int, tuple]
    unserviceable: str
    cache: Any
    rate_limited: bool
    passive_only: bool

    def submit(self, req: HostRequest) -> None:
        """Queue a validated request; it is dispatched as soon as an instance is free."""
        if self.state != READY:
            succ = self.successor
            if succ is not None:
                # Reloaded while this request was on its way: the new version serves it.
                self._forward(succ, req)
                return
            req.fail(self.not_ready_error())
            return
        if self.unserviceable and not self._alive():
            self.stats.request_failed(0, "BACKEND")
            req.fail(UnavailableError(self.unserviceable))
            return
        if self.passive_only:  # (Triton 2.51 crashes there: SIGSEGV, measured)
            self.stats.request_failed(0, "REJECTED")
            req.fail(UnavailableError(
                f"model '{self.name}' takes no requests: all its instance groups are passive"))
            return
        if self.cache is not None and self._answered_from_cache(req, self.cache):
            return
        req.on_cancel = self._cancelled
        if req.trace is not None:
            req.trace.queued(self.version, req.request_id, req.t_enqueue, req.inputs)
        sched = self.sched
        if req.timeout_us > 0 and not sched.owns_timeouts:
            self.server.timers.at_request(time.monotonic() + req.timeout_us / 1e6, req,
                                          self._timed_out)
        with self.lock:
            # Unloaded since the check above: nothing would ever run it from this queue.
            late = self.state == UNAVAILABLE
            err = None if late else sched.add(req)
            plans = self._take_locked() if err is None and not late else None
        if late:
            self.submit(req)  # forwarded to the successor, or failed
            return
        if err is not None:  # refused as it is queued: not counted, as in Triton
            req.fail(err)
            return
        if plans:
            self._send_taken()
        elif req.caller_exec and req.caller is not None and not req.done:
            self.server.bls.watch(req)

    def _forward(self, succ: ModelRuntime, req: HostRequest) -> None:
        try:
            self.server.validate(succ, req)
        except TritonpyError as exc:
            req.fail(exc)
            return
        req.model = succ
        succ.submit(req)

    def _take_locked(self) -> list[tuple[Instance, list[HostRequest]]]:
        if self.rate_limited:
            limiter = self.server.limiter
            plans = []
            while True:
                before = len(self.queue)
                with limiter.taking():  # (see RateLimiter.admits)
                    more = self.sched.take(self.instances)
                    granted, unused = limiter.settle(inst for inst, _ in more)
                plans += more
                if granted:
                    self.server.tell_reserved(granted)
                # Again while that took requests out of the queue (answered ones, maybe)
                # and gave resources back: they may admit an instance for what is left.
                if not (unused and 0 < len(self.queue) < before):
                    break
            self._withdraw_if_idle_locked()
        else:
            plans = self.sched.take(self.instances)
        for inst, batch in plans:  # under the lock: a cancel sees them taken (_cancelled)
            for req in batch:
                req.instance = inst
        if plans:
            self._outbox.items.extend(plans)  # sent in this order (see _send_taken)
        return plans

    def _withdraw_if_idle_locked(self) -> None:
        """A rate-limited model with nothing queued that has not ended (its requests went to
        one of its instances, or were cancelled or timed out while queued): its instances wait
        for resources no more, and hold back nobody ranked after them. Caller holds the lock."""
        if not any(not r.done for r in self.queue):
            self.server.tell_reserved(self.server.limiter.withdraw(self.instances))

    def withdraw_if_idle(self) -> None:
        """:meth:`_withdraw_if_idle_locked` for a caller that does not hold the lock."""
        if self.rate_limited:
            with self.lock:
                self._withdraw_if_idle_locked()

    def kick(self) -> None:
        """Form and send whatever batches can go now (a scheduler's timer calls this)."""
        with self.lock:
            plans = self._take_locked()
        if plans:
            self._send_taken()

    def kick_reserved(self, inst: Instance) -> None:
        """The rate limiter reserved ``inst``'s resources: dispatch, and give back what it
        did not use (its model had nothing for it, or it stopped meanwhile)."""
        self.kick()
        self.server.tell_reserved(self.server.limiter.unreserve(inst))

    def _release(self, inst: Instance) -> list[Instance]:
        """``inst`` holds its rate limiter resources no more (caller holds the lock): the
        instances they are reserved for now (see Server.tell_reserved)."""
        limiter = self.server.limiter
        granted = limiter.unreserve(inst) if inst.reserved else []  # (its stub died)
        if inst.holding:
            granted += limiter.release(inst, inst.state == "READY" and len(self.queue) > 0)
        return granted

    def _send_taken(self) -> None:
        """Send the batches taken (by this thread, or another), outside the lock and in the
        order they were taken: an instance may be given its next request while
        its execute runs (execute prefetch), and two threads each sending the one they took
        could reach its stub in the other order, which runs them so (a stream of an ensemble
        got two responses swapped, found by QA with cancels from another thread). See
        :class:`._outbox.Outbox`."""
        self._outbox.drain(self._send)

    def _send(self, inst: Instance, batch: list[HostRequest]) -> None:
        stub = inst.stub
        assert stub is not None
        t0 = time.monotonic_ns()
        peer = stub.channel.peer
        encode_many = self.server.transport.encode_many
        bodies: list[RequestBody] = []
        ok: list[HostRequest] = []
        for req in batch:
            try:
                inputs = encode_many(req.inputs, peer)
            except ShmExhaustedError as exc:
                if self._retry_later(req, exc):
                    continue
                self.stats.request_failed(time.monotonic_ns() - req.t_enqueue, "BACKEND")
                req.fail(UnavailableError(str(exc)))
                continue
            except Exception as exc:
                # E.g. no file descriptor left for a new segment (FdLimitError). Raised out of
                # here, it left the instance busy and the request in flight for ever.
                self.stats.request_failed(time.monotonic_ns() - req.t_enqueue, "BACKEND")
                cls = (UnavailableError if isinstance(exc, FdLimitError)
                       else InvalidArgumentError if isinstance(exc, ValueError)
                       else InternalError)
                req.fail(cls(f"the inputs cannot be passed to model '{self.name}': {exc}"))
                continue
            if self.reshapes is not None:
                # The model sees an input in its reshape form: the same contiguous data, so
                # only the wire's shape changes (the request keeps the client's shapes).
                for wire in inputs:
                    shape = self.reshapes.input_shape(wire[0], wire[2])
                    if shape is not None:
                        wire[2] = shape
            req.t_start = t0
            ok.append(req)
            bodies.append({
                "id": req.id, "model": self.name, "version": self.version,
                "request_id": req.request_id, "correlation_id": req.correlation_id,
                "flags": req.flags, "timeout": req.timeout_us, "parameters": req.parameters,
                "inputs": inputs, "outputs": req.requested or self.all_outputs,
            })
            if self.state_outputs:
                wanted = req.requested
                bodies[-1]["outputs"] = (
                    wanted + [n for n in self.state_outputs if n not in wanted] if wanted
                    else self.all_and_states)
            if req.gpu_ok:
                bodies[-1]["gpu_ok"] = True
            if req.pacer is not None:
                bodies[-1]["pace"] = req.pacer.limits()
            if req.trace is not None:  # for request.trace(): BLS calls traced under it
                bodies[-1]["trace"] = req.trace.id
                context = req.trace.otel_context()
                if context is not None:
                    bodies[-1]["trace_context"] = context
        exec_id = inst.next_exec_id()
        if not ok:
            self._finish_execute(inst, batch)
            return
        t1 = time.monotonic_ns()
        for req in ok:
            inst.active[req.id] = req
        inst.inflight[exec_id] = (ok, t1, t1 - t0)
        try:
            stub.send(Cmd.EXECUTE, exec_id, {"requests": bodies})
        except (TritonpyError, OSError):
            pass  # the stub is dying: its death path fails this batch
        except (OverflowError, UnicodeError, TypeError, ValueError) as exc:
            self._unsendable(inst, exec_id, ok, bodies, exc)
        self.server.frames.spin()  # its answer will find the loop awake

    def _unsendable(self, inst: Instance, exec_id: int, reqs: list[HostRequest],
                    bodies: list[RequestBody], exc: Exception) -> None:
        """A batch the channel could not encode (a value past 64 bits, a string that is not
        text, ...: what got past validation): each request that cannot be encoded fails with
        the reason, the others go back to the head of the queue, and the instance is free
        again. It used to stay busy for ever, and the model with it."""
        inst.inflight.pop(exec_id, None)
        bad: list[HostRequest] = []
        good: list[HostRequest] = []
        for req, body in zip(reqs, bodies):
            inst.active.pop(req.id, None)
            try:
                msgpack.packb(body, use_bin_type=True)
            except Exception as why:
                bad.append(req)
                req.fail(InvalidArgumentError(
                    f"[request id: {req.request_id or '<id_unknown>'}] the request cannot be "
                    f"passed to model '{self.name}': a value of it cannot be encoded "
                    f"({type(why).__name__}: {why})"))
            else:
                good.append(req)
        if not bad:  # not a request's own value: fail them all rather than loop
            for req in good:
                req.fail(InternalError(f"the batch cannot be passed to model '{self.name}': "
                                       f"{type(exc).__name__}: {exc}"))
            bad, good = good, []
        with self.lock:
            if good:
                for req in good:
                    req.instance = None
                self.sched.requeue(good)
        self._finish_execute(inst, bad)

    def _retry_later(self, req: HostRequest, exc: ShmExhaustedError) -> bool:
        """On the frame loop, which does not wait for room (see Server._reclaim): queue a
        request whose inputs found /dev/shm full again a moment later, for up to
        SHM_RETRY_FOR_S, while the other processes give back the idle segments they were just
        asked for. Not for a sequence (it would lose its place), nor for a tensor that cannot
        fit at all. Whether it will be retried."""
        frames = self.server.frames
        if exc.reason != NO_SPACE or not frames.on_loop() or self.sched_is_sequence \
                or not could_fit(self.server.pool.directory, exc.asked):
            return False
        now = time.monotonic()
        if not req.shm_retry_until:
            req.shm_retry_until = now + SHM_RETRY_FOR_S
        elif now >= req.shm_retry_until:
            return False
        req.instance = None  # queued again: a cancel meanwhile counts as one of a queued request
        frames.loop.call_later(SHM_RETRY_EVERY_S, self._retry, req)
        return True

    def _retry(self, req: HostRequest) -> None:
        if not req.done:
            self.submit(req)

    def _finish_execute(self, inst: Instance, batch: list[HostRequest]) -> None:
        with self.lock:
            inst.running -= 1
            granted = self._release(inst) if inst.holding else None
            self.sched.finished(inst, batch)
            plans = self._take_locked()
            if not inst.running and (self._draining and not inst.active
                                     or inst.state in ("STARTING", "RESTARTING")):
                self._idle.notify_all()  # a drain, or a warmup (_warmup), waits for this
        if plans:
            self._send_taken()
        if granted:
            self.server.tell_reserved(granted)

    def _cancelled(self, req: HostRequest, error: TritonpyError) -> None:
        with self.lock:
            inst = req.instance
            if inst is None and self.sched_is_sequence:
                self.sched.aborted(req, error)  # its sequence ends there
        if inst is None:  # still queued: it will not run (taking a batch skips it)
            self.stats.request_failed(time.monotonic_ns() - req.t_enqueue,
                                      "CANCELED" if isinstance(error, CancelledError)
                                      else "REJECTED")
            self.withdraw_if_idle()
            return
        if inst.stub is not None and inst.stub.alive:
            try:
                inst.stub.send(Cmd.CANCEL, 0, [req.id])
            except Exception:
                pass

    def _timed_out(self, req: HostRequest) -> None:
        """``req``'s ``timeout`` passed. A client's request times out only while it is queued,
        as in Triton: once an instance runs it, it runs to its end. A BLS call's timeout bounds
        the whole call (see the README's BLS differences)."""
        why = REQUEST_TIMEOUT
        with self.lock:
            if req.instance is not None and req.caller is None:
                return
            if self.sched_is_sequence and self.sched.waits_for_slot(req):
                why = SEQUENCE_TIMEOUT  # Triton's words for a sequence that waited too long
        req.abort(UnavailableError(why))

    def _alive(self) -> bool:
        return any(i.state in ("READY", "RETIRING") for i in self.instances)
