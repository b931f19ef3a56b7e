"""A loaded model version: its instances (one stub each), its queue and its scheduler.

State machine of a model: LOADING -> READY -> UNLOADING -> UNAVAILABLE (or LOADING ->
UNAVAILABLE with a reason). An instance is STARTING, READY, RESTARTING (its stub died; requests
go to the other instances meanwhile) or STOPPED. Requests are served FIFO by the first free
instance; with ``dynamic_batching`` several queued requests go to one ``execute`` call.

This module holds the version's lifecycle; its request path is in :mod:`._model_dispatch`,
its response path in :mod:`._model_responses`, and its instances in :mod:`._instances`.
"""
from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any, Callable

from tritonpy.shm import Cmd

from ._errors import (
    InternalError,
    InvalidArgumentError,
    TritonpyError,
    UnavailableError,
    load_cancelled,
    version_failed,
)
from ._instances import Instance, initialize_args, plan_instances, take_back
from ._model_responses import ModelResponses
from ._outbox import Outbox
from ._request import HostRequest
from ._runtime_base import READY, UNAVAILABLE, side_by_side
from ._scheduler import FifoScheduler, fail_queued, make_scheduler
from ._stubproc import StubProcess
from . import _warmup

log = logging.getLogger("tritonpy.model")
DEFAULT_MAX_ASYNC = 8


# Tries of a restart whose replacement dies as it starts (or cannot be spawned) before what
# waits for it is failed; the restart goes on after that.
_RESTART_TRIES = 3
# An instance that dies within this long of its start is crash-looping: each such death
# doubles the back-off of its restart (up to 32 times restart-backoff-seconds, and 10 s).
CRASH_LOOP_S = 30.0


class ModelRuntime(ModelResponses):
    """One version of one model, loaded.

    Here its lifecycle: loading (its instances started and initialized), the in-place update
    of its instances, the death and restart of a stub, readiness and unloading. The request
    path is in :class:`~tritonpy._model_dispatch.ModelDispatch` and the response path in
    :class:`~tritonpy._model_responses.ModelResponses`, its bases.
    """

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
        # Implicit state: the state outputs the model is always asked for (see _sequence_controls).
        self.state_outputs: list[str] = (
            list(self.sched.controls.state_outputs) if self.sched_is_sequence else [])
        # What the stub is asked for when the request names no output: every output, and the
        # state outputs (built once).
        self.all_and_states = self.all_outputs + [
            n for n in self.state_outputs if n not in self.all_outputs]
        self.queue: Any = self.sched.queue
        # Batches taken, sent in the order taken (see ModelDispatch._send_taken).
        self._outbox: Outbox = Outbox(self.lock, f"model '{name}': sending a batch")
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
            self._send_taken()

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

        Instances alike in everything but name and count (see
        :func:`._instances.instance_signature`), on the same device, are kept, busy ones
        first; new ones are initialized while the others serve. Removed ones take no new work;
        once their in-flight executes end (bounded by the server's exit timeout) they are
        finalized before this returns. One that holds sequences
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
            self._take_locked()  # (into the outbox)
        self._send_taken()
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
            if was != "RETIRING":
                self.sched.instance_died(inst)
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
                    for r in batch if not r.null]  # (a sequence batcher's fillers aside)
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
