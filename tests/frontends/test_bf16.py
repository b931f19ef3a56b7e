"""BF16 tensors, as Triton's Python backend carries them: numpy has no bfloat16, so data
arrives as ``ml_dtypes.bfloat16`` arrays (what tritonclient sends and returns), a model reads
and writes them through DLPack (``as_numpy()`` raises Triton's error), and they travel in
binary form only (JSON refused in Triton's words). In-process, over HTTP and gRPC with the real
tritonclient, and through BLS. No torch here: the DLPack capsule's bfloat16 dtype is read back
from the capsule itself.
"""
from __future__ import annotations

import ctypes
import json

import ml_dtypes
import numpy as np
import pytest
from _models import infer, serving_frontends, write_model

from tritonpy.stub import pb_utils

pytestmark = pytest.mark.timeout(90)

BF16_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_BF16, dims: [ -1 ] } ]
output [ { name: "OUT", data_type: TYPE_BF16, dims: [ -1 ] } ]
"""

# OUT = IN through DLPack, as Triton's own BF16 identity model does (with torch there).
IDENTITY_PY = """
import json
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN")
            try:
                x.as_numpy()
                refused = ""
            except pb_utils.TritonModelException as exc:
                refused = str(exc)
            out.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor.from_dlpack("OUT", x.to_dlpack())],
                parameters={"dtype": x.triton_dtype(), "refused": refused}))
        return out
"""

# Calls bf16_identity through BLS with its own input.
BLS_PY = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            resp = pb_utils.InferenceRequest(
                model_name="bf16_identity", requested_output_names=["OUT"],
                inputs=[pb_utils.get_input_tensor_by_name(r, "IN")]).exec()
            if resp.has_error():
                raise pb_utils.TritonModelException(resp.error().message())
            out.append(pb_utils.InferenceResponse(
                [pb_utils.get_output_tensor_by_name(resp, "OUT")]))
        return out
"""

X = np.array([1.5, -2.25, 3.0, 1e30, 0.0], dtype=ml_dtypes.bfloat16)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    write_model(repo, "bf16_identity", IDENTITY_PY, BF16_CONFIG)
    write_model(repo, "bf16_bls", BLS_PY, BF16_CONFIG)
    with serving_frontends(repo) as (server, fe):
        yield server, fe


def _same(got: np.ndarray) -> None:
    assert got.dtype == ml_dtypes.bfloat16
    assert got.view(np.uint16).tolist() == X.view(np.uint16).tolist()  # bit for bit


def test_in_process_and_through_bls(served) -> None:
    server, _ = served
    resp = infer(server.model("bf16_identity"), {"IN": X})
    assert resp.error is None, resp.error
    _same(resp.outputs["OUT"].to_numpy())
    assert resp.parameters["dtype"] == 14  # TYPE_BF16
    assert resp.parameters["refused"] == (
        "Tensor dtype is BF16 and cannot be converted to NumPy. Use to_dlpack() and "
        "from_dlpack() instead.")
    resp = infer(server.model("bf16_bls"), {"IN": X})
    assert resp.error is None, resp.error
    _same(resp.outputs["OUT"].to_numpy())


def test_http_binary_and_grpc_with_tritonclient(served) -> None:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    _, fe = served
    for mod, port in ((httpclient, fe.http_port), (grpcclient, fe.grpc_port)):
        client = mod.InferenceServerClient(f"127.0.0.1:{port}")
        try:
            inp = mod.InferInput("IN", [len(X)], "BF16")
            if mod is httpclient:
                inp.set_data_from_numpy(X, binary_data=True)
            else:
                inp.set_data_from_numpy(X)
            result = client.infer("bf16_identity", [inp])
            _same(result.as_numpy("OUT"))
        finally:
            client.close()


def test_http_json_bf16_is_refused_in_tritons_words(served) -> None:
    import http.client

    _, fe = served
    body = json.dumps({"inputs": [{"name": "IN", "datatype": "BF16", "shape": [2],
                                   "data": [1.0, 2.0]}]})
    conn = http.client.HTTPConnection("127.0.0.1", fe.http_port)
    try:
        conn.request("POST", "/v2/models/bf16_identity/infer", body=body)
        resp = conn.getresponse()
        assert (resp.status, json.loads(resp.read())) == (400, {
            "error": "receiving BF16 data via JSON is not supported. Please use the binary data "
                     "format for input IN"})
    finally:
        conn.close()


def _capsule_dtype(capsule) -> tuple[int, int, int]:
    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype = ctypes.c_void_p
    get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    name = get_name(capsule)
    offset = {b"dltensor": 20, b"dltensor_versioned": 52}[name]
    code, bits = (ctypes.c_uint8 * 2).from_address(get_pointer(capsule, name) + offset)
    lanes = ctypes.c_uint16.from_address(get_pointer(capsule, name) + offset + 2).value
    return code, bits, lanes


def test_a_bf16_tensor_is_a_dlpack_bfloat16_both_ways() -> None:
    t = pb_utils.Tensor("x", X)
    assert t.triton_dtype() == 14
    # What torch.utils.dlpack.from_dlpack reads: kDLBfloat (4), 16 bits, 1 lane.
    assert _capsule_dtype(t.to_dlpack()) == (4, 16, 1)
    assert _capsule_dtype(t.__dlpack__(max_version=(1, 0))) == (4, 16, 1)
    back = pb_utils.Tensor.from_dlpack("y", t.to_dlpack())  # a bare capsule, as from torch
    assert back.triton_dtype() == 14 and np.shares_memory(back._arr, X)
    assert pb_utils.Tensor.from_dlpack("z", t).triton_dtype() == 14  # via __dlpack__
    assert pb_utils.triton_to_numpy_type(14) is ml_dtypes.bfloat16
    assert pb_utils.numpy_to_triton_type(ml_dtypes.bfloat16) == 14
