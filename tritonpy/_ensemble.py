"""Ensembles: ``platform: "ensemble"`` models whose ``ensemble_scheduling`` steps run other
models, with each step's outputs becoming the next steps' inputs. This module runs a loaded
one; its configuration is recognised and checked in :mod:`._ensemble_config`, it is loaded in
:mod:`._ensemble_load`, its back-pressure is :mod:`._ensemble_gate`'s and its responses' output
order :mod:`._ensemble_order`'s.

Running (:class:`EnsembleRuntime` / ``_Context``): a request is a small data-flow machine.
Each ensemble tensor holds one value per *iteration* (a decoupled step produces a new
iteration with each response); a step starts, as its own :class:`HostRequest` through the step
model's scheduler, as soon as every one of its inputs has a value for the same iteration, so
independent branches run concurrently. Step outputs are the arrays the host decoded from the
step's stub — views of that stub's shared memory — and they are handed to the next step as they
are, so the transport forwards their handles instead of copying. Steps the requested outputs do
not need are pruned. The first error fails the request with ``in ensemble '<name>', <the
step's message>``; the other in-flight steps are then cancelled (Triton 2.51 lets them run on,
unseen), as they are when the client cancels the request (Triton 2.51 does not tell them).
A request's responses are made under its lock but delivered after it is released, in the
order they were made (``_Context._deliver``): a consumer that calls back into the request
(a cancel from its sink) cannot wait on a lock its own delivery holds.
The ensemble's own ``reshape`` applies as in Triton: its inputs flow into the steps in their
reshape form, and its outputs leave in their dims form. A tensor passing between a batching and
a non-batching side gains or loses a batch dimension of 1 as it does in Triton
(:func:`._ensemble_config.fit_batch_dim`).

Back-pressure (``ensemble_scheduling.max_inflight_requests``, and a decoupled ensemble's
consumer pacing its decoupled steps): see :mod:`._ensemble_gate`.
"""
from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any, Callable, Iterable, Sequence

from ._ensemble_config import fit_batch_dim
from ._ensemble_gate import RUN, WAIT, _ConsumerPacing, _Owed, _StepGate, _StepPacing
from ._ensemble_order import triton_output_order
from ._errors import (
    InternalError,
    InvalidArgumentError,
    TritonpyError,
    UnavailableError,
)
from ._outbox import Outbox
from ._request import HostRequest, tensor_bytes
from ._runtime_base import READY, RuntimeBase, reshape_arrays

log = logging.getLogger("tritonpy.ensemble")


def _call(fn: Callable[..., None], args: tuple) -> None:
    fn(*args)


# ---------------------------------------------------------------------------- runtime


class _Step:
    __slots__ = ("index", "model", "version", "inputs", "outputs", "requested")

    def __init__(self, index: int, step: Any) -> None:
        self.index = index
        self.model = step.model_name
        self.version = int(step.model_version)
        self.inputs = tuple(step.input_map.items())  # (model input, ensemble tensor)
        self.outputs = dict(step.output_map.items())  # model output -> ensemble tensor
        self.requested = list(self.outputs)


class _Plan:
    """What a request asking for ``requested`` runs: steps, consumers and use counts."""

    __slots__ = ("requested", "consumers", "uses", "steps")

    def __init__(self, steps: Sequence[_Step], requested: Sequence[str]) -> None:
        self.requested = tuple(requested)
        needed = set(requested)
        chosen: set[int] = set()
        changed = True
        while changed:  # backward from the requested outputs
            changed = False
            for st in steps:
                if st.index not in chosen and needed.intersection(st.outputs.values()):
                    chosen.add(st.index)
                    needed.update(t for _, t in st.inputs)
                    changed = True
        self.steps = chosen
        self.consumers: dict[str, list[_Step]] = {}
        # Reads of each tensor: one per input it feeds (a step may take one tensor as two of
        # its inputs, as upstream's ensemble_add_sub_int32_int32_int32 does).
        self.uses: dict[str, int] = {}
        for st in steps:
            if st.index in chosen:
                for t in dict.fromkeys(t for _, t in st.inputs):
                    self.consumers.setdefault(t, []).append(st)
                for _, t in st.inputs:
                    self.uses[t] = self.uses.get(t, 0) + 1
        for t in self.requested:
            self.uses[t] = self.uses.get(t, 0) + 1



class EnsembleRuntime(RuntimeBase):
    """One version of an ensemble, loaded: no stubs (``instances`` stays empty) and no queue of
    its own (steps queue at their models)."""

    is_ensemble = True

    def __init__(self, server: Any, name: str, version: int, config: Any, config_json: str,
                 model_dir: str) -> None:
        super().__init__(server, name, version, config, config_json, model_dir)
        self.queue: list[HostRequest] = []
        self._active: set[_Context] = set()
        self.steps = [_Step(i, s) for i, s in enumerate(config.ensemble_scheduling.step)]
        self.outputs = tuple(io.name for io in config.output)
        self.optional_inputs = tuple(io.name for io in config.input if io.optional)
        # A response lists its outputs in Triton's order (triton_output_order), not in the
        # config's or the request's: each plan holds its requested outputs in that order.
        self._output_rank = {n: i for i, n in enumerate(triton_output_order(self.outputs))}
        self._plans: dict[tuple[str, ...], _Plan] = {}
        self._full_plan = self._plan(self.outputs)
        # As Triton 2.51: an ensemble that enables the response cache is cached as a whole
        # (a hit runs no step); a decoupled one is refused at load.
        self.cache = server.response_cache if config.response_cache.enable else None
        limit = int(config.ensemble_scheduling.max_inflight_requests)
        self.gates = [_StepGate(limit) for _ in self.steps] if limit > 0 else None
        self.delivering = f"ensemble '{name}': delivering a response"  # (see _Context._out)

    def _plan(self, requested: Sequence[str]) -> _Plan:
        key = tuple(requested)
        plan = self._plans.get(key)
        if plan is None:
            last = len(self._output_rank)
            ordered = sorted(key, key=lambda n: self._output_rank.get(n, last))
            plan = self._plans[key] = _Plan(self.steps, ordered)
        return plan

    # -- life cycle ---------------------------------------------------------------------------
    def load(self) -> None:
        self.state = READY

    def step_runtime(self, step: _Step) -> Any:
        """The loaded runtime a step runs on now (a reloaded step model is picked up)."""
        repo = self.server.repo
        try:
            return repo.runtime(step.model, step.version, near=self.namespace)
        except TritonpyError:
            key = repo.step_key(step.model, self.namespace)
            entry = repo.entries.get(key) if key is not None else None
            if entry is not None and entry.runtimes and step.version >= 0:
                raise UnavailableError(
                    f"ensemble '{self.name}' depends on '{step.model}' whose required version "
                    f"{step.version} is not loaded.") from None
            raise UnavailableError(
                f"ensemble '{self.name}' depends on '{step.model}' which has no loaded "
                "version") from None

    def ready(self) -> bool:
        if self.state != READY:
            return False
        for step in self.steps:
            try:
                if not self.step_runtime(step).ready():
                    return False
            except TritonpyError:
                return False
        return True

    def _busy(self) -> bool:
        return bool(self._active)

    def _unloaded(self, timeout: float) -> None:
        """Cancel the requests still running through the steps."""
        with self.lock:
            left = list(self._active)
        for ctx in left:
            ctx.request.cancel(f"ensemble '{self.name}' was unloaded")

    # -- requests -----------------------------------------------------------------------------
    def submit(self, req: HostRequest) -> None:
        """Run a validated request through the steps; responses go to ``req``'s sink."""
        if self.state != READY:
            req.fail(self.not_ready_error())
            return
        # As Triton's, a hit carries no sequence parameters (they are not kept).
        if self.cache is not None and self._answered_from_cache(req, self.cache,
                                                                keep_params=False, queued=False):
            return
        if req.trace is not None:
            req.trace.queued(self.version, req.request_id, req.t_enqueue, req.inputs)
        plan = self._plan(req.requested) if req.requested else self._full_plan
        ctx = _Context(self, req, plan)
        with self.lock:
            self._active.add(ctx)
        ctx.start()

    def _finished(self, ctx: _Context, ok: bool) -> None:
        total_ns = time.monotonic_ns() - ctx.request.t_enqueue
        if ok:
            rows = ctx.request.batch_size
            # As Triton's: compute times are the sums of the steps' (their queueing is not
            # the ensemble's compute), and the ensemble itself queues nothing.
            self.stats.execution(rows, [(rows, total_ns, 0)], (), *ctx.compute_ns)
        else:
            self.stats.request_failed(total_ns, "OTHER")
        with self.lock:
            self._active.discard(ctx)
            if not self._active:
                self._idle.notify_all()
        # The request refers to the context no more, nor its consumer to the context's pacing
        # (reference cycles): a request that its caller dropped goes now, with the responses
        # that waited in its stream (shm blocks), not whenever the cyclic GC runs.
        ctx.request.on_cancel = None
        if ctx.consumer is not None:
            ctx.consumer.consumer.on_taken = None

    def pending_steps(self, req: HostRequest) -> list[HostRequest]:
        """The step requests in flight for ensemble request ``req`` (deadlock detection)."""
        with self.lock:
            ctx = next((c for c in self._active if c.request is req), None)
        if ctx is None:
            return []
        with ctx.lock:
            return list(ctx.pending)


def _in_ensemble(name: str, err: TritonpyError) -> TritonpyError:
    return type(err)(f"in ensemble '{name}', {err.message}", err.code)


class _Context:
    """The state of one ensemble request (see the module docstring)."""

    __slots__ = ("ens", "request", "plan", "values", "batched", "iterations", "uses_left",
                 "launched", "pending", "inflight", "error", "held", "finished", "lock",
                 "compute_ns", "gate_of", "consumer", "_out")

    def __init__(self, ens: EnsembleRuntime, req: HostRequest, plan: _Plan) -> None:
        self.ens = ens
        self.request = req
        self.plan = plan
        self.values: dict[str, dict[int, Any]] = {}
        # Whether each tensor comes from a batching producer: its first dimension is a batch.
        self.batched: dict[str, bool] = {}
        self.iterations: dict[str, int] = {}
        self.uses_left: dict[tuple[str, int], int] = {}
        self.launched: set[tuple[int, int]] = set()
        self.pending: set[HostRequest] = set()
        self.inflight = 0
        self.error: TritonpyError | None = None
        self.held: list | None = None
        self.finished = False
        self.lock = threading.Lock()
        self.compute_ns = [0, 0, 0]  # the steps' input, infer and output ns, summed
        # Under max_inflight_requests: the gate of each step request not yet launched, by id.
        self.gate_of: dict[int, _StepGate] = {}
        # A decoupled ensemble's request paced by its consumer paces its decoupled steps.
        self.consumer = (_ConsumerPacing(req.pacer)
                         if ens.decoupled and req.pacer is not None else None)
        # What _emit made under the lock (responses, then the ending), for _deliver to run
        # after it, in order.
        self._out: Outbox[tuple[Callable[..., None], tuple]] = Outbox(self.lock,
                                                                      ens.delivering)

    # -- tensor book-keeping (under self.lock) --------------------------------------------------
    def _add(self, tensor: str, value: Any, batched: bool) -> tuple[str, int] | None:
        self.batched[tensor] = batched
        it = self.iterations.get(tensor, 0)
        self.iterations[tensor] = it + 1
        uses = self.plan.uses.get(tensor, 0)
        if not uses:
            return None  # nobody in this request's plan reads it
        self.values.setdefault(tensor, {})[it] = value
        self.uses_left[(tensor, it)] = uses
        return (tensor, it)

    def _use(self, tensor: str, it: int) -> Any:
        values = self.values[tensor]
        value = values[it]
        key = (tensor, it)
        left = self.uses_left[key] - 1
        if left:
            self.uses_left[key] = left
        else:  # last reader: drop our reference so the step's shm block can be released
            del self.uses_left[key]
            del values[it]
        return value

    def _next_steps(self, updated: Iterable[tuple[str, int]]) -> list[HostRequest]:
        out: list[HostRequest] = []
        values = self.values
        for tensor, it in updated:
            for step in self.plan.consumers.get(tensor, ()):
                key = (step.index, it)
                if key in self.launched:
                    continue
                if all(it in values.get(t, ()) for _, t in step.inputs):
                    self.launched.add(key)
                    out.append(self._make_step(step, it))
        return out

    def _make_step(self, step: _Step, it: int) -> HostRequest:
        ens, parent = self.ens, self.request
        rt = ens.step_runtime(step)
        inputs = []
        batched = {}
        for model_input, tensor in step.inputs:
            value = self._use(tensor, it)
            if value is not None:  # None: an optional input nobody provided
                inputs.append((model_input, value))
                batched[model_input] = self.batched.get(tensor, False)
        inputs = fit_batch_dim(inputs, batched, rt.config, rt.config.input)
        sreq = HostRequest(
            rt, inputs, step.requested, functools.partial(self._on_step, step),
            request_id=parent.request_id, correlation_id=parent.correlation_id,
            flags=parent.flags, timeout_us=parent.timeout_us, priority=parent.priority,
            parameters=parent.parameters)
        # A BLS caller blocked on the ensemble is blocked on its steps too.
        sreq.caller = parent.caller
        sreq.caller_exec = parent.caller_exec
        if parent.trace is not None:  # as Triton: each step traced, under the ensemble's trace
            sreq.trace = parent.trace.child(rt.name)
        ens.server.validate(rt, sreq)
        gates = ens.gates
        limit = 0
        if gates is not None:
            gate = self.gate_of[sreq.id] = gates[step.index]
            limit = gate.limit
        consumer = self.consumer
        if rt.decoupled and consumer is not None:
            # (A decoupled ensemble as a step: what its own consumer takes reaches its steps.)
            consumer.pace(sreq, limit)
        elif rt.decoupled and limit and not getattr(rt, "is_ensemble", False):
            _StepPacing(limit).start(sreq)
        return sreq

    def _outputs_ready(self, updated: Iterable[tuple[str, int]]) -> list | None:
        requested = self.plan.requested
        values = self.values
        for tensor, it in updated:
            if tensor not in requested:
                continue
            if all(it in values.get(t, ()) for t in requested):
                out = []
                for t in requested:
                    value = self._use(t, it)
                    if value is not None:
                        out.append((t, value))
                    else:  # Triton's words (2.51, measured; L0_simple_ensemble greps them)
                        log.debug("Composing models did not output tensor %s", t)
                cfg = self.ens.config
                out = fit_batch_dim(out, self.batched, cfg, cfg.output, internal=True)
                reshapes = self.ens.reshapes
                if reshapes is not None and reshapes.outputs:
                    # Its outputs leave in their dims form (TritonpyError when one cannot).
                    out = reshape_arrays(out, reshapes.output_shape)
                return out
        return None

    # -- transitions ------------------------------------------------------------------------------
    def start(self) -> None:
        req = self.request
        req.on_cancel = self._cancelled
        inputs = req.inputs
        reshapes = self.ens.reshapes
        if reshapes is not None and reshapes.inputs:
            # As Triton: the ensemble's own inputs flow on in their reshape form.
            inputs = reshape_arrays(inputs, reshapes.input_shape)
        with self.lock:
            batching = self.ens.config.max_batch_size > 0
            updated = [u for u in (self._add(n, a, batching) for n, a in inputs)
                       if u is not None]
            given = {n for n, _ in req.inputs}
            for name in self.ens.optional_inputs:
                if name not in given:
                    u = self._add(name, None, batching)
                    if u is not None:
                        updated.append(u)
            launches = self._advance(updated)
        self._deliver()
        self._launch(launches)

    def _advance(self, updated: list[tuple[str, int]]) -> list[HostRequest]:
        """Start what ``updated`` makes ready, answer what it completes (under self.lock)."""
        launches: list[HostRequest] = []
        outs = None
        if self.error is None and updated:
            try:
                launches = self._next_steps(updated)
            except Exception as exc:
                self.error = self._failed(exc)
                launches = []
            else:
                self.inflight += len(launches)
                self.pending.update(launches)
                try:
                    outs = self._outputs_ready(updated)
                except Exception as exc:  # an output that does not fit its reshape
                    self.error = self._failed(exc)
        self._emit(outs)
        return launches

    def _failed(self, exc: Exception) -> TritonpyError:
        """The error that ends the request when moving it on raised ``exc``: a bad input or
        output (a TritonpyError), or a fault of tritonpy's, which fails this request alone
        (logged) and never leaves it in flight for ever."""
        if not isinstance(exc, TritonpyError):
            log.error("ensemble '%s' failed to move a request on", self.ens.name, exc_info=exc)
            exc = InternalError(f"{type(exc).__name__}: {exc}")
        return _in_ensemble(self.ens.name, exc)

    def _emit(self, outs: list | None) -> None:
        """Make the response that ``outs`` (or the request's end) calls for, under self.lock;
        :meth:`_deliver` delivers it once the lock is released."""
        if self.finished:
            return
        req = self.request
        out = self._out.items
        final = self.inflight == 0
        if final and self.error is None:  # an ensemble that is a step of another one
            req.compute = (self.compute_ns[0], self.compute_ns[1], self.compute_ns[2])
        if self.error is not None:
            if final:
                self.finished = True
                out.append((req.respond, ([], self.error, None, True)))
                out.append((self.ens._finished, (self, False)))
            return
        if outs is not None:
            if self.ens.decoupled:
                if self.consumer is not None and not final:
                    self.consumer.emitted(outs)
                out.append((req.respond, (outs, None, self._parameters(outs), final)))
                self.held = outs  # remembers that a response went out
            elif final:
                out.append((req.respond, (outs, None, self._parameters(outs), True)))
            else:
                self.held = outs
            if final:
                self.finished = True
                out.append((self.ens._finished, (self, True)))
            return
        if not final:
            return
        self.finished = True
        if self.ens.decoupled:
            # (a decoupled ensemble may answer nothing)
            out.append((req.respond, (None, None, None, True)))
        elif self.held is not None:
            out.append((req.respond, (self.held, None, self._parameters(self.held), True)))
        else:
            self.error = InvalidArgumentError(
                f"in ensemble '{self.ens.name}', unexpected deadlock, at least one output is "
                "not set while no more ensemble steps can be made")
            out.append((req.respond, ([], self.error, None, True)))
            out.append((self.ens._finished, (self, False)))
            return
        out.append((self.ens._finished, (self, True)))

    def _deliver(self) -> None:
        """Deliver what :meth:`_emit` made, outside the lock and in the order it was made (one
        thread at a time: see :class:`._outbox.Outbox`)."""
        self._out.drain(_call)

    def _late_compute(self, compute: tuple[int, int, int]) -> None:
        """The compute times of a step whose execute ended after its final response: in the
        ensemble's sums (as Triton's, measured with a decoupled step), or in its statistics
        when the ensemble had answered meanwhile."""
        with self.lock:
            if not self.finished:
                self.compute_ns = [a + b for a, b in zip(self.compute_ns, compute)]
                return
        if self.error is None:
            self.ens.stats.add_compute(self.request.batch_size, *compute)

    def _parameters(self, outs: list) -> dict | None:
        """What Triton's ensemble puts in each of its responses (measured with 2.51): the
        request's sequence ID and flags, whether or not it is part of a sequence; none in a
        response without outputs (a step that did not make the ones asked for)."""
        if not outs:
            return None
        req = self.request
        return {"sequence_id": req.correlation_id,
                "sequence_start": bool(req.flags & 1), "sequence_end": bool(req.flags & 2)}

    def _on_step(self, step: _Step, sreq: HostRequest, outputs: Any,
                 error: TritonpyError | None, parameters: dict | None, final: bool) -> None:
        cancel: list[HostRequest] = []
        launches: list[HostRequest] = []
        let_in: list = []
        pacer = sreq.pacer
        if final and type(pacer) is _StepPacing:
            pacer.request = None  # (the request <-> pacer cycle: nothing more is told)
        with self.lock:
            if final:
                self.inflight -= 1
                self.pending.discard(sreq)
                if sreq.compute is not None:
                    self.compute_ns = [a + b for a, b in zip(self.compute_ns, sreq.compute)]
                else:  # a decoupled step may end before its execute: it counts when that does
                    sreq.on_compute = self._late_compute
            if error is not None:
                if self.error is None:
                    self.error = _in_ensemble(self.ens.name, error)
                    cancel = list(self.pending)
                self._emit(None)
            elif outputs is not None and self.error is None:
                got = dict(outputs)
                batching = sreq.model.config.max_batch_size > 0
                updated = []
                for model_output, tensor in step.outputs.items():
                    # A missing output still counts as produced (as Triton): it may feed an
                    # optional input of the next step.
                    u = self._add(tensor, got.get(model_output), batching)
                    if u is not None:
                        updated.append(u)
                launches = self._advance(updated)
            else:
                self._emit(None)
        self._deliver()
        gates = self.ens.gates
        if gates is not None and final:
            let_in = gates[step.index].leave(sreq)
        for r in cancel:  # the request failed: what else runs for it is wasted work
            r.cancel(f"another step of ensemble '{self.ens.name}' failed")
        consumer = self.consumer
        if type(pacer) is _StepPacing and not final:
            # This response is taken once the step requests it made are all let in, and its
            # ensemble's consumer has not too much left to read.
            nbytes = 0
            if consumer is not None:
                pacer._held = False  # (a response after HELD: its model goes on)
                nbytes = tensor_bytes(outputs)
            if launches and self.ens.gates is not None:
                self._launch(launches,
                             _Owed(functools.partial(pacer.took, nbytes), len(launches)).one)
            else:
                self._launch(launches)
                pacer.took(nbytes)
        else:
            self._launch(launches)
        for r, then in let_in:
            if not r.done:
                r.model.submit(r)
            if then is not None:
                then()
        if consumer is not None:
            if self.finished:
                consumer.stop()
            elif consumer.owed:
                consumer.stepped()

    def _launch(self, launches: list[HostRequest],
                then: Callable[[], None] | None = None) -> None:
        """Submit step requests, or, under max_inflight_requests, let them wait their turn at
        their step's gate (``then`` is called as each is let in)."""
        if self.ens.gates is None:
            for sreq in launches:
                sreq.model.submit(sreq)
            return
        gate_of = self.gate_of
        for sreq in launches:
            entered = gate_of.pop(sreq.id).enter(sreq, then)
            if entered == RUN:
                sreq.model.submit(sreq)
            if entered != WAIT and then is not None:
                then()

    def _cancelled(self, req: HostRequest, error: TritonpyError) -> None:
        with self.lock:
            pending = list(self.pending)
        for r in pending:
            r.cancel("the ensemble request was cancelled")

