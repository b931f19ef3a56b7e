"""What a BLS call returns in the stub: the response iterators of ``exec(decoupled=True)`` and
``async_exec(decoupled=True)``, and the placement of outputs by ``preferred_memory``."""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from tritonpy.shm import cuda
from tritonpy.shm.messages import Cmd

from . import pb_utils
from ._pbtensor import Tensor
from ._waiters import Waiter, first_item

if TYPE_CHECKING:
    from ._server_calls import _ServerCalls
    from ._stubstate import _StubState


def place(outputs: list[Tensor], memory: pb_utils.PreferredMemory) -> None:
    """Copy CPU outputs of a BLS call to the GPU when the caller's ``preferred_memory`` asks
    for it (BYTES stay on the CPU). A CPU preference needs nothing here: the host asked the
    target for CPU outputs then. A GPU asked for where CuPy is missing is a preference that
    cannot be met: outputs stay put."""
    if memory.preferred_memory_type != pb_utils.TRITONSERVER_MEMORY_GPU or not cuda.available():
        return
    for t in outputs:
        if t.is_cpu() and t._dtype != 13:
            t._arr = cuda.to_device(t._arr, memory.preferred_device_id)


def on_held(rt: _StubState, body: Any) -> None:
    """HELD from the host: the producers of these decoupled BLS streams wait for this stub's
    model to take what they sent ([[call id, bytes, responses], ...]: their limits)."""
    for item in body if type(body) is list else ():
        if type(item) is not list or len(item) != 3 or any(type(v) is not int for v in item):
            continue
        call_id, max_bytes, max_count = item
        waiter = rt._calls.get(call_id)
        if waiter is not None:
            waiter.stream_pace().on_held(max_bytes, max_count,
                                         functools.partial(_report, rt, call_id))


def _report(rt: _StubState, call_id: int, taken: int) -> None:
    try:
        rt.channel.send(Cmd.ACK, 0, [[call_id, taken]])
    except Exception:  # the host is gone: nobody waits for this any more
        pass


class ResponseIterator:
    """What ``exec(decoupled=True)`` returns: responses as they arrive, with cancel()."""

    def __init__(self, rt: _ServerCalls, call_id: int, waiter: Waiter,
                 memory: pb_utils.PreferredMemory | None = None) -> None:
        self._rt = rt
        self._call_id = call_id
        self._waiter = waiter
        self._memory = memory
        self._done = False
        # As Triton's: the responses are kept, and iterating again once the stream has ended
        # starts over from the first.
        self._seen: list[pb_utils.InferenceResponse] = []
        self._pos = 0

    def __iter__(self) -> ResponseIterator:
        if self._done and self._pos == len(self._seen):
            self._pos = 0
        return self

    def _take(self, body: dict) -> pb_utils.InferenceResponse:
        if body.get("final", True):
            self._done = True
        if body.get("empty") and not body.get("error"):
            resp = pb_utils.InferenceResponse([])  # a bare final flag: an empty response
        else:
            resp = self._rt._to_response(body, self._memory)
        nbytes = 0
        for t in resp._output_tensors:
            nbytes += getattr(t._arr, "nbytes", 0)
        self._waiter.stream_pace().took(nbytes, not self._waiter.items)
        self._seen.append(resp)
        self._pos = len(self._seen)
        return resp

    def _replay(self) -> pb_utils.InferenceResponse | None:
        """The next kept response when iterating again, else None."""
        if self._pos < len(self._seen):
            self._pos += 1
            return self._seen[self._pos - 1]
        return None

    def __next__(self) -> pb_utils.InferenceResponse:
        kept = self._replay()
        if kept is not None:
            return kept
        if self._done:
            raise StopIteration
        return self._take(self._rt._await(self._waiter))

    def cancel(self) -> None:
        if not self._done:
            self._rt.cancel_call(self._call_id)

    def __del__(self) -> None:
        # Dropped before its stream ended (a ``break``, or never iterated): the rest of the
        # stream still arrives, and each reply's tensors go back undecoded. (Triton's iterator
        # waits for the rest here instead; the target is not cancelled in either.)
        if not self._done:
            try:
                self._waiter.abandon(self._rt.drop_reply)
            except Exception:  # at interpreter exit: nothing left to give back to
                pass


class AsyncResponseIterator(ResponseIterator):
    """What ``await async_exec(decoupled=True)`` returns: iterate it with ``async for``, or
    with a plain ``for`` as Triton's docs do (that blocks the event loop while it waits)."""

    def __aiter__(self) -> AsyncResponseIterator:
        return self.__iter__()  # type: ignore[return-value]

    async def __anext__(self) -> pb_utils.InferenceResponse:
        kept = self._replay()
        if kept is not None:
            return kept
        if self._done:
            raise StopAsyncIteration
        await first_item(self._waiter)
        return self._take(self._waiter.items.popleft())
