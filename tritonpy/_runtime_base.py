"""What a loaded model version (:mod:`._model`) and a loaded ensemble version
(:mod:`._ensemble`) have alike: their states, :class:`RuntimeBase`, and helpers both use.

State machine of a version: LOADING -> READY -> UNLOADING -> UNAVAILABLE (or LOADING ->
UNAVAILABLE with a reason).
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterable, Sequence

from tritonpy.shm.cuda import DeviceRef

from ._errors import TritonpyError, UnavailableError
from ._instances import Instance
from ._request import HostRequest
from ._stats import ModelStats

LOADING, READY, UNLOADING, UNAVAILABLE = "LOADING", "READY", "UNLOADING", "UNAVAILABLE"


def side_by_side(calls: Sequence[tuple[str, Callable[[], None]]]) -> list[BaseException | None]:
    """Run each ``(thread name, call)`` on a thread of its own and wait for them all; what
    each raised (None: nothing).

    Threads of our own, not an executor's: when no thread can be had (RLIMIT_NPROC, the
    cgroup's pids.max), an executor's submit raised out of its caller with the calls submitted
    before still running (a version stayed LOADING for ever). Such a call runs on this thread
    instead."""
    errors: list[BaseException | None] = [None] * len(calls)

    def run(i: int, call: Callable[[], None]) -> None:
        try:
            call()
        except BaseException as exc:  # handed to the caller, on its thread
            errors[i] = exc

    threads = []
    for i, (name, call) in enumerate(calls):
        thread = threading.Thread(target=run, args=(i, call), daemon=True, name=name)
        try:
            thread.start()
        except RuntimeError:
            run(i, call)
        else:
            threads.append(thread)
    for thread in threads:
        thread.join()
    return errors


def reshape_arrays(pairs: Iterable[tuple[str, Any]],
                   shape_of: Callable[[str, Any], list[int] | None]) -> list:
    """``(name, array)`` pairs, each array in the shape ``shape_of`` gives it (None: as it is):
    numpy views; a DeviceRef, decoded for one request alone, takes its new shape."""
    out = []
    for name, arr in pairs:
        shape = shape_of(name, arr.shape)
        if shape is not None and list(arr.shape) != shape:
            if type(arr) is DeviceRef:
                arr.shape = tuple(shape)
            else:
                arr = arr.reshape(shape)
        out.append((name, arr))
    return out


class RuntimeBase:
    """What a loaded model version and a loaded ensemble version have alike: identity and
    config, state, statistics, request validation, and unloading after in-flight work ends."""

    is_ensemble = False
    queue: Any  # what waits for an instance, deque-like (set by the subclasses)

    def __init__(self, server: Any, name: str, version: int, config: Any, config_json: str,
                 model_dir: str) -> None:
        from .validation import RequestValidator, Reshapes

        self.server = server
        self.name = name
        self.version = version
        # Its repository with --model-namespacing ("" without): the metrics' namespace label,
        # and where an ensemble looks for its steps first. Set by the repository manager.
        self.namespace = ""
        self.config = config
        self.config_json = config_json
        self.model_dir = model_dir
        self.output_labels: dict[str, list[str]] = {}  # read at load: config.read_labels
        self.state = LOADING
        # Why the last update of this version (serving on) failed, for the index, as Triton's
        # (a READY version with a reason); "" once an update or load succeeds.
        self.failed_update = ""
        self.decoupled = bool(config.model_transaction_policy.decoupled)
        self.max_batch_size = int(config.max_batch_size)
        metrics_config = getattr(server, "metrics_config", None)
        self.stats = ModelStats(name, version, summaries=bool(
            metrics_config is not None and metrics_config.summary_latencies))
        self.validator = RequestValidator(config, name)
        self.reshapes = Reshapes.of(config)  # None unless an input or output has a reshape
        # A request that names no output asks for every output of the config, as in Triton:
        # the model sees them in requested_output_names(), and outputs it makes that the
        # config does not declare are dropped.
        self.all_outputs = [o.name for o in config.output]
        self.instances: list[Instance] = []
        self.successor: Any = None  # set by a reload that replaced this one
        self.lock = threading.Lock()
        self._halt = threading.Event()  # set by the unload: restarts end
        self._idle = threading.Condition(self.lock)
        self._draining = 0  # threads in drain(): only then is _idle worth notifying
        self.cut_short = False  # unloaded with requests still in flight (the drain timed out)
        self.finalize_cut_off = False  # unloaded with a finalize still running (cut off)

    def not_ready_error(self) -> UnavailableError:
        return UnavailableError(
            f"model '{self.name}' version {self.version} is not ready ({self.state.lower()})")

    def _busy(self) -> bool:
        """Whether requests are queued or in flight (called with ``lock`` held)."""
        raise NotImplementedError

    def _queued_locked(self) -> int:
        """Queued requests not answered yet (one cancelled stays queued until a batch forms);
        caller holds ``lock``."""
        return sum(1 for r in self.queue if not r.done)

    def fail_queue(self, error: TritonpyError) -> None:
        """Fail every request queued and not started (the server stops at once). An
        ensemble queues nothing itself: its steps' models hold its requests."""

    def in_flight(self) -> int:
        """Requests not answered yet: queued, or given to an instance and not finished."""
        with self.lock:
            return self._queued_locked() + sum(len(i.active) for i in self.instances)

    def pending(self) -> int:
        """Requests awaiting execution: queued (not cancelled meanwhile), or prefetched behind
        an instance's running execute."""
        with self.lock:
            queued = self._queued_locked()
            sent_behind: int = sum(max(0, len(i.inflight) - i.capacity) for i in self.instances)
            return queued + sent_behind

    def _unloaded(self, timeout: float) -> None:
        """What is left to do once the version no longer takes requests."""
        raise NotImplementedError

    def drain(self, timeout: float | None, busy: Callable[[], bool] | None = None) -> bool:
        """Wait until nothing is queued or in flight, or until ``busy()`` (called with
        ``lock`` held) is false; bounded by ``timeout``. Returns whether that came.

        ``timeout`` None: as long as that takes (Triton lets an unloaded or replaced version
        finish every request), until the server stops; from then on its exit timeout."""
        busy = busy or self._busy
        deadline = time.monotonic() + timeout if timeout is not None else float("inf")
        with self.lock:
            self._draining += 1
            try:
                while busy():
                    if timeout is None and self.server._stopping and deadline == float("inf"):
                        deadline = time.monotonic() + self.server.exit_timeout
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._idle.wait(min(left, 0.1))
                return not busy()
            finally:
                self._draining -= 1

    def unload(self, timeout: float | None = 30.0) -> None:
        """Stop taking requests, let what is in flight finish (bounded by ``timeout``; None:
        see ``drain``), then release what the version holds."""
        if self.state == READY:
            self.state = UNLOADING
            self._hand_over()
            self.cut_short = not self.drain(timeout)
        self.state = UNAVAILABLE
        self._unloaded(self.server.exit_timeout if timeout is None else timeout)

    def _hand_over(self) -> None:
        """A version replaced by a reload: what it has queued and not started goes to its
        successor now (only what it runs is left to finish here)."""

    def _answered_from_cache(self, req: HostRequest, cache: Any, keep_params: bool = True,
                             queued: bool = True) -> bool:
        """Answer ``req`` from the response cache if it holds its answer; else arrange for
        its answer to be kept there (its parameters too, unless ``keep_params``). GPU tensors
        (a BLS call's, a client's CUDA shared memory) are not cached: the host never reads
        device memory.

        As Triton counts them, a miss counts once its request has run (``queued``: a request
        answered from the queue, rejected or timed out, is no miss), with its insertion time,
        unless an identical request's answer was kept first."""
        if any(type(a) is DeviceRef for _, a in req.inputs):
            return False
        t0 = time.monotonic_ns()
        key = cache.key(self.name, self.version, req.inputs)
        hit = cache.lookup(key, req.requested or self.all_outputs)
        t1 = time.monotonic_ns()
        if hit is not None:
            self.stats.cache_hit(t1 - req.t_enqueue, t1 - t0)
            req.respond(hit[0], None, hit[1], True)
            return True
        sink, stats = req.sink, self.stats

        def keep(r: HostRequest, outputs: Any, error: Any, params: Any, final: bool) -> None:
            if final and not (queued and error is not None and not r.t_start):
                insert_ns, missed = 0, True
                if error is None and outputs and not any(
                        type(a) is DeviceRef for _, a in outputs):
                    t = time.monotonic_ns()
                    # Copies: before the caller takes them.
                    missed = cache.insert(key, outputs, params if keep_params else None,
                                          self.name) is not None
                    insert_ns = time.monotonic_ns() - t
                if missed:
                    stats.cache_miss(t1 - t0, insert_ns)
            sink(r, outputs, error, params, final)
        req.sink = keep
        return False

