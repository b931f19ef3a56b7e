"""Requests as the host carries them, and responses as the in-process API hands them out."""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import queue
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np

from tritonpy.shm.dtypes import triton_dtype_of
from tritonpy.shm.messages import Cmd

from ._errors import CancelledError, InvalidArgumentError, TritonpyError, public

if TYPE_CHECKING:
    from ._timers import Timers

_ids = itertools.count(1)
_TIMEOUT_MAX = threading.TIMEOUT_MAX  # the longest wait a lock takes (ResponseStream.get)


@public
class Tensor:
    """An output tensor: ``to_numpy()`` is a zero-copy view when the data came in shared memory
    (a small tensor's read-only view of its message is copied once, so that it can be written;
    BYTES: an object array)."""

    __slots__ = ("name", "data_type", "shape", "_arr")

    def __init__(self, name: str, arr: np.ndarray) -> None:
        self.name = name
        self._arr = arr
        self.data_type = triton_dtype_of(arr)
        self.shape = tuple(arr.shape)

    def to_numpy(self) -> np.ndarray:
        if not self._arr.flags.writeable:
            self._arr = self._arr.copy()
        return self._arr

    def view(self) -> np.ndarray:
        """The array without that copy: read-only when it is a view of its message (for a
        reader that only reads it, such as the frontends' encoders)."""
        return self._arr

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return self._arr if dtype is None else self._arr.astype(dtype)

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._arr.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._arr.__dlpack_device__()

    def __repr__(self) -> str:
        return f"Tensor({self.name!r}, {self.data_type}, shape={list(self.shape)})"


@public
class InferenceResponse:
    """One response of a request: ``outputs`` by name, or ``error``; ``final`` ends a stream.

    ``empty``: no response at all, only the final flag (a decoupled model's
    ``send(flags=COMPLETE_FINAL)``), as against a response that holds no tensors
    (``send(InferenceResponse([]), flags=COMPLETE_FINAL)``), which Triton answers as one."""

    __slots__ = ("model", "model_version", "request_id", "parameters", "outputs", "error", "final",
                 "empty")

    def __init__(self, model: str, model_version: int, request_id: str,
                 outputs: dict[str, Tensor], error: TritonpyError | None,
                 parameters: dict | None, final: bool, empty: bool = False) -> None:
        self.model = model
        self.model_version = model_version
        self.request_id = request_id
        self.outputs = outputs
        self.error = error
        self.parameters = parameters or {}
        self.final = final
        self.empty = empty

    def __repr__(self) -> str:
        what = f"error={self.error!r}" if self.error else f"outputs={list(self.outputs)}"
        return f"InferenceResponse({self.model!r}, {what}, final={self.final})"


# (request, outputs, error, parameters, final)
Sink = Callable[["HostRequest", "list | None", "TritonpyError | None", "dict | None", bool], None]


class HostRequest:
    """A request in the host: from a client or from a stub's BLS call."""

    __slots__ = (
        "id", "model", "inputs", "requested", "request_id", "correlation_id", "flags",
        "timeout_us", "priority", "parameters", "sink", "cancelled", "done", "t_enqueue",
        "t_start", "instance", "caller", "caller_exec", "batch_size", "on_cancel", "_final",
        "queue_deadline", "trace", "gpu_ok", "pacer", "shm_retry_until", "compute",
        "on_compute", "__weakref__",
    )
    #: A direct sequence batcher's filler (``_sequence_controls.NullRequest``): counted in the batch
    #: size of its execute, not as an inference.
    null = False

    def __init__(self, model: Any, inputs: list[tuple[str, np.ndarray]],
                 requested: Sequence[str] | None, sink: Sink, *, request_id: str = "",
                 correlation_id: int | str = 0, flags: int = 0, timeout_us: int = 0,
                 priority: int = 0, parameters: Mapping[str, Any] | None = None) -> None:
        self.id = next(_ids)
        self.model = model
        self.inputs = inputs
        self.requested = list(requested) if requested else []
        self.request_id = request_id
        self.correlation_id = correlation_id
        self.flags = flags
        self.timeout_us = timeout_us
        self.priority = priority
        self.parameters = dict(parameters or {})
        self.sink = sink
        self.cancelled = False
        self.done = False
        # One token, taken by the final response: list.pop() is atomic, so of a stub's answer
        # and a timeout or cancel racing from another thread exactly one gets through.
        self._final = [True]
        self.t_enqueue = time.monotonic_ns()
        self.t_start = 0
        self.instance: Any = None  # the instance executing it, once dispatched
        self.caller: Any = None  # the instance whose BLS call this is
        # The caller's execute that waits for it (deadlock detection); 0: nobody blocks on it.
        self.caller_exec = 0
        self.batch_size = 1
        # Called with the error once the request is aborted (cancel, timeout).
        self.on_cancel: Callable[[HostRequest, TritonpyError], None] | None = None
        # When its queue timeout passes (time.monotonic_ns; 0: never), set by the batcher.
        self.queue_deadline = 0
        self.trace: Any = None  # a _trace.Trace when the request is traced
        # Whether its answer may hold GPU tensors (DeviceRef): a BLS call whose caller did not
        # ask for CPU outputs. Everyone else reads outputs on the CPU, so the stub copies them.
        self.gpu_ok = False
        # The stream that paces the stub's sends (back-pressure, see HOLD_BYTES): a decoupled
        # request of the in-process API (every HTTP and gRPC stream), or of a BLS call.
        self.pacer: _Pacing | None = None
        # Until when its inputs may wait for room in a full /dev/shm (ModelRuntime._retry_later)
        self.shm_retry_until = 0.0
        # (input, infer, output) ns of the execute that ran it, once it succeeded: an
        # ensemble's statistics are the sums of its steps'.
        self.compute: tuple[int, int, int] | None = None
        # Called with them as they are known, when that is after its final response (a
        # decoupled step of an ensemble: its execute may go on after it).
        self.on_compute: Callable[[tuple[int, int, int]], None] | None = None

    def respond(self, outputs: list | None, error: TritonpyError | None, parameters: dict | None,
                final: bool) -> None:
        """Deliver one response; anything after the final one is dropped."""
        if self.done:
            return
        if final:
            try:
                self._final.pop()
            except IndexError:
                return
            self.done = True
        trace = self.trace
        if trace is not None:
            trace.outputs(outputs or ())
            # As Triton: an ensemble step's trace has none; a response that preserve_ordering
            # holds back is complete when it is released (its sink stamps it then).
            if not trace.parent_id and not getattr(self.sink, "completes_later", False):
                trace.at("INFER_RESPONSE_COMPLETE")
            if final:
                trace.at("REQUEST_END")
        self.sink(self, outputs, error, parameters, final)

    def fail(self, error: TritonpyError) -> None:
        self.respond([], error, None, True)

    def ack(self, taken: int) -> None:
        """Tell the stub running this request how many of its responses were taken."""
        stub = getattr(self.instance, "stub", None)
        if stub is None or self.done or not stub.alive:
            return
        try:
            stub.send(Cmd.ACK, 0, [[self.id, taken]])
        except Exception:  # the stub is gone: its requests fail on their own
            pass

    def cancel(self, reason: str = "request cancelled") -> None:
        """Cancel: the caller gets CANCELLED now; the executing stub sees is_cancelled()."""
        self.abort(CancelledError(reason))

    def abort(self, error: TritonpyError) -> None:
        """Answer ``error`` now (cancel, timeout), then tell whoever runs the request.

        In that order: a model that stops early when it sees the flag answers at once, and
        that answer must not reach the caller instead of this error.
        """
        if self.done:
            return
        self.cancelled = True
        self.fail(error)
        cb = self.on_cancel
        if cb is not None:
            cb(self, error)


def tensor_bytes(tensors: list | None) -> int:
    """The bytes of a list of (name, tensor) pairs (0 for one without ``nbytes``)."""
    nbytes = 0
    for _, array in tensors or ():
        nbytes += getattr(array, "nbytes", 0)
    return nbytes


def _make_response(req: HostRequest, outputs: list | None, error: TritonpyError | None,
                   parameters: dict | None, final: bool) -> InferenceResponse:
    return InferenceResponse(
        req.model.name, req.model.version, req.request_id,
        {n: Tensor(n, a) for n, a in outputs or ()}, error, parameters, final,
        outputs is None and error is None and not parameters)


class _Pacing:
    """Back-pressure on the stub (see HOLD_BYTES), for both kinds of response stream (and, in
    part, BLS streams: ``_bls._StreamPacing``): how many responses the consumer took, how many
    of them the stub was told of (ACK), and whether the stub's model waits to send (HELD). Any
    thread may call in: a lock keeps the counts."""

    request: HostRequest | None
    # Unpaced (every default-mode request) until pace(), which sets up the rest: nothing of it
    # is built per request on the hot path.
    _timers: Timers | None = None  # the server's, once paced
    _held = False
    # Where the consumer's takes go instead of the request's stub: a decoupled ensemble's
    # request has no stub, and passes them on to its steps (_ensemble_gate._ConsumerPacing).
    on_taken: Callable[[int], None] | None = None

    def pace(self, req: HostRequest, timers: Timers | None) -> None:
        """Pace ``req``'s stub by this stream's consumer (a decoupled model's request); without
        ``timers``, no stall is watched for."""
        self._pace_lock = threading.Lock()
        self._taken = 0
        self._acked = 0
        self._bytes_since_ack = 0
        self._last_take = time.monotonic()
        self._stall_armed = False
        self._timers = timers
        req.pacer = self

    def _took(self, nbytes: int, drained: bool) -> None:
        """The consumer took a response holding ``nbytes`` of tensors (``drained``: none is left
        waiting). The stub is told in batches of a quarter of its limits while its model is
        free to send, of an eighth while it waits, and once the consumer has taken all: the
        stub may count bytes that the host does not see (outputs nobody asked for), and this
        way it hears of every response taken however it counts."""
        self._last_take = time.monotonic()
        with self._pace_lock:
            self._taken += 1
            self._bytes_since_ack += nbytes
            part = 8 if self._held else 4
            if not (self._taken - self._acked >= HOLD_RESPONSES // part
                    or self._bytes_since_ack >= HOLD_BYTES // part
                    or self._held and drained):
                return
            taken = self._acked = self._taken
            self._bytes_since_ack = 0
        self._ack(taken)

    def limits(self) -> list[int]:
        """What the stub may hold that the consumer has not taken: [bytes, responses]."""
        return [HOLD_BYTES, HOLD_RESPONSES]

    def held(self) -> None:
        """The stub's model waits to send (HELD)."""
        if self._timers is not None and self._timers.draining:
            self.unpace()
            return
        with self._pace_lock:
            self._held = True
            taken = 0
            if self._taken > self._acked:
                taken = self._acked = self._taken
                self._bytes_since_ack = 0
            arm = not self._stall_armed
            self._stall_armed = True
        if taken:
            self._ack(taken)
        self._tell_held()
        if arm and self._timers is not None:
            self._timers.at(time.monotonic() + HELD_STALLED_S, self._check_stalled)

    def _tell_held(self) -> None:
        """Pass the HELD on to the consumer, where it must report what it takes (a BLS
        caller's stub: see _bls._StreamPacing); here it is this process, which does."""

    def unpace(self) -> None:
        """No more pacing: the stub's model sends at its own pace from now on (the server
        stops: its drain must not wait for a consumer that may read no more; a BLS caller
        waits for another call), and no stall is watched for."""
        with self._pace_lock:
            self._held = False
        req = self.request
        if req is not None and req.pacer is self:
            req.pacer = None
            self._ack(-1)

    def _ack(self, taken: int) -> None:
        hook = self.on_taken
        if hook is not None:
            hook(taken)
            return
        req = self.request
        if req is not None:
            req.ack(taken)

    def _check_stalled(self) -> None:
        """While the model waits: cancel the request of a consumer that took nothing for
        HELD_STALLED_S (its model would otherwise wait for ever)."""
        req = self.request
        idle = time.monotonic() - self._last_take
        with self._pace_lock:
            stalled = self._held and req is not None and idle >= HELD_STALLED_S
            self._stall_armed = self._held and req is not None and not stalled
        if self._stall_armed:
            assert self._timers is not None
            self._timers.at(time.monotonic() + HELD_STALLED_S - idle, self._check_stalled)
        elif stalled:
            assert req is not None
            req.cancel(f"the client did not read its responses: it took none for {idle:.0f} s "
                       "while the model waited to send more")


class _Feed(_Pacing):
    """What the host holds of a :class:`ResponseStream`: its queue, request and pacing. The
    request refers to this (``req.sink``, ``req.pacer``), never to the stream the caller holds:
    a caller that drops that stream before its end can then have its request cancelled."""

    def __init__(self) -> None:
        self.q: queue.SimpleQueue[InferenceResponse] = queue.SimpleQueue()
        self.request: HostRequest | None = None

    def sink(self, req: HostRequest, outputs: list | None, error: TritonpyError | None,
             parameters: dict | None, final: bool) -> None:
        if final:
            # request <-> feed is a reference cycle (req.sink is our bound method): break it
            # so that the request's inputs (maybe shm blocks) go as soon as the caller lets go,
            # not whenever the cyclic GC runs.
            self.request = None
        self._held = False  # (a response after HELD: the stub's model goes on)
        self.q.put(_make_response(req, outputs, error, parameters, final))


class _Stream:
    """What both response streams share: the feed the host fills (the request refers to it,
    never to the stream), the request while it is in flight, and its cancel."""

    __slots__ = ("_feed", "_finished", "__weakref__")
    _feed: Any  # a _Feed or an _AsyncFeed

    @property
    def request(self) -> HostRequest | None:
        """The request while it is in flight (None once its final response is in)."""
        return self._feed.request

    def _start(self, req: HostRequest, timers: Timers | None) -> None:
        """Bind ``req``; ``timers``: pace it by this stream's consumer, and cancel it when the
        stream is dropped (a decoupled model's request)."""
        feed = self._feed
        feed.request = req
        if timers is not None:
            feed.pace(req, timers)
            _cancel_when_dropped(self, feed)

    def cancel(self) -> None:
        req = self._feed.request
        if req is not None:
            req.cancel("request cancelled by the client")


@public
class ResponseStream(_Stream):
    """Iterator of a request's responses (one for a default-mode model); ``cancel()`` stops it.

    Dropping it before its end (the last reference to it goes) cancels a decoupled model's
    request, as ``cancel()`` would: nobody is left to read what the model sends."""

    __slots__ = ()

    def __init__(self) -> None:
        self._feed = _Feed()
        self._finished = False

    def __iter__(self) -> ResponseStream:
        return self

    def __next__(self) -> InferenceResponse:
        if self._finished:
            raise StopIteration
        return self.get()

    def get(self, timeout: float | None = None) -> InferenceResponse:
        """The next response, waiting up to ``timeout`` seconds (queue.Empty when none; at
        once after the final one, which ends the iteration too: no other will come)."""
        if timeout is not None and not (type(timeout) in (int, float)
                                        and 0 <= timeout <= _TIMEOUT_MAX):
            timeout = _timeout_arg(timeout)
        if self._finished:
            raise queue.Empty
        feed = self._feed
        resp = feed.q.get(timeout=timeout)
        if feed._timers is not None:
            feed._took(sum(getattr(t._arr, "nbytes", 0) for t in resp.outputs.values()),
                       feed.q.empty())
        if resp.final:
            self._finished = True
        return resp


def _timeout_arg(timeout: Any) -> float | None:
    """A ``get`` timeout other than a plain number of seconds: refused unless a number >= 0;
    one past what a wait can take (``inf``) waits for ever. A bool is refused: ``get(True)``
    reads as queue.Queue's ``get(block=True)``, which it is not."""
    try:
        if isinstance(timeout, bool):
            raise TypeError
        seconds = float(timeout)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"timeout must be a number of seconds or None, not "
                                   f"{type(timeout).__name__}") from None
    if not seconds >= 0:  # (NaN too)
        raise InvalidArgumentError(f"timeout must be 0 or more seconds, not {timeout!r}")
    return seconds if seconds <= _TIMEOUT_MAX else None


# Requests of streams dropped before their end, cancelled by one thread of their own: a
# stream's finalizer may run in the middle of any code of any thread (the cyclic GC), maybe
# one that holds a lock that cancelling takes. SimpleQueue.put is safe there.
_dropped: queue.SimpleQueue[HostRequest] = queue.SimpleQueue()
_reaper: threading.Thread | None = None
_reaper_lock = threading.Lock()


def _cancel_when_dropped(stream: Any, feed: Any) -> None:
    """Cancel ``feed``'s request, if still in flight, once ``stream`` is gone."""
    global _reaper
    if _reaper is None:
        with _reaper_lock:
            if _reaper is None:
                thread = threading.Thread(target=_reap, name="tritonpy-dropped-streams",
                                          daemon=True)
                thread.start()  # (raises where no thread can be had: the next stream tries again)
                _reaper = thread
    weakref.finalize(stream, _dropped_feed, feed).atexit = False


def _dropped_feed(feed: Any) -> None:
    req = feed.request
    if req is not None and not req.done:
        _dropped.put(req)


def _reap() -> None:
    while True:
        req = _dropped.get()
        try:
            req.cancel("request cancelled: the client dropped its response stream")
        except Exception:  # one request's failure must not stop the others' cancels
            logging.getLogger("tritonpy").exception("cancelling a dropped stream's request")
        del req  # (its inputs, maybe shm blocks, go now, not at the next drop)


#: Back-pressure: the stub running a decoupled request of the in-process API (every HTTP and
#: gRPC stream is one) keeps at most this many bytes of tensors, and this many responses, that
#: the consumer has not taken yet; the model's next ``response_sender.send`` waits there until
#: the consumer took half of them. A model thus streams at its client's pace, and its shared
#: memory stays bounded.
HOLD_BYTES = 32 << 20
HOLD_RESPONSES = 4096
#: A consumer that takes nothing for this long while the model waits has its request
#: cancelled, as below (its model would otherwise wait for ever). Nothing grows meanwhile, so
#: this is long: a consumer that pauses, or reads several streams one after the other, keeps
#: them. It matches the HTTP frontend's disconnection of a client that reads nothing.
HELD_STALLED_S = 60.0
#: A response stream whose consumer lets more than this many responses, or this many bytes of
#: their tensors, wait and takes none of them for ``STALLED_S`` seconds (a client that stopped
#: reading its decoupled stream), or lets 4 times as many wait whatever it takes, has its
#: request cancelled: the model sees ``is_cancelled()``, what it sends next is dropped, and the
#: consumer gets the error after the responses that waited. Without it they piled up in the
#: host's memory for as long as the model kept sending. A consumer that reads slowly but reads
#: keeps its stream up to that hard limit (1 GiB, 262,144 responses).
MAX_WAITING_RESPONSES = 65_536
MAX_WAITING_BYTES = 256 << 20
STALLED_S = 5.0
_HARD = 4


class _AsyncFeed(_Pacing):
    """What the host holds of an :class:`AsyncResponseStream` (see :class:`_Feed`): a deque
    and at most one pending future (not an ``asyncio.Queue``): a response that is already
    there is returned without suspending, and each delivery costs one loop callback."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: collections.deque[tuple[InferenceResponse, int]] = collections.deque()
        self.waiting_bytes = 0
        self.taken_at = loop.time()  # when the consumer last took a response (or began)
        self.waiter: asyncio.Future | None = None
        self.request: HostRequest | None = None

    def sink(self, req: HostRequest, outputs: list | None, error: TritonpyError | None,
             parameters: dict | None, final: bool) -> None:
        resp = _make_response(req, outputs, error, parameters, final)
        nbytes = tensor_bytes(outputs)
        # The request to cancel if too much waits (None for the final response: nothing to).
        live: HostRequest | None = req
        if final:
            self.request = None  # break the request <-> feed cycle, as _Feed does
            live = None
        self._on_loop(self._push, resp, nbytes, live)

    def _on_loop(self, fn: Callable[..., None], *args: Any) -> None:
        """``fn(*args)`` on the stream's loop: now if this is it, else handed over (in order)."""
        if asyncio._get_running_loop() is self.loop:
            fn(*args)
            return
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _push(self, resp: InferenceResponse, nbytes: int, req: HostRequest | None) -> None:
        items = self.items
        items.append((resp, nbytes))
        self.waiting_bytes += nbytes
        count, size = len(items), self.waiting_bytes
        if req is not None and (count > MAX_WAITING_RESPONSES or size > MAX_WAITING_BYTES) and (
                self.loop.time() - self.taken_at > STALLED_S
                or count > _HARD * MAX_WAITING_RESPONSES or size > _HARD * MAX_WAITING_BYTES):
            # Next, not from inside the delivery: its sender may hold a lock that the cancel
            # takes (an ensemble answers under its request's lock; on the loop that reads the
            # stubs, the cancel from here waited on that lock for ever, and the server with it).
            self.loop.call_soon(req.cancel, f"the client did not read its responses: {count} "
                                f"of them ({size / (1 << 20):.1f} MiB) were waiting for it")
        self._held = False  # (a response after HELD: the stub's model goes on)
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def held(self) -> None:
        if self._timers is not None and self._timers.draining:
            self.unpace()  # (now: the loop may no longer run)
            return
        # On the loop, in order with the pushes that came before it (each clears _held).
        self._on_loop(_Pacing.held, self)


@public
class AsyncResponseStream(_Stream):
    """Async iterator of a request's responses, fed from the host's threads.

    A consumer that stops taking them gets its request cancelled (:data:`MAX_WAITING_BYTES`);
    one that drops the stream before its end, a decoupled model's request cancelled at once
    (as :class:`ResponseStream`).
    """

    __slots__ = ()

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._feed = _AsyncFeed(loop)
        self._finished = False

    def __aiter__(self) -> AsyncResponseStream:
        return self

    async def __anext__(self) -> InferenceResponse:
        if self._finished:
            raise StopAsyncIteration
        feed = self._feed
        items = feed.items
        while not items:
            waiter = feed.waiter = feed.loop.create_future()
            try:
                await waiter
            except asyncio.CancelledError:
                self.cancel()
                raise
            finally:
                feed.waiter = None
        resp, nbytes = items.popleft()
        feed.waiting_bytes -= nbytes
        feed.taken_at = feed.loop.time()
        if feed._timers is not None:
            feed._took(nbytes, not items)
        if resp.final:
            self._finished = True
        return resp

