"""The stub's calls to the host for its model: BLS, model loading, logging, metrics, shm tensors.

Each is a frame to the host; those with a reply wait on a :class:`Waiter` (see ``_readrole``:
a sync caller reads the socket itself while it waits).
"""
from __future__ import annotations

import contextvars
from typing import Any

from tritonpy.shm import ChannelClosedError, Cmd, SegmentGoneError

from . import pb_utils
from ._pberrors import TritonError, TritonModelException, unsendable
from ._bls import AsyncResponseIterator, ResponseIterator, place
from ._pbtensor import Tensor
from ._readrole import _ReadRole
from ._waiters import Waiter, first_item


# The execute a BLS call is made from: the host id of its first request (0 outside execute).
# A context variable, so that it follows an async execute into the tasks it awaits.
_EXECUTE = contextvars.ContextVar("tritonpy_execute", default=0)
# Calls whose answer may need another execute of this model to run first.
_WAITS_ON_SERVER = frozenset((Cmd.BLS_INFER, Cmd.LOAD_MODEL, Cmd.UNLOAD_MODEL))


class _ServerCalls(_ReadRole):
    """The calls to the host of :class:`._runtime.StubRuntime` (a mixin: see ``_stubstate``)."""

    def new_shm_array(self, dtype: Any, shape: tuple[int, ...]) -> Any:
        if self._forked:
            self._refuse_forked()
        return self.pool.new_array(dtype, shape)

    def _bls_body(self, req: pb_utils.InferenceRequest, decoupled: bool) -> dict:
        if self._forked:
            self._refuse_forked()
        if self.phase != "ready":
            raise TritonModelException(
                "BLS is only supported during the 'execute' function. "
                f"(this call came from {self.phase}())"
            )
        if not req._model_name:
            raise TritonModelException("BLS InferenceRequest needs a model_name")
        inputs = self.transport.encode_many([(t._name, t._arr, t) for t in req._inputs], self.peer)
        body: dict[str, Any] = {
            "request": {
                "model": req._model_name,
                "version": req._model_version,
                "request_id": req._request_id,
                "correlation_id": req._correlation_id,
                "flags": req._flags,
                "timeout": req._timeout,
                "parameters": req._parameters,
                "inputs": inputs,
                "outputs": req._requested_output_names,
            },
            "decoupled": decoupled,
            "exec": _EXECUTE.get(),
        }
        memory = req._preferred_memory
        if memory is not None:
            body["request"]["preferred_memory"] = [memory.preferred_memory_type,
                                                   memory.preferred_device_id]
        trace = req._trace.triton_trace
        if trace:  # InferenceRequest(..., trace=request.trace()) of a traced request
            body["request"]["trace"] = trace
        return body

    def _call(self, cmd: Cmd, body: Any, waiter: Waiter) -> int:
        if self._exec_busy and cmd in _WAITS_ON_SERVER:
            self._hold_executes()
        call_id = next(self._call_ids)
        self._calls[call_id] = waiter
        try:
            self.channel.send(cmd, call_id, body)
        except Exception as exc:
            self._calls.pop(call_id, None)
            if isinstance(exc, ChannelClosedError):
                raise
            # Never sent (e.g. a request id with a lone surrogate): the handles made for its
            # inputs are given back, and the model told why.
            request = body.get("request") if type(body) is dict else None
            if type(request) is dict:
                self.peer.release(_own_handles(request, "inputs"))
            raise TritonModelException(unsendable(exc, "request")) from None
        if waiter.loop is not None and not self._reading:
            with self._cv:  # an async caller cannot read: make sure an idle worker does
                self._cv.notify()
        return call_id

    def bls_exec(self, req: pb_utils.InferenceRequest, decoupled: bool) -> Any:
        if self._forked:  # made by the stub for this child (see ForkLink)
            return self._fork_link.exec(req, decoupled)
        body = self._bls_body(req, decoupled)
        if decoupled:
            waiter = Waiter()
            call_id = self._call(Cmd.BLS_INFER, body, waiter)
            return ResponseIterator(self, call_id, waiter, req._preferred_memory)
        waiter = Waiter()
        self._call(Cmd.BLS_INFER, body, waiter)
        reply = self._await(waiter, spin=True)
        return self._to_response(reply, req._preferred_memory)

    def bls_async_exec(self, req: pb_utils.InferenceRequest, decoupled: bool) -> Any:
        """Send the request now, as Triton's ``async_exec`` does (it returns a Future), and
        return the Task that gives its response: a call left unawaited still runs, and one
        awaited later has run meanwhile. Without a running event loop, asyncio's RuntimeError
        (Triton's too)."""
        import asyncio

        loop = asyncio.get_running_loop()
        if self._forked:
            return loop.run_in_executor(None, self._fork_link.exec, req, decoupled)
        body = self._bls_body(req, decoupled)
        waiter = Waiter(stream=decoupled, loop=loop)
        if not decoupled:
            waiter.drop = self.drop_reply
        call_id = self._call(Cmd.BLS_INFER, body, waiter)
        return loop.create_task(self._bls_async_reply(req, decoupled, call_id, waiter))

    async def _bls_async_reply(self, req: pb_utils.InferenceRequest, decoupled: bool,
                               call_id: int, waiter: Waiter) -> Any:
        import asyncio

        if decoupled:
            # As Triton: resolved once the first response is in, so that the documented plain
            # ``for`` over the result does not block the event loop waiting for it.
            try:
                await first_item(waiter)
            except BaseException:  # cancelled: nobody will read this stream
                waiter.abandon(self.drop_reply)
                raise
            return AsyncResponseIterator(self, call_id, waiter, req._preferred_memory)
        fut = waiter.future
        assert fut is not None
        try:
            body = await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # the reply came just before the cancel
                self.drop_reply(fut.result())
            raise
        return self._to_response(body, req._preferred_memory)

    def drop_reply(self, body: Any) -> None:
        """A BLS reply nobody will read: its tensors' blocks go back undecoded."""
        if isinstance(body, dict):
            self.transport.discard(body.get("outputs"), self.peer)

    def _to_response(self, body: dict,
                     memory: pb_utils.PreferredMemory | None = None) -> pb_utils.InferenceResponse:
        err = body.get("error")
        wrap = Tensor._wrap
        try:
            outputs = [wrap(*pair) for pair in
                       self.transport.decode_many(body.get("outputs") or [], self.peer)]
        except SegmentGoneError as exc:  # not the target's fault: an error response, not a raise
            return pb_utils.InferenceResponse([], TritonError(
                f"the response's outputs cannot be received: {exc}", TritonError.UNAVAILABLE))
        if memory is not None:
            place(outputs, memory)
        return pb_utils.InferenceResponse(
            outputs, TritonError._from_wire(err) if err else None, body.get("parameters") or {})

    def cancel_call(self, call_id: int) -> None:
        self.channel.send(Cmd.BLS_CANCEL, call_id, None)

    def model_call(self, what: str, name: str, **kw: Any) -> Any:
        cmd = {"load": Cmd.LOAD_MODEL, "unload": Cmd.UNLOAD_MODEL, "ready": Cmd.MODEL_READY}[what]
        if self.phase == "finalize":
            raise TritonModelException("the model loading API cannot be used in finalize()")
        body = {"name": name, **kw}
        for key, value in body.items():
            if type(value) is str and not value.isascii():
                body[key] = _wire_text(value)
        return self._call_ok(cmd, body).get("ready", True)

    def _call_ok(self, cmd: Cmd, body: Any) -> dict:
        """A call to the host and its reply; TritonModelException with the host's message
        when the reply is not ok."""
        waiter = Waiter()
        self._call(cmd, body, waiter)
        reply = self._await(waiter)
        if not reply.get("ok"):
            raise TritonModelException(str((reply.get("error") or {}).get("message", reply)))
        return reply

    def log(self, level: int, message: str, where: tuple[str, int] | None = None) -> None:
        """A line for the host's log; ``where``: the model's file and line that logged it."""
        self.channel.send(Cmd.LOG, 0, [level, message, *where] if where else [level, message])

    def metric_family(self, name: str, description: str, kind: int, family_id: int) -> None:
        # A call, not a notice: a family of that name but another kind is refused (as Triton).
        if self._metric_deletes:  # a deletion of the same name goes first
            self.flush_metric_deletes()
        self._call_ok(Cmd.METRIC_FAMILY, {"name": name, "description": description, "kind": kind,
                                          "id": family_id})

    def metric_family_delete(self, name: str, family_id: int, collecting: bool) -> None:
        """The model deleted a MetricFamily object (from its ``__del__``). Not once
        ``finalize`` returned: what the interpreter's exit collects was not deleted by the
        model, and its series stay, as they do on Triton. One the cyclic collector deleted
        (``collecting``) waits for the next safe point: the collection may have started at
        any allocation, a send of this very thread included."""
        if self._finalized:
            return
        self._metric_deletes.append((name, family_id))
        if not collecting:
            self.flush_metric_deletes()

    def flush_metric_deletes(self) -> None:
        """Send the deletions that wait (before anything else about metrics, and before an
        execute's responses: a client that reads the metrics after them sees them gone)."""
        deletes = self._metric_deletes
        while deletes:
            try:
                name, family_id = deletes.pop(0)
            except IndexError:  # another thread took the last one
                return
            self.channel.send(Cmd.METRIC_FAMILY_DELETE, 0, [name, family_id])

    def metric_op(self, family: str, labels: dict, op: str, value: float,
                  buckets: list | None, family_id: int = 0) -> None:
        if self._metric_deletes:
            self.flush_metric_deletes()
        self.channel.send(Cmd.METRIC_OP, 0, [family, labels, op, value, buckets, family_id])

    def metric_value(self, family: str, labels: dict) -> float:
        if self._metric_deletes:
            self.flush_metric_deletes()
        waiter = Waiter()
        self._call(Cmd.METRIC_VALUE, [family, labels], waiter)
        return float(self._await(waiter).get("value", 0.0))


def _wire_text(text: str) -> str | bytes:
    """A name, version or config of the model loading API as its frame carries it: one that
    pb_utils read from bytes that are not UTF-8 (a lone surrogate for each byte it could not
    read) as those bytes, which the host reads back the same; msgpack carries no lone
    surrogate. Another lone surrogate stays: the call then says why it cannot be sent."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        try:
            return text.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            pass
    return text


def _own_handles(body: dict, key: str = "outputs") -> list[int]:
    """The export ids of the shm (or GPU) handles among a body's tensors (a response's
    outputs, every response's of an EXECUTE_DONE, or a BLS request's inputs)."""
    ids = []
    for resp in body.get("responses", (body,)):
        for w in resp.get(key) or ():
            data = w[3]
            if type(data) is list and len(data) >= 4:
                ids.append(data[3])
    return ids
