"""BYTES inputs where tritonpy once differed from Triton 2.51 (compared side by side): binary
data (HTTP, gRPC raw contents) whose length prefixes do not frame the tensor's elements is
refused with Triton's messages, which name the model and the counts (tritonpy said only
"truncated BYTES tensor" or "holds 2 elements, expected 1"); JSON data whose element count
disagrees with the shape says both counts, as Triton does (tritonpy said "Shape does not
match")."""
from __future__ import annotations

import http.client
import json
import struct
from pathlib import Path
from typing import Callable

import grpc
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from _serve import Serve, serve_repo

ECHO = """\
import triton_python_backend_utils as pb_utils
class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT",
                    pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())]) for r in requests]
"""
ECHO_CONFIG = """\
name: "echo"
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_STRING dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_STRING dims: [ -1 ] } ]
"""


def _enc(*items: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(x)) + x for x in items)


@pytest.fixture
def server(serve: Callable[..., Serve], tmp_path: Path) -> tuple[int, int]:
    (tmp_path / "repo" / "echo" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "echo" / "config.pbtxt").write_text(ECHO_CONFIG)
    (tmp_path / "repo" / "echo" / "1" / "model.py").write_text(ECHO)
    _, http_port, grpc_port = serve_repo(serve, tmp_path / "repo")
    return http_port, grpc_port


def _post(port: int, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, object]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", "/v2/models/echo/infer", body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def _binary(port: int, shape: list[int], blob: bytes, rid: str = "") -> tuple[int, dict[str, object]]:
    header = {"inputs": [{"name": "IN", "datatype": "BYTES", "shape": shape,
                          "parameters": {"binary_data_size": len(blob)}}]}
    if rid:
        header["id"] = rid
    head = json.dumps(header).encode()
    return _post(port, head + blob, {"Inference-Header-Content-Length": str(len(head))})


PREFIX_CUT = ("incomplete string length indicator for inference input 'IN' for model 'echo', "
              "expecting 4 bytes but only {} bytes available. Please make sure the string "
              "length indicator is in one buffer.")

# (shape, data, Triton 2.51's message after the "[request id: ...] " prefix)
FRAMING = [
    ([1], b"\x05\x00", PREFIX_CUT.format(2)),
    ([1], _enc(b"a") + b"\x00", PREFIX_CUT.format(1)),
    ([1], _enc(b"a", b"b"),
     "unexpected number of string elements 2 for inference input 'IN' for model 'echo', "
     "expecting 1"),
    # A prefix past the last element is counted as one, whatever follows it (QA round 14:
    # "expecting string of length 2054847098 but only 0 bytes available").
    ([1], _enc(b"abcd") + b"zzzz",
     "unexpected number of string elements 2 for inference input 'IN' for model 'echo', "
     "expecting 1"),
    ([0], _enc(b"a"),
     "unexpected number of string elements 1 for inference input 'IN' for model 'echo', "
     "expecting 0"),
    ([3], _enc(b"a", b"b"),
     "expected 3 string elements for inference input 'IN' for model 'echo', got 2"),
    ([1], b"", "expected 1 string elements for inference input 'IN' for model 'echo', got 0"),
]


def test_bytes_framing_errors_say_what_triton_says(server: tuple[int, int]) -> None:
    http_port, grpc_port = server
    for shape, blob, message in FRAMING:
        assert _binary(http_port, shape, blob) == (
            400, {"error": f"[request id: <id_unknown>] {message}"}), (shape, blob)
        assert _binary(http_port, shape, blob, rid="r7") == (
            400, {"error": f"[request id: r7] {message}"}), (shape, blob)
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for shape, blob, message in FRAMING:
            req = service_pb2.ModelInferRequest(model_name="echo", id="g")
            req.inputs.add(name="IN", datatype="BYTES", shape=shape)
            req.raw_input_contents.append(blob)
            with pytest.raises(grpc.RpcError) as err:
                stub.ModelInfer(req)
            assert (err.value.code(), err.value.details()) == (
                grpc.StatusCode.INVALID_ARGUMENT, f"[request id: g] {message}"), (shape, blob)
        # Framed right, each element comes back as it went, NUL and non-UTF-8 bytes included.
        req = service_pb2.ModelInferRequest(model_name="echo")
        req.inputs.add(name="IN", datatype="BYTES", shape=[3])
        req.raw_input_contents.append(_enc(b"a\x00b", b"\xff", b""))
        assert stub.ModelInfer(req).raw_output_contents[0] == _enc(b"a\x00b", b"\xff", b"")


def test_json_bytes_count_mismatch_names_the_counts(server: tuple[int, int]) -> None:
    http_port, _ = server

    def infer(shape: list[int], data: list[object]) -> tuple[int, dict[str, object]]:
        body = {"inputs": [{"name": "IN", "datatype": "BYTES", "shape": shape, "data": data}]}
        return _post(http_port, json.dumps(body).encode(), {})

    assert infer([2], ["a", "b", "c"]) == (400, {"error": (
        "unexpected number of string elements 3 for inference input 'IN' (shape [2]), "
        "expecting 2")})
    assert infer([2], [["a"]]) == (400, {"error": (
        "expected 2 string elements for inference input 'IN' (shape [2]), got 1")})
    status, body = infer([4], [["a", "b"], ["c", "d"]])  # nested lists are taken row-major
    assert (status, body["outputs"][0]["data"]) == (200, ["a", "b", "c", "d"])  # type: ignore[index]


def test_grpc_bytes_contents_count_mismatch_says_what_triton_says(server: tuple[int, int]) -> None:
    # It said "unexpected number of elements 2 for input 'IN', expecting 3".
    _, grpc_port = server
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for shape, values, message in (
                ([3], [b"a", b"b"], "expected 3 string elements for inference input 'IN' for "
                                    "model 'echo', got 2"),
                ([1], [b"a", b"b"], "unexpected number of string elements 2 for inference input "
                                    "'IN' for model 'echo', expecting 1")):
            req = service_pb2.ModelInferRequest(model_name="echo", id="c")
            inp = req.inputs.add(name="IN", datatype="BYTES", shape=shape)
            inp.contents.bytes_contents.extend(values)
            with pytest.raises(grpc.RpcError) as err:
                stub.ModelInfer(req)
            assert (err.value.code(), err.value.details()) == (
                grpc.StatusCode.INVALID_ARGUMENT, f"[request id: c] {message}")
