"""Trace and logging settings where tritonpy once differed from Triton 2.51 (compared side by
side): a trace rate of 0 while tracing is on, and OFF beside another level, are refused over
HTTP and gRPC as in Triton (tritonpy took them); a trace count past 32-bit signed is refused,
and an out-of-range number says the range; a logging setting of the wrong type says what it
must be (Triton: 500 with its JSON parser's words over HTTP, "expect boolean for 'log_info'"
over gRPC)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import grpc
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from _models import write_model
from _serve import serve_repo


def _http_error(call: Callable[[], object]) -> tuple[str | None, str]:
    with pytest.raises(InferenceServerException) as e:
        call()
    return e.value.status(), e.value.message()


def _grpc_trace(stub, settings: dict[str, list[str]], model: str = "") -> grpc.RpcError:
    req = service_pb2.TraceSettingRequest(model_name=model)
    for key, values in settings.items():
        req.settings[key].value.extend(values)
    with pytest.raises(grpc.RpcError) as e:
        stub.TraceSetting(req, timeout=30)
    return e.value


def test_trace_settings_refused_as_triton_refuses_them(serve, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "double")
    _, http_port, grpc_port = serve_repo(
        serve, repo, f"--trace-config=triton,file={tmp_path / 'trace.json'}",
        "--trace-config=level=TIMESTAMPS", "--trace-config=rate=1")
    http = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}", network_timeout=30)
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    try:
        before = http.get_trace_settings()
        zero_rate = "Attempting to set invalid trace setting :sample rate must be non-zero"
        assert _http_error(lambda: http.update_trace_settings(
            settings={"trace_rate": "0", "trace_count": "3"})) == ("400", zero_rate)
        assert _http_error(lambda: http.update_trace_settings(
            "double", {"trace_rate": "0"})) == ("400", zero_rate)
        err = _grpc_trace(stub, {"trace_rate": ["0"]})
        assert (err.code(), err.details()) == (grpc.StatusCode.INVALID_ARGUMENT, zero_rate)
        # With tracing off for the model a rate of 0 is taken (Triton too); turning its
        # tracing back on (its own level cleared, the server's TIMESTAMPS) is then refused.
        http.update_trace_settings("double", {"trace_level": ["OFF"]})
        assert http.update_trace_settings("double", {"trace_rate": "0"})["trace_rate"] == "0"
        assert _http_error(lambda: http.update_trace_settings(
            "double", {"trace_level": None})) == ("400", zero_rate)
        http.update_trace_settings("double", {"trace_level": None, "trace_rate": None})

        off_and = "Expect only one trace level 'OFF' is specified"
        for levels in (["OFF", "TIMESTAMPS"], ["TENSORS", "OFF"], ["OFF", "OFF"]):
            assert _http_error(lambda: http.update_trace_settings(
                settings={"trace_level": levels})) == ("400", off_and)
        err = _grpc_trace(stub, {"trace_level": ["OFF", "TIMESTAMPS"]})
        assert (err.code(), err.details()) == (grpc.StatusCode.INVALID_ARGUMENT, off_and)

        assert _http_error(lambda: http.update_trace_settings(
            settings={"trace_count": "2147483648"})) == (
            "400", "Unable to parse 'trace_count', value is out of range [ -1, 2147483647 ], "
                   "got: 2147483648")
        err = _grpc_trace(stub, {"trace_rate": ["4294967296"]})
        assert err.details() == ("Unable to parse 'trace_rate', value is out of range "
                                 "[ 0, 4294967295 ], got: 4294967296")
        assert http.get_trace_settings() == before  # nothing applied
        assert http.get_trace_settings("double") == before
        assert http.update_trace_settings(settings={"trace_count": "2147483647"})[
            "trace_count"] == "2147483647"
    finally:
        http.close()
        channel.close()


def test_log_settings_name_the_expected_type(serve, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "double")
    _, http_port, grpc_port = serve_repo(serve, repo)
    http = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}", network_timeout=30)
    grpcc = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    try:
        assert _http_error(lambda: http.update_log_settings({"log_info": "false"})) == (
            "400", "Unable to parse 'log_info': expect boolean, got \"false\"")
        assert _http_error(lambda: http.update_log_settings({"log_verbose_level": -1})) == (
            "400", "Unable to parse 'log_verbose_level': expect unsigned integer, got -1")
        assert _http_error(lambda: http.update_log_settings({"log_format": 1})) == (
            "400", "Unable to parse 'log_format': expect string, got 1")
        req = service_pb2.LogSettingsRequest()
        req.settings["log_verbose_level"].bool_param = True
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            with pytest.raises(grpc.RpcError) as err:
                service_pb2_grpc.GRPCInferenceServiceStub(channel).LogSettings(req, timeout=30)
        assert (err.value.code(), err.value.details()) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "Unable to parse 'log_verbose_level': expect unsigned integer, got true")
    finally:
        http.close()
        grpcc.close()
