"""The response cache through the HTTP and gRPC frontends, compared with Triton 2.51 case by
case (``--cache-config local,size=N`` and ``response_cache { enable: true }``, the same
repository and requests run against both). What Triton does is said at each check; where
tritonpy answers otherwise on purpose, the check says why (README, "Response cache").
"""
from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm

from _models import COUNTING_PY, serving_frontends, write_model

pytestmark = pytest.mark.timeout(90)

COUNTING = """backend: "python"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ -1 ] },
         { name: "N", data_type: TYPE_INT64, dims: [ 1 ] } ]
instance_group [ { count: 1, kind: KIND_CPU } ]
response_cache { enable: true }
"""
# S = what the model got (A's elements and B), N as above.
STRINGS_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.n = 0

    def execute(self, requests):
        out = []
        for r in requests:
            self.n += 1
            a = pb_utils.get_input_tensor_by_name(r, "A").as_numpy()
            b = pb_utils.get_input_tensor_by_name(r, "B").as_numpy()
            s = b"|".join(list(a.flat)) + b"/" + str(int(b[0])).encode()
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("S", np.array([s], np.object_)),
                pb_utils.Tensor("N", np.array([self.n], np.int64))]))
        return out
"""
STRINGS = """backend: "python"
max_batch_size: 0
input [ { name: "A", data_type: TYPE_STRING, dims: [ -1 ] },
        { name: "B", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "S", data_type: TYPE_STRING, dims: [ 1 ] },
         { name: "N", data_type: TYPE_INT64, dims: [ 1 ] } ]
instance_group [ { count: 1, kind: KIND_CPU } ]
response_cache { enable: true }
"""
# An ensemble, itself not cached, whose one step (the cached model) is asked for OUT alone.
STEP_ENSEMBLE = """platform: "ensemble"
max_batch_size: 0
input [ { name: "EIN", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "EOUT", data_type: TYPE_FP32, dims: [ -1 ] } ]
ensemble_scheduling { step [ { model_name: "cached" model_version: -1
  input_map { key: "IN" value: "EIN" } output_map { key: "OUT" value: "EOUT" } } ] }
"""


@pytest.fixture(scope="module")
def urls(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    write_model(repo, "cached", COUNTING_PY, COUNTING)
    write_model(repo, "strings", STRINGS_PY, STRINGS)
    write_model(repo, "ens", "", STEP_ENSEMBLE)
    with serving_frontends(repo, response_cache_size=1 << 20) as (_, fe):
        yield f"127.0.0.1:{fe.http_port}", f"127.0.0.1:{fe.grpc_port}"


def _input(mod, name, arr, datatype, binary=True):
    i = mod.InferInput(name, list(arr.shape), datatype)
    if mod is httpclient:
        i.set_data_from_numpy(arr, binary_data=binary)
    else:
        i.set_data_from_numpy(arr)
    return i


def _strings(client, mod, a, binary=True):
    r = client.infer("strings", [_input(mod, "A", np.array(a, np.object_), "BYTES", binary),
                                 _input(mod, "B", np.array([7], np.int32), "INT32", binary)])
    return r.as_numpy("S")[0], int(r.as_numpy("N")[0])


def test_json_binary_and_grpc_forms_of_the_same_strings_share_one_entry(urls):
    # Triton 2.51: the key is the inputs' bytes, whatever the protocol or the encoding; the
    # order of the inputs in the request does not count, the split into elements does.
    http = httpclient.InferenceServerClient(urls[0])
    grpc = grpcclient.InferenceServerClient(urls[1])
    try:
        assert _strings(http, httpclient, [b"x", b"yz"], binary=False) == (b"x|yz/7", 1)
        assert _strings(http, httpclient, [b"x", b"yz"]) == (b"x|yz/7", 1)
        assert _strings(grpc, grpcclient, [b"x", b"yz"]) == (b"x|yz/7", 1)
        swapped = http.infer("strings", [_input(httpclient, "B", np.array([7], np.int32), "INT32"),
                                         _input(httpclient, "A", np.array([b"x", b"yz"],
                                                                          np.object_), "BYTES")])
        assert int(swapped.as_numpy("N")[0]) == 1
        assert _strings(http, httpclient, [b"xy", b"z"]) == (b"xy|z/7", 2)
        assert _strings(grpc, grpcclient, [b"\xff", b"z"]) == (b"\xff|z/7", 3)
        assert _strings(http, httpclient, [b"\xff", b"z"]) == (b"\xff|z/7", 3)
    finally:
        http.close()
        grpc.close()


def test_a_hit_fills_the_clients_output_region_and_classifies(urls, shm_prefix):
    # Triton 2.51: a hit writes its outputs into the region the request names, and the
    # classification extension works on the kept tensor (an entry made for a top-k request
    # answers a plain one with the raw floats, and the other way round).
    http = httpclient.InferenceServerClient(urls[0])
    name = f"{shm_prefix}out"
    region = shm.create_shared_memory_region(name, "/" + name, 64)
    try:
        http.register_system_shared_memory(name, "/" + name, 64)
        out = httpclient.InferRequestedOutput("OUT", binary_data=True)
        out.set_shared_memory(name, 16)
        x = np.float32([7, 8])
        for n in (1, 1):
            shm.set_shared_memory_region(region, [np.zeros(4, np.float32)])
            r = http.infer("cached", [_input(httpclient, "IN", x, "FP32")],
                           outputs=[out, httpclient.InferRequestedOutput("N")])
            assert int(r.as_numpy("N")[0]) == n
            np.testing.assert_array_equal(shm.get_contents_as_numpy(region, np.float32, [2]),
                                          x * 2)
        http.unregister_system_shared_memory(name)

        x = np.float32([3, 1, 2])
        top = [httpclient.InferRequestedOutput("OUT", class_count=2),
               httpclient.InferRequestedOutput("N")]
        plain = [httpclient.InferRequestedOutput("OUT"), httpclient.InferRequestedOutput("N")]
        r = http.infer("cached", [_input(httpclient, "IN", x, "FP32")], outputs=top)
        n = int(r.as_numpy("N")[0])
        assert list(r.as_numpy("OUT")) == [b"6.000000:0", b"4.000000:2"]
        r = http.infer("cached", [_input(httpclient, "IN", x, "FP32")], outputs=plain)
        assert int(r.as_numpy("N")[0]) == n  # a hit
        np.testing.assert_array_equal(r.as_numpy("OUT"), x * 2)
        r = http.infer("cached", [_input(httpclient, "IN", x, "FP32")],
                       outputs=[httpclient.InferRequestedOutput("OUT", class_count=1)])
        assert list(r.as_numpy("OUT")) == [b"6.000000:0"]
    finally:
        shm.destroy_shared_memory_region(region)
        http.close()


def test_where_triton_keeps_too_little(urls):
    http = httpclient.InferenceServerClient(urls[0])
    try:
        def run(model, x, **kwargs):
            return http.infer(model, [_input(httpclient, "EIN" if model == "ens" else "IN",
                                             np.asarray(x, np.float32), "FP32")], **kwargs)

        # An empty output is kept like any other (Triton 2.51 cannot keep it: it logs "Failed
        # to insert key ... Response buffer from output was nullptr" and runs it every time).
        first = int(run("cached", []).as_numpy("N")[0])
        again = run("cached", [])
        assert int(again.as_numpy("N")[0]) == first
        assert again.as_numpy("OUT").shape == (0,)

        # An ensemble step asked for OUT alone keeps an entry of OUT alone; a direct request
        # for every output is a miss and gets them all (Triton 2.51 answers it from that
        # entry, without N).
        def executions():
            stats = http.get_inference_statistics("cached")["model_stats"][0]
            return stats["execution_count"]

        np.testing.assert_array_equal(run("ens", [41]).as_numpy("EOUT"), [82])
        ran = executions()
        np.testing.assert_array_equal(run("ens", [41]).as_numpy("EOUT"), [82])
        assert executions() == ran  # a hit in the step
        direct = run("cached", [41])
        assert executions() == ran + 1
        assert {o["name"] for o in direct.get_response()["outputs"]} == {"OUT", "N"}
        assert int(run("cached", [41]).as_numpy("N")[0]) == int(direct.as_numpy("N")[0])
    finally:
        http.close()
