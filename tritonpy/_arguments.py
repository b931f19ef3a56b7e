"""The checks of the in-process API's arguments (``Server(...)``, ``load()``, ``model()``):
each gives a value as the server keeps it, or an InvalidArgumentError naming the argument and
what it should have been."""
from __future__ import annotations

import json
import numbers
import os
from typing import Any, Mapping, TypeAlias

import numpy as np

from ._errors import InvalidArgumentError

# A path as os.fsdecode takes it (bytes are the file system's own encoding).
PathArg: TypeAlias = "str | bytes | os.PathLike[str] | os.PathLike[bytes]"


def paths(value: Any) -> list[str]:
    """``Server``'s model repositories (a path, or a list of paths: str, bytes or
    ``os.PathLike``), as str; or InvalidArgumentError naming what is not."""
    if isinstance(value, (str, bytes, bytearray, os.PathLike)):
        return [path("model_repository", bytes(value) if isinstance(value, bytearray)
                     else value)]
    try:
        items = list(value)
    except TypeError:
        raise InvalidArgumentError(f"model_repository must be a path or a list of paths, not "
                                   f"{type(value).__name__}") from None
    out = []
    for item in items:
        try:
            out.append(os.fsdecode(item))
        except TypeError:
            raise InvalidArgumentError(
                f"model_repository must be a path or a list of paths, not a "
                f"{type(value).__name__} holding {type(item).__name__}") from None
    return out


def path(what: str, value: Any) -> str:
    """A path (str, bytes or ``os.PathLike``) as str, or InvalidArgumentError naming ``what``."""
    try:
        return os.fsdecode(value)
    except TypeError:
        raise InvalidArgumentError(f"{what} must be a path (or None), not "
                                   f"{type(value).__name__}") from None


def names(what: str, value: Any, kind: str = "model names") -> list[str]:
    """A list of model names (one name given as a str is a list of one, None none), or
    InvalidArgumentError naming ``what``."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, (bytes, bytearray)):
        raise InvalidArgumentError(f"{what} must be {kind} (str), not {type(value).__name__}")
    if value is None:
        return []
    try:
        names = list(value)
    except TypeError:
        names = [value]
    for name in names:
        if not isinstance(name, str):
            raise InvalidArgumentError(
                f"{what} must be {kind} (str), not {type(name).__name__}")
    return names


def config_text(config: Any) -> str | None:
    """``load()``'s config override as JSON text (None: none), or InvalidArgumentError."""
    if config is None or type(config) is str:
        return config
    if isinstance(config, Mapping):
        try:
            return json.dumps(config, default=_numpy_to_json)
        except (TypeError, ValueError) as exc:  # an object JSON has no form for, a cycle
            raise InvalidArgumentError(f"config cannot be written as JSON: {exc}") from None
    if isinstance(config, (bytes, bytearray)):
        try:
            return bytes(config).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidArgumentError(f"config must be UTF-8 JSON text: {exc}") from None
    if isinstance(config, str):
        return str.__str__(config)
    raise InvalidArgumentError(f"config must be JSON text or a dict, not "
                               f"{type(config).__name__}")


def _numpy_to_json(value: Any) -> Any:
    """A numpy number or array in a config dict, as the number or list it holds."""
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def flag(what: str, value: Any) -> bool:
    """``value`` as a bool (numpy's too, or an int), or InvalidArgumentError naming ``what``:
    a str such as "false" is not taken for true."""
    if not isinstance(value, (bool, np.bool_, int, np.integer)):
        raise InvalidArgumentError(f"{what} must be a bool, not {type(value).__name__}")
    return bool(value)


def instance(what: str, value: Any, kind: type, words: str) -> None:
    """InvalidArgumentError naming ``what`` unless ``value`` is None or a ``kind``."""
    if value is not None and not isinstance(value, kind):
        raise InvalidArgumentError(f"{what} must be {words} (or None), not "
                                   f"{type(value).__name__}")


def model_name(name: Any) -> str:
    """A model name as a plain str (``np.str_`` and a str Enum hold one), or
    InvalidArgumentError. (str() of a str Enum member is its qualified name: not that.)"""
    if not isinstance(name, str):
        raise InvalidArgumentError(f"model name must be a str, not {type(name).__name__}")
    return str.__str__(name)


def count(what: str, value: Any) -> int:
    """``value`` as an int of 0 or more, or InvalidArgumentError naming ``what``."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise InvalidArgumentError(f"{what} must be an int, not {type(value).__name__}")
    if value.__index__() < 0:
        raise InvalidArgumentError(f"{what} must be >= 0, not {value}")
    return value.__index__()


def seconds(what: str, value: Any) -> float:
    """``value`` as 0 or more seconds, or InvalidArgumentError naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numpy's too
        raise InvalidArgumentError(f"{what} must be a number of seconds, not "
                                   f"{type(value).__name__}")
    seconds = float(value)
    if not seconds >= 0:  # NaN too
        raise InvalidArgumentError(f"{what} must be 0 or more seconds, got {value!r}")
    return seconds
