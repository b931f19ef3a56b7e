"""System shared memory where tritonpy once differed from Triton 2.51 (compared side by side):
a region that a request in flight will write an output into cannot be unregistered until the
request ends, as in Triton (tritonpy used to unregister it and fail the request at its end,
its output lost); an output that asks for both shared memory and classification is refused,
as in Triton (tritonpy wrote the classes into the region); errors name the key as the client
gave it, and a shared-memory parameter of the wrong type names its tensor and what it must
be."""
from __future__ import annotations

import http.client
import json
import secrets
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, Callable

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException
from tritonclient.utils import shared_memory as shm_utils

from _serve import Serve, serve_repo

GATED = """\
import os, time
import triton_python_backend_utils as pb_utils
DIR = {dir!r}
class TritonPythonModel:
    def execute(self, requests):
        open(os.path.join(DIR, "started"), "w").close()
        deadline = time.monotonic() + 30
        while not os.path.exists(os.path.join(DIR, "go")) and time.monotonic() < deadline:
            time.sleep(0.01)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT",
                    pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() * 3)])
                for r in requests]
"""
GATED_CONFIG = """\
name: "gated"
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 16 ] } ]
"""


def _gated_server(serve: Callable[..., Serve], tmp_path: Path) -> tuple[Serve, int, int, Path]:
    gate = tmp_path / "gate"
    gate.mkdir()
    (tmp_path / "repo" / "gated" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "gated" / "config.pbtxt").write_text(GATED_CONFIG)
    (tmp_path / "repo" / "gated" / "1" / "model.py").write_text(GATED.format(dir=str(gate)))
    server, http_port, grpc_port = serve_repo(serve, tmp_path / "repo")
    return server, http_port, grpc_port, gate


class _InFlight:
    """One request to ``gated`` in a thread, held in ``execute`` until :meth:`finish`; its
    client is made in that thread (tritonclient's HTTP client serves only the thread that made
    it)."""

    def __init__(self, url: str, mod: Any, gate: Path, in_region: str | None,
                 out_region: str | None) -> None:
        self.gate = gate
        inp = mod.InferInput("IN", [16], "FP32")
        if in_region is None:
            inp.set_data_from_numpy(np.ones(16, np.float32))
        else:
            inp.set_shared_memory(in_region, 64)
        outs = None
        if out_region is not None:
            out = mod.InferRequestedOutput("OUT")
            out.set_shared_memory(out_region, 64, offset=1024)
            outs = [out]
        self.result: Any = None
        self.error: Exception | None = None

        def run() -> None:
            client = mod.InferenceServerClient(url)
            try:
                self.result = client.infer("gated", [inp], outputs=outs)
            except Exception as exc:  # reported by finish()
                self.error = exc
            finally:
                client.close()
        self.thread = threading.Thread(target=run)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not (gate / "started").exists():
            assert time.monotonic() < deadline and self.thread.is_alive(), self.error
            time.sleep(0.01)

    def finish(self) -> Any:
        (self.gate / "go").touch()
        self.thread.join(30)
        (self.gate / "go").unlink()
        (self.gate / "started").unlink()
        if self.error is not None:
            raise self.error
        return self.result


def test_a_region_a_request_in_flight_writes_to_stays_registered_until_it_ends(
        serve: Callable[..., Serve], tmp_path: Path,
        regions: Callable[[int], tuple[str, Any]]) -> None:
    server, http_port, grpc_port, gate = _gated_server(serve, tmp_path)
    (key_a, a), (key_b, _) = regions(4096), regions(4096)
    http = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}")
    grpcc = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    try:
        shm_utils.set_shared_memory_region(a, [np.arange(16, dtype=np.float32)])
        for mod, port in ((httpclient, http_port), (grpcclient, grpc_port)):
            http.register_system_shared_memory("r", "/" + key_a, 4096)
            http.register_system_shared_memory("s", "/" + key_b, 4096)
            shm_utils.set_shared_memory_region(a, [np.zeros(16, np.float32)], offset=1024)
            req = _InFlight(f"127.0.0.1:{port}", mod, gate, "r", "r")
            with pytest.raises(InferenceServerException) as err:  # that one: refused
                grpcc.unregister_system_shared_memory("r")
            assert err.value.status() == "StatusCode.INTERNAL"
            assert err.value.message() == \
                "Cannot unregister shared memory region 'r', it is currently in use."
            with pytest.raises(InferenceServerException) as err:  # all: the others go
                http.unregister_system_shared_memory()
            assert err.value.status() == "500"
            assert err.value.message() == ("Failed to unregister the following system shared "
                                           "memory regions: r (in use by requests in flight)")
            assert [r["name"] for r in http.get_system_shared_memory_status()] == ["r"]
            req.finish()
            assert shm_utils.get_contents_as_numpy(a, np.float32, [16], offset=1024).tolist() \
                == [3.0 * i for i in range(16)]
            http.unregister_system_shared_memory("r")  # the request is over: free again
            assert http.get_system_shared_memory_status() == []

        # A region only read from is copied as the request arrives: it may go at once, and
        # the request is served (Triton refuses the unregister until the request ends).
        http.register_system_shared_memory("r", "/" + key_a, 4096)
        req = _InFlight(f"127.0.0.1:{http_port}", httpclient, gate, "r", None)
        http.unregister_system_shared_memory("r")
        assert req.finish().as_numpy("OUT").tolist() == [3.0 * i for i in range(16)]

        # A request that fails lets its region go too.
        http.register_system_shared_memory("r", "/" + key_a, 4096)
        out = grpcclient.InferRequestedOutput("OUT")
        out.set_shared_memory("r", 32)
        inp = grpcclient.InferInput("IN", [16], "FP32")
        inp.set_data_from_numpy(np.ones(16, np.float32))
        (gate / "go").touch()
        with pytest.raises(InferenceServerException, match="should be at least 64 bytes"):
            grpcc.infer("gated", [inp], outputs=[out])
        grpcc.unregister_system_shared_memory("r")
        assert server.proc.poll() is None
    finally:
        http.close()
        grpcc.close()


CLASSES = """\
name: "classes"
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""
IDENTITY = """\
import triton_python_backend_utils as pb_utils
class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT",
                    pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())]) for r in requests]
"""


def _post(port: int, path: str, body: Any) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, json.dumps(body))
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_shm_parameters_and_registrations_that_cannot_work_get_clear_errors(
        serve: Callable[..., Serve], tmp_path: Path,
        regions: Callable[[int], tuple[str, Any]]) -> None:
    (tmp_path / "repo" / "classes" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "classes" / "config.pbtxt").write_text(CLASSES)
    (tmp_path / "repo" / "classes" / "1" / "model.py").write_text(textwrap.dedent(IDENTITY))
    server, http_port, grpc_port = serve_repo(serve, tmp_path / "repo")
    key, handle = regions(4096)
    http = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}")
    grpcc = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    try:
        # the key as the client gave it, with or without its "/"
        missing = f"tpyv{secrets.token_hex(4)}"
        for name in (missing, "/" + missing):
            with pytest.raises(InferenceServerException) as err:
                grpcc.register_system_shared_memory("x", name, 16)
            assert err.value.message() == f"Unable to open shared memory region: '{name}'"
        http.register_system_shared_memory("r", key, 4096)  # without "/" it works
        shm_utils.set_shared_memory_region(handle, [np.float32([1, 4, 2, 3])])

        # classification into shared memory (tritonclient refuses it itself; plain bodies
        # here): refused before the model runs, as in Triton
        refused = "output 'OUT' can't set both 'shared_memory_region' and 'classification'"
        window = {"shared_memory_region": "r", "shared_memory_byte_size": 64,
                  "shared_memory_offset": 1024}
        assert _post(http_port, "/v2/models/classes/infer", {
            "inputs": [{"name": "IN", "shape": [4], "datatype": "FP32", "data": [1, 4, 2, 3]}],
            "outputs": [{"name": "OUT", "parameters": {"classification": 2, **window}}]},
        ) == (400, {"error": refused})
        req = service_pb2.ModelInferRequest(model_name="classes")
        req.inputs.add(name="IN", datatype="FP32", shape=[4]).contents.fp32_contents.extend(
            [1, 4, 2, 3])
        out = req.outputs.add(name="OUT")
        out.parameters["classification"].int64_param = 2
        out.parameters["shared_memory_region"].string_param = "r"
        out.parameters["shared_memory_byte_size"].int64_param = 64
        out.parameters["shared_memory_offset"].int64_param = 1024
        with pytest.raises(grpc.RpcError) as rpc:
            grpcc._client_stub.ModelInfer(req)
        assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert rpc.value.details() == refused
        assert shm_utils.get_contents_as_numpy(handle, np.uint8, [64], offset=1024).tolist() \
            == [0] * 64

        # a parameter of the wrong type names its tensor and what it must be
        def body(**params: Any) -> dict[str, Any]:
            return {"inputs": [{"name": "IN", "shape": [4], "datatype": "FP32",
                                "parameters": {"shared_memory_region": "r",
                                               "shared_memory_byte_size": 16, **params}}]}
        for params, error in (
                ({"shared_memory_byte_size": "16"},
                 "Unable to parse 'shared_memory_byte_size' of tensor 'IN': expected a "
                 "non-negative integer, got '16'"),
                ({"shared_memory_offset": -4},
                 "Unable to parse 'shared_memory_offset' of tensor 'IN': expected a "
                 "non-negative integer, got -4"),
                ({"shared_memory_region": 7},
                 "Unable to parse 'shared_memory_region' of tensor 'IN': expected a string, "
                 "got 7")):
            assert _post(http_port, "/v2/models/classes/infer", body(**params)) == \
                (400, {"error": error})
        req = service_pb2.ModelInferRequest(model_name="classes")
        tensor = req.inputs.add(name="IN", datatype="FP32", shape=[4])
        tensor.parameters["shared_memory_region"].string_param = "r"
        tensor.parameters["shared_memory_byte_size"].string_param = "16"
        with pytest.raises(grpc.RpcError) as rpc:
            grpcc._client_stub.ModelInfer(req)
        assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert rpc.value.details() == ("Unable to parse 'shared_memory_byte_size' of tensor "
                                       "'IN': expected a non-negative integer, got '16'")
        # and the right ones work
        status, got = _post(http_port, "/v2/models/classes/infer", body())
        assert status == 200 and got["outputs"][0]["data"] == [1.0, 4.0, 2.0, 3.0]
        http.unregister_system_shared_memory()
        assert server.proc.poll() is None
    finally:
        http.close()
        grpcc.close()
