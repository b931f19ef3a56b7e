"""Request checks made before a stub sees a request, and KServe v2 model metadata.

The checks and their messages follow Triton core's ``InferenceRequest::Normalize``: requested
output names, the number of inputs, unknown inputs, the batch dimension, data types, shapes.
They run once per request, so :class:`RequestValidator` precomputes everything it can from
the configuration and the success path is a couple of dict look-ups and tuple compares per
input.
"""
from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from tritonclient.grpc.model_config_pb2 import DataType, ModelConfig

from tritonpy._errors import InternalError, InvalidArgumentError

__all__ = [
    "Reshapes",
    "RequestValidator",
    "model_metadata",
    "request_prefix",
    "triton_type_name",
    "validate_request",
    "reshaped",
]

WILDCARD_DIM = -1

# DataType enum value → protocol name ("TYPE_FP32" → "FP32"); TYPE_STRING travels as BYTES.
_TYPE_NAMES: dict[int, str] = {
    value: ("BYTES" if name == "TYPE_STRING" else name[len("TYPE_"):])
    for name, value in DataType.items()
}

def reshaped(shape: Sequence[int], src: Sequence[int], dst: Sequence[int],
               batched: bool) -> list[int] | None:
    """``shape`` (with its batch dimension first when ``batched``), read as ``src``, in the
    form of ``dst``, as Triton applies a config's ``reshape``: its dimensions at the
    variable-size (-1) places of ``src`` fill those of ``dst`` in order. None when that does
    not hold the same number of elements (an output that does not have the reshape's shape)."""
    off = 1 if batched and len(shape) else 0
    out = list(shape[:off])
    variable = [shape[i + off] for i, d in enumerate(src) if d == WILDCARD_DIM
                and i + off < len(shape)]
    k = 0
    for d in dst:
        if d == WILDCARD_DIM:
            if k == len(variable):
                return None
            out.append(variable[k])
            k += 1
        else:
            out.append(d)
    return out if math.prod(shape) == math.prod(out) else None


class Reshapes:
    """The ``reshape`` of a model's inputs and outputs, as Triton applies it: an input arrives
    at the model in its ``reshape`` form, and an output the model makes in that form leaves
    in its ``dims`` form, to clients, BLS callers and ensemble steps alike.

    Built only for a model that has one (``of`` returns None otherwise), so the hot path of
    the others pays one ``is None``.
    """

    __slots__ = ("batched", "inputs", "outputs")

    def __init__(self, cfg: ModelConfig) -> None:
        self.batched = cfg.max_batch_size > 0
        self.inputs = {io.name: (tuple(io.dims), tuple(io.reshape.shape))
                       for io in cfg.input if io.HasField("reshape")}
        self.outputs = {io.name: (tuple(io.reshape.shape), tuple(io.dims))
                        for io in cfg.output if io.HasField("reshape")}

    @classmethod
    def of(cls, cfg: ModelConfig) -> Reshapes | None:
        if any(io.HasField("reshape") for io in (*cfg.input, *cfg.output)):
            return cls(cfg)
        return None

    def input_shape(self, name: str, shape: Sequence[int]) -> list[int] | None:
        """The shape the model sees for a validated input (None: it has no reshape)."""
        plan = self.inputs.get(name)
        if plan is None:
            return None
        return reshaped(shape, plan[0], plan[1], self.batched)

    def output_shape(self, name: str, shape: Sequence[int]) -> list[int]:
        """The shape clients see for an output the model made (``shape`` itself when it has no
        reshape).

        Raises:
            InternalError: The output's shape does not fit its reshape.
        """
        plan = self.outputs.get(name)
        if plan is None:
            return list(shape)
        out = reshaped(shape, plan[0], plan[1], self.batched)
        if out is None:
            batch = "[batch] + " if self.batched else ""
            raise InternalError(
                f"output '{name}' has shape {_dims_text(shape)}, which does not fit the "
                f"reshape {batch}{_dims_text(plan[0])} of its configuration (dims "
                f"{_dims_text(plan[1])})")
        return out


def _names(names: Any) -> str:
    return "[" + ",".join(f"'{n}'" for n in names) + "]"


_BATCH_NOTE = (
    "NOTE: Setting a non-zero max_batch_size in the model config requires a batch dimension "
    "to be prepended to each input shape. If you want to specify the full shape including "
    "the batch dim in your input dims config, try setting max_batch_size to zero. See the "
    "model configuration docs for more info on max_batch_size."
)


def triton_type_name(data_type_enum: int) -> str:
    """The KServe/Triton protocol name of a ``DataType`` value.

    ``TYPE_FP32`` → ``"FP32"``, ``TYPE_STRING`` → ``"BYTES"``; unknown → ``"INVALID"``.
    """
    return _TYPE_NAMES.get(int(data_type_enum), "INVALID")


def request_prefix(request_id: str) -> str:
    """The ``[request id: ...] `` that Triton's core puts before its request errors.

    Triton writes ``<id_unknown>`` when the request has no id; the checks made while looking
    a tensor name up in the model (unknown input or output) carry no prefix there.
    """
    return f"[request id: {request_id or '<id_unknown>'}] "


def _dims_text(dims: Sequence[int]) -> str:
    # Triton's DimsListToString: no spaces.
    return "[" + ",".join(str(int(d)) for d in dims) + "]"


class _InputSpec(NamedTuple):
    datatype: str
    dims: tuple[int, ...]
    # No wildcard in dims: the shape check is one tuple compare.
    exact: bool


class RequestValidator:
    """Checks requests against one model configuration; build once per loaded config.

    Args:
        cfg: The normalised configuration. It must not be modified afterwards.
        model_name: The name used in error messages.
    """

    __slots__ = ("model_name", "max_batch_size", "_specs", "_order", "_required", "_outputs",
                 "known_good")

    def __init__(self, cfg: ModelConfig, model_name: str) -> None:
        self.model_name = model_name
        self.max_batch_size = int(cfg.max_batch_size)
        self._specs: dict[str, _InputSpec] = {}
        for io in cfg.input:
            dims = tuple(int(d) for d in io.dims)
            self._specs[io.name] = _InputSpec(
                triton_type_name(io.data_type), dims, WILDCARD_DIM not in dims
            )
        self._order: tuple[str, ...] = tuple(io.name for io in cfg.input)
        self._required: tuple[str, ...] = tuple(io.name for io in cfg.input if not io.optional)
        self._outputs: frozenset[str] = frozenset(io.name for io in cfg.output)
        # Signatures (names, numpy dtypes, shapes, requested outputs) already found valid:
        # a dict lookup instead of a full check for the requests a client sends over and over.
        self.known_good: dict[Any, bool] = {}

    def validate(
        self,
        inputs: Mapping[str, tuple[str, tuple[int, ...]]],
        requested_outputs: Sequence[str] | None = None,
        request_id: str = "",
    ) -> None:
        """Check one request.

        Args:
            inputs: Input name → ``(datatype, shape)``, the datatype a protocol name such as
                ``"FP32"`` or ``"BYTES"``, the shape with the batch dimension when the model
                batches.
            requested_outputs: Output names asked for; ``None`` or empty means all.
            request_id: The request's id, quoted in messages as Triton does (``<id_unknown>``
                when empty).

        Raises:
            InvalidArgumentError: The first problem found, in Triton's words.
        """
        model = self.model_name
        prefix = request_prefix(request_id)
        if requested_outputs:
            for name in requested_outputs:
                if name not in self._outputs:
                    # Triton's Model::GetOutput: no request prefix.
                    raise InvalidArgumentError(
                        f"unexpected inference output '{name}' for model '{model}'"
                    )
        specs = self._specs
        count = len(inputs)
        if count > len(specs) or count < len(self._required):
            raise self._count_error(inputs, prefix)
        for name in inputs:
            if name not in specs:
                # Triton's Model::GetInput: no request prefix.
                raise InvalidArgumentError(
                    f"unexpected inference input '{name}' for model '{model}'"
                )
        if count < len(specs) and any(r not in inputs for r in self._required):
            # Optional inputs stand in for a required one: Triton checks only the count and
            # lets this through to the model, we refuse it (the config says it is required).
            missing = [n for n in self._required if n not in inputs]
            raise InvalidArgumentError(
                f"{prefix}missing required input(s) {_names(missing)} for model '{model}': got "
                f"input(s) {_names(inputs)}, and an optional input does not stand in for a "
                "required one. Please provide all required input(s).")

        max_batch = self.max_batch_size
        if max_batch > 0:
            batch: int | None = None
            for name, (_, shape) in inputs.items():
                if len(shape) == 0:
                    raise InvalidArgumentError(
                        f"{prefix}input '{name}' has no shape but model requires batch "
                        f"dimension for '{model}'"
                    )
                if batch is None:
                    batch = shape[0]
                elif shape[0] != batch:
                    raise InvalidArgumentError(
                        f"{prefix}input '{name}' batch size does not match other inputs for "
                        f"'{model}'"
                    )
            if batch is not None and not 1 <= batch <= max_batch:
                raise self._batch_error(batch, inputs, prefix)

        for name, (datatype, shape) in inputs.items():
            spec = specs[name]
            if datatype != spec.datatype:
                raise InvalidArgumentError(
                    f"{prefix}inference input '{name}' data-type is '{datatype}', but model "
                    f"'{model}' expects '{spec.datatype}'"
                )
            dims = tuple(shape[1:]) if max_batch > 0 else tuple(shape)
            if spec.exact and dims == spec.dims:
                continue
            self._check_shape(name, shape, dims, spec, prefix)

    def _check_shape(
        self, name: str, shape: Sequence[int], dims: tuple[int, ...], spec: _InputSpec,
        prefix: str,
    ) -> None:
        if any(d < 0 for d in shape):
            raise InvalidArgumentError(
                f"{prefix}All input dimensions should be specified for input '{name}' for "
                f"model '{self.model_name}', got {_dims_text(shape)}"
            )
        matches = len(dims) == len(spec.dims) and all(
            c == WILDCARD_DIM or c == d for c, d in zip(spec.dims, dims, strict=True)
        )
        if matches:
            return
        expected = (WILDCARD_DIM, *spec.dims) if self.max_batch_size > 0 else spec.dims
        note = _BATCH_NOTE if self.max_batch_size > 0 else ""
        raise InvalidArgumentError(  # (Triton's space after the stop, with or without a note)
            f"{prefix}unexpected shape for input '{name}' for model '{self.model_name}'. "
            f"Expected {_dims_text(expected)}, got {_dims_text(shape)}. {note}"
        )

    def _batch_error(
        self, batch: int, inputs: Mapping[str, tuple[str, tuple[int, ...]]], prefix: str
    ) -> InvalidArgumentError:
        model = self.model_name
        if batch < 0:
            name, (_, shape) = next(iter(inputs.items()))
            return InvalidArgumentError(
                f"{prefix}All input dimensions should be specified for input '{name}' for "
                f"model '{model}', got {_dims_text(shape)}"
            )
        if batch == 0:
            # Triton lets an empty batch through to the backend; we refuse it.
            return InvalidArgumentError(
                f"{prefix}inference request batch-size must be >= 1 for '{model}'"
            )
        return InvalidArgumentError(
            f"{prefix}inference request batch-size must be <= {self.max_batch_size} for "
            f"'{model}'"
        )

    def _count_error(
        self, inputs: Mapping[str, Any], prefix: str
    ) -> InvalidArgumentError:
        missing = [n for n in self._required if n not in inputs]
        total, required = len(self._specs), len(self._required)
        if total == required:
            head = f"expected {total} inputs"
        else:
            head = f"expected number of inputs between {required} and {total}"
        # Triton 2.51's words (measured), "input(s)" included.
        return InvalidArgumentError(
            f"{prefix}{head} but got {len(inputs)} inputs for model '{self.model_name}'. "
            f"Got input(s) {_names(inputs)}, but missing required input(s) {_names(missing)}. "
            "Please provide all required input(s)."
        )


# Validators by id(cfg); the entry holds cfg itself, so the id cannot be reused while cached.
_CACHE: dict[int, tuple[ModelConfig, str, RequestValidator]] = {}
_CACHE_LIMIT = 512
_CACHE_LOCK = threading.Lock()


def validate_request(
    cfg: ModelConfig,
    model_name: str,
    inputs: Mapping[str, tuple[str, tuple[int, ...]]],
    requested_outputs: Sequence[str] | None,
    request_id: str = "",
) -> None:
    """Check a request against ``cfg``; see :meth:`RequestValidator.validate`.

    The validator for a configuration object is built on first use and cached by identity,
    so a configuration must not be modified once requests are checked against it.

    Raises:
        InvalidArgumentError: The request does not fit the model.
    """
    entry = _CACHE.get(id(cfg))
    if entry is None or entry[0] is not cfg or entry[1] != model_name:
        validator = RequestValidator(cfg, model_name)
        with _CACHE_LOCK:
            if len(_CACHE) >= _CACHE_LIMIT:
                _CACHE.clear()
            _CACHE[id(cfg)] = (cfg, model_name, validator)
    else:
        validator = entry[2]
    validator.validate(inputs, requested_outputs, request_id)


def model_metadata(cfg: ModelConfig, model_name: str, versions: list[int]) -> dict[str, Any]:
    """KServe v2 model metadata as Triton returns it.

    Args:
        cfg: The normalised configuration.
        model_name: The model's name.
        versions: The versions to list (Triton lists the loaded ones).

    Returns:
        ``{"name", "versions", "platform", "inputs", "outputs"}``; ``platform`` is the
        config's platform or else its backend (``"python"``, ``"ensemble"``); each tensor is
        ``{"name", "datatype", "shape"}`` with ``-1`` prepended when the model batches.
    """
    batching = cfg.max_batch_size > 0

    def tensors(ios: Any) -> list[dict[str, Any]]:
        return [
            {
                "name": io.name,
                "datatype": triton_type_name(io.data_type),
                "shape": ([WILDCARD_DIM] if batching else []) + [int(d) for d in io.dims],
            }
            for io in ios
        ]

    return {
        "name": model_name,
        "versions": [str(v) for v in versions],
        "platform": cfg.platform or cfg.backend,
        "inputs": tensors(cfg.input),
        "outputs": tensors(cfg.output),
    }
