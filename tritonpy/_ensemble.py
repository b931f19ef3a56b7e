"""Ensembles: ``platform: "ensemble"`` models whose ``ensemble_scheduling`` steps run other
models, with each step's outputs becoming the next steps' inputs.

Loading (:func:`load_ensemble`): the step models are loaded first (explicit mode loads them as
dependencies, as Triton does), then the ensemble is checked against their completed
configurations the way Triton's ``ValidateEnsembleConfig`` does — every step input mapped once,
no mapping to or from a tensor the step model lacks, data types and shapes consistent across
every use of an ensemble tensor, batch sizes compatible, no step fed by two different decoupled
streams — and the ensemble is decoupled when any of its steps is.

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
The ensemble's own ``reshape`` applies as in Triton: its inputs flow into the steps in their
reshape form, and its outputs leave in their dims form. A tensor passing between a batching and
a non-batching side gains or loses a batch dimension of 1 as it does in Triton
(:func:`_fit_batch_dim`).

Back-pressure (``ensemble_scheduling.max_inflight_requests``, a newer Triton's; 2.51 refuses
the field): at most that many requests run at each step at once, across all of the ensemble's
requests (:class:`_StepGate`); a step request beyond it waits in the host, in order, until one
of that step's requests ends. A decoupled step that streams faster than the steps after it
consume is paced as a client's stream is (``_request._Pacing``): its model's
``response_sender.send`` waits once that many of its responses wait to be let into the next
steps, as Triton's producer waits, so neither the step requests nor their tensors pile up.
"""
from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

from ._errors import (
    InternalError,
    InvalidArgumentError,
    TritonpyError,
    UnavailableError,
)
from ._model import READY, RuntimeBase, reshape_arrays
from ._request import HostRequest, _Pacing

if TYPE_CHECKING:
    from ._repo_manager import ModelEntry, RepositoryManager

log = logging.getLogger("tritonpy.ensemble")

ENSEMBLE_PLATFORM = "ensemble"
_WILDCARD = -1

# Ensembles being loaded by this thread, outermost first (circular dependency detection).
_loading = threading.local()


def is_ensemble(cfg: Any) -> bool:
    """Whether a parsed ``ModelConfig`` describes an ensemble."""
    return cfg.platform == ENSEMBLE_PLATFORM or cfg.HasField("ensemble_scheduling")


def is_ensemble_dir(model_dir: str, config_name: str = "") -> bool:
    """A cheap look at the model's configuration file: does it declare an ensemble? (False
    when unreadable.)"""
    from .config import load_model_config

    try:
        cfg, _ = load_model_config(model_dir, config_name)
    except (TritonpyError, OSError):
        return False
    return is_ensemble(cfg)


# ---------------------------------------------------------------------------- dependencies


def ensure_step_loaded(repo: RepositoryManager, ensemble: str, name: str,
                       namespace: str = "") -> None:
    """Make sure step model ``name`` of ``ensemble`` is loaded, loading it if that is allowed.

    Explicit mode loads a missing step model as a dependency (as Triton does); in the other
    modes every model was already tried at start-up, so a step model without a loaded version
    fails the ensemble with that model's reason. An ensemble met again while it is itself being
    loaded is a circular dependency.
    """
    try:  # with namespacing: the one of the ensemble's repository, else the only one
        entry: ModelEntry | None = repo.find(name, namespace) if repo.namespacing \
            else repo.entries.get(name)
    except TritonpyError:
        entry = None
    stack: list[str] = getattr(_loading, "stack", [])  # the keys of the ensembles loading
    key = entry.key if entry is not None else name
    if key in stack:
        last_entry = repo.entries.get(stack[-1])
        last = last_entry.name if last_entry is not None else stack[-1]
        raise InvalidArgumentError(
            f"circular dependency between ensembles: {name} -> ... -> {last} -> {name}")
    if entry is None:
        raise InvalidArgumentError(
            f"ensemble {ensemble} contains models that are not available or ambiguous: {name}")
    with entry.lock:  # waits for a load of that model already under way
        if entry.runtimes:
            return
        never_tried = entry.reason == "unloaded"
        if repo.server.model_control_mode != "explicit" and not never_tried:
            raise InvalidArgumentError(
                f"ensemble '{ensemble}' depends on '{name}' which has no loaded version. "
                f"Model '{name}' loading failed with error: {entry.reason}")
        try:
            repo.without_files(entry)  # as a load of it without files would
            repo._load_entry(entry, None)
        except TritonpyError as exc:
            raise InvalidArgumentError(
                f"ensemble '{ensemble}' depends on '{name}' which has no loaded version. "
                f"Model '{name}' loading failed with error: {exc.message}") from None


class _LoadingGuard:
    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        stack = getattr(_loading, "stack", None)
        if stack is None:
            stack = _loading.stack = []
        stack.append(self.name)

    def __exit__(self, *exc: Any) -> None:
        _loading.stack.pop()


# ---------------------------------------------------------------------------- output order

# The bucket counts of a libstdc++ unordered_map as it grows one key at a time, from its first
# insertion on (measured with GCC 12; the hashtable of GCC 11, which builds Triton 2.51, grows
# alike): at load factor 1 it moves to the next count when a key would exceed the current one.
_BUCKET_COUNTS = (13, 29, 59, 127, 257, 541, 1109, 2357, 5087, 10273, 20753, 42043, 85229,
                  172933, 351061, 712697, 1447153, 2938679, 5967347)
_M64 = (1 << 64) - 1
_HASH_MUL = (0xC6A4A793 << 32) | 0x5BD1E995
_HASH_SEED = 0xC70F6907


def _cxx_string_hash(name: str) -> int:
    """``std::hash<std::string>`` of libstdc++ on 64-bit Linux: a MurmurHash2-style mix of
    the UTF-8 bytes, eight at a time (little-endian), then the tail, with a fixed seed."""

    def mix(v: int) -> int:
        return v ^ (v >> 47)

    data = name.encode()
    size = len(data)
    h = (_HASH_SEED ^ (size * _HASH_MUL)) & _M64
    whole = size & ~7
    for i in range(0, whole, 8):
        word = (mix((int.from_bytes(data[i:i + 8], "little") * _HASH_MUL) & _M64)
                * _HASH_MUL) & _M64
        h = ((h ^ word) * _HASH_MUL) & _M64
    if size & 7:
        h = ((h ^ int.from_bytes(data[whole:], "little")) * _HASH_MUL) & _M64
    return mix((mix(h) * _HASH_MUL) & _M64)


def triton_output_order(names: Sequence[str]) -> tuple[str, ...]:
    """The order in which Triton 2.51 lists an ensemble's outputs in its responses.

    Triton's ensemble keeps its outputs in a ``std::unordered_map`` filled in the config's
    order and writes a response's outputs by walking that map (measured: over HTTP JSON, HTTP
    binary and gRPC alike, whatever order the client asked for them in). The walk follows the
    map's single list of nodes: a key whose bucket is empty goes to the front of the list, one
    whose bucket has keys goes just before them, and growing the map relinks the nodes in list
    order by the same rule. This replays that for the names, in config order.
    """
    hashes: dict[str, int] = {}
    nodes: list[str] = []
    counts = iter(_BUCKET_COUNTS)
    buckets = next(counts)

    def link(into: list[str], name: str) -> None:
        bucket = hashes[name] % buckets
        for i, other in enumerate(into):
            if hashes[other] % buckets == bucket:
                into.insert(i, name)
                return
        into.insert(0, name)

    for name in names:
        if name in hashes:
            continue
        hashes[name] = _cxx_string_hash(name)
        if len(nodes) + 1 > buckets:
            buckets = next(counts, buckets)
            relinked: list[str] = []
            for other in nodes:
                link(relinked, other)
            nodes = relinked
        link(nodes, name)
    return tuple(nodes)


# ---------------------------------------------------------------------------- validation


class _Node:
    """One ensemble tensor in the load-time graph: where its type/shape was inferred from."""

    __slots__ = ("source", "dtype", "dims", "full_dims", "decoupled", "label", "visited",
                 "prev", "next", "sibling")

    def __init__(self, source: str, batching: bool = False, dtype: int = 0,
                 dims: Sequence[int] = ()) -> None:
        self.source = source
        self.dtype = dtype
        self.dims = tuple(int(d) for d in dims)
        self.full_dims = ((_WILDCARD,) if batching else ()) + self.dims
        self.decoupled = False
        self.label = 0
        self.visited = False
        self.prev: list[_Node] = []
        self.next: list[_Node] = []
        self.sibling: _Node | None = None


def _dims_match(a: Sequence[int], b: Sequence[int]) -> bool:
    return len(a) == len(b) and all(x == y or x == _WILDCARD or y == _WILDCARD
                                    for x, y in zip(a, b))


def _dims_text(dims: Sequence[int]) -> str:
    return "[" + ",".join(str(d) for d in dims) + "]"


def _consistent(known: _Node, new: _Node, where: str) -> None:
    from .validation import triton_type_name

    if known.dtype != new.dtype:
        raise InvalidArgumentError(
            f"{where}inconsistent data type: TYPE_{triton_type_name(known.dtype)} is inferred "
            f"from model {known.source} while TYPE_{triton_type_name(new.dtype)} is inferred "
            f"from model {new.source}")
    # A tensor may pass between a batching and a non-batching model when the full shapes
    # agree ([-1, d...] against a batching model's [d...]).
    if not _dims_match(known.dims, new.dims) and not _dims_match(known.full_dims, new.full_dims):
        raise InvalidArgumentError(
            f"{where}inconsistent shape: {_dims_text(known.full_dims)} is inferred from model "
            f"{known.source} while {_dims_text(new.full_dims)} is inferred from model "
            f"{new.source}")


def validate_ensemble(cfg: Any, step_configs: Sequence[Any]) -> bool:
    """Check an ensemble against its step models' configurations; whether it is decoupled.

    Args:
        cfg: The ensemble's normalised configuration (its own structure is already checked
            by ``normalize_config``).
        step_configs: The configuration of each step's model, in step order.

    Raises:
        InvalidArgumentError: In Triton's words, naming the ensemble, tensor and model.
    """
    ens = cfg.name
    batching = cfg.max_batch_size > 0
    nodes: dict[str, _Node] = {}
    for io in cfg.input:
        dims = io.reshape.shape if io.HasField("reshape") else io.dims
        nodes[io.name] = _Node(ens, batching, io.data_type, dims)
    sink = _Node(ens)
    for io in cfg.output:
        dims = io.reshape.shape if io.HasField("reshape") else io.dims
        node = nodes.setdefault(io.name, _Node(ens, batching, io.data_type, dims))
        sink.prev.append(node)
        node.next.append(sink)

    for step, mcfg in zip(cfg.ensemble_scheduling.step, step_configs):
        model = step.model_name
        if mcfg.max_batch_size != 0 and mcfg.max_batch_size < cfg.max_batch_size:
            raise InvalidArgumentError(
                f"ensemble {ens} allows maximum batch size {cfg.max_batch_size}, but it "
                f"contains model {model} which only allows maximum batch size to be "
                f"{mcfg.max_batch_size}")
        step_batching = mcfg.max_batch_size > 0
        where = f"in ensemble {ens}, "
        inputs = {io.name: io for io in mcfg.input}
        for model_input, tensor in step.input_map.items():
            if model_input not in inputs:
                raise InvalidArgumentError(
                    f"{where}ensemble tensor {tensor} is mapping to non-existing input "
                    f"{model_input} in model {model}")
        for name, io in inputs.items():
            if name not in step.input_map:
                if io.optional:
                    continue
                raise InvalidArgumentError(
                    f"{where}input {name} in model {model} is not mapped to any ensemble "
                    "tensors")
            tensor = step.input_map[name]
            new = _Node(model, step_batching, io.data_type, io.dims)
            if tensor in nodes:
                _consistent(nodes[tensor], new, f"{where}ensemble tensor {tensor}: ")
            else:
                nodes[tensor] = new
        outputs = {io.name: io for io in mcfg.output}
        sibling = _Node(model)
        for model_output, tensor in step.output_map.items():
            io = outputs.get(model_output)
            if io is None:
                raise InvalidArgumentError(
                    f"{where}ensemble tensor {tensor} is mapped from non-existing output "
                    f"{model_output} in model {model}")
            new = _Node(model, step_batching, io.data_type, io.dims)
            if tensor in nodes:
                _consistent(nodes[tensor], new, f"{where}ensemble tensor {tensor}: ")
            else:
                nodes[tensor] = new
            nodes[tensor].sibling = sibling
        decoupled = bool(mcfg.model_transaction_policy.decoupled)
        for tensor in step.output_map.values():
            node = nodes[tensor]
            node.decoupled = decoupled
            for source in step.input_map.values():
                node.prev.append(nodes[source])
                nodes[source].next.append(node)

    # Label each tensor with the decoupled stream it comes from (0: the request itself); a
    # step fed from two different streams could never line its inputs up.
    labels = 0
    frontier = []
    for io in cfg.input:
        nodes[io.name].visited = True
        frontier.append(nodes[io.name])
    while frontier:
        current = frontier.pop(0)
        for node in current.next:
            if node.visited or not all(p.visited for p in node.prev):
                continue
            label = node.prev[0].label
            if any(p.label != label for p in node.prev):
                raise InvalidArgumentError(
                    f"in ensemble {ens}, step of model '{node.source}' receives inputs "
                    "originated from different decoupled models")
            sib = node.sibling
            if sib is not None and sib.visited:
                node.label = sib.label
            else:
                if node.decoupled:
                    labels += 1
                    node.label = labels
                else:
                    node.label = label
                if sib is not None:
                    sib.label = node.label
                    sib.visited = True
            node.visited = True
            frontier.append(node)
    return labels != 0


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


RUN, WAIT, GONE = range(3)


class _StepGate:
    """``max_inflight_requests`` at one step: the step requests running (ids), and those
    waiting for room, oldest first, each with what to call once it is let in."""

    __slots__ = ("limit", "lock", "running", "waiting")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.lock = threading.Lock()
        self.running: set[int] = set()
        self.waiting: collections.deque[tuple[HostRequest, Callable[[], None] | None]] = (
            collections.deque())

    def enter(self, sreq: HostRequest, then: Callable[[], None] | None) -> int:
        """RUN: ``sreq`` may run now; WAIT: it waits its turn (see :meth:`leave`); GONE: it
        ended already (cancelled before it was launched). Under the lock, as :meth:`leave`
        is: a request that ends meanwhile is either seen here as ended or found running."""
        with self.lock:
            if sreq.done:
                return GONE
            if len(self.running) < self.limit and not self.waiting:
                self.running.add(sreq.id)
                return RUN
            self.waiting.append((sreq, then))
            return WAIT

    def leave(self, sreq: HostRequest) -> list[tuple[HostRequest, Callable[[], None] | None]]:
        """``sreq`` ended (its final response, or it was cancelled while it waited): the
        waiting requests it makes room for, to be submitted by the caller, outside any lock.
        A request that ended while it waited is dropped (its tensors with it), its ``then``
        returned to be called all the same."""
        with self.lock:
            if sreq.id not in self.running:
                for i, (r, then) in enumerate(self.waiting):
                    if r is sreq:
                        del self.waiting[i]
                        return [(r, then)] if then is not None else []
                return []
            self.running.discard(sreq.id)
            let_in = []
            while self.waiting and len(self.running) < self.limit:
                r, then = self.waiting.popleft()
                if not r.done:
                    self.running.add(r.id)
                let_in.append((r, then))
            return let_in


class _StepPacing(_Pacing):
    """Back-pressure on a decoupled step under ``max_inflight_requests``: its stub may have
    ``limit`` responses that the steps after it have not let in yet; its model's next send
    waits there. No stall is watched for: the steps after it always move on."""

    def __init__(self, limit: int) -> None:
        self.request = None
        self._limit = limit
        self._batch = max(1, limit // 4)

    def start(self, req: HostRequest) -> None:
        self.request = req
        self.pace(req, None)

    def limits(self) -> list[int]:
        # No bound on bytes: the limit counts requests, as Triton's.
        return [1 << 62, self._limit]

    def took(self) -> None:
        """One more of the step's responses has all its next step requests let in."""
        with self._pace_lock:
            self._taken += 1
            if not self._held and self._taken - self._acked < self._batch:
                return
            taken = self._acked = self._taken
        self._ack(taken)


class _Owed:
    """One response of a paced step, taken once its ``left`` step requests are let in."""

    __slots__ = ("pacer", "left", "lock")

    def __init__(self, pacer: _StepPacing, left: int) -> None:
        self.pacer = pacer
        self.left = left
        self.lock = threading.Lock()

    def one(self) -> None:
        with self.lock:
            self.left -= 1
            if self.left:
                return
        self.pacer.took()


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
                                                                keep_params=False):
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

    def pending_steps(self, req: HostRequest) -> list[HostRequest]:
        """The step requests in flight for ensemble request ``req`` (deadlock detection)."""
        with self.lock:
            ctx = next((c for c in self._active if c.request is req), None)
        if ctx is None:
            return []
        with ctx.lock:
            return list(ctx.pending)


def _fit_batch_dim(pairs: list, batched: dict[str, bool], cfg: Any, ios: Any,
                   internal: bool = False) -> list:
    """``(name, array)`` pairs given or stripped a batch dimension of 1 where they pass
    between a batching and a non-batching side (as Triton's ensembles do).

    ``batched`` says which arrays come from a batching producer (the ensemble's request or a
    step); ``cfg`` is the receiver's config (a step model's, or the ensemble's for its own
    outputs) and ``ios`` its tensors, compared in their ``dims`` form (``internal``: in their
    ``reshape`` form, the one ensemble tensors flow in). A receiver that batches gets ``[1,
    ...]`` when the array already has its per-item dims; one that does not gets a batch of
    one without its batch dimension when the array does not fit its dims as it is. Anything
    else is left to the receiver's own shape check.
    """
    receiver_batches = cfg.max_batch_size > 0
    if not any(batched.get(n) != receiver_batches for n, _ in pairs):
        return pairs  # the usual case: both sides batch, or neither does
    dims = {}
    for io in ios:
        shape = io.reshape.shape if internal and io.HasField("reshape") else io.dims
        dims[io.name] = tuple(int(d) for d in shape)

    def shape_of(name: str, shape: Sequence[int]) -> list[int] | None:
        expected = dims.get(name)
        if expected is None:
            return None
        batch = shape[0] if batched.get(name) and len(shape) else 0
        if receiver_batches == (batch != 0):
            return None
        if receiver_batches:
            return [1, *shape] if _dims_match(expected, shape) else None
        if batch == 1 and not _dims_match(expected, shape):
            return list(shape[1:])
        return None

    return reshape_arrays(pairs, shape_of)


def _in_ensemble(name: str, err: TritonpyError) -> TritonpyError:
    return type(err)(f"in ensemble '{name}', {err.message}", err.code)


class _Context:
    """The state of one ensemble request (see the module docstring)."""

    __slots__ = ("ens", "request", "plan", "values", "batched", "iterations", "uses_left",
                 "launched", "pending", "inflight", "error", "held", "finished", "lock",
                 "compute_ns", "gate_of")

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
        inputs = _fit_batch_dim(inputs, batched, rt.config, rt.config.input)
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
        if gates is not None:
            gate = self.gate_of[sreq.id] = gates[step.index]
            if rt.decoupled and not getattr(rt, "is_ensemble", False):
                _StepPacing(gate.limit).start(sreq)
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
                out = _fit_batch_dim(out, self.batched, cfg, cfg.output, internal=True)
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
        if self.finished:
            return
        req = self.request
        final = self.inflight == 0
        if final and self.error is None:  # an ensemble that is a step of another one
            req.compute = (self.compute_ns[0], self.compute_ns[1], self.compute_ns[2])
        if self.error is not None:
            if final:
                self.finished = True
                req.respond([], self.error, None, True)
                self.ens._finished(self, False)
            return
        if outs is not None:
            if self.ens.decoupled:
                req.respond(outs, None, self._parameters(outs), final)
                self.held = outs  # remembers that a response went out
            elif final:
                req.respond(outs, None, self._parameters(outs), True)
            else:
                self.held = outs
            if final:
                self.finished = True
                self.ens._finished(self, True)
            return
        if not final:
            return
        self.finished = True
        if self.ens.decoupled:
            req.respond(None, None, None, True)  # a decoupled ensemble may answer nothing
        elif self.held is not None:
            req.respond(self.held, None, self._parameters(self.held), True)
        else:
            self.error = InvalidArgumentError(
                f"in ensemble '{self.ens.name}', unexpected deadlock, at least one output is "
                "not set while no more ensemble steps can be made")
            req.respond([], self.error, None, True)
            self.ens._finished(self, False)
            return
        self.ens._finished(self, True)

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
        gates = self.ens.gates
        if gates is not None and final:
            let_in = gates[step.index].leave(sreq)
        for r in cancel:  # the request failed: what else runs for it is wasted work
            r.cancel(f"another step of ensemble '{self.ens.name}' failed")
        if type(pacer) is _StepPacing and not final:
            # This response is taken once the step requests it made are all let in.
            if launches:
                self._launch(launches, _Owed(pacer, len(launches)).one)
            else:
                pacer.took()
        else:
            self._launch(launches)
        for r, then in let_in:
            if not r.done:
                r.model.submit(r)
            if then is not None:
                then()

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


# ---------------------------------------------------------------------------- loading


def step_models_to_unload(repo: RepositoryManager, name: str) -> list[str]:
    """The models that unloading ensemble ``name`` with ``unload_dependents`` also unloads.

    Its step models (and theirs, for nested ensembles), except those that another loaded
    ensemble still runs and those a load asked for by name (Triton keeps both). Empty for a
    model that is not a loaded ensemble.
    """
    def steps_of(model: str) -> set[str]:  # by key
        entry = repo.entries.get(model)
        rts = list(entry.runtimes.values()) if entry is not None else []
        keys = {repo.step_key(st.model, rt.namespace) for rt in rts
                if isinstance(rt, EnsembleRuntime) for st in rt.steps}
        return {k for k in keys if k is not None}

    def requested(model: str) -> bool:
        entry = repo.entries.get(model)
        return entry is not None and entry.requested

    closure: set[str] = set()
    todo = list(steps_of(name))
    while todo:
        model = todo.pop()
        if model not in closure and model != name and not requested(model):
            closure.add(model)
            todo.extend(steps_of(model))
    kept: set[str] = set()  # everything the other ensembles run, directly or nested
    todo = [s for other in repo.entries if other != name and other not in closure
            for s in steps_of(other)]
    while todo:
        model = todo.pop()
        if model not in kept:
            kept.add(model)
            todo.extend(steps_of(model))
    return sorted(closure - kept)



def load_ensemble(repo: RepositoryManager, entry: ModelEntry, cfg: Any,
                  versions: Sequence[int]) -> dict[int, EnsembleRuntime]:
    """Runtimes for the ensemble's versions, after loading and checking its step models.

    Args:
        repo: The repository manager (to find and, in explicit mode, load step models).
        entry: The ensemble's repository entry (its lock is held by the caller).
        cfg: The ensemble's normalised configuration.
        versions: The versions selected by its version policy.
    """
    from .config import config_to_json

    name = entry.name
    with _LoadingGuard(entry.key):
        for step in cfg.ensemble_scheduling.step:
            ensure_step_loaded(repo, name, step.model_name, entry.namespace)
    configs = []
    for step in cfg.ensemble_scheduling.step:
        try:
            rt = repo.runtime(step.model_name, int(step.model_version), near=entry.namespace)
        except TritonpyError:
            raise InvalidArgumentError(
                f"ensemble '{name}' depends on '{step.model_name}' whose required version "
                f"{step.model_version} is not loaded.") from None
        configs.append(rt.config)
    # As Triton: an ensemble's config always has its transaction policy (decoupled when a
    # step is), where a plain model's has it only when set.
    decoupled = validate_ensemble(cfg, configs)
    if decoupled and cfg.response_cache.enable:  # as Triton 2.51 (it was loaded, never cached)
        raise InvalidArgumentError(
            f"Response Cache does not currently support model {name} with 'decoupled' "
            "transaction policy. Please disable the response cache.")
    cfg.model_transaction_policy.SetInParent()
    cfg.model_transaction_policy.decoupled = decoupled
    cfg_json = config_to_json(cfg)
    out: dict[int, EnsembleRuntime] = {}
    for v in versions:
        ens_rt = EnsembleRuntime(repo.server, name, v, cfg, cfg_json, entry.directory)
        ens_rt.namespace = ens_rt.stats.namespace = entry.namespace
        ens_rt.load()
        out[v] = ens_rt
    log.info("ensemble '%s': %d step(s) over %s%s", name, len(cfg.ensemble_scheduling.step),
             sorted({s.model_name for s in cfg.ensemble_scheduling.step}),
             " (decoupled)" if decoupled else "")
    return out
