"""Triton's trace extension: request tracing, its settings (server-wide and per model), and the
trace files.

A request is traced when its model's settings have a level other than OFF: every
``trace_rate``-th request, until ``trace_count`` traces have been taken (-1: no limit). A trace
records Triton's timestamps (``REQUEST_START``, ``QUEUE_START``, ``COMPUTE_START``,
``COMPUTE_INPUT_END``, ``COMPUTE_OUTPUT_START``, ``COMPUTE_END``, ``INFER_RESPONSE_COMPLETE``,
``REQUEST_END``, and the frontends' ``HTTP_RECV_START``... ``GRPC_SEND_END``) in nanoseconds of
the monotonic clock, as Triton's steady clock. They are written as Triton writes them: a JSON
array with, per trace, one entry naming the model and one entry per timestamp; to
``trace_file`` itself (``log_frequency`` 0, closed when the server stops) or, every
``log_frequency`` traces, to ``trace_file.0``, ``trace_file.1``... As in Triton, settings
updated are new settings that hold their own traces (see :class:`_Sink`).

Only requests from the HTTP and gRPC frontends are sampled (the in-process API carries no
trace, as requests made without one in Triton). As in Triton, an ensemble's steps, and the BLS
calls a model makes with ``trace=request.trace()``, are traced under their caller: traces of
their own (``parent_id`` the caller's), written with it. In OpenTelemetry mode (``mode``) the
traces go to :mod:`._otel` as spans instead of to a file. Level TENSORS records each input
when the request is queued (``TENSOR_QUEUE_INPUT``) and each output of its responses
(``TENSOR_BACKEND_OUTPUT``), values joined by commas as Triton writes them.
"""
from __future__ import annotations

import itertools
import json
import logging
import secrets
import threading
import time
from typing import Any, Iterable, Iterator, Mapping

import numpy as np

from ._errors import InvalidArgumentError, UnsupportedError, public
from ._otel import SETTING_NAMES, OtelSettings, OtlpExporter, parse_traceparent
from .shm.dtypes import triton_dtype_of

log = logging.getLogger(__name__)

_LEVELS = ("OFF", "TIMESTAMPS", "TENSORS")
_NUMBERS = ("trace_rate", "trace_count", "log_frequency")


class Trace:
    """What is recorded of one sampled request: its timestamps (level TIMESTAMPS) and its
    input and output tensors (level TENSORS)."""

    __slots__ = ("id", "model", "version", "request_id", "events", "tensors", "timestamps",
                 "context", "parent_id", "children", "span_ids", "_levels", "_ids", "_sink",
                 "_finished")

    def __init__(self, trace_id: int, model: str, sink: Any, levels: list[str],
                 context: tuple[str, str] | None = None, ids: Any = None,
                 parent_id: int = 0, span_ids: tuple[str, str, str] | None = None) -> None:
        self.id = trace_id
        self.context = context  # OpenTelemetry: the caller's (trace id, span id), if given
        # OpenTelemetry: (trace id, InferRequest span id, model span id), made up front so that
        # the model can read its span's context (request.trace().get_context()).
        self.span_ids = span_ids
        self.parent_id = parent_id  # an ensemble step's: its ensemble request's trace id
        self.children: list[Trace] = []  # its ensemble steps' and traced BLS calls' traces
        self._levels = levels
        self._ids = ids  # the server's trace ids (a callable), for the children
        self.model = model
        self.version = -1
        self.request_id = ""
        self.events: list[tuple[str, int]] = []
        self.timestamps = "TIMESTAMPS" in levels
        self.tensors: list[dict] | None = [] if "TENSORS" in levels else None
        self._sink = sink
        self._finished = False

    def at(self, name: str, ns: int = 0) -> None:
        """Record timestamp ``name`` (now, unless ``ns`` is given)."""
        if self.timestamps:
            self.events.append((name, ns or time.monotonic_ns()))

    def stamps(self, pairs: Iterable[tuple[str, int]]) -> None:
        """Record timestamps given as (name, ns)."""
        if self.timestamps:
            self.events.extend(pairs)

    def queued(self, version: int, request_id: str, t_start: int,
               inputs: Iterable[tuple[str, np.ndarray]] = ()) -> None:
        """The request, with its ``inputs``, reached its model version's scheduler."""
        self.version, self.request_id = version, request_id
        self.stamps((("REQUEST_START", t_start), ("QUEUE_START", time.monotonic_ns())))
        if self.tensors is not None:
            self.tensors += (_tensor(self.id, "TENSOR_QUEUE_INPUT", n, a) for n, a in inputs)

    def outputs(self, outputs: Iterable[tuple[str, np.ndarray]]) -> None:
        """A response with these outputs is delivered (level TENSORS)."""
        if self.tensors is not None:
            self.tensors += (_tensor(self.id, "TENSOR_BACKEND_OUTPUT", n, a) for n, a in outputs)

    def child(self, model: str) -> Trace:
        """The trace of an ensemble step's request, or of a BLS call made with this trace,
        written with this one (as Triton: its own id, ``parent_id`` this trace's)."""
        span_ids = None if self.span_ids is None else (self.span_ids[0], "", _span_id())
        trace = Trace(self._ids() if self._ids is not None else 0, model, self._sink,
                      self._levels, ids=self._ids, parent_id=self.id, span_ids=span_ids)
        self.children.append(trace)
        return trace

    def otel_context(self) -> str | None:
        """What ``request.trace().get_context()`` gives the model in OpenTelemetry mode, as in
        Triton: its model span's W3C context, as JSON; None in Triton mode."""
        if self.span_ids is None:
            return None
        return json.dumps({"traceparent": f"00-{self.span_ids[0]}-{self.span_ids[2]}-01"},
                          separators=(",", ":"))

    def finish(self) -> None:
        """The request is over: hand the trace, with its steps', to its file (once)."""
        if not self._finished:
            self._finished = True
            if not self.parent_id:  # a step's trace goes with its ensemble's
                self._sink.add(self)

    def family(self) -> Iterator[Trace]:
        """This trace and those under it, in the order Triton writes them: the steps' traces
        first (they end first), then this one."""
        for child in self.children:
            yield from child.family()
        yield self

    def entries(self) -> list[dict]:
        """Triton's file entries of this trace and of those under it."""
        return [e for t in self.family() for e in t.own_entries()]

    def own_entries(self) -> list[dict]:
        """Triton's file entries of this trace alone."""
        out: list[dict] = []
        if self.timestamps:  # as Triton: level TENSORS alone writes the tensors only
            head: dict[str, Any] = {"id": self.id, "model_name": self.model,
                                    "model_version": self.version}
            if self.request_id:
                head["request_id"] = self.request_id
            if self.parent_id:
                head["parent_id"] = self.parent_id
            out.append(head)
            out += ({"id": self.id, "timestamps": [{"name": n, "ns": ns}]}
                    for n, ns in self.events)
        return out + (self.tensors or [])


def _span_id() -> str:
    return secrets.token_hex(8)


def _tensor(trace_id: int, activity: str, name: str, array: np.ndarray) -> dict:
    """A tensor entry as Triton writes it: values joined by commas (floats to 6 significant
    digits, strings quoted), the shape too, and Triton's datatype name. A GPU tensor passed
    on by a BLS call (which the host never reads) has no data."""
    flat = np.asarray(array).reshape(-1) if isinstance(array, np.ndarray) else np.empty(0)
    kind = flat.dtype.kind
    if not flat.size:
        data = ""
    elif kind == "f":
        data = ",".join(f"{v:g}" for v in flat.tolist())
    elif kind in "OSU":
        data = ",".join(json.dumps(v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v))
                        for v in flat.tolist())
    else:  # integers, and booleans as 1 and 0
        data = ",".join(str(int(v)) for v in flat.tolist())
    return {"id": trace_id, "activity": activity,
            "tensor": {"name": name, "data": data, "shape": ",".join(map(str, array.shape)),
                       "dtype": triton_dtype_of(array)}}


class _File:
    """One ``trace_file``, shared by the settings that write to it (as Triton's): its numbered
    parts (``file.0``, ``file.1``...), and the file itself, one JSON array that traces are
    added to ("[" before the first, "]" when the server stops)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._index = itertools.count()
        self._lock = threading.Lock()
        self._file: Any = None
        self._failed = False

    def part(self, traces: list[Trace]) -> None:
        """Write ``traces`` as the next part, whole."""
        with self._lock:
            path = f"{self.path}.{next(self._index)}"
            try:
                with open(path, "w", encoding="utf-8") as f:
                    f.write("[" + ",".join(_dumps(e) for t in traces for e in t.own_entries())
                            + "]")
            except OSError as exc:
                self._fail(path, exc)

    def append(self, traces: list[Trace]) -> None:
        """Add ``traces`` to the file itself."""
        text = ",".join(_dumps(e) for t in traces for e in t.own_entries())
        with self._lock:
            try:
                if self._file is None:
                    if self._failed:
                        return
                    self._file = open(self.path, "w", encoding="utf-8")
                    self._file.write("[" + text)
                else:
                    self._file.write("," + text)
                self._file.flush()
            except OSError as exc:
                self._fail(self.path, exc)

    def _fail(self, path: str, exc: OSError) -> None:
        if not self._failed:
            log.error("cannot write traces to '%s': %s", path, exc)
        self._failed = True
        self._file = None

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                try:
                    self._file.write("]")
                    self._file.close()
                except OSError as exc:
                    self._fail(self.path, exc)
                self._file = None


class _Sink:
    """Where the traces taken under one version of a scope's settings go (the server's, or a
    model's own), as Triton's trace setting: a settings update makes a new one, and the old one
    writes what it holds once its last trace is in. Traces are written every ``log_frequency``
    (counting each trace of an ensemble's steps) as the file's next part; a used-up count's
    last trace writes what is held as a part at once; what is held at the end (an update, the
    server's stop) goes to the next part with a ``log_frequency``, else to the file itself.
    With neither a ``log_frequency`` nor a count, each trace goes to the file as it ends."""

    def __init__(self, file: _File, log_frequency: int, counted: bool) -> None:
        self.file = file
        self.log_frequency = log_frequency
        self._stream = log_frequency == 0 and not counted
        self._lock = threading.Lock()
        self._pending: list[Trace] = []
        self._closed = False
        self._retired = False
        # Traces sampled and those in; ``last``: the count ran out, so once every sampled
        # trace is in, what is held becomes a part.
        self._sampled = 0
        self._collected = 0
        self._last = False

    def sampled(self, last: bool) -> None:
        """One more trace will come (``last``: its trace count is used up with it)."""
        with self._lock:
            self._sampled += 1
            self._last = self._last or last

    def add(self, trace: Trace) -> None:
        with self._lock:
            if self._closed:  # finished after the server stopped: its file is complete
                return
            self._collected += 1
            if self._stream:
                self.file.append(list(trace.family()))
            else:
                for one in trace.family():
                    self._pending.append(one)
                    if self.log_frequency and len(self._pending) >= self.log_frequency:
                        self._write(part=True)
            if self._last and self._collected >= self._sampled:
                # As Triton: the count's last trace is in, what is held is written out as the
                # next part at once.
                self._last = False
                self._write(part=True)
            if self._retired and self._collected >= self._sampled:
                self._write(part=self.log_frequency > 0)

    def retire(self) -> bool:
        """Settings of the scope were updated: no trace is sampled here any more, and what is
        held is written once the last one is in. Whether that is now."""
        with self._lock:
            self._retired = True
            if self._collected < self._sampled:
                return False
            self._write(part=self.log_frequency > 0)
            return True

    def _write(self, part: bool) -> None:
        traces, self._pending = self._pending, []
        if traces:
            (self.file.part if part else self.file.append)(traces)

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._write(part=self.log_frequency > 0)


def _dumps(entry: dict) -> str:
    return json.dumps(entry, separators=(",", ":"))


@public
class Tracing:
    """The server's trace settings and the traces they take.

    Args:
        level: "OFF" or "TIMESTAMPS" (a list of levels, as Triton's, is accepted).
        rate: trace every ``rate``-th request (0: none).
        count: stop after this many traces (-1: no limit).
        log_frequency: write every this many traces to a new ``file.N`` (0: all to ``file``).
        file: the trace file; required unless the level is OFF (in mode "triton").
        mode: "triton" (to the file) or "opentelemetry" (spans to an OTLP/HTTP collector).
        otel: the exporter's settings in mode "opentelemetry" (default: Triton's).
    """

    def __init__(self, level: str | list[str] = "OFF", rate: int | str = 1000,
                 count: int | str = -1, log_frequency: int | str = 0, file: str = "",
                 mode: str = "triton", otel: OtelSettings | None = None) -> None:
        if mode not in ("triton", "opentelemetry"):
            raise InvalidArgumentError(
                f"trace mode must be 'triton' or 'opentelemetry', got {mode!r}")
        self.mode = mode
        self.otel = otel or OtelSettings() if mode == "opentelemetry" else None
        self._exporter = OtlpExporter(self.otel) if self.otel is not None else None
        levels = [level] if isinstance(level, str) else list(level)
        self._global: dict[str, Any] = {}
        self._global.update(_checked({"trace_level": levels, "trace_rate": str(rate),
                                      "trace_count": str(count),
                                      "log_frequency": str(log_frequency)}))
        self._global["trace_file"] = file
        self._check_file(self._global)
        self._startup = dict(self._global)  # what clearing a server-wide setting goes back to
        self._models: dict[str, dict[str, Any]] = {}  # a model's own settings (overrides)
        self._seen: dict[str, int] = {}  # requests seen per sampling scope
        # As Triton: a model with settings of its own counts its traces on its own, from
        # the server's count (which it does not use up), until either count is set again.
        self._counts: dict[str, int] = {}
        self._ids = 0
        self._files: dict[str, _File] = {}
        # Per scope ("" the server's settings, else a model's own), the sink of its settings
        # now; those of settings updated since, until their last trace is in.
        self._sinks: dict[str, _Sink] = {}
        self._retired: list[_Sink] = []
        self._lock = threading.Lock()
        self.active = False  # whether any scope traces: the hot path reads only this
        self._refresh()

    # -- settings ------------------------------------------------------------------------------
    def settings(self, model: str = "") -> dict[str, Any]:
        """The settings in effect (for ``model``, its own merged over the server's), in
        Triton's JSON form."""
        with self._lock:
            return self._effective(model)

    def update(self, new: Mapping[str, Any], model: str = "") -> dict[str, Any]:
        """Apply ``new`` settings (Triton's names; for a model, None clears one of its own)
        and return those in effect. Raises for a bad value; nothing changes then."""
        if not isinstance(new, Mapping):
            raise InvalidArgumentError("trace settings must be a JSON object")
        known = {"trace_level", "trace_mode", "trace_file", *_NUMBERS}
        if self.otel is not None:  # as Triton: shown, but not changed over the network
            known.update(SETTING_NAMES)
        # As Triton: unknown settings are ignored (the known ones beside them apply), and so
        # is trace_mode, which only the command line sets.
        unknown = sorted(set(new) - known)
        if unknown:
            log.warning("ignoring unknown trace setting(s): %s", ", ".join(unknown))
        mode = new.get("trace_mode")
        if mode is not None and mode != self.mode:
            log.warning("ignoring trace_mode %r: the trace mode is set at start only (this "
                        "server traces in mode '%s')", mode, self.mode)
        if "trace_file" in new:
            raise UnsupportedError(
                "trace file location can not be updated through network protocol")
        # As Triton: in OpenTelemetry mode the mode and the file settings are left as they are.
        ignored = {"trace_mode", *unknown,
                   *(("log_frequency", *SETTING_NAMES) if self.otel else ())}
        values = {k: v for k, v in new.items() if k not in ignored}
        levels = values.get("trace_level")
        if isinstance(levels, list) and len(levels) > 1 and any(
                isinstance(v, str) and v.upper() == "OFF" for v in levels):
            # As Triton: OFF with another level is a contradiction, refused (the command line
            # may give level twice, the last one winning, which it does not pass through here).
            raise InvalidArgumentError("Expect only one trace level 'OFF' is specified")
        cleared = [k for k, v in values.items() if v is None]
        checked = _checked({k: v for k, v in values.items() if v is not None})
        with self._lock:
            trial = dict(self._models.get(model, {}) if model else self._global)
            trial.update(checked)
            for k in cleared:
                # A model's own setting is dropped (the server's applies again); a
                # server-wide one goes back to what the server started with, as Triton's.
                if model:
                    trial.pop(k, None)
                else:
                    trial[k] = self._startup[k]
            effective = dict(self._global, **trial) if model else trial
            self._check_file(effective)
            if effective["trace_level"] != ["OFF"] and int(effective["trace_rate"]) == 0:
                # As Triton over the network (a rate of 0 at start is taken, and traces none).
                raise InvalidArgumentError(
                    "Attempting to set invalid trace setting :sample rate must be non-zero")
            if not model:
                self._global = trial
            elif trial:
                self._models[model] = trial
            else:
                self._models.pop(model, None)
            # As Triton: settings updated are new settings, which write where the old ones
            # did, but hold their own traces (those of a model with settings of its own too,
            # at an update of the server's).
            for scope in [model] if model else ["", *self._sinks]:
                self._retire(scope)
            if "trace_rate" in checked or cleared:
                self._seen.pop(model, None)
            if model:
                self._counts.pop(model, None)
            elif "trace_count" in checked or "trace_count" in cleared:
                self._counts.clear()
            self._refresh()
            return self._effective(model)

    def _retire(self, scope: str) -> None:
        sink = self._sinks.pop(scope, None)
        if sink is not None and not sink.retire():
            self._retired.append(sink)

    def _check_file(self, values: Mapping[str, Any]) -> None:
        if self.mode != "triton":
            return
        if values["trace_level"] != ["OFF"] and not values.get("trace_file"):
            raise InvalidArgumentError(
                "Attempting to set invalid trace setting :trace file name is not given")

    def _effective(self, model: str) -> dict[str, Any]:
        values = dict(self._global, **self._models.get(model, {})) if model else self._global
        if model in self._counts:
            values = dict(values, trace_count=self._counts[model])
        if self.otel is not None:  # Triton's OpenTelemetry form: no file, the exporter's settings
            return {"trace_level": list(values["trace_level"]),
                    "trace_rate": str(values["trace_rate"]),
                    "trace_count": str(values["trace_count"]),
                    "trace_mode": "opentelemetry", **self.otel.as_json()}
        return {"trace_level": list(values["trace_level"]),
                "trace_rate": str(values["trace_rate"]),
                "trace_count": str(values["trace_count"]),
                "log_frequency": str(values["log_frequency"]),
                "trace_file": values["trace_file"], "trace_mode": "triton"}

    def _refresh(self) -> None:
        self.active = any(s.get("trace_level", ["OFF"]) != ["OFF"]
                          for s in (self._global, *self._models.values()))

    # -- tracing -------------------------------------------------------------------------------
    def start(self, model: str, traceparent: str = "") -> Trace | None:
        """A new trace for a request to ``model`` if it is sampled, else None. In OpenTelemetry
        mode a request that carries a valid W3C ``traceparent`` is traced whatever the rate
        and count (as Triton), its spans in the caller's trace."""
        context = parse_traceparent(traceparent) if self._exporter is not None else None
        with self._lock:
            own = self._models.get(model, {})
            values = dict(self._global, **own) if own else self._global
            if values["trace_level"] == ["OFF"]:
                return None
            if context is not None and self._exporter is not None:
                return Trace(self._next_id_locked(), model, self._exporter, values["trace_level"],
                             context, ids=self._next_id,
                             span_ids=(context[0], _span_id(), _span_id()))
            rate = int(values["trace_rate"])
            count = self._counts.get(model, int(values["trace_count"]))
            if rate <= 0 or count == 0:
                return None
            scope = model if "trace_rate" in own else ""
            seen = self._seen[scope] = self._seen.get(scope, 0) + 1
            if seen % rate:
                return None
            if count > 0:
                if "trace_count" in own:
                    own["trace_count"] = count - 1
                elif own:
                    self._counts[model] = count - 1
                else:
                    self._global["trace_count"] = count - 1
            trace_id = self._next_id_locked()
            if self._exporter is not None:
                return Trace(trace_id, model, self._exporter, values["trace_level"],
                             ids=self._next_id,
                             span_ids=(secrets.token_hex(16), _span_id(), _span_id()))
            scope = model if own else ""
            sink = self._sinks.get(scope)
            if sink is None:
                path = values["trace_file"]
                file = self._files.get(path)
                if file is None:
                    file = self._files[path] = _File(path)
                sink = self._sinks[scope] = _Sink(file, int(values["log_frequency"]),
                                                  counted=count > 0)
            sink.sampled(last=count == 1)
            return Trace(trace_id, model, sink, values["trace_level"], ids=self._next_id)

    def _next_id_locked(self) -> int:
        self._ids += 1
        return self._ids

    def _next_id(self) -> int:
        with self._lock:
            return self._next_id_locked()

    def close(self) -> None:
        """Write what is left (the server stops)."""
        with self._lock:
            sinks = self._retired + list(self._sinks.values())
            files = list(self._files.values())
        for sink in sinks:
            sink.close()
        for file in files:
            file.close()
        if self._exporter is not None:
            self._exporter.close()


def _checked(values: Mapping[str, Any]) -> dict[str, Any]:
    """Settings in Triton's JSON form, validated: levels as a list, numbers as strings."""
    out: dict[str, Any] = {}
    if "trace_level" in values:
        levels = values["trace_level"]
        if not isinstance(levels, list) or not all(isinstance(v, str) for v in levels):
            raise InvalidArgumentError("Unable to parse 'trace_level': expected a list of strings")
        levels = [v.upper() for v in levels] or ["OFF"]
        bad = [v for v in levels if v not in _LEVELS]
        if bad:
            raise InvalidArgumentError(
                f"Unable to parse 'trace_level': expected OFF, TIMESTAMPS or TENSORS, got {bad[0]}")
        levels = list(dict.fromkeys(v for v in levels if v != "OFF")) or ["OFF"]
        out["trace_level"] = levels
    for key in _NUMBERS:
        if key not in values:
            continue
        raw = values[key]
        if not isinstance(raw, str):
            raise InvalidArgumentError(f"Unable to parse '{key}': expected a string, got {raw!r}")
        try:
            number = int(raw)
        except ValueError:
            raise InvalidArgumentError(f"Unable to parse '{key}', got: {raw}") from None
        # As Triton: the count is a 32-bit signed integer, the rate and frequency unsigned.
        low, high = (-1, 0x7FFFFFFF) if key == "trace_count" else (0, 0xFFFFFFFF)
        if number < low:
            raise InvalidArgumentError(
                f"Unable to parse '{key}'. Expecting value >= {low}, got:{raw}")
        if number > high:
            raise InvalidArgumentError(
                f"Unable to parse '{key}', value is out of range [ {low}, {high} ], got: {raw}")
        out[key] = number
    return out


__all__ = ["Trace", "Tracing"]
