"""Model configuration: parse ``config.pbtxt``, fill Triton's defaults, check it, serialise it.

The configuration is Triton's own ``inference.ModelConfig`` protobuf (shipped by
``tritonclient[grpc]``), so every field Triton accepts parses here too. What
:func:`normalize_config` fills and refuses follows Triton core's
``AutoCompleteBackendFields``, ``NormalizeModelConfig``, ``NormalizeInstanceGroup``,
``ValidateModelConfig``, ``ValidateModelIOConfig`` and ``ValidateInstanceGroup`` for the
kinds of model tritonpy runs: ``backend: "python"``, Python-based backends (any other
``backend``: its ``model.py`` is looked for in the backend directory as a version loads, see
:func:`tritonpy.repository.model_file`) and ``platform: "ensemble"``.

Every error is a :class:`~tritonpy._errors.ConfigError` whose message starts with the
configuration's path, so a repository with one bad model says which file to fix. Its JSON
form (to a model, from a config override) is :mod:`tritonpy._config_json`'s, re-exported here.
"""
from __future__ import annotations

import math
import os
import re
from typing import Any

from google.protobuf import text_format
from tritonclient.grpc.model_config_pb2 import (
    BatchInput,
    BatchOutput,
    DataType,
    ModelConfig,
    ModelInput,
    ModelInstanceGroup,
    ModelOutput,
    ModelQueuePolicy,
    ModelSequenceBatching,
)

from tritonpy._config_json import config_from_dict, config_to_dict, config_to_json
from tritonpy._errors import ConfigError, InternalError, NotFoundError

__all__ = [
    "CONFIG_FILENAME", "ModelConfig", "config_from_dict", "config_to_dict", "config_to_json",
    "load_model_config", "normalize_config", "parse_config_text",
]

CONFIG_FILENAME = "config.pbtxt"
PYTHON_BACKEND = "python"
ENSEMBLE_PLATFORM = "ensemble"
DEFAULT_MODEL_FILENAME = "model.py"
# Triton core's SEQUENCE_IDLE_DEFAULT_MICROSECONDS.
SEQUENCE_IDLE_DEFAULT_MICROSECONDS = 1_000_000
WILDCARD_DIM = -1

_Kind = ModelInstanceGroup.Kind
_Control = ModelSequenceBatching.Control
_CORRID_TYPES = frozenset({DataType.TYPE_UINT64, DataType.TYPE_INT64, DataType.TYPE_UINT32,
                           DataType.TYPE_INT32, DataType.TYPE_STRING})


# --- Parsing ---

# text_format messages look like '4:3 : Message type "inference.ModelConfig" has no field ...'.
_POS_PREFIX = re.compile(r"^\s*\d+:\d+\s*:\s*")
_NO_FIELD = re.compile(r'Message type "(?:[\w.]*\.)?(\w+)" has no field named "([^"]+)"')
_QUOTED_LINE = re.compile(r"^'[^\n]*?':\s*")


def parse_config_text(text: str, path: str) -> ModelConfig:
    """Parse protobuf text format into a ``ModelConfig``.

    Args:
        text: The content of a ``config.pbtxt``.
        path: The file it came from; every error message starts with it.

    Returns:
        The parsed configuration, with nothing filled in.

    Raises:
        ConfigError: The text does not parse; the message reads
            ``"<path>:<line>:<column>: <what is wrong>"`` and names the field or token.
    """
    cfg = ModelConfig()
    try:
        text_format.Parse(text, cfg)
    except text_format.ParseError as exc:
        raise ConfigError(_describe_parse_error(exc, text, path)) from None
    return cfg


def _describe_parse_error(exc: text_format.ParseError, text: str, path: str) -> str:
    line, col = exc.GetLine(), exc.GetColumn()
    detail = _POS_PREFIX.sub("", str(exc)).strip()
    no_field = _NO_FIELD.search(detail)
    if no_field:
        detail = f"invalid field '{no_field.group(2)}' in {no_field.group(1)}"
    else:
        # Some messages quote the whole source line first; we quote the line ourselves.
        detail = _QUOTED_LINE.sub("", detail)
        if line is not None and 0 < line <= len(text.splitlines()):
            source = text.splitlines()[line - 1].strip()
            if source:
                detail = f"{detail} (in '{source}')"
    where = path if line is None else f"{path}:{line}" if col is None else f"{path}:{line}:{col}"
    return f"{where}: {detail}"


def config_path(model_dir: str, config_name: str = "") -> str:
    """The configuration file of a model: ``configs/<config_name>.pbtxt`` when a name is given
    and that file exists (Triton's ``--model-config-name``), else ``config.pbtxt``."""
    if config_name:
        custom = os.path.join(model_dir, "configs", config_name + ".pbtxt")
        if os.path.lexists(custom):
            return custom
    return os.path.join(model_dir, CONFIG_FILENAME)


def load_model_config(model_dir: str, config_name: str = "") -> tuple[ModelConfig, bool]:
    """Read the model's configuration file (see :func:`config_path`).

    Args:
        model_dir: A model directory inside a repository.
        config_name: Triton's ``--model-config-name``: ``configs/<name>.pbtxt`` is read in
            place of ``config.pbtxt`` where it exists.

    Returns:
        ``(config, True)`` when the file exists, else ``(ModelConfig(), False)``: Triton
        loads a model without a config file and lets auto-complete fill it.

    Raises:
        NotFoundError: ``model_dir`` is not a directory.
        ConfigError: The file cannot be read or does not parse.
    """
    if not os.path.isdir(model_dir):
        raise NotFoundError(f"model directory '{model_dir}' does not exist")
    path = config_path(model_dir, config_name)
    if not os.path.lexists(path):
        return ModelConfig(), False
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        reason = exc.strerror or exc
        raise ConfigError(f"{path}: cannot read model configuration: {reason}") from None
    return parse_config_text(text, path), True


# --- Normalisation and checks ---


class _Invalid(Exception):
    """A check failed; normalize_config adds the path. ``detail`` (ours) goes after Triton's
    whole sentence, model name included, so that a search for Triton's words finds them."""

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail


def _require(ok: Any, message: str, detail: str = "") -> None:
    if not ok:
        raise _Invalid(message, detail)


def read_labels(cfg: ModelConfig, model_dir: str, path: str) -> dict[str, list[str]]:
    """The class labels of each output that names a ``label_filename`` (a label per line, line
    i for class i), read at load as Triton reads them; a file that cannot be read fails the
    load. The name must stay inside the model directory: a config may come over the network
    (a repository load), and its labels go back to clients."""
    labels: dict[str, list[str]] = {}
    for out in cfg.output:
        name = out.label_filename
        if not name:
            continue
        if os.path.isabs(name) or ".." in name.replace("\\", "/").split("/"):
            raise ConfigError(f"{path}: output '{out.name}': label_filename {name!r} must name "
                              "a file inside the model directory")
        file = os.path.join(model_dir, name)
        try:
            with open(file, encoding="utf-8") as f:
                labels[out.name] = f.read().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise InternalError(f"failed to open text file for read {file}: {why}") from None
    return labels


def normalize_config(
    cfg: ModelConfig, model_name: str, path: str, gpu_count: int = 0
) -> ModelConfig:
    """Fill Triton's defaults and refuse what Triton refuses.

    Run it after auto-complete. ``cfg`` is not modified; a normalised copy is returned.

    Args:
        cfg: The parsed (and auto-completed) configuration.
        model_name: The model's directory name.
        path: The configuration's path, the first thing in every error message.
        gpu_count: GPUs visible to the server; KIND_AUTO and default groups use them.

    Returns:
        A copy with ``name``, ``backend``, ``default_model_filename``, ``version_policy``,
        ``optimization`` pinned-memory flags, dynamic/sequence batching defaults and
        ``instance_group`` filled in.

    Raises:
        ConfigError: The configuration is invalid; the message names the file and field.
    """
    c = ModelConfig()
    c.CopyFrom(cfg)
    try:
        _fill_identity(c, model_name)
        _fill_defaults(c)
        _check_model(c)
        _check_io(c)
        if not c.HasField("ensemble_scheduling"):
            _fill_instance_groups(c, gpu_count)
            _check_instance_groups(c, gpu_count)
    except _Invalid as exc:
        raise ConfigError(f"{path}: {exc}{exc.detail}") from None
    return c


def auto_complete_input(cfg: ModelConfig, model_name: str, gpu_count: int = 0) -> dict[str, Any]:
    """The configuration a model's ``auto_complete_config`` receives, as Triton hands it over:
    with the defaults the server fills first (name, backend, default model file, version
    policy, pinned-memory flags, one instance group), so that code reading them finds them.
    Nothing is checked here: :func:`normalize_config` checks the completed configuration (and
    fills these same values, so a model that changes none of them gets the same result)."""
    c = ModelConfig()
    c.CopyFrom(cfg)
    _fill_names(c, model_name)
    _fill_policies(c)
    _fill_instance_groups(c, gpu_count)
    return config_to_dict(c)


def auto_completed(model_name: str) -> str:
    """What an error in a configuration ``auto_complete_config`` returned names as its
    source."""
    return f"the configuration auto_complete_config of '{model_name}' returned"


def _fill_names(c: ModelConfig, model_name: str) -> None:
    """The name, backend and model file that a configuration may leave out."""
    c.name = c.name or model_name
    if not c.backend and not c.platform:
        c.backend = PYTHON_BACKEND
    if c.backend == PYTHON_BACKEND:
        c.default_model_filename = c.default_model_filename or DEFAULT_MODEL_FILENAME
    elif c.backend:
        # A Python-based backend: Triton 2.51 names its script as the runtime (measured; a
        # runtime or default_model_filename given stays as given, and is not used).
        c.runtime = c.runtime or DEFAULT_MODEL_FILENAME


def _fill_identity(c: ModelConfig, model_name: str) -> None:
    _fill_names(c, model_name)
    # Triton refuses a config named otherwise than its directory (it keeps two same-named
    # models apart that way).
    _require(c.name == model_name, f"unexpected directory name '{model_name}' for model "
             f"'{c.name}', directory name must equal model name")
    if c.platform == ENSEMBLE_PLATFORM:
        _require(not c.backend, f"Ensemble model '{c.name}' must have platform type "
                 f"'{ENSEMBLE_PLATFORM}' and empty backend type")
        return
    _require(c.backend, f"unexpected platform type '{c.platform}' for {c.name}: "
             f"tritonpy runs 'backend: \"{PYTHON_BACKEND}\"' models, Python-based backends "
             f"and 'platform: \"{ENSEMBLE_PLATFORM}\"' models")


def _fill_policies(c: ModelConfig) -> None:
    """The version policy and, but for an ensemble, the pinned-memory flags."""
    if not c.HasField("version_policy"):
        c.version_policy.latest.num_versions = 1
    if not c.HasField("ensemble_scheduling"):
        for pinned in ("input_pinned_memory", "output_pinned_memory"):
            if not c.optimization.HasField(pinned):
                getattr(c.optimization, pinned).enable = True


def _fill_defaults(c: ModelConfig) -> None:
    _fill_policies(c)
    if c.HasField("dynamic_batching"):
        if not c.dynamic_batching.preferred_batch_size and c.max_batch_size > 0:
            c.dynamic_batching.preferred_batch_size.append(c.max_batch_size)
    if c.HasField("sequence_batching"):
        sb = c.sequence_batching
        if sb.max_sequence_idle_microseconds == 0:
            sb.max_sequence_idle_microseconds = SEQUENCE_IDLE_DEFAULT_MICROSECONDS
        if sb.HasField("oldest") and not sb.oldest.preferred_batch_size and c.max_batch_size > 0:
            sb.oldest.preferred_batch_size.append(c.max_batch_size)


def _check_model(c: ModelConfig) -> None:
    n = c.name
    _require(c.max_batch_size >= 0, f"'max_batch_size' must be non-negative value for {n}")
    if c.HasField("dynamic_batching"):
        _check_dynamic_batching(c)
    if c.HasField("sequence_batching"):
        _require(not c.response_cache.enable, f"Response Cache does not currently support model "
                 f"{n} with sequence batching scheduler. Please disable the response cache.")
        _check_sequence_batching(c)
    if c.HasField("ensemble_scheduling"):
        _check_ensemble(c)
    _require(c.platform != ENSEMBLE_PLATFORM or c.HasField("ensemble_scheduling"),
             f"ensemble scheduling must be set for ensemble {n} whose platform is "
             f"{ENSEMBLE_PLATFORM} ('ensemble_scheduling' is missing)")
    _require(not (c.model_transaction_policy.decoupled and c.response_cache.enable),
             f"Response Cache does not currently support model {n} with 'decoupled' "
             "transaction policy. Please disable the response cache.")
    for control in c.model_metrics.metric_control:
        _require(control.HasField("metric_identifier"),
                 "metric control must specify 'metric_identifier'")
        _require(control.metric_identifier.family,
                 "metric identifier must specify non-empty 'family'")
        _require(control.HasField("histogram_options"),
                 "metric control must specify 'histogram_options'")
        _require(control.histogram_options.buckets,
                 "histogram options must specify non-empty 'buckets'")


def _check_dynamic_batching(c: ModelConfig) -> None:
    n, db = c.name, c.dynamic_batching
    for size in db.preferred_batch_size:
        _require(size > 0, f"dynamic batching preferred size must be positive for {n}")
        _require(size <= c.max_batch_size, f"dynamic batching preferred size must be <= max "
                 f"batch size for {n} ('preferred_batch_size' {size} > 'max_batch_size' "
                 f"{c.max_batch_size})")
    levels = db.priority_levels
    if levels != 0:
        _require(0 < db.default_priority_level <= levels,
                 f"default priority level must be in range [1, {levels}] for {n}")
        for level in db.priority_queue_policy:
            _require(0 < level <= levels, "priority queue policy must have priority level in "
                     f"range [1, {levels}] for {n}")
    if db.preserve_ordering:
        _require(levels <= 1, "Only one priority level is allowed when 'preserve_ordering' is "
                 f"true for {n}")
        for policy in [db.default_queue_policy, *db.priority_queue_policy.values()]:
            delays = policy.timeout_action == ModelQueuePolicy.DELAY
            _require(not (policy.default_timeout_microseconds and delays), "Queue policy can "
                     f"not have DELAY as timeout action when 'preserve_ordering' is true for {n}")


_FALSE_TRUE = ("int32_false_true", "fp32_false_true", "bool_false_true")


def _check_sequence_batching(c: ModelConfig) -> None:
    n, sb = c.name, c.sequence_batching
    seen_tensors: set[str] = set()
    seen_kinds: set[int] = set()
    for control_input in sb.control_input:
        tensor = control_input.name
        _require(tensor, f"sequence batching control tensor must have a name for {n}")
        _require(tensor not in seen_tensors, f"sequence batching control tensor '{tensor}' is "
                 f"specified for multiple control kinds for {n}")
        seen_tensors.add(tensor)
        for control in control_input.control:
            kind = f"{_Control.Kind.Name(control.kind)} for {n}"
            _require(control.kind not in seen_kinds,
                     f"sequence batching specifies multiple {kind.replace(' for', ' tensors for')}")
            seen_kinds.add(control.kind)
            given = [f for f in _FALSE_TRUE if len(getattr(control, f))]
            if control.kind == _Control.CONTROL_SEQUENCE_CORRID:
                _require(not given, "sequence batching must not specify either "
                         f"'int32_false_true', 'fp32_false_true' or 'bool_false_true' for {kind}")
                _require(control.data_type in _CORRID_TYPES, f"unexpected data type for control "
                         f"{kind}. Allowed data types are TYPE_UINT64, TYPE_INT64, TYPE_UINT32, "
                         "TYPE_INT32 and TYPE_STRING")
                continue
            _require(given, "sequence batching must specify either 'int32_false_true', "
                     f"'fp32_false_true' or 'bool_false_true' for {kind}")
            _require(len(given) == 1, "sequence batching specifies more than one from "
                     f"'int32_false_true', 'fp32_false_true' and 'bool_false_true' for {kind}")
            _require(len(getattr(control, given[0])) == 2, f"sequence batching control "
                     f"'{given[0]}' must have exactly 2 entries for {kind}")
    for size in sb.oldest.preferred_batch_size:
        _require(size > 0, f"sequence batching preferred batch size must be positive for {n}")
        _require(size <= c.max_batch_size,
                 f"sequence batching preferred batch size must be <= max batch size for {n}")
    _require(0.0 <= sb.direct.minimum_slot_utilization <= 1.0, "sequence batching minimum slot "
             f"utilization must be in range (0.0, 1.0] for {n}")


def _check_ensemble(c: ModelConfig) -> None:
    n = c.name
    _require(c.platform == ENSEMBLE_PLATFORM, f"ensemble scheduling cannot be set for model "
             f"'{n}' whose platform is not {ENSEMBLE_PLATFORM}")
    _require(not c.instance_group, f"instance group should not be specified for ensemble '{n}'")
    _require(not c.HasField("optimization"),
             f"optimization should not be specified for ensemble '{n}'")
    _require(not c.model_warmup, f"model_warmup can not be specified for ensemble '{n}'")
    steps = c.ensemble_scheduling.step
    _require(steps, f"must specify 'step' for ensemble '{n}'")
    # The data flow over ensemble tensors: each output of a step depends on its inputs.
    is_output: dict[str, bool] = {}
    prev: dict[str, list[str]] = {}
    nxt: dict[str, list[str]] = {}
    for idx, step in enumerate(steps):
        for field in ("model_name", "input_map", "output_map"):
            _require(getattr(step, field),
                     f"must specify '{field}' in step {idx} of ensemble '{n}'")
        produced = list(step.output_map.values())
        for tensor in produced:
            _require(not is_output.get(tensor), f"ensemble tensor '{tensor}' can appear in an "
                     f"output map only once for ensemble '{n}' step {idx}")
            is_output[tensor] = True
        for tensor in step.input_map.values():
            is_output.setdefault(tensor, False)
            nxt.setdefault(tensor, []).extend(produced)
            for out in produced:
                prev.setdefault(out, []).append(tensor)
    ready: set[str] = set()
    queue: list[str] = []
    for io in c.input:
        _require(io.name in is_output, f"ensemble input '{io.name}' for ensemble '{n}' is not used")
        ready.add(io.name)
        queue.append(io.name)
    while queue:
        for candidate in nxt.get(queue.pop(), []):
            if candidate not in ready and all(p in ready for p in prev.get(candidate, [])):
                ready.add(candidate)
                queue.append(candidate)
    outputs = {io.name for io in c.output}
    for name in outputs:
        _require(name in is_output, f"ensemble output '{name}' for ensemble '{n}' is not used")
        if name not in ready:
            source, seen = name, {name}
            while more := [p for p in prev.get(source, []) if p not in ready and p not in seen]:
                source = more[0]
                seen.add(source)
            why = "" if source == name else (f": at least one of its depending tensors, "
                                             f"'{source}', is not connected")
            raise _Invalid(f"output '{name}' for ensemble '{n}' is not written{why}")
    for tensor in is_output:
        _require(tensor in outputs or (tensor in ready and nxt.get(tensor)),
                 f"ensemble tensor '{tensor}' is unused in ensemble '{n}'")


def _element_count(dims: Any) -> int:
    # Triton's GetElementCount: -1 when any dimension is variable; 0 for no dimensions.
    return -1 if WILDCARD_DIM in dims else (math.prod(dims) if len(dims) else 0)


def _chunks(dims: Any) -> list[int]:
    # Element counts of the runs between variable-size dimensions.
    counts = [1]
    for d in dims:
        if d == WILDCARD_DIM:
            counts.append(1)
        else:
            counts[-1] *= d
    return counts


def _check_io_shape(io: ModelInput | ModelOutput, kind: str, max_batch_size: int) -> None:
    _require(io.name, f"model {kind} must specify 'name'")
    pre = f"model {kind} '{io.name}' "
    _require(io.data_type != DataType.TYPE_INVALID, pre + "must specify 'data_type'")
    _require(io.dims, pre + "must specify 'dims'")
    has_reshape = io.HasField("reshape")
    _require(not has_reshape or io.reshape.shape or max_batch_size > 0, pre + "cannot have empty "
             "reshape for non-batching model as scalar tensors are not supported")
    for d in io.dims:
        _require(d >= 1 or d == WILDCARD_DIM, pre + f"dimension must be integer >= 1, or "
                 f"{WILDCARD_DIM} to indicate a variable-size dimension", f" ('dims' has {d})")
    if not has_reshape:
        return
    for d in io.reshape.shape:
        _require(d >= 1 or d == WILDCARD_DIM, pre + f"reshape dimensions must be integer >= 1, "
                 f"or {WILDCARD_DIM} to indicate a variable-size dimension")
    dims_size, reshape_size = _element_count(io.dims), _element_count(io.reshape.shape)
    # An empty reshape (one scalar per batch item) is allowed for one-element dims.
    _require(dims_size == reshape_size or (reshape_size == 0 and dims_size == 1),
             pre + "has different size for dims and reshape")
    if dims_size == -1:
        dim_chunks, reshape_chunks = _chunks(io.dims), _chunks(io.reshape.shape)
        _require(len(dim_chunks) == len(reshape_chunks), pre + "has different number of "
                 "variable-size dimensions for dims and reshape")
        _require(dim_chunks == reshape_chunks, pre + "has different size for dims and reshape")


def _check_io(c: ModelConfig) -> None:
    try:
        for kind, ios in (("input", c.input), ("output", c.output)):
            names: set[str] = set()
            for io in ios:
                _check_io_shape(io, kind, c.max_batch_size)
                # Triton silently keeps the last of two same-named tensors; we refuse.
                _require(io.name not in names, f"model {kind} '{io.name}' is specified more "
                         "than once")
                names.add(io.name)
                if kind == "input" and io.format in _IMAGE_FORMATS:
                    _require(len(io.dims) == 3, f"model input '{io.name}' NHWC/NCHW require 3 dims")
                _require(not io.is_shape_tensor, "shape tensors are only supported for TensorRT "
                         "platform", f" ('is_shape_tensor' on '{io.name}')")
                _require(not io.is_non_linear_format_io, "Non-linear IO format is only supported "
                         "for the TensorRT platform", f" ('is_non_linear_format_io' on "
                         f"'{io.name}')")
        _check_batch_io(c)
    except _Invalid as exc:
        raise _Invalid(f"{exc} for {c.name}{exc.detail}") from None


_IMAGE_FORMATS = (ModelInput.FORMAT_NHWC, ModelInput.FORMAT_NCHW)
_ONE_SOURCE_KINDS = frozenset(
    v for k, v in BatchInput.Kind.items() if k.startswith(("BATCH_ELEMENT", "BATCH_ACCUMULATED",
                                                            "BATCH_MAX", "BATCH_ITEM"))
)


def _check_batch_io(c: ModelConfig) -> None:
    inputs = {io.name for io in c.input}
    outputs = {io.name for io in c.output}
    tagged = [(b, "input") for b in c.batch_input] + [(b, "output") for b in c.batch_output]
    for bio, what in tagged:
        kind_enum = BatchInput.Kind if what == "input" else BatchOutput.Kind
        kind = kind_enum.Name(bio.kind)
        known = (bio.kind in _ONE_SOURCE_KINDS if what == "input"
                 else bio.kind == BatchOutput.BATCH_SCATTER_WITH_INPUT_SHAPE)
        _require(known, f"unknown batch {what} kind '{kind}'")
        _require(len(bio.source_input) == 1, f"batch {what} kind '{kind}' expects 1 source "
                 f"input, got {len(bio.source_input)}")
        if what == "input":
            _require(bio.data_type in (DataType.TYPE_INT32, DataType.TYPE_FP32),
                     "batch input data type must be TYPE_INT32 or TYPE_FP32")
        for source in bio.source_input:
            _require(source in inputs, f"unknown source input name '{source}'")
        if what == "output":
            targets: set[str] = set()
            for target in bio.target_name:
                _require(target in outputs, f"unknown target output name '{target}'")
                _require(target not in targets,
                         f"target output name '{target}' can only be specified once")
                targets.add(target)


def _fill_instance_groups(c: ModelConfig, gpu_count: int) -> None:
    if not c.instance_group:
        # As Triton does with the Python backend's preferred group (KIND_GPU where GPUs
        # exist): one group, named after the model itself, not '<model>_0'.
        group = c.instance_group.add(name=c.name)
        if gpu_count > 0:
            group.kind = _Kind.KIND_GPU
    for index, group in enumerate(c.instance_group):
        group.name = group.name or f"{c.name}_{index}"
        if group.kind == _Kind.KIND_AUTO:
            # KIND_AUTO is GPU only where GPUs exist and every listed one is present.
            present = gpu_count > 0 and all(0 <= g < gpu_count for g in group.gpus)
            group.kind = _Kind.KIND_GPU if present else _Kind.KIND_CPU
        group.count = max(group.count, 1)
        if group.kind == _Kind.KIND_GPU and not group.gpus:
            group.gpus.extend(range(gpu_count))


def _check_instance_groups(c: ModelConfig, gpu_count: int) -> None:
    for group in c.instance_group:
        pre = f"instance group {group.name} of model {c.name}"
        kind = _Kind.Name(group.kind)
        _require(group.kind in (_Kind.KIND_CPU, _Kind.KIND_GPU, _Kind.KIND_MODEL),
                 f"{pre} has unexpected kind {kind}")
        if group.kind == _Kind.KIND_GPU:
            _require(group.gpus, f"{pre} has kind KIND_GPU but no GPUs are available")
            available = ", ".join(str(g) for g in range(gpu_count)) or "none"
            for gid in group.gpus:
                _require(0 <= gid < gpu_count, f"{pre} specifies invalid or unsupported gpu id "
                         f"{gid} in 'gpus'. Available GPUs are: {available}")
        else:
            _require(not group.gpus, f"{pre} has kind {kind} but specifies one or more GPUs")
        _require(not group.profile, f"{pre} and platform '{c.platform}' specifies 'profile' "
                 "field which is only supported for TensorRT models")
