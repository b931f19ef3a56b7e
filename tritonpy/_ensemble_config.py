"""An ensemble's configuration: recognising one (``platform: "ensemble"``), and checking it
against its step models' completed configurations the way Triton's ``ValidateEnsembleConfig``
does — every step input mapped once, no mapping to or from a tensor the step model lacks, data
types and shapes consistent across every use of an ensemble tensor, batch sizes compatible, no
step fed by two different decoupled streams — and whether it is decoupled (when any of its steps
is); and how a tensor gains or loses a batch dimension between a batching and a non-batching
side (:func:`fit_batch_dim`). Loading is :mod:`._ensemble_load`'s, running :mod:`._ensemble`'s.
"""
from __future__ import annotations

from typing import Any, Sequence

from ._errors import InvalidArgumentError, TritonpyError
from ._runtime_base import reshape_arrays

ENSEMBLE_PLATFORM = "ensemble"
_WILDCARD = -1


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


def fit_batch_dim(pairs: list, batched: dict[str, bool], cfg: Any, ios: Any,
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
