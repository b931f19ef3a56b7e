"""BLS routing: a stub's InferenceRequest is validated and scheduled like a client's, and its
responses go back to that stub. Also the deadlock detector the real Triton lacks.

A deadlock is a set of BLS waits (``exec()``, or ``await async_exec()`` inside an ``async def
execute``) that can never finish: a request queued at a model whose every instance is blocked
waiting, directly or through other such requests, on that very request's progress (a model
calling itself with every instance busy, or A <-> B both busy).
The newest request of such a cycle is answered with an error naming the cycle, which unblocks
its caller instead of hanging.

A decoupled BLS stream is paced by the caller's model as a client's stream is by its consumer
(see ``_request.HOLD_BYTES``): the producer's stub waits to send once too much of what it sent
is not taken yet; the caller's stub tells the host how many responses its model took (ACK), and
the host passes that on to the producer's stub. The deadlock detector knows of it: a producer
waiting to send waits for the execute that reads its stream, which is blocked if it waits on
other calls that cannot progress (a model reading a stream issued after another one the same
producer instance serves first); the streams of such a cycle are paced no more, which ends it.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from tritonpy.shm import Cmd, SegmentGoneError
from tritonpy.shm.messages import MEMORY_GPU

from . import _request
from ._errors import InvalidArgumentError, NotFoundError, TritonpyError, UnavailableError
from ._ensemble_gate import _StepPacing
from ._request import HostRequest, _Pacing

if TYPE_CHECKING:
    from ._instances import Instance
    from ._model import ModelRuntime
    from ._stubproc import StubProcess

log = logging.getLogger("tritonpy.bls")

# The first check waits a little: a real deadlock persists, a transient state does not.
_FIRST_CHECK_S = 0.02
_RECHECK_S = 0.25


def _refused(body: Any, err: TritonpyError) -> TritonpyError:
    """``err`` for a BLS call (its frame's ``body``) refused before it was queued (unknown
    model, bad inputs, a scheduler that will not take it), in Triton's words: its Python
    backend prefixes these, not the errors of a request that ran."""
    request = body.get("request")
    model = request.get("model", "") if isinstance(request, dict) else ""
    return type(err)(f"Model {model} - Error when running inference: {err.message}", err.code)


class _StreamPacing(_Pacing):
    """Back-pressure on a decoupled BLS stream, paced by the calling stub's model: the
    producer's HELD is passed on to the caller's stub, which from then on reports what its
    model took (Cmd.ACK from the caller, in batches as :meth:`_Pacing._took` makes them), and
    each report goes on as the producer's ACK. A caller that takes nothing for
    ``HELD_STALLED_S`` while the producer waits has the request cancelled, as a client has."""

    def __init__(self, caller: StubProcess, call_id: int) -> None:
        self.caller = caller
        self.call_id = call_id
        self.request: HostRequest | None = None

    def _tell_held(self) -> None:
        try:  # the limits along: the caller's stub batches its reports by them
            self.caller.send(Cmd.HELD, 0, [[self.call_id, _request.HOLD_BYTES,
                                            _request.HOLD_RESPONSES]])
        except Exception:  # the caller is gone: its calls are cancelled as it is reaped
            pass

    def taken(self, taken: int) -> None:
        """The caller's model took ``taken`` of the stream's responses so far."""
        self._last_take = time.monotonic()
        with self._pace_lock:
            if taken <= self._acked:
                return
            self._acked = self._taken = taken
        self._ack(taken)


class BlsRouter:
    """Handles BLS_INFER / BLS_CANCEL frames for the server."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.deadlocks = 0

    def infer(self, model: ModelRuntime, inst: Instance, stub: StubProcess, call_id: int,
              body: dict) -> None:
        decoupled = bool(body.get("decoupled"))
        peer = stub.channel.peer
        srv = self.server
        # The thread submitting the request, while it does: an error the scheduler answers
        # then is a refusal (the request was never queued), in Triton's words too.
        submitting = [0]

        def reply_error(err: TritonpyError) -> None:
            err = _refused(body, err)
            try:
                stub.send(Cmd.BLS_RESPONSE, call_id, {"error": err.to_wire(), "final": True})
            except Exception:
                pass

        try:
            rb = body["request"]
            try:
                target = srv.runtime(str(rb["model"]), int(rb.get("version", -1)))
            except NotFoundError as exc:  # Triton's sentence first: models match on it
                raise NotFoundError(f"Failed for execute the inference request. Model "
                                    f"'{rb['model']}' is not ready. ({exc.message})") from None
            if target.decoupled and not decoupled:  # Triton's words
                raise InvalidArgumentError(
                    f"Model {target.name} is using the decoupled. The current BLS request call "
                    "doesn't support models using the decoupled transaction policy. Please use "
                    "'decoupled=True' argument to the 'exec' or 'async_exec' calls for "
                    "decoupled models.")
            inputs = srv.transport.decode_many(rb.get("inputs") or [], peer)
            params = rb.get("parameters") or {}
            for k, v in params.items():
                if not isinstance(v, (bool, int, str)):
                    raise InvalidArgumentError(
                        f"BLS parameter '{k}' has type {type(v).__name__}; bool, int or str only")
        except TritonpyError as exc:
            reply_error(exc)
            return
        except SegmentGoneError as exc:  # not the caller's fault: it may send it again
            reply_error(UnavailableError(f"cannot receive the BLS request's inputs: {exc}"))
            return
        except (KeyError, TypeError, ValueError) as exc:
            reply_error(InvalidArgumentError(f"malformed BLS request: {exc}"))
            return

        # Paced by the caller's model (a decoupled target's stream; a decoupled ensemble's
        # steps through it: see _ensemble_gate._ConsumerPacing).
        pacer = _StreamPacing(stub, call_id) if decoupled and target.decoupled else None

        def sink(req: HostRequest, outputs: Any, error: TritonpyError | None,
                 parameters: dict | None, final: bool) -> None:
            if pacer is not None:
                pacer._held = False  # (a response after HELD: the producer goes on)
                if final:
                    pacer.request = None  # (the request <-> pacer cycle)
            if not stub.alive or inst.stub is not stub:
                return
            out: dict[str, Any] = {"final": final}
            if outputs is None:
                out["empty"] = True
            else:
                try:
                    out["outputs"] = srv.transport.encode_many(outputs, peer)
                except TritonpyError as exc:
                    error = exc
                except Exception as exc:  # e.g. shm exhausted while forwarding
                    error = UnavailableError(str(exc))
            if error is not None:
                if final and submitting[0] == threading.get_ident():
                    error = _refused(body, error)
                out["error"] = error.to_wire()
            if parameters:
                out["parameters"] = parameters
            if final:
                inst.waiting_on.discard(req)
                inst.bls_calls.pop(call_id, None)
            try:
                stub.send(Cmd.BLS_RESPONSE, call_id, out)
            except Exception:
                pass

        req = HostRequest(
            target, inputs, rb.get("outputs") or None, sink,
            request_id=str(rb.get("request_id", "")),
            correlation_id=rb.get("correlation_id", 0), flags=int(rb.get("flags", 0)),
            timeout_us=int(rb.get("timeout", 0)), parameters=params,
        )
        req.caller = inst
        memory = rb.get("preferred_memory")
        req.gpu_ok = not (type(memory) is list and memory and memory[0] != MEMORY_GPU)
        trace_id = rb.get("trace")
        if type(trace_id) is int and trace_id > 0:
            # InferenceRequest(..., trace=request.trace()): traced under that request's trace,
            # if it is one that this instance executes now.
            parent = next((r.trace for r in list(inst.active.values())
                           if r.trace is not None and r.trace.id == trace_id), None)
            if parent is not None:
                req.trace = parent.child(target.name)
        # Waits count only while the execute that made the call runs (a task an async execute
        # left behind may still call after its execute has returned).
        key = body.get("exec")
        req.caller_exec = key if type(key) is int and key in inst.active else 0
        try:
            srv.validate(target, req)
        except TritonpyError as exc:
            reply_error(exc)
            return
        if pacer is not None:
            pacer.request = req
            pacer.pace(req, srv.timers)
        inst.bls_calls[call_id] = req
        if req.caller_exec:
            inst.waiting_on.add(req)
        # An ensemble answers its steps' errors as errors of a request that ran.
        submitting[0] = 0 if target.is_ensemble else threading.get_ident()
        try:
            target.submit(req)
        finally:
            submitting[0] = 0

    def cancel(self, inst: Instance, call_id: int) -> None:
        req = inst.bls_calls.get(call_id)
        if req is not None:
            req.cancel("BLS request cancelled by the caller")

    def taken(self, inst: Instance, body: Any) -> None:
        """ACK from a caller's stub: [[call id, responses its model took], ...]."""
        for item in body if type(body) is list else ():
            if type(item) is not list or len(item) != 2:
                continue
            call_id, taken = item
            req = inst.bls_calls.get(call_id) if type(call_id) is int else None
            pacer = req.pacer if req is not None else None
            if type(pacer) is _StreamPacing and type(taken) is int and taken >= 0:
                pacer.taken(taken)

    # -- deadlock detection ------------------------------------------------------------------
    def watch(self, req: HostRequest) -> None:
        """Check a queued BLS request that an execute waits on for a deadlock shortly, and
        again while it waits."""
        self.server.timers.at(time.monotonic() + _FIRST_CHECK_S, lambda: self._check(req))

    def _check(self, req: HostRequest) -> None:
        if req.done or req.instance is not None:
            return
        found = self._find_cycle(req)
        if found is None:
            self.server.timers.at(time.monotonic() + _RECHECK_S, lambda: self._check(req))
            return
        cycle, paced = found
        path = " -> ".join(cycle)
        if paced:
            # The cycle runs through producers that wait for their reader (pacing), and the
            # reader waits on calls that those producers hold up: pace them no more, and the
            # cycle is gone (this request may still wait for them to end: look again).
            for stream in paced:
                pacer = stream.pacer
                if type(pacer) is _StreamPacing:
                    log.info("the BLS stream of model '%s' read by '%s' is paced no more: "
                             "its reader waits on a call that waits on it (%s)",
                             stream.model.name, stream.caller.name, path)
                    pacer.unpace()
            self.server.timers.at(time.monotonic() + _RECHECK_S, lambda: self._check(req))
            return
        self.deadlocks += 1
        msg = (f"BLS deadlock: request to model '{req.model.name}' can never run because every "
               f"instance it needs is blocked waiting on it ({path}); add instances or avoid "
               "the circular call")
        log.error("%s", msg)
        with req.model.lock:
            try:
                req.model.queue.remove(req)
            except ValueError:
                return  # dispatched meanwhile: not a deadlock after all
        req.fail(UnavailableError(msg))

    def _find_cycle(self, req: HostRequest) -> tuple[list[str], list[HostRequest]] | None:
        """The chain of instances that makes ``req`` unservable, and the paced streams in it
        (see ``_held_by_exec``); None if it can progress.

        An execute is blocked while it waits on BLS calls none of which can make progress (a
        sync execute waits on one call at a time; an async one may await several, and is
        blocked only while all of those it still waits for are stuck), or, waiting on none,
        while it waits to send on a decoupled BLS stream whose reader is blocked on other
        calls (pacing). An instance is stuck iff it is busy and every execute it runs is
        blocked."""
        on_path: list[str] = []
        seen: set[int] = set()  # the instances on the path (a cycle: assume stuck)
        reading: set[tuple[int, int]] = set()  # the reading executes on the path
        paced: list[HostRequest] = []  # the paced streams the cycle runs through

        def on_path_if(marks: set, key: Any, label: str, stuck_of: Callable[[], bool]) -> bool:
            # ``label`` is on the path (``key`` in ``marks``: coming back to it is a cycle)
            # while ``stuck_of`` decides; if not stuck, it comes off again, with the paced
            # streams found meanwhile.
            marks.add(key)
            on_path.append(label)
            mark = len(paced)
            stuck = stuck_of()
            if not stuck:
                on_path.pop()
                marks.discard(key)
                del paced[mark:]
            return stuck

        def inst_stuck(inst: Instance) -> bool:
            if id(inst) in seen:
                return True  # a cycle: assume stuck (greatest fixed point)
            if inst.limits and inst.state == "READY" and not inst.running:
                return starved(inst)
            if inst.state != "READY" or inst.running < inst.capacity:
                return False
            waits = _waits_by_exec(inst)
            held = _held_by_exec(inst)
            execs = waits.keys() | held.keys()
            if len(execs) < inst.capacity:  # an execute that waits on nothing
                return False
            return on_path_if(seen, id(inst), inst.name, lambda: all(
                exec_stuck(waits.get(k, ()), held.get(k, ())) for k in execs))

        def starved(inst: Instance) -> bool:
            # Idle, waiting for rate limiter resources: stuck iff every holder of one it
            # lacks is stuck (none of them will give any back).
            if inst.admitted():
                return False
            return on_path_if(
                seen, id(inst), f"{inst.name} (waiting for rate limiter resources)",
                lambda: any(holders and all(inst_stuck(h) for h in holders)
                            for holders in self.server.limiter.lacking_holders(inst)))

        def exec_stuck(waits: Any, held: Any) -> bool:
            if waits:
                return all(req_stuck(r) for r in waits)
            return bool(held) and all(reader_stuck(r) for r in held)

        def reader_stuck(stream: HostRequest) -> bool:
            # The execute reading a paced stream is blocked iff it waits on other calls, all
            # stuck: waiting on nothing but this stream, it reads it (slowly, maybe).
            reader, key = stream.caller, stream.caller_exec
            if reader is None or not key:
                return False
            if (id(reader), key) in reading:
                return True  # a cycle
            if not any(batch[0].id == key for batch, _, _ in list(reader.inflight.values())):
                return False  # read outside an execute: whether it is blocked is not seen
            others = [r for r in _waits_by_exec(reader).get(key, ()) if r is not stream]
            if not others:
                return False
            stuck = on_path_if(reading, (id(reader), key),
                               f"{reader.name} reading {stream.model.name}",
                               lambda: all(req_stuck(r) for r in others))
            if stuck:
                paced.append(stream)
            return stuck

        def req_stuck(r: HostRequest) -> bool:
            if r.done:
                return False
            if r.instance is not None:  # executing: progresses unless its instance is stuck
                return inst_stuck(r.instance)
            model = r.model
            if model.is_ensemble:  # stuck iff every running step is
                steps = model.pending_steps(r)
                return bool(steps) and all(req_stuck(s) for s in steps)
            if any(i.free() for i in model.instances):
                return False
            # A RETIRING instance (removed by an update) takes no queued request, nor does a
            # passive one. With no instance left to wait on there is no cycle either (the
            # model is unloading).
            live = [i for i in model.instances
                    if i.state not in ("STOPPED", "RETIRING") and not i.passive]
            return bool(live) and all(inst_stuck(i) for i in live)

        if req_stuck(req):
            return [f"{req.model.name}"] + on_path, paced
        return None


def _waits_by_exec(inst: Instance) -> dict[int, list[HostRequest]]:
    """The BLS calls ``inst``'s running executes wait on, by execute."""
    waits: dict[int, list[HostRequest]] = {}
    for r in list(inst.waiting_on):
        if not r.done:
            waits.setdefault(r.caller_exec, []).append(r)
    return waits


def _held_by_exec(inst: Instance) -> dict[int, list[HostRequest]]:
    """The requests of ``inst``'s running executes whose model waits to send on a decoupled
    BLS stream until its reader takes more (HELD), by execute: the stream's request, which is
    the ensemble's where the request is the step of a decoupled ensemble that a BLS caller
    reads (its consumer paces the step)."""
    held: dict[int, list[HostRequest]] = {}
    for batch, _, _ in list(inst.inflight.values()):
        for r in batch:
            pacer = r.pacer
            if pacer is None or not pacer._held or r.done:
                continue
            if type(pacer) is _StepPacing:
                stream = pacer.outer
                while stream is not None and type(stream.pacer) is _StepPacing:
                    stream = stream.pacer.outer  # (a step of an ensemble that is a step)
                if stream is not None and type(stream.pacer) is _StreamPacing and not stream.done:
                    held.setdefault(batch[0].id, []).append(stream)
            elif type(pacer) is _StreamPacing:
                held.setdefault(batch[0].id, []).append(r)
    return held
