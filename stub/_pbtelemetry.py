"""``pb_utils.Logger`` and the custom metrics API (``MetricFamily`` / ``Metric``).

Inside a stub both forward to the host (logs land in the host's log tagged with model and
instance; metrics are exported by the host's Prometheus endpoint). In a plain interpreter logs
go to Python logging and metrics are kept locally, so a model's unit test still runs.
"""
from __future__ import annotations

import enum
import gc
import itertools
import logging
import os
import sys
import weakref
from typing import Any

from ._pberrors import TritonModelException, sendable

_log = logging.getLogger("triton_python_backend_utils")


class _Named(enum.IntEnum):
    """An enum that prints as Triton's (pybind11) do, ``LogLevel.INFO``, where an IntEnum
    prints its number on Python 3.11+."""

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"

    def __format__(self, spec: str) -> str:
        return str(self) if not spec else int.__format__(self, spec)


class LogLevel(_Named):
    INFO = 0
    WARNING = 1
    ERROR = 2
    VERBOSE = 3


class MetricKind(_Named):
    COUNTER = 0
    GAUGE = 1
    HISTOGRAM = 2


_Level = LogLevel  # for annotations inside Logger, whose own LogLevel attribute shadows it
_Kind = MetricKind  # the same inside MetricFamily

_PY_LEVEL = {LogLevel.INFO: logging.INFO, LogLevel.WARNING: logging.WARNING,
             LogLevel.ERROR: logging.ERROR, LogLevel.VERBOSE: logging.DEBUG}


def _rt() -> Any:
    from . import pb_utils

    return pb_utils._runtime


class Logger:
    """Static logging helpers, as Triton's ``pb_utils.Logger`` (levels also as
    ``Logger.INFO`` ... and ``Logger.LogLevel``, as there)."""

    LogLevel = LogLevel
    INFO = LogLevel.INFO
    WARNING = LogLevel.WARNING
    ERROR = LogLevel.ERROR
    VERBOSE = LogLevel.VERBOSE

    def __init__(self) -> None:
        # As Triton's (pybind11, measured): the class has static methods only.
        raise TypeError("pb_utils.Logger: No constructor defined!")

    @staticmethod
    def log(message: str, level: _Level = _Level.INFO) -> None:
        # As Triton's (pybind11, measured): a str message and a LogLevel, not a number or
        # None; a model that passes those would fail its requests there.
        if not isinstance(message, str):
            raise TypeError(f"Logger.log: message must be a str, got {type(message).__name__}")
        if not isinstance(level, LogLevel):
            raise TypeError(f"Logger.log: level must be one of Logger.INFO, WARNING, ERROR or "
                            f"VERBOSE, got {level!r}")
        rt = _rt()
        if rt is not None:
            # The model's line, for the host's log line (file:line, as Triton's shows).
            frame = sys._getframe(1)
            while frame.f_back is not None and frame.f_code.co_filename == __file__:
                frame = frame.f_back
            rt.log(int(level), sendable(str(message)),  # a lone surrogate goes escaped
                   (os.path.basename(frame.f_code.co_filename), frame.f_lineno))
        else:
            _log.log(_PY_LEVEL[level], "%s", message)

    @staticmethod
    def log_info(message: str) -> None:
        Logger.log(message, LogLevel.INFO)

    @staticmethod
    def log_warn(message: str) -> None:
        Logger.log(message, LogLevel.WARNING)

    @staticmethod
    def log_error(message: str) -> None:
        Logger.log(message, LogLevel.ERROR)

    @staticmethod
    def log_verbose(message: str) -> None:
        Logger.log(message, LogLevel.VERBOSE)


# Ids of this process's MetricFamily objects: the host counts the series each one made.
_family_ids = itertools.count(1)
# Whether the cyclic garbage collector is running (it runs the __del__ of what it frees, at
# whatever allocation started it).
_collecting = False


def _gc_phase(phase: str, info: dict) -> None:
    global _collecting
    _collecting = phase == "start"


gc.callbacks.append(_gc_phase)


class MetricFamily:
    """A family of custom metrics: ``MetricFamily(name, description, kind)``.

    As in Triton, deleting the object (``del``, garbage collection, or in ``finalize``) removes
    every series its metrics made from the metrics endpoint, even those of Metric objects that
    are still alive (their operations raise from then on); the same name made again starts
    from 0. A Metric object deleted alone keeps its series.
    """

    MetricKind = MetricKind
    COUNTER = MetricKind.COUNTER
    GAUGE = MetricKind.GAUGE
    HISTOGRAM = MetricKind.HISTOGRAM

    def __init__(self, name: str, description: str, kind: _Kind) -> None:
        self._rt: Any = None  # set once the host took it: only then is there something to delete
        if not isinstance(kind, MetricKind):
            # As Triton's (pybind11, measured): MetricFamily.COUNTER, GAUGE or HISTOGRAM, not
            # a number.
            raise TypeError(f"MetricFamily: kind must be MetricFamily.COUNTER, GAUGE or "
                            f"HISTOGRAM, got {kind!r}")
        if not name or not name.replace("_", "a").replace(":", "a").isalnum():
            raise TritonModelException(f"invalid metric family name {name!r}")
        self.name = name
        self.description = description
        self.kind = kind
        self._id = next(_family_ids)
        rt = _rt()
        if rt is not None:
            rt.metric_family(name, description, kind, self._id)
            self._rt = rt

    def Metric(self, labels: dict[str, str] | None = None,  # noqa: N802 - Triton's name
               buckets: list[float] | None = None) -> Metric:
        return Metric(self, dict(labels or {}), buckets)

    def __del__(self) -> None:
        rt = self._rt
        if rt is not None:
            self._rt = None
            try:
                rt.metric_family_delete(self.name, self._id, _collecting)
            except Exception:  # the host is gone, or a forked child: nobody to tell
                pass


_FAMILY_DELETED = (
    "Invalid metric operation as the corresponding 'MetricFamily' has been deleted. The "
    "'MetricFamily' object should be deleted AFTER its corresponding 'Metric' objects have "
    "been deleted.")

# What Triton's stub puts before an operation's error (python_backend src/metric.cc), and the
# errors of Triton's core for an operation the kind has not (core src/metric_family.cc).
_INCREMENT = "Failed to increment metric value: "
_SET = "Failed to set metric value: "
_OBSERVE = "Failed to observe metric value: "
_VALUE = "Failed to get metric value: "
_KIND_NAME = {0: "TRITONSERVER_METRIC_KIND_COUNTER", 1: "TRITONSERVER_METRIC_KIND_GAUGE",
              2: "TRITONSERVER_METRIC_KIND_HISTOGRAM"}


class Metric:
    """One labelled metric of a family.

    As in Triton, a metric does not keep its family alive: once the family object is gone,
    every operation raises (so ``MetricFamily(...).Metric(...)``, whose family is dropped at
    once, fails here as it does on Triton).
    """

    def __init__(self, family: MetricFamily, labels: dict[str, str],
                 buckets: list[float] | None) -> None:
        if family.kind == MetricFamily.HISTOGRAM:
            # As Triton: a list (empty allowed: one +Inf bucket) of strictly ascending bounds.
            if not isinstance(buckets, (list, tuple)):
                raise TritonModelException(
                    f"a histogram metric needs buckets (a list of ascending bounds), got "
                    f"{type(buckets).__name__}")
            bounds = [float(b) for b in buckets]
            if any(a >= b for a, b in zip(bounds, bounds[1:])):
                raise TritonModelException(
                    f"histogram buckets must be strictly ascending (no duplicates), got {bounds}")
            buckets = bounds
        elif buckets:
            raise TritonModelException("only histogram metrics take buckets")
        self._family = weakref.ref(family)
        self._name = family.name
        self._kind = family.kind
        for k, v in labels.items():
            if not isinstance(k, str) or not isinstance(v, str):
                # Triton's words first (measured): its core reads the labels as JSON strings.
                raise TritonModelException(
                    f"attempt to access JSON non-string as string (metric label {k!r}: {v!r}; "
                    "label names and values are str)")
        self._labels = dict(labels)
        self._buckets = buckets if family.kind == MetricFamily.HISTOGRAM else None
        self._local = 0.0
        rt = family._rt
        if rt is not None:
            rt.metric_op(self._name, self._labels, "create", 0.0, self._buckets, family._id)

    def _check(self, prefix: str, op: str, kinds: tuple[int, ...]) -> None:
        """Raise what Triton raises for this operation, with its prefix: the family is gone,
        or the kind has no such operation."""
        if self._family() is None:
            raise TritonModelException(prefix + _FAMILY_DELETED)
        if self._kind not in kinds:
            raise TritonModelException(f"{prefix}{_KIND_NAME[self._kind]} does not support {op}")

    def _op(self, op: str, value: float) -> None:
        rt = _rt()
        if rt is not None:
            rt.metric_op(self._name, self._labels, op, float(value), self._buckets)

    def increment(self, value: float) -> None:
        self._check(_INCREMENT, "Increment", (MetricFamily.COUNTER, MetricFamily.GAUGE))
        if self._kind == MetricFamily.COUNTER and value < 0:
            raise TritonModelException(
                f"{_INCREMENT}TRITONSERVER_METRIC_KIND_COUNTER can only be incremented "
                "monotonically by non-negative values.")
        self._local += value
        self._op("increment", value)

    def set(self, value: float) -> None:
        self._check(_SET, "Set", (MetricFamily.GAUGE,))
        self._local = value
        self._op("set", value)

    def observe(self, value: float) -> None:
        self._check(_OBSERVE, "Observe", (MetricFamily.HISTOGRAM,))
        self._local += value
        self._op("observe", value)

    def value(self) -> float:
        """The current value of a counter or gauge (a histogram has none, as in Triton: read
        it from the metrics endpoint)."""
        self._check(_VALUE, "Value", (MetricFamily.COUNTER, MetricFamily.GAUGE))
        rt = _rt()
        if rt is not None:
            return float(rt.metric_value(self._name, self._labels))
        return self._local
