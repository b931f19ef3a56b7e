"""Triton's trace extension: settings over HTTP and gRPC (tritonclient), sampling by rate and
count, and the trace files in Triton's layout, for requests through the real frontends."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

import tritonpy
from tritonpy._errors import InvalidArgumentError, UnsupportedError
from tritonpy._trace import Tracing
from tritonpy._cli_settings import _tracing
from tritonpy.cli import build_parser
from tritonpy.frontends import Frontends
from _models import BLS_TRACED_PY, serving_frontends, write_model, write_quadruple

CORE = ["REQUEST_START", "QUEUE_START", "COMPUTE_START", "COMPUTE_INPUT_END",
        "COMPUTE_OUTPUT_START", "COMPUTE_END", "INFER_RESPONSE_COMPLETE", "REQUEST_END"]


def _load(path: Path) -> list[dict]:
    return json.loads(path.read_text())


def _traces(entries: list[dict]) -> dict[int, dict]:
    """Per trace id: its header, its timestamps and its tensors, in the order written."""
    out: dict[int, dict] = {}
    for e in entries:
        t = out.setdefault(e["id"], {"names": [], "ns": [], "tensors": []})
        if "activity" in e:
            t["tensors"].append((e["activity"], e["tensor"]))
        elif "timestamps" in e:
            (stamp,) = e["timestamps"]
            t["names"].append(stamp["name"])
            t["ns"].append(stamp["ns"])
        else:
            t["head"] = e
    return out


@pytest.fixture
def traced(tmp_path: Path) -> Iterator[tuple[tritonpy.Server, Frontends, Path]]:
    write_model(tmp_path / "repo", "double")
    trace_file = tmp_path / "trace.json"
    tracing = Tracing(level="TIMESTAMPS", rate=1, file=str(trace_file))
    with serving_frontends(tmp_path / "repo", tracing=tracing) as (server, fe):
        yield server, fe, trace_file


def _inputs(mod):
    inp = mod.InferInput("IN", [3], "FP32")
    inp.set_data_from_numpy(np.array([1, 2, 3], np.float32))
    return [inp]


def test_http_and_grpc_requests_are_traced_in_tritons_layout(traced) -> None:
    server, fe, trace_file = traced
    http = httpclient.InferenceServerClient(f"127.0.0.1:{fe.http_port}")
    grpcc = grpcclient.InferenceServerClient(f"127.0.0.1:{fe.grpc_port}")
    try:
        http.infer("double", _inputs(httpclient), request_id="h1")
        grpcc.infer("double", _inputs(grpcclient))
        with pytest.raises(InferenceServerException):  # a failed request is traced too
            http.infer("double", [httpclient.InferInput("NOPE", [1], "FP32")
                                  .set_data_from_numpy(np.zeros(1, np.float32))])
    finally:
        http.close()
        grpcc.close()
    # The frontends first, as tritonpy serve stops: a request's trace is finished after its
    # answer is written, so the client may have it before the trace is done.
    fe.stop_in_thread()
    server.stop()  # closes the file: "[" ... "]"
    traces = _traces(_load(trace_file))
    assert sorted(traces) == [1, 2, 3]
    h, g = traces[1], traces[2]
    assert h["head"] == {"id": 1, "model_name": "double", "model_version": 1, "request_id": "h1"}
    assert g["head"] == {"id": 2, "model_name": "double", "model_version": 1}
    assert h["names"] == ["HTTP_RECV_START", "HTTP_RECV_END", *CORE,
                          "HTTP_SEND_START", "HTTP_SEND_END"]
    assert g["names"] == ["GRPC_WAITREAD_START", "GRPC_WAITREAD_END", *CORE,
                          "GRPC_SEND_START", "GRPC_SEND_END"]
    for t in (h, g):
        assert t["ns"] == sorted(t["ns"]) and t["ns"][0] > 0, t
    # The request that failed validation never reached the model: no compute timestamps.
    assert "COMPUTE_START" not in traces[3]["names"]
    assert traces[3]["names"][:2] == ["HTTP_RECV_START", "HTTP_RECV_END"]
    # As Triton's, its trace ends with the error's send (it used to end before it).
    assert traces[3]["names"][-2:] == ["HTTP_SEND_START", "HTTP_SEND_END"]


def test_a_request_the_model_fails_is_traced_to_its_answer(tmp_path: Path) -> None:
    # As Triton 2.51 (measured): the trace of a request whose execute fails ends with the
    # error's send, over HTTP and gRPC; it used to end at REQUEST_END.
    write_model(tmp_path / "repo", "fails", """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        raise pb_utils.TritonModelException("no")
""")
    trace_file = tmp_path / "trace.json"
    tracing = Tracing(level="TIMESTAMPS", rate=1, file=str(trace_file))
    with serving_frontends(tmp_path / "repo", tracing=tracing) as (server, fe):
        http = httpclient.InferenceServerClient(f"127.0.0.1:{fe.http_port}")
        grpcc = grpcclient.InferenceServerClient(f"127.0.0.1:{fe.grpc_port}")
        try:
            for client, mod in ((http, httpclient), (grpcc, grpcclient)):
                with pytest.raises(InferenceServerException, match="no"):
                    client.infer("fails", _inputs(mod))
        finally:
            http.close()
            grpcc.close()
        fe.stop_in_thread()
    traces = _traces(_load(trace_file))
    h, g = traces[1], traces[2]
    assert h["names"][-3:] == ["REQUEST_END", "HTTP_SEND_START", "HTTP_SEND_END"], h
    assert g["names"][-3:] == ["REQUEST_END", "GRPC_SEND_START", "GRPC_SEND_END"], g
    assert "COMPUTE_START" in h["names"] and "COMPUTE_START" in g["names"]


def test_settings_over_http_and_grpc(traced) -> None:
    _, fe, trace_file = traced
    http = httpclient.InferenceServerClient(f"127.0.0.1:{fe.http_port}")
    grpcc = grpcclient.InferenceServerClient(f"127.0.0.1:{fe.grpc_port}")
    try:
        assert http.get_trace_settings() == {
            "trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": "-1",
            "log_frequency": "0", "trace_file": str(trace_file), "trace_mode": "triton"}
        # A model's own settings override the server's; None (HTTP) or an empty value
        # (gRPC) clears one.
        assert http.update_trace_settings("double", {"trace_rate": "5"})["trace_rate"] == "5"
        assert http.get_trace_settings()["trace_rate"] == "1"
        assert http.update_trace_settings("double", {"trace_rate": None})["trace_rate"] == "1"
        got = grpcc.update_trace_settings("double", {"trace_count": "4"}, as_json=True)
        assert got["settings"]["trace_count"]["value"] == ["4"]
        got = grpcc.update_trace_settings("double", {"trace_count": None}, as_json=True)
        assert got["settings"]["trace_count"]["value"] == ["-1"]
        assert http.update_trace_settings(settings={"trace_level": ["OFF"]})["trace_level"] == ["OFF"]
        for bad, words in [
            ({"trace_rate": "abc"}, "Unable to parse 'trace_rate', got: abc"),
            ({"trace_count": "-5"}, "Expecting value >= -1, got:-5"),
            ({"trace_level": ["BOGUS"]}, "expected OFF, TIMESTAMPS or TENSORS, got BOGUS"),
            ({"trace_file": "/tmp/elsewhere.json"}, "can not be updated through network"),
        ]:
            with pytest.raises(InferenceServerException, match=words):
                http.update_trace_settings(settings=bad)
            with pytest.raises(InferenceServerException, match=words):
                grpcc.update_trace_settings(settings=bad)
        # Two values for a one-value setting (tritonclient sends one; a raw stub may not).
        with grpc.insecure_channel(f"127.0.0.1:{fe.grpc_port}") as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            req = service_pb2.TraceSettingRequest()
            req.settings["trace_rate"].value.extend(["3", "4"])
            with pytest.raises(grpc.RpcError) as err:
                stub.TraceSetting(req)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details() == "expect only 1 value for 'trace_rate'"
        with pytest.raises(InferenceServerException, match="Request for unknown model : zzz"):
            http.get_trace_settings("zzz")
        assert http.get_trace_settings()["trace_level"] == ["OFF"]  # nothing bad was applied
        # As Triton: an unknown setting, and trace_mode (set at start only), are ignored and
        # the known settings beside them apply; clearing a server-wide setting brings back
        # the value the server started with.
        got = http.update_trace_settings(settings={"bogus": "1", "trace_rate": "7",
                                                   "trace_mode": "opentelemetry"})
        assert got["trace_rate"] == "7" and got["trace_mode"] == "triton" and "bogus" not in got
        got = grpcc.update_trace_settings(settings={"bogus": "2", "trace_count": "9"},
                                          as_json=True)["settings"]
        assert got["trace_count"]["value"] == ["9"] and "bogus" not in got
        got = http.update_trace_settings(settings={"trace_rate": None, "trace_level": None})
        assert got["trace_rate"] == "1" and got["trace_level"] == ["TIMESTAMPS"]
        got = grpcc.update_trace_settings(settings={"trace_count": None}, as_json=True)
        assert got["settings"]["trace_count"]["value"] == ["-1"]
    finally:
        http.close()
        grpcc.close()


def test_level_tensors_records_inputs_and_outputs(traced) -> None:
    server, fe, trace_file = traced
    http = httpclient.InferenceServerClient(f"127.0.0.1:{fe.http_port}")
    try:
        http.update_trace_settings(settings={"trace_level": ["TENSORS"]})
        http.infer("double", _inputs(httpclient))
        http.update_trace_settings(settings={"trace_level": ["TIMESTAMPS", "TENSORS"]})
        http.infer("double", _inputs(httpclient), request_id="both")
    finally:
        http.close()
    fe.stop_in_thread()  # each trace is finished (see above)
    server.stop()
    traces = _traces(_load(trace_file))
    tensors = [("TENSOR_QUEUE_INPUT", {"name": "IN", "data": "1,2,3", "shape": "3", "dtype": "FP32"}),
               ("TENSOR_BACKEND_OUTPUT", {"name": "OUT", "data": "2,4,6", "shape": "3",
                                          "dtype": "FP32"})]
    # TENSORS alone: the tensors only, as Triton writes them; with TIMESTAMPS, both.
    assert traces[1] == {"names": [], "ns": [], "tensors": tensors}
    assert traces[2]["tensors"] == tensors and traces[2]["head"]["request_id"] == "both"
    assert "COMPUTE_START" in traces[2]["names"]


def test_tensor_values_are_written_as_triton_writes_them() -> None:
    from tritonpy._trace import _tensor
    cases = [
        (np.array([[0.5, -1.25], [1e-7, 3.0]], np.float32), "0.5,-1.25,1e-07,3", "2,2", "FP32"),
        (np.array([b"ab", b'q"'], dtype=np.object_), '"ab","q\\""', "2", "BYTES"),
        (np.array([True, False]), "1,0", "2", "BOOL"),
        (np.arange(3, dtype=np.uint8), "0,1,2", "3", "UINT8"),
    ]
    for array, data, shape, dtype in cases:
        assert _tensor(7, "A", "X", array) == {
            "id": 7, "activity": "A",
            "tensor": {"name": "X", "data": data, "shape": shape, "dtype": dtype}}


def test_rate_count_and_log_frequency(tmp_path: Path) -> None:
    # Every 2nd request, 3 traces in all, written 2 to a file: trace.0 (2), then trace.1 (1)
    # once the count is used up, as Triton 2.51 writes them (measured, QA L0_cmdline_trace).
    base = tmp_path / "trace"
    tracing = Tracing(level=["TIMESTAMPS"], rate=2, count=3, log_frequency=2, file=str(base))
    taken = []
    for i in range(10):
        trace = tracing.start("m")
        if trace is not None:
            trace.queued(1, f"r{i}", 1)
            trace.finish()
            taken.append(i)
    assert taken == [1, 3, 5]
    assert tracing.settings()["trace_count"] == "0"
    assert [t["head"]["request_id"] for t in _traces(_load(Path(f"{base}.0"))).values()] == ["r1", "r3"]
    assert [t["head"]["request_id"] for t in _traces(_load(Path(f"{base}.1"))).values()] == ["r5"]
    tracing.close()
    assert not base.exists() and not Path(f"{base}.2").exists()


def test_a_used_up_count_writes_the_file_out_as_a_part_at_once(tmp_path: Path) -> None:
    # log_frequency 0 and a count: the file is written out as trace.0, complete, with the
    # count's last trace, as Triton 2.51 writes it (it used to stay an unclosed `trace` until
    # the server stopped). The count set again starts a new file.
    base = tmp_path / "trace"
    tracing = Tracing(level=["TIMESTAMPS"], rate=1, count=2, file=str(base))
    for i in range(4):
        trace = tracing.start("m")
        if trace is not None:
            trace.queued(1, f"r{i}", 1)
            trace.finish()
    assert [t["head"]["request_id"] for t in _traces(_load(Path(f"{base}.0"))).values()] == [
        "r0", "r1"]
    assert not base.exists()
    tracing.update({"trace_count": "1"})
    trace = tracing.start("m")
    assert trace is not None
    trace.queued(1, "r9", 1)
    trace.finish()
    assert [t["head"]["request_id"] for t in _traces(_load(Path(f"{base}.1"))).values()] == ["r9"]
    tracing.close()
    assert not base.exists()


def test_a_model_with_settings_of_its_own_counts_its_traces_on_its_own(tmp_path: Path) -> None:
    # As Triton 2.51 (measured): a model with settings of its own takes the server's count as
    # its own; its traces do not use up the server's, which the other models go on with.
    tracing = Tracing(level=["TIMESTAMPS"], rate=1, file=str(tmp_path / "trace"))
    tracing.update({"log_frequency": "34"}, model="own")
    tracing.update({"trace_count": "2"})
    taken = [m for m in ["own"] * 5 + ["other"] * 3 if tracing.start(m) is not None]
    assert taken == ["own", "own", "other", "other"]
    assert tracing.settings()["trace_count"] == "0"
    assert tracing.settings("own")["trace_count"] == "0"
    tracing.update({"trace_count": "1"})  # set again: both count from it
    assert tracing.settings("own")["trace_count"] == "1"
    tracing.close()


def test_a_level_needs_a_file_and_bad_settings_change_nothing() -> None:
    with pytest.raises(InvalidArgumentError, match="trace file name is not given"):
        Tracing(level="TIMESTAMPS")
    tracing = Tracing()
    assert not tracing.active and tracing.start("m") is None
    with pytest.raises(InvalidArgumentError, match="trace file name is not given"):
        tracing.update({"trace_level": ["TIMESTAMPS"]}, "m")
    with pytest.raises(UnsupportedError, match="can not be updated"):
        tracing.update({"trace_file": "/tmp/x"})
    assert tracing.settings("m") == tracing.settings() and tracing.settings()["trace_rate"] == "1000"
    assert tracing.update({"trace_rate": "5"})["trace_rate"] == "5"
    assert tracing.update({"trace_rate": None})["trace_rate"] == "1000"  # the start's value


def test_cli_trace_flags(tmp_path: Path) -> None:
    args = build_parser().parse_args([
        "serve", f"--trace-config=triton,file={tmp_path}/t.json", "--trace-config", "level=TIMESTAMPS",
        "--trace-config", "triton,log-frequency=50", "--trace-rate", "100", "--trace-count", "7"])
    assert _tracing(args).settings() == {
        "trace_level": ["TIMESTAMPS"], "trace_rate": "100", "trace_count": "7",
        "log_frequency": "50", "trace_file": f"{tmp_path}/t.json", "trace_mode": "triton"}
    for flags, words in [(["--trace-config", "level=TIMESTAMPS"], "trace file name is not given"),
                         (["--trace-config", "zipkin,url=x"], "unknown trace mode"),
                         (["--trace-config", "colour=red"], "unknown setting 'colour'")]:
        with pytest.raises(SystemExit, match=words):
            _tracing(build_parser().parse_args(["serve", *flags]))


def test_a_trace_finished_after_close_leaves_the_file_whole(tmp_path: Path) -> None:
    base = tmp_path / "t.json"
    tracing = Tracing(level="TIMESTAMPS", rate=1, file=str(base))
    first, late = tracing.start("m"), tracing.start("m")
    assert first is not None and late is not None
    first.finish()
    tracing.close()
    late.finish()  # e.g. a response sent after the server stopped: dropped, not a new file
    assert [t["head"]["id"] for t in _traces(_load(base)).values()] == [1]


def _ids_in(path: Path) -> list[str]:
    """The request ids of the traces in a trace file, in the order written (a step's
    trace, which has no request id, by its model's name)."""
    return [t["head"].get("request_id") or t["head"]["model_name"]
            for t in _traces(_load(path)).values()]


def _take(tracing: Tracing, model: str, request_id: str) -> Any:
    trace = tracing.start(model)
    assert trace is not None
    trace.queued(1, request_id, 1)
    return trace


def test_updated_settings_hold_their_own_traces(tmp_path: Path) -> None:
    # As Triton 2.51 writes them (QA, measured): an update makes new settings; what the old
    # ones held goes to the file itself, and the new count's last trace makes a part of its
    # own. tritonpy wrote all four to trace.0, and never wrote the file itself.
    base = tmp_path / "trace"
    tracing = Tracing(level="TIMESTAMPS", rate=1, count=5, file=str(base))
    for rid in ("a1", "a2", "a3"):
        _take(tracing, "m", rid).finish()
    tracing.update({"trace_count": "1"})
    for rid in ("a4", "a5"):
        trace = tracing.start("m")
        if trace is not None:
            trace.queued(1, rid, 1)
            trace.finish()
    tracing.close()
    assert _ids_in(base) == ["a1", "a2", "a3"]
    assert _ids_in(Path(f"{base}.0")) == ["a4"]
    assert not Path(f"{base}.1").exists()


def test_a_model_with_settings_of_its_own_holds_its_traces_apart(tmp_path: Path) -> None:
    # As Triton 2.51 (QA, measured): the server's settings and a model's own each count their
    # traces to log_frequency, each trace of an ensemble's steps counting; the parts share
    # the file's numbers. tritonpy wrote a6 and the ensemble's two traces together.
    base = tmp_path / "trace"
    tracing = Tracing(level="TIMESTAMPS", rate=1, file=str(base))
    tracing.update({"log_frequency": "2"})
    tracing.update({"trace_rate": "1"}, model="ens")
    _take(tracing, "m", "a6").finish()
    ens = _take(tracing, "ens", "e1")
    ens.child("add").queued(1, "", 1)
    ens.finish()
    _take(tracing, "m", "a8").finish()
    tracing.close()
    assert _ids_in(Path(f"{base}.0")) == ["add", "e1"]
    assert _ids_in(Path(f"{base}.1")) == ["a6", "a8"]
    assert not base.exists() and not Path(f"{base}.2").exists()


def test_parts_of_one_file_are_numbered_across_log_frequencies(tmp_path: Path) -> None:
    # Each update holds its own traces: what one held at the next update is a part.
    base = tmp_path / "t"
    tracing = Tracing(level="TIMESTAMPS", rate=1, log_frequency=1, file=str(base))
    for frequency in ("1", "2", "2"):
        tracing.update({"log_frequency": frequency})
        trace = tracing.start("m")
        assert trace is not None
        trace.finish()
    tracing.close()
    ids = [[t["head"]["id"] for t in _traces(_load(Path(f"{base}.{n}"))).values()]
           for n in (0, 1, 2)]
    assert ids == [[1], [2], [3]]


def _traced_http_infer(tmp_path: Path, model: str, request_id: str) -> tuple[list, dict]:
    """(OUT, traces) of one HTTP request to ``model`` of ``tmp_path``/repo, every request
    traced at TIMESTAMPS level."""
    trace_file = tmp_path / "trace.json"
    tracing = Tracing(level="TIMESTAMPS", rate=1, file=str(trace_file))
    with serving_frontends(tmp_path / "repo", tracing=tracing) as (server, fe):
        http = httpclient.InferenceServerClient(f"127.0.0.1:{fe.http_port}")
        try:
            out = http.infer(model, _inputs(httpclient), request_id=request_id).as_numpy("OUT")
        finally:
            http.close()
    return out.tolist(), _traces(_load(trace_file))


def test_an_ensembles_steps_are_traced_under_it(tmp_path: Path) -> None:
    # As Triton 2.51 (compared side by side): each step has a trace of its own, with the
    # ensemble's request id and its trace id as parent_id, written with the ensemble's; the
    # steps' traces have no INFER_RESPONSE_COMPLETE.
    write_quadruple(tmp_path / "repo")
    out, traces = _traced_http_infer(tmp_path, "quadruple", "q1")
    assert out == [4, 8, 12]
    assert sorted(traces) == [1, 2, 3]
    assert traces[1]["head"] == {"id": 1, "model_name": "quadruple", "model_version": 1,
                                 "request_id": "q1"}
    assert traces[1]["names"] == ["HTTP_RECV_START", "HTTP_RECV_END", "REQUEST_START",
                                  "QUEUE_START", "INFER_RESPONSE_COMPLETE", "REQUEST_END",
                                  "HTTP_SEND_START", "HTTP_SEND_END"]
    for step in (2, 3):
        assert traces[step]["head"] == {"id": step, "model_name": "double", "model_version": 1,
                                        "request_id": "q1", "parent_id": 1}
        assert traces[step]["names"] == [n for n in CORE if n != "INFER_RESPONSE_COMPLETE"]
    assert traces[2]["ns"][-1] <= traces[3]["ns"][0]  # the second step after the first


def test_a_bls_call_given_request_trace_is_traced_under_it(tmp_path: Path) -> None:
    # As Triton 2.51: InferenceRequest(..., trace=request.trace()) gives the call a trace of
    # its own under the caller's (parent_id; the call's own request id, here none); a call
    # without it is not traced.
    write_model(tmp_path / "repo", "double")
    write_model(tmp_path / "repo", "bls_traced", BLS_TRACED_PY)
    out, traces = _traced_http_infer(tmp_path, "bls_traced", "b1")
    assert out == [2, 4, 6]
    assert sorted(traces) == [1, 2]
    assert traces[1]["head"]["model_name"] == "bls_traced"
    assert traces[2]["head"] == {"id": 2, "model_name": "double", "model_version": 1,
                                 "parent_id": 1}
    assert traces[2]["names"] == [n for n in CORE if n != "INFER_RESPONSE_COMPLETE"]


def test_a_grpc_stream_request_is_traced_with_its_reads_and_sends(traced) -> None:
    # As Triton 2.51 (compared side by side): a ModelStreamInfer request's trace has the
    # GRPC_WAITREAD and GRPC_SEND timestamps too, and ends after its answer is written.
    import queue as queue_mod
    server, fe, trace_file = traced
    grpcc = grpcclient.InferenceServerClient(f"127.0.0.1:{fe.grpc_port}")
    answers: queue_mod.Queue = queue_mod.Queue()
    try:
        grpcc.start_stream(callback=lambda result, error: answers.put((result, error)))
        grpcc.async_stream_infer("double", _inputs(grpcclient), request_id="s1")
        result, error = answers.get(timeout=20)
        assert error is None and result.as_numpy("OUT").tolist() == [2, 4, 6]
        grpcc.stop_stream()
    finally:
        grpcc.close()
    fe.stop_in_thread()
    server.stop()
    traces = _traces(_load(trace_file))
    (only,) = traces.values()
    assert only["head"] == {"id": 1, "model_name": "double", "model_version": 1,
                            "request_id": "s1"}
    assert only["names"] == ["GRPC_WAITREAD_START", "GRPC_WAITREAD_END", *CORE,
                             "GRPC_SEND_START", "GRPC_SEND_END"]
    assert only["ns"] == sorted(only["ns"])


ORDERED_PY = """
import time
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            if x[0, 0] == 1:
                time.sleep(0.6)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)]))
        return out
"""


def test_a_response_preserve_ordering_holds_is_complete_when_released(tmp_path: Path) -> None:
    # As Triton 2.51 (measured; QA L0_batcher's verify_timestamps.py -p): a response held
    # back behind an earlier request's is stamped INFER_RESPONSE_COMPLETE when it is released
    # to the caller, after its REQUEST_END. tritonpy stamped it when the model made it.
    import threading

    from _models import io_config

    write_model(tmp_path / "repo", "ordered", ORDERED_PY, io_config(
        8, dims="[ 1 ]", extra="dynamic_batching { preserve_ordering: true }\n"
                               "instance_group [ { kind: KIND_CPU, count: 2 } ]\n"))
    trace_file = tmp_path / "trace.json"
    tracing = Tracing(level="TIMESTAMPS", rate=1, file=str(trace_file))
    with serving_frontends(tmp_path / "repo", tracing=tracing) as (server, fe):
        http = httpclient.InferenceServerClient(f"127.0.0.1:{fe.http_port}", concurrency=2)
        try:
            def call(v: float) -> Any:
                inp = httpclient.InferInput("IN", [1, 1], "FP32")
                inp.set_data_from_numpy(np.full((1, 1), v, np.float32))
                return http.async_infer("ordered", [inp])
            slow = call(1)
            threading.Event().wait(0.1)  # on the first instance
            fast = call(2)  # on the other, done at once
            slow.get_result(timeout=30), fast.get_result(timeout=30)
        finally:
            http.close()
        fe.stop_in_thread()
        server.stop()  # closes the file
    traces = _traces(_load(trace_file))
    first, second = (dict(zip(traces[i]["names"], traces[i]["ns"])) for i in (1, 2))
    assert second["REQUEST_END"] < first["INFER_RESPONSE_COMPLETE"] - 0.3e9  # made at once
    assert second["INFER_RESPONSE_COMPLETE"] >= first["INFER_RESPONSE_COMPLETE"]  # released
    assert traces[2]["names"].index("REQUEST_END") < \
        traces[2]["names"].index("INFER_RESPONSE_COMPLETE")
