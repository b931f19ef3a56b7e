"""A loaded model version: its instances (one stub each), its queue and its scheduler.

State machine of a model: LOADING -> READY -> UNLOADING -> UNAVAILABLE (or LOADING ->
UNAVAILABLE with a reason). An instance is STARTING, READY, RESTARTING (its stub died; requests
go to the other instances meanwhile) or STOPPED. Requests are served FIFO by the first free
instance; with ``dynamic_batching`` several queued requests go to one ``execute`` call.
"""
from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any, Callable, Sequence

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
    error_from_wire,
    load_cancelled,
    version_failed,
)
from ._instances import Instance, initialize_args, plan_instances, take_back
from ._request import HostRequest
from ._runtime_base import READY, UNAVAILABLE, RuntimeBase, reshape_arrays, side_by_side
from ._scheduler import REQUEST_TIMEOUT, FifoScheduler, fail_queued, make_scheduler
from ._sequence import SEQUENCE_TIMEOUT
from ._stubproc import StubProcess
from . import _warmup

log = logging.getLogger("tritonpy.model")
# A request whose inputs find /dev/shm full on the frame loop is queued again this often, for
# this long (see ModelRuntime._retry_later).
SHM_RETRY_EVERY_S = 0.05
SHM_RETRY_FOR_S = 0.25

# The stub's frames, as plain ints: _on_frame compares each frame's command with them, and an
# IntEnum member compares several times slower.
_EXECUTE_DONE = int(Cmd.EXECUTE_DONE)
_RESPONSE_SEND = int(Cmd.RESPONSE_SEND)
_HELD = int(Cmd.HELD)
DEFAULT_MAX_ASYNC = 8


# Tries of a restart whose replacement dies as it starts (or cannot be spawned) before what
# waits for it is failed; the restart goes on after that.
_RESTART_TRIES = 3
# An instance that dies within this long of its start is crash-looping: each such death
# doubles the back-off of its restart (up to 32 times restart-backoff-seconds, and 10 s).
CRASH_LOOP_S = 30.0


class ModelRuntime(RuntimeBase):
    """One version of one model, loaded."""

    def __init__(self, server: Any, name: str, version: int, config: Any, config_json: str,
                 model_dir: str, source: dict[str, str]) -> None:
        super().__init__(server, name, version, config, config_json, model_dir)
        # Where its stubs import the model from (see repository.model_source).
        self.source = source
        params = {k: v.string_value for k, v in config.parameters.items()}
        try:
            self.max_async = int(params.get("max_concurrent_executes", DEFAULT_MAX_ASYNC))
        except ValueError:
            self.max_async = 0
        if self.max_async < 1:  # 0 loaded READY and let no request reach an async execute
            raise InvalidArgumentError(
                f"model '{name}': parameter max_concurrent_executes must be an integer of 1 "
                f"or more, got {params['max_concurrent_executes']!r}")
        self.instances = [Instance(self, n, kind, dev, sig)
                          for n, kind, dev, sig in plan_instances(config, name)]
        # Batch formation (FIFO, dynamic batcher or sequence batcher); ``queue`` is its view
        # of what waits, deque-like, for drain / unload / the BLS deadlock detector.
        try:
            self.sched = make_scheduler(self)
        except Exception as exc:  # as Triton: its scheduler is made as the version loads
            err = exc if isinstance(exc, TritonpyError) else InternalError(
                f"{type(exc).__name__}: {exc}")
            if err is not exc:  # a bug of ours: where it is goes to the log
                log.exception("model '%s' version %d: making its scheduler failed", name,
                              version)
            raise type(err)(version_failed(version, err)) from exc
        self.sched_is_sequence = config.HasField("sequence_batching")
        # Implicit state: the state outputs the model is always asked for (see _sequence).
        self.state_outputs: list[str] = (
            list(self.sched.controls.state_outputs) if self.sched_is_sequence else [])
        # What the stub is asked for when the request names no output: every output, and the
        # state outputs (built once).
        self.all_and_states = self.all_outputs + [
            n for n in self.state_outputs if n not in self.all_outputs]
        self.queue: Any = self.sched.queue
        # Default mode: a response sent without the final flag, until the flag comes.
        self._held: dict[int, tuple] = {}
        # Why requests are refused at once while no instance is alive: every instance died
        # and its restart failed, or has not succeeded within stub-timeout-seconds. Cleared
        # when an instance is back.
        self.unserviceable = ""
        # The server's response cache, when this model asks for it (a decoupled one cannot).
        self.cache = (server.response_cache if config.response_cache.enable
                      and not self.decoupled else None)
        self.rate_limited = False  # an instance of it needs rate limiter resources
        # Every instance is passive: nothing would ever run a request.
        self.passive_only = all(i.passive for i in self.instances)

    # -- loading ------------------------------------------------------------------------------
    def load(self) -> None:
        """Start and initialize every instance; on any failure stop them all and raise."""
        try:
            self._limit(self.instances)
            self._start_all(self.instances)
        except TritonpyError:
            self.state = UNAVAILABLE
            raise
        self.state = READY
        if self.rate_limited:
            self.server.limiter.log_resources()

    def _state_after_failure(self) -> str:
        """This version's state in Triton's words once a start of instances failed: READY for
        an update of a version that serves on (its instances are kept), else UNAVAILABLE."""
        return READY if self.state == READY else UNAVAILABLE

    def _limit(self, insts: list[Instance]) -> None:
        """Give ``insts`` their rate limiter resources (with ``--rate-limit execution_count``);
        raises this version's failure where one needs more than the server gives."""
        limiter = self.server.limiter
        if limiter is None:
            return
        try:
            limiter.register(insts)
        except TritonpyError as err:
            raise type(err)(version_failed(self.version, err, self._state_after_failure())) from None
        self.rate_limited = self.rate_limited or any(i.limits for i in insts)

    def _start_all(self, insts: list[Instance], config_json: str | None = None,
                   finalize: bool = False) -> None:
        """Start and initialize ``insts`` in parallel; on any failure stop them all (with
        ``finalize``) and raise the first error as this version's failure to load."""
        at_once = threading.BoundedSemaphore(8)

        def start(inst: Instance) -> None:
            with at_once:
                self._start_instance(inst, config_json)

        # (An instance that gets no thread starts on this one: its stub will then say what
        # is missing.)
        errors = side_by_side([(f"{inst.name}-start", functools.partial(start, inst))
                               for inst in insts])
        failed = [e for e in errors if e is not None]
        if not failed:
            return
        for inst in insts:
            inst.state = "STOPPED"
            if inst.stub is not None:
                inst.stub.stop(finalize=finalize, timeout=5 if finalize else 2)
        err = failed[0]
        if not isinstance(err, TritonpyError):
            err = InternalError(str(err))
        raise type(err)(version_failed(self.version, err, self._state_after_failure()))

    def _initialize_args(self, inst: Instance, config_json: str = "") -> dict[str, str]:
        return initialize_args(config_json or self.config_json, inst.kind, inst.name,
                               inst.device_id, self.model_dir, self.version, self.name)

    def _start_instance(self, inst: Instance, config_json: str | None = None,
                        on_hello: Callable[[], None] | None = None) -> None:
        srv = self.server
        env = {}
        if inst.kind == "GPU":
            # Each GPU instance sees only its own device (SPEC §8).
            from ._gpus import device_for_stub

            env["CUDA_VISIBLE_DEVICES"] = device_for_stub(inst.device_id)
        if srv.loads_cancelled:  # no new stub once the server is stopping
            raise load_cancelled()
        stub = StubProcess(inst.name, self.name, srv.transport, srv.options, srv.frames,
                           on_frame=self._on_frame, on_death=self._on_death, extra_env=env,
                           python=self._python(), instance=inst)
        with self.lock:  # an unload stops what it finds here: this one, or none at all
            stopped = inst.state == "STOPPED"
            if not stopped:
                inst.stub = stub
        if stopped:
            stub.stop(finalize=False, timeout=2)
            raise UnavailableError(f"instance '{inst.name}' was stopped as it started")
        srv.track_start(stub)
        try:
            self._bring_up(inst, stub, config_json, on_hello)
        except TritonpyError:  # _bring_up stopped the stub
            if srv.loads_cancelled:
                raise load_cancelled() from None
            raise
        finally:
            srv.untrack_start(stub)
        with self.lock:
            stopped = inst.state == "STOPPED"  # restarted, but unloaded or removed meanwhile
            if stopped or inst not in self.instances:
                plans = None
                if not stopped:  # a new instance of an update: it serves once swapped in
                    inst.state = "READY"
            else:
                inst.state = "READY"
                plans = self._take_locked()
        if stopped:
            stub.stop(finalize=True, timeout=5)
        elif plans is not None:
            self._send_plans(plans)

    def _bring_up(self, inst: Instance, stub: StubProcess, config_json: str | None,
                  on_hello: Callable[[], None] | None) -> None:
        """Wait for ``stub``'s hello, initialize the model in it and run its warmup; on a
        failure the stub is stopped and this raises."""
        try:
            stub.wait_hello(60)
            if on_hello is not None:
                on_hello()
            reply = stub.call(Cmd.INITIALIZE, {
                "args": self._initialize_args(inst, config_json or ""),
                **self.source,
                "decoupled": self.decoupled,
                "max_async": self.max_async,
            }, timeout=None)  # as Triton: as long as the stub lives and answers (watchdog)
        except TritonpyError:
            stub.stop(finalize=False, timeout=2)
            raise
        inst.capacity = self.max_async if reply.get("async") else 1
        inst.prefetch_ns = (int(self.server.options.execute_prefetch_microseconds * 1000)
                            if not reply.get("async") and not self.decoupled
                            and isinstance(self.sched, FifoScheduler) else 0)
        inst.has_is_ready = bool(reply.get("has_is_ready"))
        if self.config.model_warmup:
            try:
                _warmup.run(self, inst)
            except TritonpyError:
                stub.stop(finalize=True, timeout=5)
                raise

    def _python(self) -> list[str] | None:
        return self.server.execution_env(self)

    # -- instance update -------------------------------------------------------------------------
    def update_instances(self, config: Any, config_json: str) -> None:
        """Serve ``config``, which differs from the current one only in its instance groups, by
        adding and removing instances, as Triton's in-place update does.

        Instances alike in everything but name and count (see :func:`instance_signature`), on
        the same device, are kept, busy ones first; new ones are initialized while the others
        serve. Removed ones take no new work; once their in-flight executes end (bounded by the
        server's exit timeout) they are finalized before this returns. One that holds sequences
        lives until they end, then is finalized in the background. On any failure to start a
        new instance, the model keeps its instances and its config, and this raises.
        """
        with self.lock:
            current = [i for i in self.instances if i.state != "RETIRING"]
            held = self.sched.holds
            # Busy instances first: they are the ones kept, the idle ones go.
            pool = sorted(current, key=lambda i: not (i.running or i.active or held(i)))
            taken = {i.name for i in self.instances}
            keep: list[Instance] = []
            new: list[Instance] = []
            for name, kind, dev, sig in plan_instances(config, self.name):
                match = next((i for i in pool if i.signature == sig and i.device_id == dev),
                             None)
                if match is not None:
                    pool.remove(match)
                    keep.append(match)
                    continue
                base, n = name.rsplit("_", 1)[0], 0
                while name in taken:
                    name, n = f"{base}_{n}", n + 1
                taken.add(name)
                new.append(Instance(self, name, kind, dev, sig))
            gone = pool
        if new:  # the model keeps what it has if any of them fails
            self._limit(new)
            self._start_all(new, config_json, finalize=True)
        with self.lock:
            self.config = config
            self.config_json = config_json
            for inst in gone:
                if inst.state in ("READY", "STARTING"):
                    inst.state = "RETIRING"
                else:  # restarting after its stub died: it simply stops
                    inst.state = "STOPPED"
            self.instances = keep + new + [i for i in self.instances if i.state == "RETIRING"]
            self.passive_only = all(i.passive for i in keep + new)
            for inst in new:
                self.sched.add_instance(inst)
            plans = self._take_locked()
        self._send_plans(plans)
        if self.rate_limited:  # (what the retiring ones held no longer counts)
            self.server.limiter.log_resources()
        if gone:
            self._retire(gone, None)
        log.info("model '%s' version %d: instances %s", self.name, self.version,
                 [i.name for i in self.instances if i.state != "RETIRING"])

    def _retire(self, insts: list[Instance], timeout: float | None) -> None:
        """Finalize the RETIRING ones of ``insts`` once idle (waiting at most ``timeout`` for
        their in-flight executes; None: see ``drain``), except those that still hold
        sequences."""
        held = self.sched.holds
        self.drain(timeout, lambda: any(i.state == "RETIRING" and not held(i)
                                        and (i.running or i.active) for i in insts))
        with self.lock:
            done = [i for i in insts if i.state == "RETIRING" and not held(i)]
            for inst in done:
                inst.state = "STOPPED"
                self.sched.remove_instance(inst)
            self.instances = [i for i in self.instances if i not in done]
        for inst in done:
            if inst.stub is not None:
                inst.stub.stop(finalize=True, timeout=min(timeout or 10.0, 10.0))

    def retire_later(self, inst: Instance) -> None:
        """A RETIRING instance's last sequence ended: finalize it in the background (the
        caller holds the model lock)."""
        threading.Thread(target=self._retire, args=([inst], None),
                         daemon=True, name=f"{inst.name}-retire").start()

    # -- scheduling ----------------------------------------------------------------------------
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
            self._send_plans(plans)
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
            self._send_plans(plans)

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

    def _send_plans(self, plans: list[tuple[Instance, list[HostRequest]]]) -> None:
        for inst, batch in plans:
            self._send(inst, batch)

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
            self._send_plans(plans)
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

    # -- frames from the stubs -------------------------------------------------------------------
    def _on_frame(self, stub: StubProcess, msg: list) -> None:
        cmd, call_id, body = msg
        inst: Instance = stub.instance
        if cmd == _EXECUTE_DONE:
            self._on_done(inst, stub, call_id, body)
        elif cmd == _RESPONSE_SEND:
            self._on_response(inst, stub, body)
        elif cmd == _HELD:
            for rid in body if isinstance(body, list) else ():
                req = inst.active.get(rid) if isinstance(rid, int) else None
                if req is not None and req.pacer is not None and not req.done:
                    req.pacer.held()
                else:  # nobody here will acknowledge anything: the stub must not wait
                    try:
                        stub.send(Cmd.ACK, 0, [[rid, -1]])
                    except Exception:
                        pass
        else:
            self.server.on_stub_frame(self, inst, stub, msg)

    def _decode(self, stub: StubProcess, wires: Any) -> list:
        return self.server.transport.decode_many(wires or [], stub.channel.peer)

    def _deliver(self, inst: Instance, stub: StubProcess, req: HostRequest, body: dict) -> None:
        answer = self._answer(inst, stub, req, body)
        if answer is not None:
            req.respond(*answer)

    def _answer(self, inst: Instance, stub: StubProcess, req: HostRequest,
                body: dict) -> tuple | None:
        """``req.respond`` arguments for a response frame (None: held until its final flag).
        Statistics count the request when its execute ends (``_on_done``), not here."""
        err = body.get("error")
        error = error_from_wire(err) if err else None
        try:
            outputs: Any = None if body.get("empty") else self._decode(stub, body.get("outputs"))
        except TritonpyError as exc:
            outputs, error = [], exc
        except FdLimitError as exc:  # not the stub's fault, and it may pass
            outputs, error = [], UnavailableError(
                f"the response of '{inst.name}' cannot be read: {exc}")
        except Exception as exc:
            outputs, error = [], InternalError(f"bad response from '{inst.name}': {exc}")
        if outputs and self.reshapes is not None and self.reshapes.outputs:
            try:
                outputs = self._reshape_outputs(outputs)
            except TritonpyError as exc:
                outputs, error = [], InternalError(f"model '{self.name}': {exc.message}")
        if outputs and self.state_outputs:
            try:
                outputs = self.sched.keep_state(req, outputs, req.requested or self.all_outputs)
            except TritonpyError as exc:
                outputs, error = [], exc
        final = bool(body.get("final", True))
        params = body.get("parameters")
        if not self.decoupled:
            # A default-mode model may answer through its response sender: the response, then
            # the final flag on its own. The caller gets exactly one response, so hold it.
            if not final:
                self._held[req.id] = (outputs, error, params)
                return None
            held = self._held.pop(req.id, None) if self._held else None
            if held is not None and outputs is None:
                if error is not None:
                    # As with Triton, the response the sender sent is the caller's; the error
                    # that came after it (e.g. execute raised) goes to the log.
                    log.error("model '%s' instance '%s': %s", self.name, inst.name, error.message)
                outputs, error, params = held
        if final:
            inst.active.pop(req.id, None)
        return outputs, error, params, final

    def _reshape_outputs(self, outputs: list) -> list:
        """Outputs the model made in their ``reshape`` form, in their ``dims`` form (views)."""
        assert self.reshapes is not None
        return reshape_arrays(outputs, self.reshapes.output_shape)

    def _on_response(self, inst: Instance, stub: StubProcess, body: dict) -> None:
        req = inst.active.get(body.get("id", -1))
        if req is None:
            return  # cancelled or timed out earlier: drop it
        self._deliver(inst, stub, req, body)
        if self._draining and not inst.active and not inst.running:
            with self.lock:
                self._idle.notify_all()

    def _on_done(self, inst: Instance, stub: StubProcess, exec_id: int, body: dict) -> None:
        entry = inst.inflight.pop(exec_id, None)
        if entry is None:
            return
        batch, t_sent, input_ns = entry
        if body.get("returned"):
            self._returned(inst, batch)
            return
        t_done = time.monotonic_ns()
        # A prefetched execute started when the one before it was done, not when it was sent;
        # an instance of an async execute runs its executes side by side (capacity > 1): each
        # started as it was sent.
        t_run = max(t_sent, inst.last_done_ns) if inst.capacity == 1 else t_sent
        inst.last_done_ns = t_done
        inst.exec_mean_ns += (t_done - t_run - inst.exec_mean_ns) / 8
        inst.held_back = False
        responses = body.get("responses")
        if (len(batch) == 1 and not self.decoupled and batch[0].trace is None
                and not inst.waiting_on and "error" not in body and "reschedule" not in body
                and type(responses) is list and len(responses) == 1):
            self._one_done(inst, stub, batch[0], responses[0], t_sent, t_run, t_done, input_ns)
            self._finish_execute(inst, batch)
            return
        by_id = {r.id: r for r in batch}
        resched = set(body.get("reschedule") or ())
        # Every statistic is counted before any caller sees a response in this body: a caller
        # that reads the statistics right after its answer finds its execution in them. (One
        # answered earlier through its response sender may look before they are counted, as
        # with Triton, whose backend also reports them only once execute has returned.)
        answers = []
        for rb in body.get("responses") or ():
            rid = rb.get("id")
            req = by_id.get(rid)
            if req is not None and rid not in resched:
                answer = self._answer(inst, stub, req, rb)
                if answer is not None:
                    answers.append((req, answer))
        err = body.get("error")
        failed = []
        logged = False
        if err:
            error = error_from_wire(err)
            for req in batch:
                if not req.done and req.id not in resched:
                    inst.active.pop(req.id, None)
                    if not self.decoupled and req.id in self._held:
                        # Its response went out through the sender before execute failed:
                        # _answer gives the caller that response and logs the error.
                        answer = self._answer(inst, stub, req,
                                              {"error": err, "empty": True, "final": True})
                        assert answer is not None  # a final response is never held
                        answers.append((req, answer))
                        logged = True
                        continue
                    self._held.pop(req.id, None)
                    failed.append(req)
        requeue = [r for r in batch if r.id in resched and not r.done]
        for r in requeue:
            inst.active.pop(r.id, None)
        if resched or self.decoupled:
            for r in batch:
                # Answered already (cancelled, timed out) and its execute is over: nothing
                # more is delivered for it; a rescheduled one will send no final flag at all.
                if r.done:
                    inst.active.pop(r.id, None)
        t_out = time.monotonic_ns()
        # As Triton counts them: each request this execute ran (a rescheduled one runs again)
        # succeeded unless the execute failed, whatever its responses say (a decoupled one too,
        # whether or not its final flag has come); queue and compute times count successes.
        ran = [r for r in batch if r.id not in resched] if resched else batch
        if self.sched.sends_nulls:  # a direct sequence batcher's fillers: batch rows only
            ran = [r for r in ran if not r.null]
        waited = t_run - t_sent  # in the stub, behind the execute before it: queued time
        if err:
            compute = (input_ns, t_done - t_run, t_out - t_done)
            for r in ran:
                if r.on_compute is not None:  # the ensemble it is a step of answered already
                    r.on_compute(compute)
            self.stats.execution(sum(r.batch_size for r in batch), (),
                                 [t_out - r.t_enqueue for r in ran], *compute)
        else:
            self._count_success(sum(r.batch_size for r in batch), ran, t_out, waited,
                                (input_ns, t_done - t_run, t_out - t_done))
        for r in batch:
            if r.trace is not None:  # a prefetched execute starts when it stops waiting
                r.trace.stamps((("COMPUTE_START", t_run if waited else r.t_start),
                                       ("COMPUTE_INPUT_END", t_run),
                                       ("COMPUTE_OUTPUT_START", t_done), ("COMPUTE_END", t_out)))
        for req, answer in answers:
            req.respond(*answer)
        if err:
            for req in failed:
                req.fail(error)
            # Nobody left to tell (e.g. a decoupled execute returned responses after its final
            # flag): the log says it.
            if not failed and not logged:
                log.error("model '%s' instance '%s': %s", self.name, inst.name, error.message)
        if requeue:
            with self.lock:
                self.sched.requeue(requeue)
        if inst.waiting_on:  # calls this execute left unawaited no longer block it
            key = batch[0].id
            for r in [r for r in list(inst.waiting_on) if r.caller_exec == key]:
                inst.waiting_on.discard(r)
        self._finish_execute(inst, batch)

    def _one_done(self, inst: Instance, stub: StubProcess, req: HostRequest, rb: Any,
                  t_sent: int, t_run: int, t_done: int, input_ns: int) -> None:
        """``_on_done`` for the usual execute: one request of a default-mode model, untraced,
        that succeeded with one response (the same steps, with nothing to sort out between
        several requests or responses)."""
        answer = self._answer(inst, stub, req, rb) if rb.get("id") == req.id else None
        t_out = time.monotonic_ns()
        self._count_success(req.batch_size, (req,), t_out, t_run - t_sent,
                            (input_ns, t_done - t_run, t_out - t_done))
        if answer is not None:
            req.respond(*answer)

    def _count_success(self, rows: int, ran: Sequence[HostRequest], t_out: int, waited: int,
                       compute: tuple[int, int, int]) -> None:
        """The statistics of an execute of ``rows`` rows that succeeded and was over at
        ``t_out``, for the requests it ran: ``compute`` is its (input, infer, output) ns, and
        ``waited`` how long it waited in the stub behind the one before (queue time)."""
        for r in ran:
            r.compute = compute
            if r.on_compute is not None:  # a decoupled step of an ensemble that answered first
                r.on_compute(compute)
        self.stats.execution(rows, [(r.batch_size, t_out - r.t_enqueue,
                                     r.t_start - r.t_enqueue + waited) for r in ran], (),
                             *compute)

    def _returned(self, inst: Instance, batch: list[HostRequest]) -> None:
        """A prefetched execute the stub gave back unrun: the execute before it runs long or
        waits on the server. Its requests queue again, first; that instance prefetches no more
        until its execute is done."""
        inst.held_back = True
        again = take_back(inst.active, batch)
        if again:
            with self.lock:
                self.sched.requeue(again)
        self._finish_execute(inst, batch)
        for req in again:
            if req.caller_exec and req.caller is not None and not req.done:
                self.server.bls.watch(req)

    # -- death and restart ----------------------------------------------------------------------
    def _on_death(self, stub: StubProcess, reason: str) -> None:
        # Every end of a stub comes here, an unload's too: its custom metrics stay.
        self.server.custom_metrics.forget(stub)
        if stub.segments_gone:  # stubs that mapped them (tensors it passed on) let go too
            self.server.broadcast(Cmd.DROPPED, stub.segments_gone, exclude=stub)
        inst: Instance = stub.instance
        if inst.stub is not stub:
            return
        err = UnavailableError(reason)
        with self.lock:
            was = inst.state
            # A replacement that dies while it starts stays RESTARTING: the restart loop that
            # started it tries again after its back-off.
            inst.state = ("RESTARTING" if was in ("READY", "RESTARTING") and self.state == READY
                          else "STOPPED")
            inflight, inst.inflight = inst.inflight, {}
            active, inst.active = inst.active, {}
            calls, inst.bls_calls = inst.bls_calls, {}
            inst.waiting_on.clear()
            inst.running = 0
            granted = self._release(inst) if inst.holding or inst.reserved else []
            inst.held_back = False  # its replacement starts afresh
            for batch, _, _ in inflight.values():
                self.sched.finished(inst, batch)
            # Prefetched requests, sent behind the execute that was running, never started
            # (the stub runs one execute at a time): they queue again, as if never sent.
            back = (sorted(inflight)[1:] if inst.prefetch_ns and inst.state == "RESTARTING"
                    else [])
            unstarted = [r for exec_id in back for r in take_back(active, inflight[exec_id][0])]
            if unstarted:
                self.sched.requeue(unstarted)
            # The requests of an execute that never ended fail with it (the statistics count
            # one whose execute ended, e.g. a decoupled one still streaming, already).
            died = [r for exec_id, (batch, _, _) in inflight.items() if exec_id not in back
                    for r in batch]
            orphans: list[HostRequest] = []
            if was == "RETIRING":  # removed by an update: its sequences end with it
                orphans = self.sched.remove_instance(inst)
                self.instances = [i for i in self.instances if i is not inst]
        now = time.monotonic_ns()
        for req in died:
            self.stats.request_failed(now - req.t_enqueue, "BACKEND")
        for req in orphans:
            if not req.done:
                self.stats.request_failed(now - req.t_enqueue, "BACKEND")
                req.fail(err)
        for req in active.values():
            self._held.pop(req.id, None)
            if not req.done:
                req.fail(err)
        for req in calls.values():  # BLS calls the dead stub made: nobody waits for them now
            req.cancel("the calling stub died")
        if unstarted:
            self.kick()  # another instance may be free for them now
        if granted:
            self.server.tell_reserved(granted)
        if inst.state == "RESTARTING" and was == "READY":
            self.server.on_instance_died(self, inst)
            self.server.frames.start_thread(
                lambda: threading.Thread(target=self._restart, args=(inst,), daemon=True,
                                         name=f"{inst.name}-restart"),
                f"the restart of '{inst.name}'", lambda t: setattr(inst, "restarter", t))
        with self.lock:
            self._idle.notify_all()

    def _restart(self, inst: Instance) -> None:
        delay = self.server.options.restart_backoff_seconds
        # A stub that keeps dying soon after each start was restarted every 0.2 s for ever.
        soon = time.monotonic() - inst.started_at < CRASH_LOOP_S
        inst.crash_loop = min(inst.crash_loop + 1, 5) if soon else 0
        while self.state == READY and inst.state == "RESTARTING":
            backoff = delay * 2 ** min(inst.restarts + inst.crash_loop, 5)
            if self._halt.wait(min(backoff, 10.0)):
                break  # unloaded during the back-off
            if self.state != READY or inst.state != "RESTARTING":
                break
            inst.restarts += 1
            inst.attempt += 1
            attempt = inst.attempt
            try:
                self._start_instance(inst, on_hello=lambda: self._bound_restart(inst, attempt))
                log.warning("restarted instance %s of model %s", inst.name, self.name)
                inst.restarts = 0
                inst.started_at = time.monotonic()
                self.unserviceable = ""
                return
            except TritonpyError as exc:
                if self._restart_stopped(inst):
                    return
                if self.server.loads_cancelled:  # the server is stopping: no more tries
                    self._restart_failed(inst, exc.message)
                    return
                log.error("restart of %s failed: %s", inst.name, exc.message)
                # The model's initialize failed: it will most likely fail again, so what waits
                # is answered now. A replacement that died as it started (say killed) may well
                # start next time: what waits is answered after a few such tries. The restart
                # goes on after the back-off either way.
                if not isinstance(exc, UnavailableError) or inst.restarts >= _RESTART_TRIES:
                    self._restart_failed(inst, exc.message)
            except Exception as exc:  # e.g. the spawn itself failed: try again after the back-off
                if self._restart_stopped(inst):
                    return
                log.exception("restart of %s failed", inst.name)
                if inst.restarts >= _RESTART_TRIES:
                    self._restart_failed(inst, f"{type(exc).__name__}: {exc}")

    def _restart_failed(self, inst: Instance, why: str) -> None:
        self._still_restarting(inst, f"instance '{inst.name}' died and its restart failed: {why}")

    def _bound_restart(self, inst: Instance, attempt: int) -> None:
        """Queued requests wait for a restart, but not without end: once the replacement has
        started (said hello), its initialize gets ``stub-timeout-seconds`` before they are
        failed. Spawning it and the back-off do not count: a loaded machine is slow to start
        a process, and that is no reason to fail them."""
        bound = self.server.options.stub_timeout_seconds
        if bound <= 0:
            return

        def expired() -> None:
            if inst.attempt == attempt:
                self._still_restarting(inst, f"instance '{inst.name}' died and its replacement "
                                             f"has not initialized within {bound:g} s")

        self.server.timers.at(time.monotonic() + bound, expired)

    def _restart_stopped(self, inst: Instance) -> bool:
        """Whether a restart that failed was stopped (an unload or an update): nothing to
        report, and nothing to try again."""
        if inst.state == "RESTARTING" and self.state == READY:
            return False
        log.info("restart of %s ended: the instance was stopped", inst.name)
        return True

    def _alive(self) -> bool:
        return any(i.state in ("READY", "RETIRING") for i in self.instances)

    def _still_restarting(self, inst: Instance, why: str) -> None:
        """If ``inst`` is still restarting and no other instance is alive, fail what is
        queued and refuse new requests at once (with ``why``) until an instance is back; the
        restart goes on meanwhile. Triton fails them too when its stub will not restart."""
        with self.lock:
            if inst.state != "RESTARTING" or self.state != READY or self._alive():
                return
            self.unserviceable = f"model '{self.name}' has no ready instance: {why}"
            leftover = [r for r in self.queue if not r.done]
            self.queue.clear()
        err = UnavailableError(self.unserviceable)
        for req in leftover:
            self.stats.request_failed(time.monotonic_ns() - req.t_enqueue, "BACKEND")
            req.fail(err)

    # -- readiness and unloading ------------------------------------------------------------------
    def ready(self) -> bool:
        if self.state != READY or any(i.state not in ("READY", "RETIRING")
                                      for i in self.instances):
            return False
        for inst in self.instances:
            if inst.has_is_ready and inst.stub is not None:
                try:
                    if not inst.stub.call(Cmd.IS_READY, None, 5.0).get("ready", False):
                        return False
                except TritonpyError:
                    return False
        return True

    def _busy(self) -> bool:
        # Queued requests count only while a live instance can still take them: a stub that
        # died during the drain is not restarted, so they would wait it out. One answered
        # already (cancelled) stays in a batcher's queue until a batch forms, maybe only once
        # its max_queue_delay has passed: it is not waited for.
        queued = any(not r.done for r in self.queue)
        return (queued and any(i.state == "READY" for i in self.instances)) or any(
            i.running or i.active for i in self.instances
            if i.state in ("READY", "RESTARTING", "RETIRING"))

    def _hand_over(self) -> None:
        if self.successor is not None and not self.sched_is_sequence:  # a sequence stays
            self._pass_on_queue()

    def _take_queue(self) -> list[HostRequest]:
        """What is queued and not started, taken off the queue."""
        with self.lock:
            taken = list(self.queue)
            self.queue.clear()
        return taken

    def fail_queue(self, error: TritonpyError) -> None:
        fail_queued(self, self._take_queue(), error, "OTHER")

    def _pass_on_queue(self) -> None:
        """Empty the queue: each request goes to the successor, or fails when there is none."""
        succ = self.successor
        for req in self._take_queue():
            if succ is not None and not req.done:
                self._forward(succ, req)
            else:
                req.fail(UnavailableError(f"model '{self.name}' was unloaded"))

    def _unloaded(self, timeout: float) -> None:
        """Forward or fail what is still queued, then finalize every instance."""
        self._pass_on_queue()
        # After a drain cut short (its exit timeout spent, requests still running) a finalize
        # gets a moment only, and an instance still running a request none: it is ended at
        # once, as Triton then exits at once (a finalize would wait behind the execute that
        # outlasted the timeout). Otherwise a finalize gets what is left of the timeout, a
        # second at least.
        cut = self.cut_short
        grace = 1.0 if cut else min(max(timeout, 1.0), 10.0)
        with self.lock:  # a restart under way sees STOPPED and stops what it started
            # A restarting instance's stub is dead or has not finished initialize: nothing to
            # finalize, it is ended at once.
            stubs = [(i.stub, i.state != "RESTARTING" and not (cut and (i.running or i.active)))
                     for i in self.instances if i.stub is not None]
            for inst in self.instances:
                inst.state = "STOPPED"
            restarters = [i.restarter for i in self.instances if i.restarter is not None]
            self._halt.set()
        # Together, so that instances stuck in finalize cost one grace, not one each.
        for exc in side_by_side([(f"{stub.name}-stop", functools.partial(stub.stop, finalize,
                                                                         grace))
                                 for stub, finalize in stubs]):
            if exc is not None:
                log.error("stopping a stub of model '%s' failed: %r", self.name, exc)
        self.finalize_cut_off = any(stub.finalize_cut_off for stub, _ in stubs)
        for thread in restarters:  # so that no stub outlives the unload
            if thread.ident is not None:  # (one not started yet sees STOPPED when it starts)
                thread.join(grace + 5.0)
