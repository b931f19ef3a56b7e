"""The HTTP and gRPC frontends end to end: the real ``tritonclient`` (sync and aio, HTTP and
gRPC, the gRPC stream, the system shm utilities) against a real ``tritonpy.Server`` with real
Python-backend models, over loopback on ports the OS picks.

One server serves the whole module (stub start-up is the expensive part); every error test
checks that the next request still succeeds.
"""
from __future__ import annotations

import asyncio
import contextlib
import http.client as httplib
import json
import logging
import os
import queue
import secrets
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
import tritonclient.http.aio as httpaio
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException
from tritonclient.utils import shared_memory as shm_utils

import tritonpy
from tritonpy.frontends import Frontends

from _models import wait_for

MAX_INPUT = 4 * 1024 * 1024

IDENTITY_PY = """
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            return [pb_utils.InferenceResponse([pb_utils.Tensor(
                "OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())])
                for r in requests]
    """

MODELS: dict[str, tuple[str, str]] = {
    "identity_fp32": ("""
        backend: "python"
        input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
        output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
        """, """
        import json
        import triton_python_backend_utils as pb_utils

        class TritonPythonModel:
            def execute(self, requests):
                out = []
                for r in requests:
                    x = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
                    params = json.loads(r.parameters())
                    params["echo_id"] = r.request_id()
                    out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x)],
                                                          parameters=params))
                return out
        """),
    "identity_bytes": ("""
        backend: "python"
        input [ { name: "INPUT0", data_type: TYPE_STRING, dims: [ -1 ] } ]
        output [ { name: "OUTPUT0", data_type: TYPE_STRING, dims: [ -1 ] } ]
        """, """
        import triton_python_backend_utils as pb_utils

        class TritonPythonModel:
            def execute(self, requests):
                return [pb_utils.InferenceResponse([pb_utils.Tensor(
                    "OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())])
                    for r in requests]
        """),
    "add_sub": ("""
        backend: "python"
        input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 16 ] },
                { name: "INPUT1", data_type: TYPE_FP32, dims: [ 16 ] } ]
        output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 16 ] },
                 { name: "OUTPUT1", data_type: TYPE_FP32, dims: [ 16 ] } ]
        """, """
        import triton_python_backend_utils as pb_utils

        class TritonPythonModel:
            def execute(self, requests):
                out = []
                for r in requests:
                    a = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
                    b = pb_utils.get_input_tensor_by_name(r, "INPUT1").as_numpy()
                    out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", a + b),
                                                           pb_utils.Tensor("OUTPUT1", a - b)]))
                return out
        """),
    "repeat": ("""
        backend: "python"
        model_transaction_policy { decoupled: true }
        input [ { name: "IN", data_type: TYPE_INT32, dims: [ -1 ] } ]
        output [ { name: "OUT", data_type: TYPE_INT32, dims: [ 1 ] } ]
        """, """
        import numpy as np
        import triton_python_backend_utils as pb_utils

        class TritonPythonModel:
            def execute(self, requests):
                for r in requests:
                    sender = r.get_response_sender()
                    for v in pb_utils.get_input_tensor_by_name(r, "IN").as_numpy():
                        sender.send(pb_utils.InferenceResponse(
                            [pb_utils.Tensor("OUT", np.array([v], np.int32))]))
                    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                return None
        """),
    # IN[0] responses of 64 KiB each: enough to fill a stream's flow-control window.
    "repeat_big": ("""
        backend: "python"
        model_transaction_policy { decoupled: true }
        input [ { name: "IN", data_type: TYPE_INT32, dims: [ 1 ] } ]
        output [ { name: "OUT", data_type: TYPE_UINT8, dims: [ -1 ] } ]
        """, """
        import numpy as np
        import triton_python_backend_utils as pb_utils

        class TritonPythonModel:
            def execute(self, requests):
                for r in requests:
                    sender = r.get_response_sender()
                    for _ in range(int(pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()[0])):
                        if sender.is_cancelled():
                            break
                        sender.send(pb_utils.InferenceResponse(
                            [pb_utils.Tensor("OUT", np.zeros(65536, np.uint8))]))
                    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                return None
        """),
    # Batching identities for Triton's raw binary requests (a batch of 1 is deduced).
    "batched_fp32": ("""
        backend: "python"
        max_batch_size: 8
        input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
        output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
        """, IDENTITY_PY),
    "one_string": ("""
        backend: "python"
        max_batch_size: 8
        input [ { name: "INPUT0", data_type: TYPE_STRING, dims: [ 1 ] } ]
        output [ { name: "OUTPUT0", data_type: TYPE_STRING, dims: [ 1 ] } ]
        """, IDENTITY_PY),
    "raiser": ("""
        backend: "python"
        input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
        output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
        """, """
        class TritonPythonModel:
            def execute(self, requests):
                raise RuntimeError("boom from execute")
        """),
    "identity_uint64": ("""
        backend: "python"
        input [ { name: "INPUT0", data_type: TYPE_UINT64, dims: [ -1 ] } ]
        output [ { name: "OUTPUT0", data_type: TYPE_UINT64, dims: [ -1 ] } ]
        """, IDENTITY_PY),
    "identity_fp16": ("""
        backend: "python"
        input [ { name: "INPUT0", data_type: TYPE_FP16, dims: [ -1 ] } ]
        output [ { name: "OUTPUT0", data_type: TYPE_FP16, dims: [ -1 ] } ]
        """, IDENTITY_PY),
    "identity_int64": ("""
        backend: "python"
        input [ { name: "INPUT0", data_type: TYPE_INT64, dims: [ -1 ] } ]
        output [ { name: "OUTPUT0", data_type: TYPE_INT64, dims: [ -1 ] } ]
        """, IDENTITY_PY),
    # The request's parameters() JSON, as the model sees it.
    "params_seen": ("""
        backend: "python"
        input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
        output [ { name: "OUTPUT0", data_type: TYPE_STRING, dims: [ 1 ] } ]
        """, """
        import numpy as np
        import triton_python_backend_utils as pb_utils

        class TritonPythonModel:
            def execute(self, requests):
                return [pb_utils.InferenceResponse([pb_utils.Tensor(
                    "OUTPUT0", np.array([r.parameters()], dtype=object))]) for r in requests]
        """),
}


def write_repository(root: Path, names: Any = None) -> Path:
    """Write the test models (all, or ``names``) into ``root``."""
    for name, (config, code) in MODELS.items():
        if names is not None and name not in names:
            continue
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(f'name: "{name}"\n' + textwrap.dedent(config))
        (root / name / "1" / "model.py").write_text(textwrap.dedent(code))
    return root


@dataclass
class Served:
    server: tritonpy.Server
    frontends: Frontends
    http: str
    grpc: str
    metrics: str
    prefix: str


def shm_left(prefix: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    repo = write_repository(tmp_path_factory.mktemp("repo"))
    prefix = f"tpyt{secrets.token_hex(4)}_"
    server = tritonpy.Server(str(repo), backend_config={"shm-region-prefix-name": prefix,
                                                         "shm-default-byte-size": str(1 << 20)})
    server.start()
    fe = Frontends(server, http_port=0, grpc_port=0, metrics_port=0, http_address="127.0.0.1",
                   grpc_address="127.0.0.1", metrics_address="127.0.0.1",
                   max_input_size=MAX_INPUT, exit_timeout=5.0)
    try:
        fe.start_in_thread()
        yield Served(server, fe, f"127.0.0.1:{fe.http_port}", f"127.0.0.1:{fe.grpc_port}",
                     f"http://127.0.0.1:{fe.metrics_port}/metrics", prefix)
    finally:
        fe.stop_in_thread()
        server.stop()
    assert shm_left(prefix) == []


@pytest.fixture
def http(served: Served) -> Iterator[httpclient.InferenceServerClient]:
    client = httpclient.InferenceServerClient(served.http)
    yield client
    client.close()


@pytest.fixture
def grpcc(served: Served) -> Iterator[grpcclient.InferenceServerClient]:
    client = grpcclient.InferenceServerClient(served.grpc)
    yield client
    client.close()


def raw_post(served: Served, path: str, body: bytes, headers: dict[str, str] | None = None,
             method: str = "POST") -> tuple[int, dict[str, Any]]:
    """A hand-made HTTP request (for what tritonclient would never send)."""
    conn = httplib.HTTPConnection(*served.http.split(":"))
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, (json.loads(data) if data else {})
    finally:
        conn.close()


def add_sub_inputs(mod: Any, binary: bool = True) -> tuple[list[Any], np.ndarray, np.ndarray]:
    a = np.arange(16, dtype=np.float32)
    b = np.full(16, 2, dtype=np.float32)
    i0 = mod.InferInput("INPUT0", [16], "FP32")
    i1 = mod.InferInput("INPUT1", [16], "FP32")
    if mod is httpclient or mod is httpaio:
        i0.set_data_from_numpy(a, binary_data=binary)
        i1.set_data_from_numpy(b, binary_data=binary)
    else:
        i0.set_data_from_numpy(a)
        i1.set_data_from_numpy(b)
    return [i0, i1], a, b


def assert_still_serving(http: httpclient.InferenceServerClient) -> None:
    inputs, a, b = add_sub_inputs(httpclient)
    assert np.array_equal(http.infer("add_sub", inputs).as_numpy("OUTPUT0"), a + b)


# == HTTP ==========================================================================================

def test_http_health_metadata_config(served: Served, http: httpclient.InferenceServerClient) -> None:
    assert http.is_server_live() and http.is_server_ready()
    for path in ("/v2/health/live", "/v2/health/ready", "/v2/models/add_sub/ready"):
        conn = httplib.HTTPConnection(*served.http.split(":"))
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            # As Triton's: an empty text/plain body.
            assert (resp.status, resp.getheader("Content-Type"), resp.read()) == (
                200, "text/plain", b""), path
        finally:
            conn.close()
    meta = http.get_server_metadata()
    # Triton's name by default: tritonclient's own example checks it (--id changes it).
    assert meta["name"] == "triton" and "binary_tensor_data" in meta["extensions"]
    assert "cuda_shared_memory" not in meta["extensions"]  # no GPU counted: not offered
    assert http.is_model_ready("add_sub") and http.is_model_ready("add_sub", "1")
    assert not http.is_model_ready("no_such_model")
    md = http.get_model_metadata("add_sub", "1")
    assert md["name"] == "add_sub" and [i["name"] for i in md["inputs"]] == ["INPUT0", "INPUT1"]
    assert md["inputs"][0]["datatype"] == "FP32" and md["inputs"][0]["shape"] == [16]
    config = http.get_model_config("repeat")
    assert config["name"] == "repeat" and config["model_transaction_policy"]["decoupled"] is True
    index = {m["name"]: m["state"] for m in http.get_model_repository_index()}
    assert index["add_sub"] == "READY" and set(MODELS) <= set(index)


@pytest.mark.parametrize("binary", [True, False])
def test_http_infer_json_and_binary(http: httpclient.InferenceServerClient, binary: bool) -> None:
    inputs, a, b = add_sub_inputs(httpclient, binary)
    outputs = [httpclient.InferRequestedOutput("OUTPUT1", binary_data=binary)]
    result = http.infer("add_sub", inputs, outputs=outputs, request_id="req-7")
    assert np.array_equal(result.as_numpy("OUTPUT1"), a - b)
    assert result.as_numpy("OUTPUT0") is None  # only what was asked for
    response = result.get_response()
    assert response["id"] == "req-7" and response["model_version"] == "1"
    assert ("binary_data_size" in response["outputs"][0].get("parameters", {})) is binary
    # No outputs named: all of them, binary (the client asks with binary_data_output).
    result = http.infer("add_sub", inputs, model_version="1")
    assert np.array_equal(result.as_numpy("OUTPUT0"), a + b)


def test_http_bytes_tensors(http: httpclient.InferenceServerClient) -> None:
    words = np.array([b"alpha", b"", "é".encode(), b"\xff\xfe raw"], dtype=object)
    for binary in (True, False):
        data = words if binary else words[:3]  # JSON carries text only
        inp = httpclient.InferInput("INPUT0", [len(data)], "BYTES")
        inp.set_data_from_numpy(data, binary_data=binary)
        out = httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)
        got = http.infer("identity_bytes", [inp], outputs=[out]).as_numpy("OUTPUT0")
        # JSON BYTES outputs reach the client as str, as from Triton.
        assert [x.encode() if isinstance(x, str) else x for x in got.tolist()] == data.tolist()
    # Bytes that are not UTF-8 cannot travel in JSON: they come back binary instead.
    inp = httpclient.InferInput("INPUT0", [4], "BYTES")
    inp.set_data_from_numpy(words, binary_data=True)
    res = http.infer("identity_bytes", [inp], outputs=[httpclient.InferRequestedOutput("OUTPUT0", binary_data=False)])
    assert res.as_numpy("OUTPUT0").tolist() == words.tolist()


def test_http_json_outputs_carry_nan_and_infinities_as_triton_writes_them(
        served: Served, http: httpclient.InferenceServerClient) -> None:
    # Triton 2.51 answers 200 application/json with NaN, Infinity and -Infinity (not strict JSON,
    # but Python's json and tritonclient read them); a float past FP32's range is infinite.
    body = (b'{"inputs":[{"name":"INPUT0","shape":[4],"datatype":"FP32",'
            b'"data":[NaN,Infinity,-Infinity,1e40]}]}')
    status, doc = raw_post(served, "/v2/models/identity_fp32/infer", body)
    assert status == 200
    data = doc["outputs"][0]["data"]
    assert np.isnan(data[0]) and data[1:] == [np.inf, -np.inf, np.inf]
    conn = httplib.HTTPConnection(*served.http.split(":"))
    try:
        conn.request("POST", "/v2/models/identity_fp32/infer", body=body)
        resp = conn.getresponse()
        raw = resp.read()
    finally:
        conn.close()
    assert resp.getheader("Content-Type") == "application/json"
    assert b'"data":[NaN,Infinity,-Infinity,Infinity]' in raw
    inp = httpclient.InferInput("INPUT0", [2], "FP32")
    inp.set_data_from_numpy(np.array([np.nan, -np.inf], np.float32), binary_data=True)
    out = httpclient.InferRequestedOutput("OUTPUT0", binary_data=False)
    res = http.infer("identity_fp32", [inp], outputs=[out])
    assert res.get_output("OUTPUT0")["data"][1] == -np.inf
    got = res.as_numpy("OUTPUT0")
    assert got.dtype == np.float32 and np.isnan(got[0]) and got[1] == -np.inf


def test_http_request_and_response_parameters(http: httpclient.InferenceServerClient) -> None:
    inp = httpclient.InferInput("INPUT0", [3], "FP32")
    inp.set_data_from_numpy(np.array([1, 2, 3], np.float32))
    result = http.infer("identity_fp32", [inp], request_id="p1",
                        parameters={"temperature": "hot", "k": 3, "flag": True})
    params = result.get_response()["parameters"]
    assert params == {"temperature": "hot", "k": 3, "flag": True, "echo_id": "p1"}
    with pytest.raises(InferenceServerException, match="reserved"):
        http.infer("identity_fp32", [inp], parameters={"triton_x": 1})
    # As Triton 2.51: a JSON number with a fraction is a double parameter, and so is an
    # integer past int64 (Triton's JSON reader holds it as a double).
    result = http.infer("params_seen", [inp], parameters={"f": 1.5, "two": 2.0, "big": 2**63 + 5})
    seen = json.loads(result.as_numpy("OUTPUT0")[0])
    assert seen == {"f": 1.5, "two": 2.0, "big": 9.223372036854776e18}
    assert isinstance(seen["two"], float) and isinstance(seen["big"], float)


def test_grpc_request_parameter_kinds(served: Served) -> None:
    # Triton 2.51 takes int64, bool, string and double parameters and refuses uint64.
    with grpc.insecure_channel(served.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        req = service_pb2.ModelInferRequest(model_name="params_seen")
        req.inputs.add(name="INPUT0", datatype="FP32", shape=[1])
        req.raw_input_contents.append(np.ones(1, np.float32).tobytes())
        req.parameters["p"].double_param = 2.5
        seen = stub.ModelInfer(req).raw_output_contents[0][4:]  # past the length prefix
        assert json.loads(seen) == {"p": 2.5}
        req.parameters["p"].uint64_param = 7
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelInfer(req)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details() == ("invalid value type for 'p' parameter, expected int64_param, "
                                     "bool_param, or string_param.")


def test_http_compression(http: httpclient.InferenceServerClient) -> None:
    inputs, a, b = add_sub_inputs(httpclient)
    for algo in ("gzip", "deflate"):
        res = http.infer("add_sub", inputs, request_compression_algorithm=algo,
                         response_compression_algorithm=algo)
        assert np.array_equal(res.as_numpy("OUTPUT1"), a - b)


def test_http_unknown_content_encoding_is_refused(served: Served) -> None:
    # Triton 2.51's answer (measured), naming the codings it takes.
    conn = httplib.HTTPConnection(*served.http.split(":"))
    try:
        conn.request("POST", "/v2/models/identity_fp32/infer",
                     body=_infer_body([dict(FP32_4, data=[1, 2, 3, 4])]),
                     headers={"Content-Encoding": "br"})
        resp = conn.getresponse()
        assert (resp.status, resp.read()) == (501, b'{"error":"Unsupported compression type"}')
        assert resp.getheader("Accept-Encoding") == "gzip, deflate"
    finally:
        conn.close()
    status, body = raw_post(served, "/v2/models/identity_fp32/infer",
                            _infer_body([dict(FP32_4, data=[1, 2, 3, 4])]),
                            {"Content-Encoding": "identity"})
    assert status == 200 and body["outputs"][0]["data"] == [1, 2, 3, 4]


def test_http_binary_data_output_is_the_default_of_unlisted_outputs_only(served: Served) -> None:
    # Triton 2.51 (measured): a listed output without binary_data comes back as JSON even
    # when binary_data_output is true; an unlisted one follows binary_data_output.
    doc = json.loads(_infer_body([dict(FP32_4, data=[1, 2, 3, 4])], outputs=[{"name": "OUTPUT0"}]))
    doc["parameters"] = {"binary_data_output": True}
    status, body = raw_post(served, "/v2/models/identity_fp32/infer", json.dumps(doc).encode())
    assert status == 200 and body["outputs"][0]["data"] == [1, 2, 3, 4]
    del doc["outputs"]
    conn = httplib.HTTPConnection(*served.http.split(":"))
    try:
        conn.request("POST", "/v2/models/identity_fp32/infer", body=json.dumps(doc).encode())
        resp = conn.getresponse()
        head_len = int(resp.getheader("Inference-Header-Content-Length"))
        data = resp.read()
        assert resp.status == 200
        assert json.loads(data[:head_len])["outputs"][0]["parameters"] == {"binary_data_size": 16}
        assert np.frombuffer(data[head_len:], np.float32).tolist() == [1, 2, 3, 4]
    finally:
        conn.close()


def _shm_regions(tag: str, sizes: dict[str, int]) -> dict[str, Any]:
    return {n: shm_utils.create_shared_memory_region(f"{tag}_{n}", f"/{tag}_{n}", s)
            for n, s in sizes.items()}


def test_http_system_shared_memory(served: Served, http: httpclient.InferenceServerClient) -> None:
    tag = f"tpyc{secrets.token_hex(4)}"
    handles = _shm_regions(tag, {"in": 128, "out": 128})
    try:
        a = np.arange(16, dtype=np.float32)
        b = np.ones(16, dtype=np.float32)
        shm_utils.set_shared_memory_region(handles["in"], [a, b])
        http.register_system_shared_memory(f"{tag}_in", f"/{tag}_in", 128)
        http.register_system_shared_memory(f"{tag}_out", f"/{tag}_out", 128)
        status = {r["name"]: r for r in http.get_system_shared_memory_status()}
        assert status[f"{tag}_in"]["byte_size"] == 128 and status[f"{tag}_in"]["key"] == f"/{tag}_in"
        i0 = httpclient.InferInput("INPUT0", [16], "FP32")
        i0.set_shared_memory(f"{tag}_in", 64)
        i1 = httpclient.InferInput("INPUT1", [16], "FP32")
        i1.set_shared_memory(f"{tag}_in", 64, offset=64)
        o0 = httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)
        o0.set_shared_memory(f"{tag}_out", 64)
        o1 = httpclient.InferRequestedOutput("OUTPUT1", binary_data=True)
        o1.set_shared_memory(f"{tag}_out", 64, offset=64)
        result = http.infer("add_sub", [i0, i1], outputs=[o0, o1])
        # The data is in the client's region. The response names each output and nothing more,
        # as Triton 2.51's (measured): C++ clients such as perf_analyzer read an output with
        # parameters as binary data and fail ("non-existing object member 'binary_data_size'").
        assert result.get_response()["outputs"] == [
            {"name": "OUTPUT0", "datatype": "FP32", "shape": [16]},
            {"name": "OUTPUT1", "datatype": "FP32", "shape": [16]}]
        got = shm_utils.get_contents_as_numpy(handles["out"], np.float32, [32])
        assert np.array_equal(got[:16], a + b) and np.array_equal(got[16:], a - b)

        # Errors: unknown region, window past the region, output too small, duplicate, reserved.
        bad = httpclient.InferInput("INPUT0", [16], "FP32")
        bad.set_shared_memory("nope", 64)
        with pytest.raises(InferenceServerException, match="Unable to find shared memory region: 'nope'") as e:
            http.infer("add_sub", [bad, i1])
        assert e.value.status() == "404"
        bad.set_shared_memory(f"{tag}_in", 64, offset=100)
        with pytest.raises(InferenceServerException, match="Invalid offset \\+ byte size"):
            http.infer("add_sub", [bad, i1])
        small = httpclient.InferRequestedOutput("OUTPUT0")
        small.set_shared_memory(f"{tag}_out", 32)
        with pytest.raises(InferenceServerException, match="should be at least 64 bytes"):
            http.infer("add_sub", [i0, i1], outputs=[small])
        with pytest.raises(InferenceServerException, match="already in manager"):
            http.register_system_shared_memory(f"{tag}_in", f"/{tag}_in", 128)
        with pytest.raises(InferenceServerException, match="reserved"):
            http.register_system_shared_memory("mine", f"/{served.prefix}x", 8)
        # a key another region holds: Triton 2.51's 500 (measured), whatever the size
        with pytest.raises(InferenceServerException, match=r"^\[500\] Invalid shared memory region: "):
            http.register_system_shared_memory("big", f"/{tag}_in", 4096)
        http.unregister_system_shared_memory(f"{tag}_in")
        assert [r["name"] for r in http.get_system_shared_memory_status()] == [f"{tag}_out"]
        with pytest.raises(InferenceServerException, match="Unable to find"):
            http.infer("add_sub", [i0, i1])
        assert_still_serving(http)
    finally:
        http.unregister_system_shared_memory()
        for h in handles.values():
            shm_utils.destroy_shared_memory_region(h)
    assert http.get_system_shared_memory_status() == []


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_requests_of_one_header_read_shared_memory_afresh_each_time(
        served: Served, protocol: str) -> None:
    """A request whose header was seen before (tritonclient and perf_analyzer send the same one
    each time) is decoded from its kept plan, its inputs in shared memory read again from their
    windows: what the region holds now, and the errors of a region gone or grown too small."""
    mod: Any = httpclient if protocol == "http" else grpcclient
    client = mod.InferenceServerClient(served.http if protocol == "http" else served.grpc)
    tag = f"tpyc{secrets.token_hex(4)}"
    handles = _shm_regions(tag, {"in": 128, "out": 128})
    try:
        client.register_system_shared_memory(f"{tag}_in", f"/{tag}_in", 128)
        client.register_system_shared_memory(f"{tag}_out", f"/{tag}_out", 128)
        i0 = mod.InferInput("INPUT0", [16], "FP32")
        i0.set_shared_memory(f"{tag}_in", 64)
        i1 = mod.InferInput("INPUT1", [16], "FP32")
        i1.set_data_from_numpy(np.ones(16, dtype=np.float32))
        out = mod.InferRequestedOutput("OUTPUT0")
        out.set_shared_memory(f"{tag}_out", 64)
        outputs = [out, mod.InferRequestedOutput("OUTPUT1")]
        for k in range(3):
            a = np.arange(16, dtype=np.float32) * (k + 1)
            shm_utils.set_shared_memory_region(handles["in"], [a])
            result = client.infer("add_sub", [i0, i1], outputs=outputs)
            got = shm_utils.get_contents_as_numpy(handles["out"], np.float32, [16])
            assert np.array_equal(got, a + 1) and np.array_equal(result.as_numpy("OUTPUT1"), a - 1)
        client.unregister_system_shared_memory(f"{tag}_in")
        with pytest.raises(InferenceServerException,
                           match=f"Unable to find shared memory region: '{tag}_in'"):
            client.infer("add_sub", [i0, i1], outputs=outputs)
        client.register_system_shared_memory(f"{tag}_in", f"/{tag}_in", 32)
        with pytest.raises(InferenceServerException, match="Invalid offset \\+ byte size"):
            client.infer("add_sub", [i0, i1], outputs=outputs)
    finally:
        client.unregister_system_shared_memory()
        client.close()
        for h in handles.values():
            shm_utils.destroy_shared_memory_region(h)


def test_http_cuda_shm_is_unsupported_and_tracing_off(served: Served,
                                                     http: httpclient.InferenceServerClient) -> None:
    assert http.get_cuda_shared_memory_status() == []
    with pytest.raises(InferenceServerException, match="GPUs not supported"):
        http.register_cuda_shared_memory("c", b"\0" * 64, 0, 64)
    http.unregister_cuda_shared_memory()
    # Tracing is off unless the server was started with a level and a file (Triton's defaults).
    status, body = raw_post(served, "/v2/trace/setting", b"", method="GET")
    assert status == 200 and body == {"trace_level": ["OFF"], "trace_rate": "1000",
                                      "trace_count": "-1", "log_frequency": "0",
                                      "trace_file": "", "trace_mode": "triton"}
    # A named repository: Triton 2.51 answers the index and refuses load/unload.
    status, index = raw_post(served, "/v2/repository/other/index", b"")
    assert status == 200 and {"name": "add_sub", "version": "1", "state": "READY"} in index
    status, body = raw_post(served, "/v2/repository/other/models/add_sub/unload", b"")
    assert status == 501 and "repository_name" in body["error"]


def _infer_body(inputs: list[dict[str, Any]], outputs: Any = None) -> bytes:
    doc: dict[str, Any] = {"inputs": inputs}
    if outputs is not None:
        doc["outputs"] = outputs
    return json.dumps(doc).encode()


FP32_4 = {"name": "INPUT0", "datatype": "FP32", "shape": [4]}


@pytest.mark.parametrize("path, body, headers, status, message", [
    ("/v2/models/identity_fp32/infer", b"{not json", {}, 400, "failed to parse the request JSON"),
    ("/v2/models/identity_fp32/infer", b"[1, 2]", {}, 400, "expected a JSON object"),
    ("/v2/models/identity_fp32/infer", b'{"inputs": 3}', {}, 400, "Unable to parse 'inputs'"),
    ("/v2/models/identity_fp32/infer", _infer_body([dict(FP32_4, parameters={"binary_data_size": 16})]),
     {"Inference-Header-Content-Length": "9999"}, 400, "inference header size should be in range"),
    ("/v2/models/identity_fp32/infer", _infer_body([dict(FP32_4, parameters={"binary_data_size": 16})]),
     {"Inference-Header-Content-Length": "abc"}, 400, "Unable to parse Inference-Header-Content-Length"),
    ("/v2/models/identity_fp32/infer", b"BINARY", {}, 400, "failed to parse the request JSON"),
    # (QA) Binary tensors sent without Inference-Header-Content-Length, read as Triton 2.51
    # reads them (measured): a NUL byte after the JSON ends it, and the input is found short;
    # any other byte is refused there. Both were "Invalid encoding in string".
    ("/v2/models/identity_fp32/infer",
     _infer_body([dict(FP32_4, parameters={"binary_data_size": 16})]) + b"\0" * 16, {}, 400,
     "unexpected size for input 'INPUT0', expecting 16 additional bytes for model "
     "'identity_fp32'"),
    ("/v2/models/identity_fp32/infer",
     _infer_body([dict(FP32_4, parameters={"binary_data_size": 16})]) + b"\x80" * 16, {}, 400,
     "failed to parse the request JSON buffer: The document root must not be followed by "
     f"other values. at {len(_infer_body([dict(FP32_4, parameters={'binary_data_size': 16})]))}"),
    ("/v2/models/identity_fp32/infer", b'{"inputs": []} {"x": 1}', {}, 400,
     "The document root must not be followed by other values. at 15"),
    ("/v2/models/identity_fp32/infer", b'{"id": "\xff"} tail', {}, 400,
     "failed to parse the request JSON buffer: Invalid encoding in string. at 8"),
    ("/v2/models/identity_fp32/infer", _infer_body([dict(FP32_4)]), {}, 400, "no field is set"),
    ("/v2/models/identity_fp32/infer", _infer_body([dict(FP32_4, data=[1, 2, 3, 4],
                                                         parameters={"binary_data_size": 16})]),
     {}, 400, "But set 'data' 'binary_data_size'"),
    ("/v2/models/identity_fp32/infer", _infer_body([dict(FP32_4, data=[1, 2, 3])]), {}, 400,
     "Shape does not match"),
    ("/v2/models/identity_fp32/infer", _infer_body([dict(FP32_4, data=["a", "b", "c", "d"])]), {},
     400, "expected FP32 values"),
    ("/v2/models/identity_fp32/infer", _infer_body([dict(FP32_4, datatype="FLOAT", data=[1, 2, 3, 4])]),
     {}, 400, "invalid datatype 'FLOAT'"),
    ("/v2/models/identity_fp32/infer", _infer_body([dict(FP32_4, datatype="INT32", data=[1, 2, 3, 4])]),
     {}, 400, "INPUT0"),
    ("/v2/models/identity_fp32/infer", _infer_body([dict(FP32_4, name="WRONG", data=[1, 2, 3, 4])]),
     {}, 400, "WRONG"),
    ("/v2/models/identity_fp32/infer", _infer_body([dict(FP32_4, data=[1, 2, 3, 4])],
                                                   [{"name": "NOPE"}]), {}, 400, "NOPE"),
    ("/v2/models/identity_fp32/infer", _infer_body([dict(FP32_4, data=[1, 2, 3, 4])],
                                                   [{"name": "OUTPUT0", "parameters": {"classification": -2}}]),
     {}, 400, "the 'classification' parameter must be a non-negative integer"),
    ("/v2/models/no_such_model/infer", _infer_body([dict(FP32_4, data=[1, 2, 3, 4])]), {}, 404,
     "unknown model"),
    ("/v2/models/identity_fp32/versions/x/infer", b"{}", {}, 404, "Not Found"),
    ("/v2/models/repeat/infer", _infer_body([{"name": "IN", "datatype": "INT32", "shape": [1], "data": [1]}]),
     {}, 501, "decoupled transaction policy"),  # as Triton 2.51
    ("/v2/models/raiser/infer", _infer_body([dict(FP32_4, data=[1, 2, 3, 4])]), {}, 500,
     "boom from execute"),
    ("/v2/models/identity_fp32/infer",
     _infer_body([dict(FP32_4, shape=[1] * 70, data=[1])]), {}, 400,
     "input 'INPUT0' has 70 dimensions; tensors have at most"),
    ("/v2/nothing/here", b"", {}, 404, "Not Found"),
    ("/v2/health/live", b"", {}, 405, "Method Not Allowed"),
    ("/v2/models/add_sub/config", b"", {}, 405, "Method Not Allowed"),
    ("/v2/systemsharedmemory/region/r/register", b'{"byte_size": 8}', {}, 400, "no 'key' field"),
    ("/v2/repository/index", b'{"ready": "yes"}', {}, 400, "Unable to parse 'ready'"),
    ("/v2/logging", b'{"log_info": 3}', {}, 400, "Unable to parse 'log_info'"),
])
def test_http_bad_requests(served: Served, http: httpclient.InferenceServerClient, path: str,
                           body: bytes, headers: dict[str, str], status: int, message: str,
                           caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR)
    got_status, got = raw_post(served, path, body, headers)
    assert got_status == status, got
    assert message in got["error"]
    assert_still_serving(http)
    # The client's mistake is answered, not logged as the server's failure; a model's failure
    # (500) is logged too, as Triton's stub logs it.
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    if status == 500:
        assert len(said) == 1 and "Failed to process the request(s) for model 'raiser_0'" \
            in said[0] and message in said[0], said
    else:
        assert said == []


def test_http_path_escapes_are_decoded_after_routing(served: Served) -> None:
    # An escaped slash is part of a name, never a separator (it used to route
    # ".../identity_fp32%2Fconfig" to the model's config); an escape in a name is decoded.
    status, doc = raw_post(served, "/v2/models/identity_fp32%2Fconfig", b"", method="GET")
    assert status == 404 and "unknown model: 'identity_fp32/config'" in doc["error"], doc
    status, _ = raw_post(served, "/v2/models/identity%5Ffp32/ready", b"", method="GET")
    assert status == 200
    status, doc = raw_post(served, "/v2/models/identity%5Ffp32/config", b"", method="GET")
    assert status == 200 and doc["name"] == "identity_fp32"
    # Versions are numbers as sent (Triton's routing): an escaped digit is no version.
    status, _ = raw_post(served, "/v2/models/identity_fp32/versions/%31/ready", b"", method="GET")
    assert status == 404
    # The absolute form of a target, which HTTP/1.1 servers must take.
    for target in ("http://localhost/v2/health/live", "HTTP://x:1/v2/models/identity_fp32/ready"):
        status, _ = raw_post(served, target, b"", method="GET")
        assert status == 200, target
    status, _ = raw_post(served, "ftp://x/v2/health/live", b"", method="GET")
    assert status == 404


def test_http_binary_framing_errors(served: Served, http: httpclient.InferenceServerClient) -> None:
    header = _infer_body([dict(FP32_4, parameters={"binary_data_size": 16})])
    hdr = {"Inference-Header-Content-Length": str(len(header))}
    status, body = raw_post(served, "/v2/models/identity_fp32/infer", header + b"\0" * 8, hdr)
    assert status == 400 and "expecting 8 additional bytes" in body["error"]
    status, body = raw_post(served, "/v2/models/identity_fp32/infer", header + b"\0" * 20, hdr)
    assert status == 400 and "unexpected additional input data" in body["error"]
    header = _infer_body([dict(FP32_4, parameters={"binary_data_size": 12})])
    hdr = {"Inference-Header-Content-Length": str(len(header))}
    status, body = raw_post(served, "/v2/models/identity_fp32/infer", header + b"\0" * 12, hdr)
    assert (status, body["error"]) == (400, "[request id: <id_unknown>] input byte size mismatch "
                                            "for input 'INPUT0' for model 'identity_fp32'. "
                                            "Expected 16, got 12")
    # A BYTES element whose length runs past the tensor's end, in Triton's words.
    cut = (4).to_bytes(4, "little") + b"ab"
    header = _infer_body([{"name": "INPUT0", "datatype": "BYTES", "shape": [1],
                           "parameters": {"binary_data_size": len(cut)}}])
    status, body = raw_post(served, "/v2/models/identity_bytes/infer", header + cut,
                            {"Inference-Header-Content-Length": str(len(header))})
    incomplete = ("incomplete string data for inference input 'INPUT0', expecting string of "
                  "length 4 but only 2 bytes available")
    assert (status, body["error"]) == (400, incomplete)
    with grpc.insecure_channel(served.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        req = service_pb2.ModelInferRequest(model_name="identity_bytes", id="g")
        req.inputs.add(name="INPUT0", datatype="BYTES", shape=[1])
        req.raw_input_contents.append(cut)
        with pytest.raises(grpc.RpcError) as err:
            stub.ModelInfer(req)
        assert (err.value.code(), err.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, incomplete)
        req = service_pb2.ModelInferRequest(model_name="identity_fp32", id="g")
        req.inputs.add(name="INPUT0", datatype="FP32", shape=[2])
        req.raw_input_contents.append(b"\0" * 4)
        with pytest.raises(grpc.RpcError) as err:
            stub.ModelInfer(req)
        assert err.value.details() == ("[request id: g] input byte size mismatch for input "
                                       "'INPUT0' for model 'identity_fp32'. Expected 8, got 4")
    # Raw binary request (header length 0): the whole body is the model's only input.
    raw = np.arange(4, dtype=np.float32).tobytes()
    conn = http_conn(served)
    conn.request("POST", "/v2/models/identity_fp32/infer", body=raw,
                 headers={"Inference-Header-Content-Length": "0"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    hlen = int(resp.getheader("Inference-Header-Content-Length"))
    assert resp.status == 200 and data[hlen:] == raw
    assert_still_serving(http)


def test_a_request_header_seen_before_decodes_each_body_anew(served: Served) -> None:
    """A header seen before is decoded once and kept (a client sends the same one for each
    request of a shape): each body still gets its own data back, and a body that does not fit
    the header gets the errors a first decode gives."""
    header = _infer_body([dict(FP32_4, parameters={"binary_data_size": 16})],
                         [{"name": "OUTPUT0", "parameters": {"binary_data": True}}])
    hdr = {"Inference-Header-Content-Length": str(len(header))}
    path = "/v2/models/identity_fp32/infer"

    def post(body: bytes) -> tuple[int, bytes]:
        conn = http_conn(served)
        try:
            conn.request("POST", path, body=header + body, headers=hdr)
            resp = conn.getresponse()
            data = resp.read()
            hlen = resp.getheader("Inference-Header-Content-Length")
            return resp.status, data[int(hlen):] if hlen is not None else data
        finally:
            conn.close()

    for i in range(3):
        data = np.arange(4, dtype=np.float32) + 10 * i
        assert post(data.tobytes()) == (200, data.tobytes())
    status, body = raw_post(served, path, header + b"\0" * 8, hdr)
    assert status == 400 and "expecting 8 additional bytes for model 'identity_fp32'" in body["error"]
    status, body = raw_post(served, path, header + b"\0" * 20, hdr)
    assert (status, body["error"]) == (400, "unexpected additional input data for model 'identity_fp32'")
    assert post(b"\1" * 16) == (200, b"\1" * 16)
    client = httpclient.InferenceServerClient(served.http)
    try:
        # (A model that answers without parameters: their answers' headers are kept too.)
        inp = httpclient.InferInput("INPUT0", [4], "INT64")
        for rid in ("a", "b", ""):
            inp.set_data_from_numpy(np.full(4, len(rid), np.int64))
            result = client.infer("identity_int64", [inp], request_id=rid,
                                  outputs=[httpclient.InferRequestedOutput("OUTPUT0")])
            assert result.get_response().get("id", "") == rid
            assert result.as_numpy("OUTPUT0").tolist() == [len(rid)] * 4
    finally:
        client.close()
    # BYTES: each body's elements are its own, and a cut one is still refused.
    header = _infer_body([{"name": "INPUT0", "datatype": "BYTES", "shape": [1],
                           "parameters": {"binary_data_size": 6}}],
                         [{"name": "OUTPUT0", "parameters": {"binary_data": True}}])
    hdr = {"Inference-Header-Content-Length": str(len(header))}
    path = "/v2/models/identity_bytes/infer"
    for word in (b"ab", b"cd"):
        element = (2).to_bytes(4, "little") + word
        assert post(element) == (200, element)
    status, body = raw_post(served, path, header + (4).to_bytes(4, "little") + b"ab", hdr)
    assert (status, body["error"]) == (400, "incomplete string data for inference input 'INPUT0', "
                                            "expecting string of length 4 but only 2 bytes available")
    # gRPC: the same, with the raw contents; each answer carries its own request's id.
    with grpc.insecure_channel(served.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)

        def request(raw: list[bytes], rid: str = "g") -> Any:
            req = service_pb2.ModelInferRequest(model_name="identity_int64", id=rid)
            req.inputs.add(name="INPUT0", datatype="INT64", shape=[2])
            req.outputs.add(name="OUTPUT0")
            req.raw_input_contents.extend(raw)
            return req

        for i in range(3):
            data = np.array([i, -i], np.int64).tobytes()
            resp = stub.ModelInfer(request([data], f"r{i}"))
            assert (resp.id, resp.model_name, resp.model_version) == (f"r{i}", "identity_int64", "1")
            assert list(resp.outputs[0].shape) == [2] and resp.raw_output_contents == [data]
        with pytest.raises(grpc.RpcError) as err:
            stub.ModelInfer(request([b"\0" * 4]))
        assert err.value.details() == ("[request id: g] input byte size mismatch for input "
                                       "'INPUT0' for model 'identity_int64'. Expected 16, got 4")
        with pytest.raises(grpc.RpcError) as err:
            stub.ModelInfer(request([b"\0" * 16, b"\0" * 16]))
        assert err.value.details() == ("unexpected number of raw_input_contents for model "
                                       "'identity_int64': 2 given, 1 inputs use them")
        assert stub.ModelInfer(request([b"\2" * 16])).raw_output_contents == [b"\2" * 16]


def test_a_bytes_input_is_checked_against_the_model_before_its_elements(served: Served) -> None:
    """As in Triton, a BYTES input sent to a model that expects another datatype is refused for
    its datatype before its elements are read: a cut element in it does not matter. (A large
    one is not decoded at all; a bad request with millions of elements costs nothing.)"""
    cut = (4).to_bytes(4, "little") + b"ab"
    header = _infer_body([{"name": "INPUT0", "datatype": "BYTES", "shape": [1],
                           "parameters": {"binary_data_size": len(cut)}}])
    status, body = raw_post(served, "/v2/models/identity_fp32/infer", header + cut,
                            {"Inference-Header-Content-Length": str(len(header))})
    wrong = ("inference input 'INPUT0' data-type is 'BYTES', but model 'identity_fp32' "
             "expects 'FP32'")
    assert (status, body["error"]) == (400, "[request id: <id_unknown>] " + wrong)
    with grpc.insecure_channel(served.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        req = service_pb2.ModelInferRequest(model_name="identity_fp32", id="g")
        req.inputs.add(name="INPUT0", datatype="BYTES", shape=[1])
        req.raw_input_contents.append(cut)
        with pytest.raises(grpc.RpcError) as err:
            stub.ModelInfer(req)
        assert (err.value.code(), err.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT,
                                                           "[request id: g] " + wrong)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_large_bytes_tensors_round_trip(served: Served, protocol: str) -> None:
    """A BYTES input of over a MiB and hundreds of thousands of elements of mixed lengths (the
    host decodes and encodes it off its event loop, in chunks) arrives whole and in order; twice,
    the second time decoded with the plan its header made (over gRPC, from views of the
    message's own buffer)."""
    words = np.array([b"w" * (i % 7) + bytes([i % 251]) for i in range(300_000)], dtype=object)
    mod: Any = httpclient if protocol == "http" else grpcclient
    client = mod.InferenceServerClient(served.http if protocol == "http" else served.grpc)
    try:
        inp = mod.InferInput("INPUT0", [len(words)], "BYTES")
        inp.set_data_from_numpy(words)
        got = [client.infer("identity_bytes", [inp]).as_numpy("OUTPUT0") for _ in range(2)]
    finally:
        client.close()
    assert got[0].tolist() == words.tolist() and got[1].tolist() == words.tolist()


def raw_binary(served: Served, model: str, body: bytes) -> tuple[int, dict[str, Any], bytes]:
    """A raw binary request (header length 0): (status, response JSON header, tensor bytes)."""
    conn = http_conn(served)
    try:
        conn.request("POST", f"/v2/models/{model}/infer", body=body,
                     headers={"Inference-Header-Content-Length": "0"})
        resp = conn.getresponse()
        data = resp.read()
    finally:
        conn.close()
    hlen = int(resp.getheader("Inference-Header-Content-Length") or len(data))
    return resp.status, json.loads(data[:hlen]), data[hlen:]


@pytest.mark.parametrize("body, words", [
    # Triton 2.51's words for each, measured side by side (its JSON parser's; QA L0_http's
    # http_request_many_chunks.py looks for "Invalid value. at 0"). tritonpy said Python's
    # ("Expecting value: line 1 column 1 (char 0)"). Triton answers 500, tritonpy 400.
    (b"  ", "The document is empty. at 2"),
    (b"AAAA", "Invalid value. at 0"),
    (b'{"a" 1}', "Missing a colon after a name of object member. at 5"),
    (b'{"a": 1 "b": 2}', "Missing a comma or '}' after an object member. at 8"),
    (b"[1 2]", "Missing a comma or ']' after an array element. at 3"),
    (b'{"a": [1, 2 3]}', "Missing a comma or ']' after an array element. at 12"),
    (b'{"a": "x', "Missing a closing quotation mark in string. at 8"),
    (b'{"a": "\\q"}', "Invalid escape character in string. at 7"),
    (b"{} x", "The document root must not be followed by other values. at 3"),
    (b"{x: 1}", "Missing a name for object member. at 1"),
    (b'{"a": "\x01"}', "Invalid escape character in string. at 7"),
    (b'{"a": "\\u12G4"}', "Incorrect hex digit after \\u escape in string. at 7"),
])
def test_a_body_that_is_no_json_is_refused_in_tritons_words(served: Served, body: bytes,
                                                            words: str) -> None:
    assert raw_post(served, "/v2/repository/index", body) == (
        400, {"error": f"failed to parse the request JSON buffer: {words}"})


def test_an_unload_outside_explicit_mode_is_refused_before_its_body_is_read(
        served: Served) -> None:
    # As Triton 2.51 (measured; QA L0_http): the mode first (a load's body is read first).
    assert raw_post(served, "/v2/repository/models/add_sub/unload", b"AAAA") == (
        503, {"error": "explicit model load / unload is not allowed if polling is enabled"})
    assert raw_post(served, "/v2/repository/models/add_sub/load", b"AAAA") == (
        400, {"error": "failed to parse the request JSON buffer: Invalid value. at 0"})


def test_http_raw_binary_requests(served: Served, http: httpclient.InferenceServerClient) -> None:
    # As Triton 2.51: a batching model gets a batch of 1, its variable dimension deduced.
    raw = np.arange(8, dtype=np.float32).tobytes()
    status, header, data = raw_binary(served, "batched_fp32", raw)
    assert (status, header["outputs"][0]["shape"], data) == (200, [1, 8], raw)
    # A BYTES input of shape [1] takes the whole body as its one element.
    status, header, data = raw_binary(served, "one_string", b"427")
    assert (status, header["outputs"][0]["shape"], data) == (200, [1, 1], b"\x03\x00\x00\x00427")
    for model, message in [  # Triton 2.51's words, its "[request id: ...] " prefix included
        ("identity_bytes", "[request id: <id_unknown>] For BYTE datatype raw input 'INPUT0', the "
                           "model must have input shape [1]"),
        ("add_sub", "[request id: <id_unknown>] Raw request must only have 1 input (found 1) to "
                    "be deduced but got 2 inputs in 'add_sub' model configuration"),
    ]:
        status, header, _ = raw_binary(served, model, b"\0" * 64)
        assert (status, header["error"]) == (400, message)
    assert_still_serving(http)


@pytest.mark.parametrize("inp, message", [
    # Checks of later Triton versions (2.51 answers 500, or runs the request).
    (dict(FP32_4, shape=[2**4, 2**60 + 2], data=[1.0]),
     "causes total element count to exceed maximum size of 9223372036854775807"),
    (dict(FP32_4, shape=[2**2, 2**60 + 2], data=[1.0]), "byte size overflow for input 'INPUT0'"),
    (dict(FP32_4, shape=[1, 1], data=json.loads("[" * 120 + "1.0" + "]" * 120)),
     "JSON nesting depth exceeds maximum allowed limit (100)"),
    (dict(name="INPUT0", datatype="BYTES", shape=[1, 1], data=json.loads("[" * 120 + '"x"' + "]" * 120)),
     "JSON nesting depth exceeds maximum allowed limit (100)"),
])
def test_http_json_tensor_limits(served: Served, http: httpclient.InferenceServerClient,
                                 inp: dict[str, Any], message: str) -> None:
    model = "identity_bytes" if inp["datatype"] == "BYTES" else "identity_fp32"
    status, body = raw_post(served, f"/v2/models/{model}/infer", _infer_body([inp]))
    assert status == 400 and message in body["error"]
    # Deep but within the limit (and past numpy's own dimension limit): served.
    deep = json.loads("[" * 70 + "1.5" + "]" * 70)
    status, body = raw_post(served, "/v2/models/identity_fp32/infer",
                            _infer_body([dict(FP32_4, shape=[1], data=deep)]))
    assert status == 200 and body["outputs"][0]["data"] == [1.5]
    assert_still_serving(http)


@pytest.mark.parametrize("datatype, values", [
    ("UINT64", [1, 18446744073709551615]),  # below and above 2**63: numpy would make floats
    ("UINT64", [2**63, 0, 2**63 + 1]),
    ("INT64", [-(2**63), 2**63 - 1]),
    ("INT64", [-1, 9007199254740993]),  # past a double's exact integers
])
def test_http_json_64_bit_integers_are_exact(served: Served, datatype: str, values: list[int]) -> None:
    inp = {"name": "INPUT0", "datatype": datatype, "shape": [len(values)], "data": values}
    status, body = raw_post(served, f"/v2/models/identity_{datatype.lower()}/infer", _infer_body([inp]))
    assert status == 200, body
    assert body["outputs"][0]["data"] == values


@pytest.mark.parametrize("datatype, values, expected", [
    # Triton 2.51 (measured): FP32 [1e40, -1e40] runs as [inf, -inf]; it refuses FP16 JSON.
    ("FP32", [1e40, -1e40, 3.5e38, 1e-50, 2.5], [np.inf, -np.inf, np.inf, 0.0, 2.5]),
    ("FP16", [1e6, -70000, 1.5], [np.inf, -np.inf, 1.5]),
])
def test_http_json_floats_past_their_range_are_infinite(served: Served, datatype: str,
                                                        values: list[float],
                                                        expected: list[float]) -> None:
    # Warnings are errors in this run: numpy's "overflow encountered in cast" (which went to
    # the server's stderr) would fail the request.
    inp = {"name": "INPUT0", "datatype": datatype, "shape": [len(values)], "data": values}
    conn = httplib.HTTPConnection(*served.http.split(":"))
    try:
        conn.request("POST", f"/v2/models/identity_{datatype.lower()}/infer", _infer_body([inp]))
        resp = conn.getresponse()
        data = resp.read()
    finally:
        conn.close()
    assert resp.status == 200, data
    if datatype == "FP16":  # FP16 goes out as binary
        size = int(resp.getheader("Inference-Header-Content-Length"))
        got = np.frombuffer(data[size:], dtype=np.float16).tolist()
    else:  # infinities in JSON, as Triton writes them
        got = json.loads(data)["outputs"][0]["data"]
    assert got == expected


def test_an_output_asked_for_twice_comes_back_once_as_its_first_entry_says(
        served: Served, http: httpclient.InferenceServerClient,
        grpcc: grpcclient.InferenceServerClient) -> None:
    # Triton 2.51 (measured): a name repeated in the requested outputs is asked for once, with
    # the settings of its first entry (here: JSON, then binary data).
    status, body = raw_post(served, "/v2/models/identity_fp32/infer", _infer_body(
        [dict(FP32_4, data=[1, 2, 3, 4])], outputs=[
            {"name": "OUTPUT0", "parameters": {"binary_data": False}},
            {"name": "OUTPUT0", "parameters": {"binary_data": True}}]))
    assert status == 200, body
    assert [(o["name"], o["data"]) for o in body["outputs"]] == [("OUTPUT0", [1, 2, 3, 4])]
    inp = grpcclient.InferInput("INPUT0", [4], "FP32")
    inp.set_data_from_numpy(np.arange(4, dtype=np.float32))
    outs = [grpcclient.InferRequestedOutput("OUTPUT0"), grpcclient.InferRequestedOutput("OUTPUT0")]
    result = grpcc.infer("identity_fp32", [inp], outputs=outs)
    assert [o.name for o in result.get_response().outputs] == ["OUTPUT0"]
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.arange(4, dtype=np.float32))
    assert_still_serving(http)


def test_an_input_named_twice_is_refused(served: Served, http: httpclient.InferenceServerClient,
                                         grpcc: grpcclient.InferenceServerClient) -> None:
    # Triton 2.51's words, with its core's request prefix.
    message = "[request id: <id_unknown>] input 'INPUT0' already exists in request"
    status, body = raw_post(served, "/v2/models/identity_fp32/infer", _infer_body(
        [dict(FP32_4, data=[1, 2, 3, 4]), dict(FP32_4, data=[5, 6, 7, 8])]))
    assert (status, body["error"]) == (400, message)
    inputs = [grpcclient.InferInput("INPUT0", [4], "FP32") for _ in range(2)]
    for inp in inputs:
        inp.set_data_from_numpy(np.ones(4, np.float32))
    with pytest.raises(InferenceServerException) as info:
        grpcc.infer("identity_fp32", inputs, request_id="twice")
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert info.value.message() == "[request id: twice] input 'INPUT0' already exists in request"


def test_core_request_errors_carry_the_request_id(served: Served, http: httpclient.InferenceServerClient,
                                                 grpcc: grpcclient.InferenceServerClient) -> None:
    # Triton 2.51 starts the core's request checks with "[request id: <id>] " ("<id_unknown>"
    # without an id); an unknown input or output name, found while looking it up in the model,
    # has no prefix even with an id.
    def post(doc: dict[str, Any]) -> tuple[int, str]:
        status, body = raw_post(served, "/v2/models/identity_fp32/infer", json.dumps(doc).encode())
        return status, body["error"]

    wrong_type = [dict(FP32_4, datatype="INT32", data=[1, 2, 3, 4])]
    expects = "inference input 'INPUT0' data-type is 'INT32', but model 'identity_fp32' expects 'FP32'"
    assert post({"inputs": wrong_type}) == (400, "[request id: <id_unknown>] " + expects)
    assert post({"id": "my-id", "inputs": wrong_type}) == (400, "[request id: my-id] " + expects)
    assert post({"id": "my-id", "inputs": [dict(FP32_4, name="X", data=[1, 2, 3, 4])]}) == (
        400, "unexpected inference input 'X' for model 'identity_fp32'")
    assert post({"id": "my-id", "inputs": [dict(FP32_4, data=[1, 2, 3, 4])],
                 "outputs": [{"name": "NOPE"}]}) == (
        400, "unexpected inference output 'NOPE' for model 'identity_fp32'")
    inp = grpcclient.InferInput("INPUT0", [16], "FP32")
    inp.set_data_from_numpy(np.ones(16, np.float32))
    with pytest.raises(InferenceServerException) as info:
        grpcc.infer("add_sub", [inp])
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert info.value.message().startswith(
        "[request id: <id_unknown>] expected 2 inputs but got 1 inputs for model 'add_sub'.")
    assert_still_serving(http)
    assert_still_serving(http)


def test_http_chunked_body_with_a_content_length(served: Served, http: httpclient.InferenceServerClient) -> None:
    # Transfer-Encoding wins over Content-Length (as in Triton), and the connection closes after.
    body = _infer_body([dict(FP32_4, data=[1, 2, 3, 4])])
    host, port = served.http.split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v2/models/identity_fp32/infer HTTP/1.1\r\nHost: x\r\n"
                     + f"Content-Length: {len(body)}\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
                     + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, payload = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK") and b"Connection: close" in head
    assert json.loads(payload)["outputs"][0]["data"] == [1, 2, 3, 4]
    assert_still_serving(http)


def http_conn(served: Served) -> httplib.HTTPConnection:
    host, port = served.http.split(":")
    return httplib.HTTPConnection(host, int(port))


def test_http_oversized_body(served: Served, http: httpclient.InferenceServerClient) -> None:
    big = np.zeros(MAX_INPUT // 4 + 16, dtype=np.float32)
    inp = httpclient.InferInput("INPUT0", [big.size], "FP32")
    inp.set_data_from_numpy(big)
    with pytest.raises(InferenceServerException, match="--http-max-input-size") as e:
        http.infer("identity_fp32", [inp])
    assert e.value.status() == "400"
    assert_still_serving(http)


def test_http_statistics_and_metrics(served: Served, http: httpclient.InferenceServerClient,
                                     grpcc: grpcclient.InferenceServerClient) -> None:
    assert_still_serving(http)
    stats = http.get_inference_statistics("add_sub")["model_stats"]
    assert stats[0]["name"] == "add_sub" and int(stats[0]["inference_stats"]["success"]["count"]) >= 1
    everything = {s["name"] for s in http.get_inference_statistics()["model_stats"]}
    assert {"add_sub", "identity_fp32"} <= everything
    # Triton 2.51's words and codes: INVALID_ARG (HTTP 400), the model before the version.
    for client, code in ((http, "400"), (grpcc, "StatusCode.INVALID_ARGUMENT")):
        with pytest.raises(InferenceServerException) as e:
            client.get_inference_statistics("no_such_model")
        assert (e.value.status(), e.value.message()) == (
            code, "requested model 'no_such_model' is not available")
        with pytest.raises(InferenceServerException) as e:
            client.get_inference_statistics("add_sub", "7")
        assert (e.value.status(), e.value.message()) == (
            code, "requested model version is not available for model 'add_sub'")
    assert http.get_inference_statistics("add_sub", "1")["model_stats"][0]["version"] == "1"
    text = urllib.request.urlopen(served.metrics).read().decode()
    for family in ("nv_inference_request_success", "nv_inference_request_failure",
                   "nv_inference_count", "nv_inference_exec_count",
                   "nv_inference_request_duration_us", "nv_inference_queue_duration_us",
                   "nv_inference_compute_input_duration_us", "nv_inference_compute_infer_duration_us",
                   "nv_inference_compute_output_duration_us", "tritonpy_shm_pool_mapped_bytes",
                   "tritonpy_shm_pool_used_bytes", "tritonpy_shm_pool_segments",
                   "tritonpy_shm_pool_peak_bytes"):
        assert f"# TYPE {family} " in text, family
    assert 'nv_inference_request_success{model="add_sub",version="1"}' in text
    # As Triton 2.51 (measured): "/metrics/" is the page too, and any other path of the
    # metrics port is 200 with an empty body (an HTTP probe of the port passes); they were 400.
    base = served.metrics.rsplit("/metrics", 1)[0]
    with urllib.request.urlopen(base + "/metrics/") as resp:
        assert "# TYPE nv_inference_count " in resp.read().decode()
        # Triton 2.51's content type and 405, to the byte (QA L0_metrics, measured).
        assert resp.headers["Content-Type"] == "text/plain; charset=utf-8"
    for path in ("/", "/healthz", "/metricsX"):
        with urllib.request.urlopen(base + path) as resp:
            assert (resp.status, resp.read()) == (200, b"")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(urllib.request.Request(served.metrics, data=b"x"))
    with refused.value as err:
        assert (err.code, err.headers["Content-Type"], err.read()) == (
            405, "text/plain", b'{"error":"Method Not Allowed"}')


def test_http_logging_settings(http: httpclient.InferenceServerClient) -> None:
    settings = http.get_log_settings()
    assert settings["log_info"] is True and settings["log_format"] == "default"
    try:
        assert http.update_log_settings({"log_verbose_level": 1})["log_verbose_level"] == 1
    finally:
        http.update_log_settings({"log_verbose_level": 0})


def test_log_settings_as_triton_reads_them(http: httpclient.InferenceServerClient,
                                           grpcc: grpcclient.InferenceServerClient) -> None:
    # As Triton 2.51 (measured): an unknown setting is ignored and the known ones beside it
    # apply; a bad log_format is 503 over HTTP and INVALID_ARGUMENT over gRPC. A verbose level
    # past 32 bits is refused (Triton truncates it): stored, it broke every gRPC read.
    try:
        got = http.update_log_settings({"log_verbose_level": 1, "no_such_setting": True})
        assert got["log_verbose_level"] == 1 and "no_such_setting" not in got
        got = grpcc.update_log_settings({"log_info": False, "no_such_setting": True}, as_json=True)
        assert got["settings"]["log_info"] == {"bool_param": False}
        with pytest.raises(InferenceServerException) as e:
            http.update_log_settings({"log_verbose_level": 2 ** 32})
        assert e.value.status() == "400" and "4294967295" in e.value.message()
        assert grpcc.get_log_settings(as_json=True)["settings"]["log_verbose_level"] == \
            {"uint32_param": 1}
        with pytest.raises(InferenceServerException) as e:
            http.update_log_settings({"log_format": "bad"})
        assert (e.value.status(), e.value.message()) == (
            "503", "invalid argument for --log_format, got: bad")
        with pytest.raises(InferenceServerException) as e:
            grpcc.update_log_settings({"log_format": "bad"})
        assert (e.value.status(), e.value.message()) == (
            "StatusCode.INVALID_ARGUMENT", "invalid argument for log_format, got: bad")
    finally:
        http.update_log_settings({"log_verbose_level": 0, "log_info": True})


def test_a_network_client_cannot_choose_the_log_file(served: Served, tmp_path: Path,
                                                     http: httpclient.InferenceServerClient,
                                                     grpcc: grpcclient.InferenceServerClient) -> None:
    # As Triton 2.51: HTTP 501 / UNIMPLEMENTED, and nothing in the update is applied.
    target = tmp_path / "chosen.log"
    message = "log file location can not be updated through network protocol"
    with pytest.raises(InferenceServerException) as e:
        http.update_log_settings({"log_file": str(target), "log_verbose_level": 1})
    assert (e.value.status(), e.value.message()) == ("501", message)
    with pytest.raises(InferenceServerException) as e:
        grpcc.update_log_settings({"log_file": str(target)})
    assert (e.value.status(), e.value.message()) == ("StatusCode.UNIMPLEMENTED", message)
    settings = http.get_log_settings()
    assert (settings["log_file"], settings["log_verbose_level"]) == ("", 0)
    assert not target.exists()


def test_http_aio_client(served: Served) -> None:
    async def run() -> None:
        client = httpaio.InferenceServerClient(served.http)
        try:
            assert await client.is_server_ready()
            inputs, a, b = add_sub_inputs(httpaio)
            results = await asyncio.gather(*(client.infer("add_sub", inputs) for _ in range(8)))
            for r in results:
                assert np.array_equal(r.as_numpy("OUTPUT0"), a + b)
        finally:
            await client.close()

    asyncio.run(run())


# == gRPC ==========================================================================================

def test_grpc_health_metadata_config(grpcc: grpcclient.InferenceServerClient) -> None:
    assert grpcc.is_server_live() and grpcc.is_server_ready()
    assert grpcc.get_server_metadata().name == "triton"
    assert grpcc.is_model_ready("add_sub") and not grpcc.is_model_ready("no_such_model")
    md = grpcc.get_model_metadata("add_sub", as_json=True)
    assert md["inputs"][0] == {"name": "INPUT0", "datatype": "FP32", "shape": ["16"]}
    config = grpcc.get_model_config("repeat").config
    assert config.name == "repeat" and config.model_transaction_policy.decoupled
    names = {m.name for m in grpcc.get_model_repository_index().models}
    assert set(MODELS) <= names
    # A version that is no number, in Triton 2.51's words (measured; QA L0_grpc).
    with pytest.raises(InferenceServerException) as err:
        grpcc.get_model_metadata("add_sub", "x")
    assert (err.value.status(), err.value.message()) == (
        "StatusCode.INVALID_ARGUMENT", "failed to get model version from specified version "
        "string 'x' (details: stol), version should be an integral value > 0")


def test_grpc_infer_raw_and_typed(served: Served, grpcc: grpcclient.InferenceServerClient) -> None:
    inputs, a, b = add_sub_inputs(grpcclient)
    result = grpcc.infer("add_sub", inputs, request_id="g1",
                         outputs=[grpcclient.InferRequestedOutput("OUTPUT0")])
    assert np.array_equal(result.as_numpy("OUTPUT0"), a + b)
    assert result.get_response().id == "g1" and [o.name for o in result.get_response().outputs] == ["OUTPUT0"]
    words = np.array([b"x", b"\xff", b""], dtype=object)
    inp = grpcclient.InferInput("INPUT0", [3], "BYTES")
    inp.set_data_from_numpy(words)
    assert grpcc.infer("identity_bytes", [inp]).as_numpy("OUTPUT0").tolist() == words.tolist()
    inp = grpcclient.InferInput("INPUT0", [2], "FP32")
    inp.set_data_from_numpy(np.array([1, 2], np.float32))
    res = grpcc.infer("identity_fp32", [inp], parameters={"k": 5, "s": "v", "b": False})
    params = res.get_response().parameters
    assert params["k"].int64_param == 5 and params["s"].string_param == "v"
    # Typed contents, which tritonclient never sends: through the raw stub.
    with grpc.insecure_channel(served.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        req = service_pb2.ModelInferRequest(model_name="identity_fp32")
        t = req.inputs.add(name="INPUT0", datatype="FP32", shape=[3])
        t.contents.fp32_contents.extend([1.5, 2.5, 3.5])
        resp = stub.ModelInfer(req)
        assert np.frombuffer(resp.raw_output_contents[0], np.float32).tolist() == [1.5, 2.5, 3.5]
        t.contents.int_contents.extend([1, 2, 3])
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelInfer(req)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        req = service_pb2.ModelInferRequest(model_name="identity_fp32")
        req.inputs.add(name="INPUT0", datatype="FP32", shape=[3])
        with pytest.raises(grpc.RpcError, match="unable to find data for input tensor"):
            stub.ModelInfer(req)
        # A value past a narrow type in int_contents / uint_contents is the client's mistake
        # (it was INTERNAL with numpy's OverflowError text; Triton 2.51 wraps it).
        for datatype, field, value in (("INT8", "int_contents", 300),
                                       ("UINT16", "uint_contents", 70000)):
            req = service_pb2.ModelInferRequest(model_name="identity_fp32")
            t = req.inputs.add(name="INPUT0", datatype=datatype, shape=[1])
            getattr(t.contents, field).append(value)
            with pytest.raises(grpc.RpcError) as e:
                stub.ModelInfer(req)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"value out of range for {datatype}" in (e.value.details() or "")


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_grpc_compressed_requests(grpcc: grpcclient.InferenceServerClient, algorithm: str) -> None:
    inputs, a, b = add_sub_inputs(grpcclient)
    result = grpcc.infer("add_sub", inputs, compression_algorithm=algorithm)
    assert np.array_equal(result.as_numpy("OUTPUT0"), a + b)
    assert np.array_equal(result.as_numpy("OUTPUT1"), a - b)


def test_grpc_large_tensors_both_ways(grpcc: grpcclient.InferenceServerClient) -> None:
    """20 MiB each way: more than the HTTP/2 windows and frame sizes, so the client's message
    arrives in many frames and the answer waits for the client's window updates."""
    x = np.random.default_rng(0).random(5 << 20, dtype=np.float32)
    inp = grpcclient.InferInput("INPUT0", [x.size], "FP32")
    inp.set_data_from_numpy(x)
    for _ in range(2):
        assert np.array_equal(grpcc.infer("identity_fp32", [inp]).as_numpy("OUTPUT0"), x)


def test_grpc_unknown_method_is_unimplemented(served: Served,
                                              grpcc: grpcclient.InferenceServerClient) -> None:
    with grpc.insecure_channel(served.grpc) as channel:
        nope = channel.unary_unary("/inference.GRPCInferenceService/NoSuchMethod")
        with pytest.raises(grpc.RpcError) as err:
            nope(b"")
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "NoSuchMethod" in (err.value.details() or "")
    assert grpcc.is_server_live()


@pytest.mark.parametrize("model, datatype, shape, code, message", [
    ("no_such_model", "FP32", [2], "StatusCode.NOT_FOUND", "unknown model"),
    ("identity_fp32", "INT32", [2], "StatusCode.INVALID_ARGUMENT", "INPUT0"),
    ("add_sub", "FP32", [2], "StatusCode.INVALID_ARGUMENT", "INPUT"),
    ("repeat", "INT32", [2], "StatusCode.UNIMPLEMENTED", "decoupled transaction policy"),
    ("raiser", "FP32", [2], "StatusCode.INTERNAL", "boom from execute"),
])
def test_grpc_errors(grpcc: grpcclient.InferenceServerClient, model: str, datatype: str,
                     shape: list[int], code: str, message: str) -> None:
    name = "IN" if model == "repeat" else "INPUT0"
    inp = grpcclient.InferInput(name, shape, datatype)
    inp.set_data_from_numpy(np.zeros(shape, dtype=np.float32 if datatype == "FP32" else np.int32))
    with pytest.raises(InferenceServerException, match=message) as e:
        grpcc.infer(model, [inp])
    assert e.value.status() == code
    inputs, a, b = add_sub_inputs(grpcclient)
    assert np.array_equal(grpcc.infer("add_sub", inputs).as_numpy("OUTPUT1"), a - b)


def test_grpc_unsupported_and_settings(grpcc: grpcclient.InferenceServerClient) -> None:
    assert len(grpcc.get_cuda_shared_memory_status().regions) == 0
    with pytest.raises(InferenceServerException, match="GPUs not supported"):
        grpcc.register_cuda_shared_memory("c", b"\0" * 64, 0, 64)
    assert grpcc.get_trace_settings(as_json=True)["settings"]["trace_level"]["value"] == ["OFF"]
    with pytest.raises(InferenceServerException, match="trace file name is not given"):
        grpcc.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"]})
    settings = grpcc.get_log_settings(as_json=True)["settings"]
    assert settings["log_info"]["bool_param"] is True
    stats = grpcc.get_inference_statistics("add_sub", as_json=True)
    assert stats["model_stats"][0]["name"] == "add_sub"


@pytest.mark.parametrize("failing", ["raiser", "no_such_model"])
def test_grpc_stream_with_triton_grpc_error_ends_at_its_first_error(
        served: Served, http: httpclient.InferenceServerClient, failing: str) -> None:
    # Triton 2.49+: a stream opened with this header ends at its first error from a model
    # with the error's gRPC status (a model that raises: INTERNAL) instead of answering it in
    # error_message. A request refused before it reaches a model (an unknown one, bad inputs)
    # is answered in error_message and the stream goes on, as in Triton 2.51 (measured;
    # tritonpy ended the stream with NOT_FOUND).
    client = grpcclient.InferenceServerClient(served.grpc)
    results: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)),
                        headers={"triton_grpc_error": "true"})
    try:
        inputs, a, b = add_sub_inputs(grpcclient)
        client.async_stream_infer("add_sub", inputs, request_id="ok")
        result, error = results.get(timeout=10)
        assert error is None and np.array_equal(result.as_numpy("OUTPUT0"), a + b)
        x = grpcclient.InferInput("INPUT0", [2], "FP32")
        x.set_data_from_numpy(np.ones(2, np.float32))
        client.async_stream_infer(failing, [x], request_id="bad")
        result, error = results.get(timeout=10)
        assert result is None
        if failing == "no_such_model":
            assert error.status() is None
            assert error.message() == "Request for unknown model: 'no_such_model' is not found"
            client.async_stream_infer("add_sub", inputs, request_id="after")
            result, error = results.get(timeout=10)
            assert error is None and np.array_equal(result.as_numpy("OUTPUT0"), a + b)
            return
        assert error.status() == "StatusCode.INTERNAL"
        assert "boom from execute" in error.message()
        # The stream is over: a later request gets no answer on it.
        with pytest.raises(Exception):
            client.async_stream_infer("add_sub", inputs, request_id="after")
            results.get(timeout=1)
    finally:
        client.stop_stream()
        client.close()
    assert_still_serving(http)


def test_grpc_stream_decoupled_and_errors(grpcc: grpcclient.InferenceServerClient) -> None:
    results: queue.Queue[Any] = queue.Queue()
    grpcc.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        x = grpcclient.InferInput("IN", [3], "INT32")
        x.set_data_from_numpy(np.array([4, 5, 6], np.int32))
        grpcc.async_stream_infer("repeat", [x], request_id="d1", enable_empty_final_response=True)
        got, finals = [], []
        for _ in range(4):
            result, error = results.get(timeout=10)
            assert error is None
            resp = result.get_response()
            assert resp.id == "d1"
            finals.append(resp.parameters["triton_final_response"].bool_param)
            if resp.outputs:
                got.append(int(result.as_numpy("OUT")[0]))
        assert got == [4, 5, 6] and finals == [False, False, False, True]
        # Without the empty final response, exactly one response per element.
        grpcc.async_stream_infer("repeat", [x], request_id="d2")
        assert [int(results.get(timeout=10)[0].as_numpy("OUT")[0]) for _ in range(3)] == [4, 5, 6]
        # A failing request reports on the stream, which stays open.
        grpcc.async_stream_infer("no_such_model", [x], request_id="bad")
        result, error = results.get(timeout=10)
        assert result is None and "unknown model" in str(error)
        # Default-mode models work over the stream too, answered in request order.
        inputs, a, b = add_sub_inputs(grpcclient)
        for i in range(5):
            grpcc.async_stream_infer("add_sub", inputs, request_id=f"n{i}")
        ids = []
        for _ in range(5):
            result, error = results.get(timeout=10)
            assert error is None and np.array_equal(result.as_numpy("OUTPUT0"), a + b)
            assert result.get_response().parameters["triton_final_response"].bool_param
            ids.append(result.get_response().id)
        assert ids == [f"n{i}" for i in range(5)]
        assert results.empty()
    finally:
        grpcc.stop_stream()


_VANISHING_STREAM_CLIENT = """
import os, sys, threading, time, numpy as np, tritonclient.grpc as g
got = []
def stall(result, error):  # reads one response, then nothing more: the server's writes wait
    got.append(error)
    threading.Event().wait()
client = g.InferenceServerClient(sys.argv[1])
client.start_stream(callback=stall)
x = g.InferInput("IN", [1], "INT32")
x.set_data_from_numpy(np.array([2000], dtype=np.int32))
for _ in range(3):
    client.async_stream_infer("repeat_big", [x])
while not got:
    time.sleep(0.01)
time.sleep(0.5)
os._exit(0)  # gone mid-stream, without closing anything
"""


def test_a_stream_whose_client_vanishes_ends_without_an_error_in_the_log(
        served: Served, caplog: pytest.LogCaptureFixture) -> None:
    """A client that stops reading its stream, then dies: the server drops the stream and logs
    nothing at error level (grpc used to log a traceback for the write that failed)."""
    caplog.set_level(logging.WARNING)
    subprocess.run([sys.executable, "-c", _VANISHING_STREAM_CLIENT, served.grpc], timeout=60,
                   check=True)
    streams = served.frontends.grpc._service._streams  # type: ignore[union-attr]  # open streams
    deadline = time.monotonic() + 20
    while streams and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not streams, "the stream of the vanished client is still open"
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert_still_serving_grpc(served)


@pytest.mark.parametrize("rule,hard,stalled_s,most", [
    ("four-times-the-limit", 4, 60.0, 1000),  # 16 MiB waited, plus what the sockets held
    ("stalled", 1_000_000, 1.0, 20000),  # what the model sent in that second
])
def test_a_stream_client_that_does_not_read_gets_its_request_cancelled(
        served: Served, monkeypatch: pytest.MonkeyPatch, rule: str, hard: int, stalled_s: float,
        most: int) -> None:
    """A decoupled model streams to a client that stopped reading: once more than the limit
    waits for it (4 MiB here, 256 MiB by default) and it takes nothing for a while (1 s here;
    5 s by default, 60 s once the model waits for it to read), or 4 times as much waits, the request is cancelled, the model stops (it checks is_cancelled()), and
    the client, once it reads again, gets what waited, then the error. The host's memory no
    longer grows for as long as the model sends. A client that reads slowly gets it all."""
    from tritonpy import _request

    monkeypatch.setattr(_request, "MAX_WAITING_BYTES", 4 << 20)
    monkeypatch.setattr(_request, "STALLED_S", stalled_s)
    monkeypatch.setattr(_request, "HELD_STALLED_S", stalled_s)  # once the model waits (paced)
    monkeypatch.setattr(_request, "_HARD", hard)

    def executions() -> int:  # the model's execute returns once it sees is_cancelled()
        return next(m["execution_count"] for m in served.server.statistics()["model_stats"]
                    if m["name"] == "repeat_big")

    before = executions()
    release = threading.Event()
    got: queue.Queue[Any] = queue.Queue()

    def stall(result: Any, error: Any) -> None:  # the first response blocks the reader
        got.put((result, error))
        release.wait(60)

    with repeat_big_stream(served, 30000, stall):  # 30,000 × 64 KiB: 2 GB
        try:
            assert wait_for(lambda: executions() == before + 1, 60), "the model is still sending"
        finally:
            release.set()  # else closing the stream waits for the stalled reader
        responses = 0
        while True:
            result, error = got.get(timeout=30)
            if error is not None:
                break
            responses += 1
        assert "the client did not read its responses" in str(error), error
        assert 1 <= responses < most, responses

    slow: queue.Queue[Any] = queue.Queue()

    def read_slowly(result: Any, error: Any) -> None:
        slow.put((result, error))
        time.sleep(0.004)

    # 13 MB, read over ~1 s
    with repeat_big_stream(served, 200, read_slowly, enable_empty_final_response=True):
        got_all = 0
        while True:
            result, error = slow.get(timeout=60)
            assert error is None, error
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
            got_all += 1
        assert got_all == 200
    assert_still_serving_grpc(served)


@contextlib.contextmanager
def repeat_big_stream(served: Served, count: int, callback: Any, **kwargs: Any) -> Iterator[None]:
    """A gRPC stream asking ``repeat_big`` for ``count`` responses, read by ``callback``."""
    client = grpcclient.InferenceServerClient(served.grpc)
    try:
        client.start_stream(callback=callback)
        x = grpcclient.InferInput("IN", [1], "INT32")
        x.set_data_from_numpy(np.array([count], np.int32))
        client.async_stream_infer("repeat_big", [x], **kwargs)
        yield
    finally:
        client.stop_stream()
        client.close()


def assert_still_serving_grpc(served: Served) -> None:
    x = grpcclient.InferInput("IN", [2], "INT32")
    x.set_data_from_numpy(np.array([5, 6], np.int32))
    got: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(served.grpc)
    try:
        client.start_stream(callback=lambda result, error: got.put((result, error)))
        client.async_stream_infer("repeat", [x])
        assert [got.get(timeout=10)[0].as_numpy("OUT").tolist() for _ in range(2)] == [[5], [6]]
    finally:
        client.stop_stream()
        client.close()


def test_grpc_stream_errors_and_empty_finals_name_the_asked_version(served: Served) -> None:
    # As Triton 2.51: an error or the flags-only final response on the stream carries the
    # request's model_version (none when the client named none); a response with outputs
    # names the version that ran.
    def request(model: str, rid: str, version: str = "") -> Any:
        req = service_pb2.ModelInferRequest(model_name=model, id=rid, model_version=version)
        if model == "repeat":
            req.inputs.add(name="IN", datatype="INT32", shape=[1])
            req.raw_input_contents.append(np.array([4], np.int32).tobytes())
            req.parameters["triton_enable_empty_final_response"].bool_param = True
        else:
            req.inputs.add(name="INPUT0", datatype="FP32", shape=[1])
            req.raw_input_contents.append(np.ones(1, np.float32).tobytes())
        return req

    with grpc.insecure_channel(served.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        got = {}
        for rid, version in (("e1", ""), ("e2", "1")):
            for msg in stub.ModelStreamInfer(iter([request("repeat", rid, version)]), timeout=30):
                r = msg.infer_response
                got.setdefault(rid, []).append((len(r.outputs), r.model_version))
        assert got == {"e1": [(1, "1"), (0, "")], "e2": [(1, "1"), (0, "1")]}
        [msg] = stub.ModelStreamInfer(iter([request("raiser", "e3")]), timeout=30)
        assert "boom from execute" in msg.error_message
        r = msg.infer_response
        assert (r.id, r.model_name, r.model_version) == ("e3", "raiser", "")


def test_grpc_system_shared_memory(grpcc: grpcclient.InferenceServerClient) -> None:
    tag = f"tpyc{secrets.token_hex(4)}"
    handles = _shm_regions(tag, {"io": 256})
    try:
        a = np.arange(16, dtype=np.float32)
        shm_utils.set_shared_memory_region(handles["io"], [a, a])
        grpcc.register_system_shared_memory(tag, f"/{tag}_io", 256)
        assert grpcc.get_system_shared_memory_status(tag).regions[tag].byte_size == 256
        i0 = grpcclient.InferInput("INPUT0", [16], "FP32")
        i0.set_shared_memory(tag, 64)
        i1 = grpcclient.InferInput("INPUT1", [16], "FP32")
        i1.set_shared_memory(tag, 64, offset=64)
        out = grpcclient.InferRequestedOutput("OUTPUT0")
        out.set_shared_memory(tag, 64, offset=128)
        result = grpcc.infer("add_sub", [i0, i1], outputs=[out])
        got = shm_utils.get_contents_as_numpy(handles["io"], np.float32, [64])
        assert np.array_equal(got[32:48], a + a)
        # Named with no parameters and empty raw contents, as Triton 2.51's (measured).
        response = result.get_response()
        assert [(o.name, o.datatype, list(o.shape), dict(o.parameters)) for o in response.outputs] \
            == [("OUTPUT0", "FP32", [16], {})]
        assert list(response.raw_output_contents) == [b""]
        with pytest.raises(InferenceServerException, match="already in manager") as e:
            grpcc.register_system_shared_memory(tag, f"/{tag}_io", 256)
        assert e.value.status() == "StatusCode.ALREADY_EXISTS"
        with pytest.raises(InferenceServerException, match="Unable to find system shared memory region"):
            grpcc.get_system_shared_memory_status("nope")
    finally:
        grpcc.unregister_system_shared_memory()
        for h in handles.values():
            shm_utils.destroy_shared_memory_region(h)


def test_grpc_system_shared_memory_registration_as_triton(grpcc: grpcclient.InferenceServerClient) -> None:
    """Triton 2.51's codes and words (measured): a key it cannot open, or that another region
    holds, is INTERNAL; a byte size of 0 is its mmap's EINVAL; an empty name is a name."""
    tag = f"tpyc{secrets.token_hex(4)}"
    handles = _shm_regions(tag, {"io": 256})
    try:
        for key in (f"/{tag}_none", f"/{tag}/x", ""):
            with pytest.raises(InferenceServerException) as e:
                grpcc.register_system_shared_memory("r", key, 16)
            assert e.value.status() == "StatusCode.INTERNAL"
            assert e.value.message() == f"Unable to open shared memory region: '{key}'"
        with pytest.raises(InferenceServerException) as e:
            grpcc.register_system_shared_memory("r", f"/{tag}_io", 0)
        assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert e.value.message() == ("failed to register shared memory region 'r': "
                                     "unable to process address spaceInvalid argument")
        grpcc.register_system_shared_memory("", f"/{tag}_io", 256)
        assert list(grpcc.get_system_shared_memory_status().regions) == [""]
        with pytest.raises(InferenceServerException) as e:
            grpcc.register_system_shared_memory("r", f"/{tag}_io", 256)
        assert e.value.status() == "StatusCode.INTERNAL"
        assert e.value.message() == f"Invalid shared memory region: '/{tag}_io'"
    finally:
        grpcc.unregister_system_shared_memory()
        for h in handles.values():
            shm_utils.destroy_shared_memory_region(h)


def test_grpc_aio_client_and_stream(served: Served) -> None:
    async def run() -> None:
        client = grpcaio.InferenceServerClient(served.grpc)
        try:
            assert await client.is_server_live()
            inputs, a, b = add_sub_inputs(grpcaio)
            results = await asyncio.gather(*(client.infer("add_sub", inputs) for _ in range(8)))
            assert all(np.array_equal(r.as_numpy("OUTPUT1"), a - b) for r in results)
            x = grpcaio.InferInput("IN", [2], "INT32")
            x.set_data_from_numpy(np.array([7, 8], np.int32))

            async def requests() -> Any:
                # The aio client refuses reserved "triton_" parameters, so no empty final
                # response comes: the stream carries exactly the two data responses.
                yield {"model_name": "repeat", "inputs": [x], "request_id": "a1"}

            seen = []
            async for result, error in client.stream_infer(requests()):
                assert error is None
                assert result.get_response().id == "a1"
                seen.append(int(result.as_numpy("OUT")[0]))
                if len(seen) == 2:
                    break
            assert seen == [7, 8]
        finally:
            await client.close()

    asyncio.run(run())
