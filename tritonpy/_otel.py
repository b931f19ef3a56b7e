"""Triton's OpenTelemetry trace mode: each traced request as OTLP spans, exported over HTTP.

As Triton 2.51 (checked side by side against its exports), a traced request gives three spans,
all of kind SERVER, in one trace:

* ``InferRequest``, the frontend's: the ``HTTP_*`` or ``GRPC_*`` timestamps and each
  ``INFER_RESPONSE_COMPLETE`` as events; its parent is the caller's span when the request
  carried a W3C ``traceparent`` header (then its trace id is the caller's too);
* a span named after the model, child of the first: ``REQUEST_START``, ``QUEUE_START``,
  ``REQUEST_END``, with the attributes ``triton.model_name``, ``triton.model_version``,
  ``triton.trace_id``, ``triton.trace_parent_id`` and ``triton.request_id``;
* ``compute``, child of the model's: the ``COMPUTE_*`` timestamps;
* for an ensemble, each step's model span (``triton.trace_parent_id`` the ensemble's trace
  id) and compute span, under the ensemble's model span (which has no compute span).

Times are the wall clock's (Unix nanoseconds), as OpenTelemetry's. The spans are sent as
OTLP/HTTP JSON (what Triton's exporter sends) to ``url`` by a batch processor of Triton's
settings: every ``bsp_schedule_delay`` ms, or as soon as ``bsp_max_export_batch_size`` spans
wait; past ``bsp_max_queue_size`` waiting spans, new ones are dropped (and counted in the log).
No OpenTelemetry package is needed.
"""
from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import re
import secrets
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from ._errors import public

log = logging.getLogger(__name__)

_FRONTEND = frozenset({"HTTP_RECV_START", "HTTP_RECV_END", "HTTP_SEND_START", "HTTP_SEND_END",
                       "GRPC_WAITREAD_START", "GRPC_WAITREAD_END", "GRPC_SEND_START",
                       "GRPC_SEND_END", "INFER_RESPONSE_COMPLETE"})
_COMPUTE = frozenset({"COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START",
                      "COMPUTE_END"})
_SERVER = 2  # SpanKind SERVER, as Triton's spans
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}$")


def parse_traceparent(value: str) -> tuple[str, str] | None:
    """(trace id, parent span id) of a W3C ``traceparent`` header, or None when malformed."""
    m = _TRACEPARENT.match(value.strip().lower()) if value else None
    if m is None or m.group(1) == "0" * 32 or m.group(2) == "0" * 16:
        return None
    return m.group(1), m.group(2)


#: The settings that the trace setting endpoints show in OpenTelemetry mode, and leave as they are.
SETTING_NAMES = ("url", "resource", "bsp_schedule_delay", "bsp_max_export_batch_size",
                 "bsp_max_queue_size")


@public
@dataclass
class OtelSettings:
    """Triton's ``--trace-config opentelemetry,<setting>=<value>`` settings."""

    url: str = "http://localhost:4318/v1/traces"
    resource: dict[str, str] = field(default_factory=dict)
    bsp_schedule_delay: int = 5000  # ms
    bsp_max_export_batch_size: int = 512
    bsp_max_queue_size: int = 2048

    def resource_attributes(self) -> dict[str, str]:
        """The resource's attributes: OTEL_RESOURCE_ATTRIBUTES, then ours, then the settings'
        (``service.name`` is Triton's, ``triton-inference-server``, unless one is given)."""
        attrs = {"telemetry.sdk.name": "tritonpy", "telemetry.sdk.language": "python",
                 "telemetry.sdk.version": _version(), "service.name": "triton-inference-server"}
        for item in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "").split(","):
            key, sep, value = item.partition("=")
            if sep and key.strip():
                attrs[key.strip()] = value.strip()
        attrs.update(self.resource)
        return attrs

    def as_json(self) -> dict[str, str]:
        """The settings as Triton's trace setting endpoints show them."""
        return {"url": self.url, "resource": ",".join(f"{k}={v}" for k, v in self.resource.items()),
                "bsp_schedule_delay": str(self.bsp_schedule_delay),
                "bsp_max_export_batch_size": str(self.bsp_max_export_batch_size),
                "bsp_max_queue_size": str(self.bsp_max_queue_size)}


def _version() -> str:
    try:
        return importlib.metadata.version("tritonpy")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        return "0"


def _event(name: str, ns: int, offset: int) -> dict[str, Any]:
    return {"name": name, "timeUnixNano": str(ns + offset)}


def _span(trace_id: str, span_id: str, parent: str | None, name: str,
          events: list[tuple[str, int]], offset: int, start: int | None = None,
          end: int | None = None, attributes: list[dict] | None = None) -> dict[str, Any]:
    times = [ns for _, ns in events]
    span: dict[str, Any] = {
        "traceId": trace_id, "spanId": span_id, "name": name, "kind": _SERVER,
        "startTimeUnixNano": str((start if start is not None else min(times)) + offset),
        "endTimeUnixNano": str((end if end is not None else max(times)) + offset),
        "events": [_event(n, ns, offset) for n, ns in events],
    }
    if parent:
        span["parentSpanId"] = parent
    if attributes:
        span["attributes"] = attributes
    return span


def _model_spans(trace: Any, trace_id: str, parent: str, offset: int) -> list[dict[str, Any]]:
    """The model span of ``trace`` (under ``parent``), its compute span, and its ensemble
    steps' spans under it: in the order they end."""
    events = sorted(trace.events, key=lambda e: e[1])
    compute = [e for e in events if e[0] in _COMPUTE]
    model = [e for e in events if e[0] not in _FRONTEND and e[0] not in _COMPUTE]
    if not model:
        return []
    span_id = trace.span_ids[2]
    out = []
    for child in trace.children:
        out += _model_spans(child, trace_id, span_id, offset)
    if compute:
        out.append(_span(trace_id, secrets.token_hex(8), span_id, "compute", compute, offset))
    attributes = [
        {"key": "triton.model_name", "value": {"stringValue": trace.model}},
        {"key": "triton.model_version", "value": {"intValue": str(trace.version)}},
        {"key": "triton.trace_id", "value": {"intValue": str(trace.id)}},
        {"key": "triton.trace_parent_id", "value": {"intValue": str(trace.parent_id)}},
        {"key": "triton.request_id", "value": {"stringValue": trace.request_id}},
    ]
    out.append(_span(trace_id, span_id, parent, trace.model, model, offset,
                     attributes=attributes))
    return out


def spans_of(trace: Any, offset: int) -> list[dict[str, Any]]:
    """The OTLP spans of a finished :class:`~tritonpy._trace.Trace` (its steps', compute,
    model, InferRequest: the order they end in); ``offset`` turns its monotonic ns into Unix
    ns."""
    events = sorted(trace.events, key=lambda e: e[1])
    if not events:
        return []
    trace_id, top_id, _ = trace.span_ids  # made when the trace started (Tracing.start)
    front = [e for e in events if e[0] in _FRONTEND]
    out = _model_spans(trace, trace_id, top_id, offset)
    caller = trace.context[1] if trace.context else None
    out.append(_span(trace_id, top_id, caller, "InferRequest", front, offset,
                     start=events[0][1], end=events[-1][1]))
    return out


class OtlpExporter:
    """A batch span processor with an OTLP/HTTP JSON exporter, on a thread of its own (started
    with the first trace)."""

    def __init__(self, settings: OtelSettings) -> None:
        self.settings = settings
        url = settings.url
        self.url = url if "://" in url else f"http://{url}"
        self._spans: list[dict[str, Any]] = []
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closing = False
        self.dropped = 0
        self.failures = 0
        self.exported = 0

    def add(self, trace: Any) -> None:
        """Queue the spans of a finished trace."""
        spans = spans_of(trace, time.time_ns() - time.monotonic_ns())
        with self._cv:
            if self._closing:
                return
            room = self.settings.bsp_max_queue_size - len(self._spans)
            if len(spans) > room:
                self.dropped += len(spans)
                if self.dropped == len(spans) or self.dropped % 1000 < len(spans):
                    log.warning("OpenTelemetry: the span queue is full (bsp_max_queue_size %d): "
                                "%d span(s) dropped so far", self.settings.bsp_max_queue_size,
                                self.dropped)
                return
            self._spans += spans
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tritonpy-otlp",
                                                daemon=True)
                self._thread.start()
            if len(self._spans) >= self.settings.bsp_max_export_batch_size:
                self._cv.notify()

    def _run(self) -> None:
        delay = self.settings.bsp_schedule_delay / 1000
        batch = self.settings.bsp_max_export_batch_size
        while True:
            with self._cv:
                deadline = time.monotonic() + delay
                while (not self._closing and len(self._spans) < batch
                       and time.monotonic() < deadline):
                    self._cv.wait(max(0.0, deadline - time.monotonic()))
                taken, self._spans = self._spans[:batch], self._spans[batch:]
                done = self._closing and not self._spans
            if taken:
                self._post(taken)
            if done:
                return

    def _post(self, spans: list[dict[str, Any]]) -> None:
        resource = [{"key": k, "value": {"stringValue": v}}
                    for k, v in self.settings.resource_attributes().items()]
        body = json.dumps({"resourceSpans": [{
            "resource": {"attributes": resource},
            "scopeSpans": [{"scope": {"name": "triton-server"}, "spans": spans}]}]},
            separators=(",", ":")).encode()
        request = urllib.request.Request(self.url, data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=10) as resp:
                resp.read()
            self.exported += len(spans)
        except (OSError, urllib.error.URLError) as exc:
            self.failures += 1
            if self.failures == 1 or self.failures % 100 == 0:
                log.warning("OpenTelemetry: cannot export %d span(s) to %s (%d failure(s) so "
                            "far): %s", len(spans), self.url, self.failures, exc)

    def close(self, timeout: float = 5.0) -> None:
        """Send what waits, then stop (the server stops): at most ``timeout`` seconds of it,
        after which what is left goes with the process."""
        with self._cv:
            self._closing = True
            self._cv.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
