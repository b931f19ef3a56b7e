"""The response path of a loaded model version, stub to host: the frames its stubs send
(responses, the end of an execute, flow control of streamed responses), decoded and
delivered to the callers, and the statistics of each execute.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Sequence

from tritonpy.shm import Cmd
from tritonpy.shm._errors import FdLimitError, SegmentGoneError

from ._errors import InternalError, TritonpyError, UnavailableError, error_from_wire
from ._instances import Instance, take_back
from ._model_dispatch import ModelDispatch
from ._request import HostRequest
from ._runtime_base import reshape_arrays
from ._stubproc import StubProcess

log = logging.getLogger("tritonpy.model")
# The stub's frames, as plain ints: _on_frame compares each frame's command with them, and an
# IntEnum member compares several times slower.
_EXECUTE_DONE = int(Cmd.EXECUTE_DONE)
_RESPONSE_SEND = int(Cmd.RESPONSE_SEND)
_HELD = int(Cmd.HELD)


class ModelResponses(ModelDispatch):
    """The response path of :class:`~tritonpy._model.ModelRuntime`, one of its bases (never
    made on its own): a base class rather than a collaborator for the reasons
    :class:`~tritonpy._model_dispatch.ModelDispatch` gives (each frame reads the instance's
    and the version's state, and ends its execute through the request path).
    """

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
        except (FdLimitError, SegmentGoneError) as exc:  # not the stub's fault; it may pass
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
            # As Triton's stub logs it (QA): an execute that failed (it raised, or returned no
            # list of responses) is in the server's log too, with the model's frames, whoever
            # else is told (and when nobody is left to tell, e.g. a decoupled execute that
            # returned responses after its final flag).
            if not logged:
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

