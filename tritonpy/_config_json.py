"""The model configuration as JSON, exactly as Triton hands it to a model (``args
["model_config"]``) and serves it from its config endpoint, and back: a config override or an
``auto_complete_config`` result read into Triton's ``ModelConfig`` protobuf, with errors in
Triton's words."""
from __future__ import annotations

import json
import re
from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from tritonclient.grpc.model_config_pb2 import ModelConfig

from tritonpy._errors import ConfigError


def config_to_dict(cfg: ModelConfig) -> dict[str, Any]:
    """The configuration as Triton's ``ModelConfigToJson`` renders it, as a dict.

    Triton prints with ``preserve_proto_field_names`` and ``always_print_primitive_fields``
    (so empty lists, empty maps and zero scalars appear; unset sub-messages do not), then
    turns a fixed list of 64-bit fields from protobuf's JSON strings back into numbers. The
    64-bit fields outside that list stay strings, as they do under Triton. Keys come in the
    ``.proto`` declaration order, as Triton's C++ printer emits them, a set scalar member of a
    oneof after the rest.
    """
    raw = json_format.MessageToDict(
        cfg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    ordered = _ordered(cfg.DESCRIPTOR, raw)
    _fix_int64(ordered)
    # Fields that Triton 2.51's ModelConfig does not have yet (tritonclient's newer protos
    # do): left at their default, they are not printed, as 2.51 prints none of them.
    for section, field in _NEWER_FIELDS:
        part = ordered.get(section)
        if isinstance(part, dict) and part.get(field) in (0, "0", False, ""):
            del part[field]
    return ordered


# (section, field) of the ModelConfig fields added after Triton 2.51.
_NEWER_FIELDS = (("ensemble_scheduling", "max_inflight_requests"),)


def config_to_json(cfg: ModelConfig) -> str:
    """The configuration as the compact JSON string Triton gives ``args['model_config']``."""
    return json.dumps(config_to_dict(cfg), separators=(",", ":"), ensure_ascii=False)


def _ordered(desc: Descriptor, obj: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # Triton's printer lays out every field but the scalar members of a oneof first, and adds
    # a set scalar oneof member after them: InitialState prints "name" before "zero_data".
    fields = sorted(desc.fields, key=lambda f: (f.containing_oneof is not None
                                                and f.message_type is None))
    for field in fields:
        if field.name not in obj:
            continue
        value = obj[field.name]
        msg = field.message_type
        if msg is not None and msg.GetOptions().map_entry:
            value_field = msg.fields_by_name["value"]
            value = {k: _value(value_field, value[k]) for k in sorted(value)}
        elif _is_repeated(field):
            value = [_value(field, v) for v in value]
        else:
            value = _value(field, value)
        out[field.name] = value
    return out


def _is_repeated(field: FieldDescriptor) -> bool:
    # protobuf 6 deprecates ``label`` for the ``is_repeated`` property; older ones lack it.
    flag = getattr(field, "is_repeated", None)
    if flag is None:
        return bool(field.label == FieldDescriptor.LABEL_REPEATED)
    return bool(flag() if callable(flag) else flag)


def _value(field: FieldDescriptor, value: Any) -> Any:
    if field.message_type is not None:
        return _ordered(field.message_type, value)
    # C++ prints an integral float as '1', which Triton's JSON layer keeps as an integer.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _ints(obj: Any, key: str) -> None:
    if isinstance(obj, dict) and isinstance(obj.get(key), list):
        obj[key] = [int(v) for v in obj[key]]


def _int(obj: Any, key: str) -> None:
    if isinstance(obj, dict) and isinstance(obj.get(key), str):
        obj[key] = int(obj[key])


def _fix_int64(d: dict[str, Any]) -> None:
    # The list below is Triton core's ModelConfigToJson fix-up list, field for field. Not on
    # it (so strings, as under Triton): optimization.cuda.graph_spec dims,
    # instance_group.secondary_devices.device_id, sequence_batching.state.initial_state.dims
    # (Triton looks for initial_state on the wrong object) and priority_queue_policy keys
    # (JSON keys are strings).
    for io in d.get("input", []) + d.get("output", []):
        _ints(io, "dims")
        _ints(io.get("reshape"), "shape")
    _ints(d.get("version_policy", {}).get("specific"), "versions")
    db = d.get("dynamic_batching")
    if isinstance(db, dict):
        for key in ("max_queue_delay_microseconds", "priority_levels", "default_priority_level"):
            _int(db, key)
        _int(db.get("default_queue_policy"), "default_timeout_microseconds")
        for policy in db.get("priority_queue_policy", {}).values():
            _int(policy, "default_timeout_microseconds")
    sb = d.get("sequence_batching")
    if isinstance(sb, dict):
        _int(sb, "max_sequence_idle_microseconds")
        _int(sb.get("oldest"), "max_queue_delay_microseconds")
        _int(sb.get("direct"), "max_queue_delay_microseconds")
        for state in sb.get("state", []):
            _ints(state, "dims")
    for step in d.get("ensemble_scheduling", {}).get("step", []):
        _int(step, "model_version")
    for warmup in d.get("model_warmup", []):
        for tensor in warmup.get("inputs", {}).values():
            _ints(tensor, "dims")


def config_from_dict(d: dict[str, Any] | str | bytes, path: str = "<config>") -> ModelConfig:
    """Build a ``ModelConfig`` from its JSON form (the inverse of :func:`config_to_dict`).

    Accepts numbers or strings for 64-bit fields, and enum names in any case (Triton parses
    with ``case_insensitive_enum_parsing``). Used for ``auto_complete_config`` results and
    ``load_model(config=...)``.

    Args:
        d: The JSON object, as a dict or a JSON string.
        path: Where it came from, for error messages.

    Raises:
        ConfigError: Invalid JSON, an unknown field (named, with where it sits), or a value
            of the wrong type.
    """
    obj: Any = d
    if isinstance(d, (str, bytes)):
        text = d.decode(errors="replace") if isinstance(d, bytes) else d
        try:
            obj = json.loads(text)
        except ValueError as exc:
            plain = _plain_json(text)
            try:
                obj = json.loads(plain) if plain is not None else None
            except ValueError:
                obj = None
            if obj is None:
                raise ConfigError(f"{path}: invalid JSON model configuration: {exc}") from None
    prepared = _prepare(ModelConfig.DESCRIPTOR, obj, "", path)
    cfg = ModelConfig()
    try:
        json_format.ParseDict(prepared, cfg)
    except json_format.ParseError as exc:
        raise ConfigError(f"{path}: {str(exc).splitlines()[0]}") from None
    return cfg


_BARE_KEY = re.compile(r"([A-Za-z_$][A-Za-z0-9_$]*)\s*:")


def _plain_json(text: str) -> str | None:
    """``text`` with the liberties protobuf's JSON parser (Triton's) takes made plain JSON:
    object keys without quotes (upstream's L0_iterative_sequence loads ``direct: {...}``),
    strings in single quotes and a comma before a closing bracket (Triton 2.51 loads all
    three, measured). None when it takes none of them."""
    out: list[str] = []
    stack: list[str] = []
    after = ""  # the last significant character outside strings
    changed = False
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == '"' or c == "'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            body = text[i + 1:j]
            if c == "'":
                changed = True
                body = re.sub(r'(?<!\\)"', '\\"', body).replace("\\'", "'")
            out.append(f'"{body}"')
            after = '"'
            i = j + 1
            continue
        if stack and stack[-1] == "{" and after in "{," and (m := _BARE_KEY.match(text, i)):
            out.append(f'"{m.group(1)}"')
            changed = True
            after = '"'
            i += len(m.group(1))
            continue
        if c in "{[":
            stack.append(c)
        elif c in "}]" and stack:
            stack.pop()
            if after == ",":  # a trailing comma
                k = len(out) - 1
                while out[k].isspace():
                    k -= 1
                del out[k]
                changed = True
        if not c.isspace():
            after = c
        out.append(c)
        i += 1
    return "".join(out) if changed else None


def _json_names(desc: Descriptor) -> dict[str, FieldDescriptor]:
    return {f.json_name: f for f in desc.fields}


_JSON_KINDS = {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
               int: "a number", float: "a number", type(None): "null"}
_TYPE_NAMES = {getattr(FieldDescriptor, n): n for n in dir(FieldDescriptor)
               if n.startswith("TYPE_")}
_INT_RANGES = {
    FieldDescriptor.CPPTYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.CPPTYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.CPPTYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.CPPTYPE_UINT64: (0, 2**64 - 1),
}
_INTEGER = re.compile(r"-?[0-9]+")


def _invalid(path: str, where: str, value: Any, type_name: str) -> ConfigError:
    """Triton's words for a value of the wrong type, e.g. ``(max_batch_size): invalid value
    "abc" for type TYPE_INT32``."""
    shown = json.dumps(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return ConfigError(f"{path}: ({where}): invalid value {shown} for type {type_name}")


def _message_type(desc: Descriptor) -> str:
    return f"type.googleapis.com/{desc.full_name}"


def _field_type(field: FieldDescriptor) -> str:
    if field.message_type is not None:
        return _message_type(field.message_type)
    if field.enum_type is not None:
        return f"type.googleapis.com/{field.enum_type.full_name}"
    return _TYPE_NAMES.get(field.type, "?")


def _prepare(desc: Descriptor, obj: Any, where: str, path: str) -> dict[str, Any]:
    """Copy ``obj`` checking field names and value types, with clear errors: the field's path
    and what is wrong with it, in Triton's words (protobuf's JSON parser raised Python's, e.g.
    "invalid literal for int() with base 10")."""
    if not isinstance(obj, dict):
        if not where:
            kind = _JSON_KINDS.get(type(obj), type(obj).__name__)
            raise ConfigError(f"{path}: the model configuration must be a JSON object, not {kind}")
        raise _invalid(path, where, obj, _message_type(desc))
    out: dict[str, Any] = {}
    for key, value in obj.items():
        field = desc.fields_by_name.get(key) or _json_names(desc).get(key)
        if field is None:
            at = f" (at '{where}')" if where else ""
            raise ConfigError(f"{path}: invalid field '{key}' in {desc.name}{at}")
        sub = f"{where}.{key}" if where else key
        msg = field.message_type
        if value is None:
            out[key] = value
        elif msg is not None and msg.GetOptions().map_entry:
            vfield = msg.fields_by_name["value"]
            if not isinstance(value, dict):
                raise _invalid(path, sub, value, _message_type(msg))
            out[key] = {k: _prepare_value(vfield, v, f"{sub}[{k}]", path) for k, v in value.items()}
        elif _is_repeated(field):
            if not isinstance(value, list):
                raise _invalid(path, sub, value, _field_type(field))
            out[key] = [_prepare_value(field, v, f"{sub}[{i}]", path) for i, v in enumerate(value)]
        else:
            out[key] = _prepare_value(field, value, sub, path)
    return out


def _prepare_value(field: FieldDescriptor, value: Any, where: str, path: str) -> Any:
    """``value`` for ``field`` as protobuf's JSON parser takes it, if Triton's takes it (it
    also takes integral numbers, strings of integers and "true"/"false", and enums by
    number or by name in any case); a ConfigError naming ``where`` if not."""
    if field.message_type is not None:
        return _prepare(field.message_type, value, where, path)
    cpp = field.cpp_type
    if field.enum_type is not None:
        if isinstance(value, str) and value.upper() in field.enum_type.values_by_name:
            return value.upper()
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif cpp in _INT_RANGES:
        number: Any = value
        if isinstance(value, str) and _INTEGER.fullmatch(value):
            number = int(value)
        elif isinstance(value, float) and value.is_integer():
            number = int(value)
        low, high = _INT_RANGES[cpp]
        if isinstance(number, int) and not isinstance(number, bool) and low <= number <= high:
            return number
    elif cpp == FieldDescriptor.CPPTYPE_BOOL:
        if isinstance(value, bool):
            return value
        if value in ("true", "false"):
            return value == "true"
    elif cpp in (FieldDescriptor.CPPTYPE_FLOAT, FieldDescriptor.CPPTYPE_DOUBLE):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return float(value)  # "NaN", "Infinity", "0.5"
            except ValueError:
                pass
    elif isinstance(value, str):  # string and bytes
        return value
    raise _invalid(path, where, value, _field_type(field))
