"""Triton's OpenTelemetry trace mode through the real frontends, exported to a local collector.

The collector is a plain HTTP server on loopback that keeps what it is sent; the expected
spans, attributes, events and settings are what Triton 2.51 sends and answers for the same
requests (checked side by side with the anchor server): OTLP/HTTP JSON, three spans per
request (``InferRequest``, the model's, ``compute``), W3C ``traceparent`` propagation that
traces a request whatever the rate.
"""
from __future__ import annotations

import http.server
import json
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

import tritonpy
from tritonpy._otel import OtelSettings, parse_traceparent
from tritonpy._trace import Tracing
from tritonpy._cli_settings import _tracing
from tritonpy.cli import build_parser
from tritonpy.frontends import Frontends
from _models import serving_frontends, wait_until, write_model, write_quadruple

pytestmark = pytest.mark.timeout(60)

PARENT_TRACE, PARENT_SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
TRACEPARENT = f"00-{PARENT_TRACE}-{PARENT_SPAN}-01"


class Collector:
    """An OTLP/HTTP receiver that keeps each export: (path, content type, JSON body)."""

    def __init__(self) -> None:
        self.exports: list[tuple[str, str, dict]] = []
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                owner.exports.append((self.path, self.headers.get("Content-Type", ""),
                                      json.loads(body)))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def spans(self) -> list[dict]:
        return [span for _, _, body in self.exports for rs in body["resourceSpans"]
                for ss in rs["scopeSpans"] for span in ss["spans"]]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def collector() -> Iterator[Collector]:
    c = Collector()
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def traced(tmp_path: Path, collector: Collector) -> Iterator[tuple[tritonpy.Server, Frontends]]:
    write_model(tmp_path / "repo", "double")
    tracing = tritonpy.Tracing(level="TIMESTAMPS", rate=1, mode="opentelemetry",  # public API
                               otel=tritonpy.OtelSettings(url=collector.url,
                                                          resource={"deployment": "test"},
                                                          bsp_schedule_delay=100))
    with serving_frontends(tmp_path / "repo", tracing=tracing) as (server, fe):
        yield server, fe


def _inputs(mod: Any) -> list[Any]:
    inp = mod.InferInput("IN", [3], "FP32")
    inp.set_data_from_numpy(np.array([1, 2, 3], np.float32))
    return [inp]


def _by_trace(spans: list[dict]) -> dict[str, dict[str, dict]]:
    out: dict[str, dict[str, dict]] = {}
    for span in spans:
        out.setdefault(span["traceId"], {})[span["name"]] = span
    return out


def _events(span: dict) -> list[str]:
    return [e["name"] for e in span["events"]]


def test_spans_as_triton_sends_them(traced, collector) -> None:
    _, fe = traced
    http = httpclient.InferenceServerClient(f"127.0.0.1:{fe.http_port}")
    grpcc = grpcclient.InferenceServerClient(f"127.0.0.1:{fe.grpc_port}")
    before = time.time_ns()
    try:
        http.infer("double", _inputs(httpclient), request_id="h1")
        grpcc.infer("double", _inputs(grpcclient), request_id="g1",
                    headers={"traceparent": TRACEPARENT})
    finally:
        http.close()
        grpcc.close()
    wait_until(lambda: len(collector.spans()) >= 6, 10, "six spans at the collector")
    path, content_type, body = collector.exports[0]
    assert path == "/v1/traces" and content_type == "application/json"
    resource = {a["key"]: a["value"]["stringValue"]
                for a in body["resourceSpans"][0]["resource"]["attributes"]}
    assert resource["service.name"] == "triton-inference-server"
    assert resource["deployment"] == "test" and resource["telemetry.sdk.name"] == "tritonpy"
    assert body["resourceSpans"][0]["scopeSpans"][0]["scope"] == {"name": "triton-server"}

    traces = _by_trace(collector.spans())
    assert len(traces) == 2 and PARENT_TRACE in traces
    (h_id,) = set(traces) - {PARENT_TRACE}
    for trace_id, front, request_id in ((h_id, "HTTP", "h1"), (PARENT_TRACE, "GRPC", "g1")):
        spans = traces[trace_id]
        assert set(spans) == {"InferRequest", "double", "compute"}
        top, model, compute = spans["InferRequest"], spans["double"], spans["compute"]
        assert model["parentSpanId"] == top["spanId"]
        assert compute["parentSpanId"] == model["spanId"]
        assert {s["kind"] for s in spans.values()} == {2}
        recv = ["HTTP_RECV_START", "HTTP_RECV_END"] if front == "HTTP" else \
            ["GRPC_WAITREAD_START", "GRPC_WAITREAD_END"]
        assert _events(top) == [*recv, "INFER_RESPONSE_COMPLETE", f"{front}_SEND_START",
                                f"{front}_SEND_END"]
        assert _events(model) == ["REQUEST_START", "QUEUE_START", "REQUEST_END"]
        assert _events(compute) == ["COMPUTE_START", "COMPUTE_INPUT_END",
                                    "COMPUTE_OUTPUT_START", "COMPUTE_END"]
        attrs = {a["key"]: a["value"] for a in model["attributes"]}
        assert attrs["triton.model_name"] == {"stringValue": "double"}
        assert attrs["triton.model_version"] == {"intValue": "1"}
        assert attrs["triton.request_id"] == {"stringValue": request_id}
        assert attrs["triton.trace_parent_id"] == {"intValue": "0"}
        # Wall-clock nanoseconds, as OpenTelemetry's, each span inside its parent.
        for span in spans.values():
            start, end = int(span["startTimeUnixNano"]), int(span["endTimeUnixNano"])
            assert before - 10**9 < start <= end < time.time_ns() + 10**9
            assert all(start <= int(e["timeUnixNano"]) <= end for e in span["events"])
        assert int(top["startTimeUnixNano"]) <= int(model["startTimeUnixNano"])
        assert int(model["endTimeUnixNano"]) <= int(top["endTimeUnixNano"])
    assert "parentSpanId" not in traces[h_id]["InferRequest"]
    assert traces[PARENT_TRACE]["InferRequest"]["parentSpanId"] == PARENT_SPAN


def test_a_propagated_context_is_traced_whatever_the_rate(traced, collector) -> None:
    server, fe = traced
    server.tracing.update({"trace_rate": "1000"})
    http = httpclient.InferenceServerClient(f"127.0.0.1:{fe.http_port}")
    try:
        for _ in range(3):
            http.infer("double", _inputs(httpclient))  # not sampled at 1 in 1000
        http.infer("double", _inputs(httpclient), headers={"traceparent": TRACEPARENT})
        http.infer("double", _inputs(httpclient), headers={"traceparent": "00-garbage"})
    finally:
        http.close()
    wait_until(lambda: len(collector.spans()) >= 3, 10, "three spans at the collector")
    time.sleep(0.3)  # anything else would have come by now
    assert {s["traceId"] for s in collector.spans()} == {PARENT_TRACE}
    assert len(collector.spans()) == 3


def test_settings_show_the_exporter_and_keep_it(traced, collector) -> None:
    _, fe = traced
    http = httpclient.InferenceServerClient(f"127.0.0.1:{fe.http_port}")
    grpcc = grpcclient.InferenceServerClient(f"127.0.0.1:{fe.grpc_port}")
    try:
        expected = {"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": "-1",
                    "trace_mode": "opentelemetry", "url": collector.url,
                    "resource": "deployment=test", "bsp_schedule_delay": "100",
                    "bsp_max_export_batch_size": "512", "bsp_max_queue_size": "2048"}
        assert http.get_trace_settings() == expected
        # As Triton: the mode, the exporter's settings and log_frequency are not changed
        # over the network (left as they are); the rate is.
        after = http.update_trace_settings(settings={
            "trace_mode": "triton", "url": "elsewhere:1", "log_frequency": "3",
            "trace_rate": "4"})
        assert after == dict(expected, trace_rate="4")
        grpc_settings = grpcc.get_trace_settings(as_json=True)["settings"]
        assert grpc_settings["trace_mode"] == {"value": ["opentelemetry"]}
        assert grpc_settings["url"] == {"value": [collector.url]}
    finally:
        http.close()
        grpcc.close()


def test_a_collector_that_is_down_costs_nothing_but_a_warning(tmp_path, caplog) -> None:
    write_model(tmp_path / "repo", "double")
    tracing = Tracing(level="TIMESTAMPS", rate=1, mode="opentelemetry",
                      otel=OtelSettings(url="127.0.0.1:9/v1/traces", bsp_schedule_delay=50))
    with serving_frontends(tmp_path / "repo", tracing=tracing) as (server, fe):
        http = httpclient.InferenceServerClient(f"127.0.0.1:{fe.http_port}")
        try:
            for _ in range(5):
                out = http.infer("double", _inputs(httpclient)).as_numpy("OUT")
                assert out.tolist() == [2, 4, 6]
            wait_until(lambda: "OpenTelemetry: cannot export" in caplog.text, 10,
                       "the export warning")
        finally:
            http.close()
    assert caplog.text.count("OpenTelemetry: cannot export") == 1  # once, not per export


def test_cli_flags_and_environment(monkeypatch) -> None:
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "77")
    args = build_parser().parse_args([
        "serve", "--trace-config", "mode=opentelemetry", "--trace-config", "level=TIMESTAMPS",
        "--trace-config", "rate=1", "--trace-config", "opentelemetry,url=collector:4318/v1/traces",
        "--trace-config", "opentelemetry,resource=service.name=mine",
        "--trace-config", "opentelemetry,resource=zone=a",
        "--trace-config", "opentelemetry,bsp_schedule_delay=250"])
    tracing = _tracing(args)
    assert tracing.settings() == {
        "trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": "-1",
        "trace_mode": "opentelemetry", "url": "collector:4318/v1/traces",
        "resource": "service.name=mine,zone=a", "bsp_schedule_delay": "250",
        "bsp_max_export_batch_size": "512", "bsp_max_queue_size": "77"}
    assert tracing.otel is not None
    assert tracing.otel.resource_attributes()["service.name"] == "mine"
    for bad, message in ((["opentelemetry,bsp_schedule_delay=0"], "expected a positive integer"),
                         (["opentelemetry,resource=nokey"], "expected resource=<key>=<value>"),
                         (["opentelemetry,colour=blue"], "unknown setting 'colour'"),
                         (["mode=zipkin"], "expected triton or opentelemetry")):
        with pytest.raises(SystemExit, match=message):
            _tracing(build_parser().parse_args(
                ["serve", *[x for b in bad for x in ("--trace-config", b)]]))


@pytest.mark.parametrize("value,expected", [
    (TRACEPARENT, (PARENT_TRACE, PARENT_SPAN)),
    (TRACEPARENT.upper(), (PARENT_TRACE, PARENT_SPAN)),
    (f"00-{'0' * 32}-{PARENT_SPAN}-01", None),  # all-zero ids are invalid (W3C)
    ("00-short-b7ad6b7169203331-01", None), ("", None)])
def test_traceparent_parsing(value, expected) -> None:
    assert parse_traceparent(value) == expected


def test_what_waits_is_sent_when_the_server_stops(tmp_path, collector) -> None:
    write_model(tmp_path / "repo", "double")
    tracing = Tracing(level="TIMESTAMPS", rate=1, mode="opentelemetry",
                      otel=OtelSettings(url=collector.url, bsp_schedule_delay=60_000))
    with serving_frontends(tmp_path / "repo", tracing=tracing) as (server, fe):
        http = httpclient.InferenceServerClient(f"127.0.0.1:{fe.http_port}")
        try:
            http.infer("double", _inputs(httpclient))
        finally:
            http.close()
        time.sleep(0.3)
        assert collector.spans() == []  # a minute's schedule: nothing sent yet
    assert [s["name"] for s in collector.spans()] == ["compute", "double", "InferRequest"]


def test_an_ensembles_steps_are_spans_under_its_model_span(tmp_path, collector) -> None:
    # As Triton 2.51: each step's model span (trace_parent_id the ensemble's trace id) and
    # compute span, under the ensemble's model span, which has no compute span of its own.
    write_quadruple(tmp_path / "repo")
    tracing = Tracing(level="TIMESTAMPS", rate=1, mode="opentelemetry",
                      otel=OtelSettings(url=collector.url, bsp_schedule_delay=50))
    with serving_frontends(tmp_path / "repo", tracing=tracing) as (server, fe):
        http = httpclient.InferenceServerClient(f"127.0.0.1:{fe.http_port}")
        try:
            http.infer("quadruple", _inputs(httpclient), request_id="q1")
            wait_until(lambda: len(collector.spans()) >= 6, 10, "six spans")
        finally:
            http.close()
    spans = collector.spans()
    assert sorted(s["name"] for s in spans) == ["InferRequest", "compute", "compute", "double",
                                                "double", "quadruple"]
    by_id = {s["spanId"]: s for s in spans}
    (top,) = [s for s in spans if s["name"] == "InferRequest"]
    (ens,) = [s for s in spans if s["name"] == "quadruple"]
    assert ens["parentSpanId"] == top["spanId"]
    attrs = {a["key"]: list(a["value"].values())[0] for a in ens["attributes"]}
    for step in (s for s in spans if s["name"] == "double"):
        assert step["parentSpanId"] == ens["spanId"]
        step_attrs = {a["key"]: list(a["value"].values())[0] for a in step["attributes"]}
        assert step_attrs["triton.trace_parent_id"] == attrs["triton.trace_id"]
        assert step_attrs["triton.request_id"] == "q1"
    for compute in (s for s in spans if s["name"] == "compute"):
        assert by_id[compute["parentSpanId"]]["name"] == "double"
    assert len({s["traceId"] for s in spans}) == 1


CONTEXT_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array(
            [str(r.trace().get_context()).encode()], dtype=np.object_))]) for r in requests]
"""
CONTEXT_CONFIG = """
backend: "python"
input [ { name: "IN", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "OUT", data_type: TYPE_STRING, dims: [ 1 ] } ]
"""


def test_the_model_reads_its_spans_context(tmp_path, collector) -> None:
    # As Triton 2.51: request.trace().get_context() is the model span's W3C context as JSON
    # (for the model to pass on); an untraced request's is None.
    write_model(tmp_path / "repo", "context", CONTEXT_PY, CONTEXT_CONFIG)
    tracing = Tracing(level="TIMESTAMPS", rate=2, mode="opentelemetry",
                      otel=OtelSettings(url=collector.url, bsp_schedule_delay=50))
    with serving_frontends(tmp_path / "repo", tracing=tracing) as (server, fe):
        http = httpclient.InferenceServerClient(f"127.0.0.1:{fe.http_port}")
        try:
            untraced = http.infer("context", _inputs(httpclient)).as_numpy("OUT")[0]
            traced = http.infer("context", _inputs(httpclient),
                                headers={"traceparent": TRACEPARENT}).as_numpy("OUT")[0]
            wait_until(lambda: len(collector.spans()) >= 3, 10, "three spans")
        finally:
            http.close()
    assert untraced == b"None"  # rate 2: the first request is not sampled
    (model,) = [s for s in collector.spans() if s["name"] == "context"]
    assert json.loads(traced) == {"traceparent": f"00-{PARENT_TRACE}-{model['spanId']}-01"}
