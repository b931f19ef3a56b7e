"""Triton's generate extension over real HTTP: ``/generate`` (one JSON response) and
``/generate_stream`` (Server-Sent Events), on a default-mode and a decoupled model. The expected
bodies are what Triton 2.51 answered to the same requests on the same models (checked side by
side), except where tritonpy answers an error more plainly (noted at each such assertion)."""
from __future__ import annotations

import http.client
import json
import queue
import secrets
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from _models import serving_models, wait_until
from tritonpy.frontends import Frontends

ECHO_CONFIG = """
    backend: "python"
    max_batch_size: 0
    input [
      { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] },
      { name: "max_tokens" data_type: TYPE_INT32 dims: [ 1 ] optional: true },
      { name: "scale" data_type: TYPE_FP32 dims: [ -1 ] optional: true }
    ]
    output [
      { name: "text_output" data_type: TYPE_STRING dims: [ 1 ] },
      { name: "vec" data_type: TYPE_FP32 dims: [ 3 ] }
    ]
    """
# Answers what it was given: inputs (values, shapes, dtypes), parameters and request id.
ECHO_PY = """
    import json
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            out = []
            for r in requests:
                seen = {"params": json.loads(r.parameters()), "id": r.request_id()}
                for t in r.inputs():
                    a = t.as_numpy()
                    values = [x.decode() if isinstance(x, bytes) else x for x in a.ravel().tolist()]
                    seen[t.name()] = [values, list(a.shape), str(a.dtype)]
                if seen["text_input"][0] == ["fail"]:
                    out.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                        "asked to fail", pb_utils.TritonError.INVALID_ARG)))
                    continue
                out.append(pb_utils.InferenceResponse([
                    pb_utils.Tensor("text_output", np.array([json.dumps(seen, sort_keys=True).encode()],
                                                            dtype=np.object_)),
                    pb_utils.Tensor("vec", np.array([1.5, 2.0, -3.25], dtype=np.float32))]))
            return out
    """
TOKENS_CONFIG = """
    backend: "python"
    max_batch_size: 0
    model_transaction_policy { decoupled: true }
    input [
      { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] },
      { name: "max_tokens" data_type: TYPE_INT32 dims: [ 1 ] }
    ]
    output [
      { name: "text_output" data_type: TYPE_STRING dims: [ 1 ] },
      { name: "index" data_type: TYPE_INT32 dims: [ 1 ] }
    ]
    """
# ``max_tokens`` responses; "fail" makes the second an error; "forever" streams until cancelled
# and then leaves a mark file named after the request id.
TOKENS_PY = """
    import os, time
    import numpy as np
    import triton_python_backend_utils as pb_utils

    MARKS = %(marks)r

    class TritonPythonModel:
        def execute(self, requests):
            for r in requests:
                s = r.get_response_sender()
                text = pb_utils.get_input_tensor_by_name(r, "text_input").as_numpy()[0].decode()
                n = int(pb_utils.get_input_tensor_by_name(r, "max_tokens").as_numpy()[0])
                i = 0
                while i < n or text == "forever":
                    if text == "forever" and s.is_cancelled():
                        open(os.path.join(MARKS, "cancelled-" + r.request_id()), "w").close()
                        break
                    if text == "fail" and i == 1:
                        s.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("failed at 1")))
                    else:
                        s.send(pb_utils.InferenceResponse([
                            pb_utils.Tensor("text_output", np.array([f"{text}-{i}".encode()], dtype=np.object_)),
                            pb_utils.Tensor("index", np.array([i], dtype=np.int32))]))
                    i += 1
                    if text == "forever":
                        time.sleep(0.01)
                if text == "lastempty":  # a last response that holds no tensor, not the bare flag
                    s.send(pb_utils.InferenceResponse([]),
                           flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                else:
                    s.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return None
    """


@dataclass
class Served:
    port: int
    marks: Path
    grpc_port: int = 0


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("generate")
    marks = root / "marks"
    marks.mkdir()
    models = {"echo": (ECHO_PY, ECHO_CONFIG), "tokens": (TOKENS_PY % {"marks": str(marks)}, TOKENS_CONFIG)}
    with serving_models(root / "repo", models) as server:
        fe = Frontends(server, http_port=0, http_address="127.0.0.1", grpc_port=0,
                       grpc_address="127.0.0.1", allow_metrics=False, exit_timeout=5.0)
        fe.start_in_thread()
        try:
            yield Served(fe.http_port or 0, marks, fe.grpc_port or 0)
        finally:
            fe.stop_in_thread()


def post(served: Served, path: str, body: object) -> tuple[int, dict[str, str], bytes]:
    """(status, headers with lower-case names, body) of one POST; a dict body is sent as JSON,
    bytes as they are."""
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    try:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def seen(body: bytes) -> dict[str, Any]:
    """What the echo model saw, from its text_output."""
    return json.loads(json.loads(body)["text_output"])  # type: ignore[no-any-return]


def test_generate_maps_fields_to_inputs_and_parameters(served: Served) -> None:
    status, headers, body = post(served, "/v2/models/echo/generate", {
        "text_input": "hello", "max_tokens": 5, "scale": [1.5, 2], "extra": "zz",
        "parameters": {"temperature": 0.5, "stream": False, "k": 3, "extra": "overridden"}})
    assert status == 200 and headers["content-type"] == "application/json"
    doc = json.loads(body)
    # Keys in alphabetical order, a one-element output as a scalar, a longer one as a list.
    assert list(doc) == ["model_name", "model_version", "text_output", "vec"]
    assert (doc["model_name"], doc["model_version"], doc["vec"]) == ("echo", "1", [1.5, 2.0, -3.25])
    assert seen(body) == {
        "text_input": [["hello"], [1], "object"], "max_tokens": [[5], [1], "int32"],
        "scale": [[1.5, 2.0], [2], "float32"], "id": "",
        # Keys that name no input are parameters; the later of two equal keys wins.
        "params": {"extra": "overridden", "temperature": 0.5, "stream": False, "k": 3}}
    # A member of "parameters" that names an input is that input; "id" is the request id
    # (and a parameter, as in Triton) and comes back first.
    status, _, body = post(served, "/v2/models/echo/versions/1/generate",
                           {"text_input": "x", "id": "r1", "parameters": {"max_tokens": [9]}})
    assert status == 200 and list(json.loads(body))[0] == "id" and json.loads(body)["id"] == "r1"
    assert seen(body) == {"text_input": [["x"], [1], "object"], "max_tokens": [[9], [1], "int32"],
                          "id": "r1", "params": {"id": "r1"}}


@pytest.mark.parametrize("body, status, message", [
    ({"text_input": ["a", "b"]}, 400, "The schema can not convert input 'text_input' to tensor with proper shape"),
    ({"text_input": "x", "c": {"d": 1}}, 400,
     "parameter 'c' has invalid type. It should be either 'int', 'bool', or 'string'."),
    ({"text_input": "x", "parameters": {"nested": {"twice": 1}}}, 400,
     "Converting keyword: 'parameters': parameter 'nested' has invalid type."),
    (b'{"text_input": "a", "max_tokens": 1, "text_input": "b"}', 400,
     "input 'text_input' already exists in request"),
    (b'{"text_input": "a", "max_tokens": 1, "max_tokens": 2, "text_input": "b"}', 400,
     "input 'max_tokens' already exists in request"),  # the first repeat in the body's order
    # Triton 2.51 answers these with 500 (the same words, less the input's name).
    (b"not json", 400, "failed to parse the request JSON buffer"),
    ({"text_input": 3}, 400,
     "Unable to parse JSON bytes array for input 'text_input': attempt to access JSON non-string as string"),
    ({"text_input": {"user": "a"}}, 400, "attempt to access JSON non-string as string"),
    ({"text_input": "x", "max_tokens": 2.5}, 400,
     "input 'max_tokens' (INT32): attempt to access JSON non-signed-integer as signed-integer"),
    ({"text_input": "x", "scale": [1, True]}, 400, "attempt to access JSON non-number as double"),
    ({"text_input": "x", "parameters": 3}, 400,
     "Expected JSON object for keyword: 'parameters': attempt to access JSON non-object as object"),
    # Triton 2.51 runs the model without its required input.
    ({"max_tokens": 5}, 400, "missing required input(s) ['text_input']"),
    ({"text_input": "fail"}, 400, "asked to fail"),  # the model's INVALID_ARG
])
def test_generate_errors(served: Served, body: object, status: int, message: str) -> None:
    got_status, headers, got = post(served, "/v2/models/echo/generate", body)
    assert (got_status, headers["content-type"]) == (status, "application/json")
    assert message in json.loads(got)["error"]


def test_generate_unknown_model_and_wrong_method(served: Served) -> None:
    status, _, body = post(served, "/v2/models/nosuch/generate", {"text_input": "x"})
    assert status == 404 and "nosuch" in json.loads(body)["error"]
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    conn.request("GET", "/v2/models/echo/generate_stream")
    resp = conn.getresponse()
    assert resp.status == 405 and json.loads(resp.read()) == {"error": "Method Not Allowed"}
    conn.close()


def test_generate_needs_exactly_one_response(served: Served) -> None:
    status, _, body = post(served, "/v2/models/tokens/generate", {"text_input": "hi", "max_tokens": 1})
    assert status == 200
    assert json.loads(body) == {"index": 0, "model_name": "tokens", "model_version": "1", "text_output": "hi-0"}
    for n in (0, 3):  # Triton 2.51 says the same with status 200
        status, _, body = post(served, "/v2/models/tokens/generate", {"text_input": "hi", "max_tokens": n})
        assert status == 400 and json.loads(body)["error"].startswith(
            "generate expects model to produce exactly 1 response, use generate stream")


def test_generate_stream_sends_each_response_as_an_event(served: Served) -> None:
    status, headers, body = post(served, "/v2/models/tokens/generate_stream",
                                 {"text_input": "hi", "max_tokens": 3})
    assert (status, headers["content-type"]) == (200, "text/event-stream; charset=utf-8")
    assert headers["transfer-encoding"] == "chunked"
    assert body == b"".join(
        b'data: {"index":%d,"model_name":"tokens","model_version":"1","text_output":"hi-%d"}\n\n' % (i, i)
        for i in range(3))
    # An error response is an event of its own and the stream goes on.
    status, _, body = post(served, "/v2/models/tokens/generate_stream", {"text_input": "fail", "max_tokens": 3})
    assert status == 200
    assert body.split(b"\n\n")[:3] == [
        b'data: {"index":0,"model_name":"tokens","model_version":"1","text_output":"fail-0"}',
        b'data: {"error":"failed at 1"}',
        b'data: {"index":2,"model_name":"tokens","model_version":"1","text_output":"fail-2"}']
    # No response at all: an empty stream.
    assert post(served, "/v2/models/tokens/generate_stream", {"text_input": "hi", "max_tokens": 0})[::2] == (200, b"")


def test_generate_stream_status_follows_the_first_response(served: Served) -> None:
    status, headers, body = post(served, "/v2/models/echo/generate_stream", {"text_input": "hello"})
    assert status == 200 and body.startswith(b'data: {"model_name":"echo","model_version":"1","text_output":')
    status, headers, body = post(served, "/v2/models/echo/generate_stream", {"text_input": "fail"})
    assert (status, headers["content-type"], body) == (
        400, "text/event-stream; charset=utf-8", b'data: {"error":"asked to fail"}\n\n')
    # An error before the model runs is a plain JSON error.
    status, headers, body = post(served, "/v2/models/echo/generate_stream", {"text_input": ["a", "b"]})
    assert (status, headers["content-type"]) == (400, "application/json") and b"proper shape" in body


def test_generate_stream_disconnect_cancels_the_request(served: Served) -> None:
    rid = f"g{secrets.token_hex(3)}"
    body = json.dumps({"text_input": "forever", "max_tokens": 0, "id": rid}).encode()
    sock = socket.create_connection(("127.0.0.1", served.port), timeout=10)
    try:
        sock.sendall(b"POST /v2/models/tokens/generate_stream HTTP/1.1\r\nHost: x\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        got = b""
        while got.count(b"data: ") < 3:  # it is streaming
            got += sock.recv(4096)
        assert b"200 OK" in got and f'"id":"{rid}"'.encode() in got
    finally:
        sock.close()
    wait_until((served.marks / f"cancelled-{rid}").exists, 10, "the model to see the cancellation")
    assert post(served, "/v2/models/tokens/generate", {"text_input": "ok", "max_tokens": 1})[0] == 200


def test_a_final_response_without_tensors_is_a_response(served: Served) -> None:
    # Measured with Triton 2.51: send(InferenceResponse([]), flags=COMPLETE_FINAL) is a response
    # of its own (the bare flag, send(flags=COMPLETE_FINAL), is not), on every protocol.
    status, _, body = post(served, "/v2/models/tokens/generate",
                           {"text_input": "lastempty", "max_tokens": 0})
    assert (status, json.loads(body)) == (200, {"model_name": "tokens", "model_version": "1"})
    status, _, body = post(served, "/v2/models/tokens/generate_stream",
                           {"text_input": "lastempty", "max_tokens": 1})
    events = [json.loads(line[len(b"data: "):]) for line in body.split(b"\n\n") if line]
    assert status == 200 and [e.get("index") for e in events] == [0, None]
    assert events[1] == {"model_name": "tokens", "model_version": "1"}

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{served.grpc_port}")
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        text = grpcclient.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.array([b"lastempty"], dtype=np.object_))
        n = grpcclient.InferInput("max_tokens", [1], "INT32")
        n.set_data_from_numpy(np.array([0], dtype=np.int32))
        client.async_stream_infer("tokens", [text, n], request_id="e")  # no empty-final flag
        result, error = got.get(timeout=10)
        assert error is None
        resp = result.get_response()
        assert (resp.id, resp.model_version, list(resp.outputs)) == ("e", "1", [])
        assert resp.parameters["triton_final_response"].bool_param
    finally:
        client.stop_stream()
        client.close()
