"""The execute path of the stub: an EXECUTE's requests made, the model's ``execute`` run (sync,
``async def``, or a coroutine a plain ``def`` returned), and its responses sent (EXECUTE_DONE,
or RESPONSE_SEND from a response sender). The hottest path of tritonpy: one request message
and one response message per execute.
"""
from __future__ import annotations

import inspect
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # asyncio is imported when a model needs it: a stub starts 20 ms sooner
    import asyncio

from tritonpy.shm.waiting import StallWatch
from tritonpy.shm import INLINE_LIMIT, ChannelClosedError, Cmd
from tritonpy.shm import cuda
from tritonpy.shm._errors import ProtocolError, SegmentGoneError, ShmError, ShmExhaustedError

from . import pb_utils
from ._pberrors import (
    TritonModelException,
    _error_body,
    count_mismatch,
    decoupled_returned,
    exception_text,
    execute_failed,
    not_a_list,
    not_a_response,
    unsendable,
)
from ._open_requests import _Open
from ._pbtensor import Tensor
from ._server_calls import _EXECUTE, _ServerCalls, _own_handles
from ._waiters import Pace, Waiter


# A model streaming responses looks for frames from the host (ACK, CANCEL, RELEASE) this often
# at most (see StubRuntime._peek).
_PEEK_EVERY_S = 0.001


def _let_go(err: BaseException | None) -> None:
    """Free now what a failed execute's frames still hold: its arrays (GPU memory too) and its
    requests' input tensors (shared memory of the host). The exception's traceback keeps those
    frames and their locals, and the frame that caught it refers back to it: a cycle that only
    the cyclic garbage collector would break, whenever it next runs. The caller then drops its
    own reference (``del``), which ends the cycle.

    Called before the error is sent: the instance's next request may run on the stub's other
    thread as soon as this one has said the execute is over, and on a loaded machine this
    thread can lag; the next request would then find the memory still taken (seen on a GPU:
    all of it). The error's text needs only the frames' code and line numbers, which stay."""
    if err is not None:
        traceback.clear_frames(err.__traceback__)


def _new_event_loop() -> asyncio.AbstractEventLoop:
    """The loop of ``async def execute``: uvloop's where it is installed (its scheduling costs
    a fraction of the default loop's on every await), else asyncio's own."""
    try:
        import uvloop
    except ImportError:  # e.g. a model's own EXECUTION_ENV_PATH interpreter without it
        import asyncio

        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


#: Triton's words for a request released with RESCHEDULE by a model whose scheduler is not an
#: iterative sequence batcher.
RESCHEDULE_REFUSED = ("Request is released with TRITONSERVER_REQUEST_RELEASE_RESCHEDULE while "
                      "the model is not configured to handle such a flag.")


class _Executor(_ServerCalls):
    """The execute path of :class:`._runtime.StubRuntime` (a mixin: see ``_stubstate``)."""

    def _make_requests(self, body: dict) -> list[pb_utils.InferenceRequest]:
        out = []
        decode = self.transport.decode
        peer = self.peer
        wrap = Tensor._wrap
        received = pb_utils.InferenceRequest._received
        cpu_inputs = self.cpu_inputs
        try:
            for rb in body["requests"]:
                inputs = [wrap(*decode(w, peer)) for w in rb["inputs"]]
                if cpu_inputs:
                    for t in inputs:
                        if type(t._arr) is not np.ndarray and not t.is_cpu():
                            t._arr = cuda.to_host(t._arr)
                req = received(rb.get("model", ""), inputs, rb, self.decoupled)
                out.append(req)
                self._active[req._host_id] = _Open(req, self._dropped)
                pace = rb.get("pace")
                if type(pace) is list and len(pace) == 2 and all(type(n) is int for n in pace):
                    self._pace[req._host_id] = Pace(*pace)
                if self._early_cancel and req._host_id in self._early_cancel:
                    self._early_cancel.discard(req._host_id)
                    req._cancelled = True
        except BaseException:
            # The batch fails as a whole (the host answers each request with the error): the
            # requests made before the one that failed are not open any more.
            for req in out:
                self._active.pop(req._host_id, None)
                self._pace.pop(req._host_id, None)
            raise
        return out

    def _on_execute(self, call_id: int, body: dict) -> None:
        try:
            requests = self._make_requests(body)
        except SegmentGoneError as exc:  # not the request's fault: a client may send it again
            self.channel.send(Cmd.EXECUTE_DONE, call_id, {"error": _error_body(
                "UNAVAILABLE", f"cannot receive the requests' inputs: {exc}")})
            return
        except ProtocolError:
            self.channel.send(Cmd.EXECUTE_DONE, call_id, {"error": _error_body(
                "INVALID_ARG", f"cannot decode requests: {traceback.format_exc(limit=2)}")})
            return
        except ShmError as exc:  # this process's limits (descriptors, address space)
            self.channel.send(Cmd.EXECUTE_DONE, call_id, {"error": _error_body(
                "UNAVAILABLE", f"cannot receive the requests' inputs: {exc}")})
            return
        except Exception:
            self.channel.send(Cmd.EXECUTE_DONE, call_id, {"error": _error_body(
                "INVALID_ARG", f"cannot decode requests: {traceback.format_exc(limit=2)}")})
            return
        if self._async_loop is not None:
            import asyncio

            asyncio.run_coroutine_threadsafe(self._execute_async(call_id, requests),
                                             self._async_loop)
            return
        token = _EXECUTE.set(requests[0]._host_id if requests else 0)
        try:
            result = self.model.execute(requests)
            if type(result) is not list and inspect.isawaitable(result):
                result = self._run_returned(result)
            err = None
        except BaseException as exc:  # sys.exit() too: the requests get it as their error
            result, err = None, exc
        finally:
            _EXECUTE.reset(token)
        _let_go(err)  # before _complete frees the instance for the next request (_exec_over)
        try:
            self._complete(call_id, requests, result, err)
        finally:
            del err  # the last reference: it goes now, not at the next cyclic collection

    def _run_returned(self, awaitable: Any) -> Any:
        """A coroutine that a plain ``def execute`` returned: run, as Triton does, on an event
        loop of its own thread (BLS ``async_exec`` needs one running). In default mode execute
        ends when it does, with what it returns; in decoupled mode it runs in the background
        (its responses go through the senders) and execute ends now."""
        with self._mu:  # executes of a decoupled model may run at once: one loop for them all
            if self._side_loop is None:
                loop = _new_event_loop()
                threading.Thread(target=loop.run_forever, name="stub-coroutines",
                                 daemon=True).start()
                self._side_loop = loop
        tag = _EXECUTE.get()

        async def run() -> Any:
            _EXECUTE.set(tag)  # this task's own context: BLS cycles are told by it
            return await awaitable

        import asyncio

        fut = asyncio.run_coroutine_threadsafe(run(), self._side_loop)
        if not self.decoupled:
            exc = fut.exception()  # waits; not fut.result(), whose frames would show
            if exc is not None:
                raise exc
            return fut.result()

        def done(f: Any) -> None:
            exc = f.exception()
            if exc is not None:
                sys.stderr.write(f"tritonpy stub {self.name}: the coroutine that execute "
                                 f"returned failed: {exception_text(exc)}\n")
            elif f.result() is not None:
                sys.stderr.write(f"tritonpy stub {self.name}: "
                                 f"{decoupled_returned(self.name)}\n")
        fut.add_done_callback(done)
        return None

    async def _execute_async(self, call_id: int, requests: list) -> None:
        assert self._async_sem is not None
        async with self._async_sem:
            _EXECUTE.set(requests[0]._host_id if requests else 0)  # this task's own context
            try:
                result = await self.model.execute(requests)
                err = None
            except BaseException as exc:  # also SystemExit, which would stop the stub's loop
                result, err = None, exc
        _let_go(err)
        try:
            self._complete(call_id, requests, result, err)
        finally:
            del err  # the last reference: it goes now, not at the next cyclic collection

    def _complete(self, call_id: int, requests: list, result: Any,
                  err: BaseException | None) -> None:
        """Send EXECUTE_DONE: one frame carrying every response of the batch (default mode)."""
        try:
            body = self._done_body(requests, result, err)
        except ShmExhaustedError as exc:
            # No room in /dev/shm for an output: UNAVAILABLE, as for an input that finds none
            # (a condition of the machine, not a fault of the model: no traceback).
            body = {"error": _error_body("UNAVAILABLE", execute_failed(self.name, str(exc)))}
        except Exception as exc:  # e.g. a response this stub cannot send
            sys.stderr.write(traceback.format_exc())
            body = self._failed(exception_text(exc))
        reschedule = [r._host_id for r in requests
                      if r._release_flags == pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE]
        refused: list[int] = []
        if reschedule and not self.reschedulable:
            # As Triton refuses the flag, in its words (it then leaves the client waiting for
            # ever; upstream's L0_iterative_sequence expects the error): the request ends.
            refused, reschedule = reschedule, []
            if "error" not in body:
                refusal = _error_body("INVALID_ARG", RESCHEDULE_REFUSED)
                body.setdefault("responses", []).extend(
                    {"id": rid, "final": True, "error": refusal} for rid in refused)
        if reschedule and "error" not in body:
            body["reschedule"] = reschedule
        elif reschedule:
            reschedule = []  # the execute failed: its requests get the error, not another run
        keep = "error" not in body
        decoupled = self.decoupled
        for r in requests:
            # A request answered through its sender stays cancellable (is_cancelled() sees
            # CANCEL) until the sender sends the final flag, which may happen in a thread after
            # execute returned (a decoupled request always may).
            rid = r._host_id
            if refused and rid in refused:
                r._answered = True  # its sender, if the model kept it, can send no more
            elif keep and rid not in reschedule and (
                    (r._taken or decoupled) and not r._answered):
                continue
            if rid in reschedule:
                held = self._active.pop(rid, None)
                if held is not None and r._taken and not r._answered:
                    self._earlier.setdefault(rid, []).append(held)
            else:
                self._close(rid)
            if self._pace:
                self._unpace(rid)
        if self._metric_deletes:
            self.flush_metric_deletes()
        self._exec_over(self._exec_token)  # a sync execute's: the one this thread runs
        unsent = self._send_responses(Cmd.EXECUTE_DONE, call_id, body)
        if unsent is not None:
            # Every request of the batch gets the reason instead of waiting for ever.
            sys.stderr.write(f"tritonpy stub {self.name}: {unsendable(unsent)}\n")
            for r in requests:
                self._close(r._host_id)
                if self._pace:
                    self._unpace(r._host_id)
            self.channel.send(Cmd.EXECUTE_DONE, call_id, self._failed(unsendable(unsent)))

    def _send_responses(self, cmd: Cmd, call_id: int, body: dict) -> Exception | None:
        """Send a frame of responses; None, or the error that kept it from being sent at all.

        A body msgpack refuses (a str with a lone surrogate in a name, message or parameter)
        or a spilled frame with no shared memory left for it is never sent: the handles made
        for its outputs are given back (their blocks would leak) and the error returned."""
        try:
            self.channel.send(cmd, call_id, body)
        except ChannelClosedError:
            raise
        except Exception as exc:
            self.peer.release(_own_handles(body))
            # Without its traceback: its frames lead back (f_back) to the caller's, which keeps
            # this error: a cycle that would hold the caller's requests until the cyclic
            # collector runs (a request let go of would not end).
            return exc.with_traceback(None)
        return None

    def _done_body(self, requests: list, result: Any, err: BaseException | None) -> dict:
        if err is not None:
            return self._failed(exception_text(err))
        if self.decoupled:
            if result is not None:
                return {**self._failed(decoupled_returned(self.name)), "unfinished_only": True}
            return {}
        returned_none = result is None
        if returned_none:
            # Each request answered (or will answer, from a thread) through its response sender.
            result = [None] * len(requests)
        elif not isinstance(result, (list, tuple)):
            return self._failed(not_a_list(result))
        if len(result) != len(requests):
            return self._failed(count_mismatch(len(requests), len(result)))
        resched = pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE
        # A None entry (or a None return) is fine for a request that took its response sender:
        # as with Triton, its response may come from the sender before or after execute returns.
        missing = 0
        for req, resp in zip(requests, result):
            if req._release_flags == resched:
                if resp is not None:
                    # As Triton: a rescheduled request gets no response now (answering it and
                    # running it again would loop for ever). Triton's words, its spelling
                    # included: clients' tests look for them.
                    return self._failed(
                        "Expected a None object in the execute function return list for "
                        f"reschduled request, found type '{type(resp)}'.")
            elif resp is None and not req._taken:
                missing += 1
        responses = []
        for req, resp in zip(requests, result):
            taken = req._taken
            if req._release_flags == resched:
                continue
            if resp is None:
                if not taken:
                    what = ("returned None, but no response was sent" if returned_none else
                            "returned None in its list, and no response was sent,")
                    responses.append({"id": req._host_id, "error": _error_body(
                        "INTERNAL", f"execute() {what} for {missing} of {len(requests)} "
                        f"request(s) of model '{self.name}'; return a list of "
                        "InferenceResponse or use the response sender")})
                continue
            if taken and req._answered:
                # Answered through the sender already: as with Triton, the returned response
                # has nobody to go to.
                sys.stderr.write(f"tritonpy stub {self.name}: execute returned a response for a "
                                 "request already answered through its response sender; "
                                 "dropped\n")
                continue
            if taken and req._sent:
                req._answered = True  # the host answers with the response the sender sent
                responses.append({"id": req._host_id, "error": _error_body(
                    "INTERNAL", "a response was already sent for this request through its "
                    "response sender; execute() must return None for it")})
                continue
            if not isinstance(resp, pb_utils.InferenceResponse):
                # Only this request fails (Triton fails the whole batch).
                responses.append({"id": req._host_id, "error": _error_body(
                    "INTERNAL", execute_failed(self.name, not_a_response(resp)))})
                continue
            if taken:
                req._answered = True  # its one response is this one
            responses.append(self._response_body(req, resp, True))
        return {"responses": responses}

    def _failed(self, message: str) -> dict:
        """The body of an execute that failed as a whole."""
        return {"error": _error_body("INTERNAL", execute_failed(self.name, message))}

    def _response_body(self, req: pb_utils.InferenceRequest,
                       resp: pb_utils.InferenceResponse | None, final: bool) -> dict:
        body: dict[str, Any] = {"id": req._host_id, "final": final}
        if resp is None:
            body["empty"] = True
            return body
        if resp._err is not None:
            # As Triton: a response that carries an error carries no tensors (its parameters
            # still go).
            body["error"] = resp._err._to_wire()
            body["outputs"] = []
        else:
            wanted = req._requested_output_names
            gpu_ok = req._gpu_ok
            body["outputs"] = self.transport.encode_many(
                [(t._name, t._arr if gpu_ok or type(t._arr) is np.ndarray or t.is_cpu()
                  else self._host_copy(t._arr))
                 for t in resp._output_tensors if not wanted or t._name in wanted], self.peer)
        if resp._parameters:
            body["parameters"] = resp._parameters
        return body

    def _host_copy(self, arr: Any) -> np.ndarray:
        """A GPU output copied to the CPU for a reader there: straight into shared memory
        when it will travel by handle."""
        if arr.nbytes <= INLINE_LIMIT:
            return cuda.to_host(arr)
        return cuda.to_host(arr, self.pool.new_array(arr.dtype, tuple(arr.shape)))

    def send_response(self, req: pb_utils.InferenceRequest,
                      resp: pb_utils.InferenceResponse | None, final: bool) -> None:
        if self._forked:
            self._refuse_forked()
        now = time.monotonic()
        if now - self._peeked > _PEEK_EVERY_S:
            self._peeked = now
            self._peek()
        p = self._pace.get(req._host_id) if self._pace else None
        if p is not None:
            # Back-pressure: once the consumer (a client reading its stream slowly) has not
            # taken max_bytes or max_count of the responses sent, the send waits until it took
            # half of them. Not on the event loop of async execute, where every other request
            # of the instance would wait too: those streams keep the host's bound only (see
            # AsyncResponseStream).
            if threading.get_ident() != self._async_thread:
                self._wait_for_consumer(req, p)
            nbytes = 0
            for t in resp._output_tensors if resp is not None else ():
                nbytes += t._arr.nbytes
            with self._mu:
                p.sizes.append(nbytes)
                p.unread += nbytes
        try:
            exc = self._send_responses(Cmd.RESPONSE_SEND, 0,
                                       self._response_body(req, resp, final))
        except ChannelClosedError:
            raise
        except BaseException:  # its body could not be built (a BYTES element, no shm left)
            if final:
                self._reopen(req)
            raise
        if exc is not None:  # nothing went: the model may send another response instead
            if final:
                self._reopen(req)
            raise TritonModelException(f"Unable to send response. {unsendable(exc)}") from None
        if final:
            self._close(req._host_id)
            self._unpace(req._host_id)

    def _wait_for_consumer(self, req: pb_utils.InferenceRequest, p: Pace) -> None:
        while True:
            with self._mu:
                if req._cancelled or self._pace.get(req._host_id) is not p or (
                        len(p.sizes) < p.max_count and p.unread < p.max_bytes):
                    return
                w = p.waiter
                first = w is None
                if first:
                    w = p.waiter = Waiter()
            assert w is not None
            if first:  # the host acknowledges what is taken from now on, in eighths
                self.channel.send(Cmd.HELD, 0, [req._host_id])
            self._hold_executes()
            self._await(w, take=False)

    def _start_async_loop(self) -> None:
        loop = _new_event_loop()
        started = threading.Event()

        def run() -> None:
            self._async_thread = threading.get_ident()
            import asyncio

            asyncio.set_event_loop(loop)
            self._async_sem = asyncio.Semaphore(self.max_async)
            started.set()
            loop.run_forever()

        threading.Thread(target=run, name="stub-async", daemon=True).start()
        started.wait()
        self._async_watch = StallWatch(loop, self._stall_s, self._async_stalled,
                                       self._async_thread)
        self._async_loop = loop

    def _async_stalled(self, seconds: float, where: str | None) -> None:
        if where is None:
            self.log(1, f"the event loop of async def execute runs again, after {seconds:.1f} s")
        else:
            self.log(1, f"the event loop of async def execute has run nothing for {seconds:.0f} s: "
                        "something on it blocks instead of awaiting (a time.sleep, a blocking "
                        "call, a long computation: run those with asyncio.to_thread), and every "
                        f"request of this instance waits. Its thread is in:\n{where}")
