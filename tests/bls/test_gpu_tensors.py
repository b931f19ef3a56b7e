"""GPU tensors: outputs made on the GPU, and BLS calls that pass them between stubs by CUDA IPC.

There is no GPU here. The stubs import ``tests/fake_gpu``'s stand-in for CuPy and the CUDA
driver (the only mock the suite allows): its "device memory" is memfd memory that other
processes map through its IPC handles, so handles, offsets, lifetimes and the copies made are
real; only the CUDA calls are imitated. The host process never imports CuPy. The ``gpu``-marked
test at the end runs the same calls on a real GPU where there is one.
"""
from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import numpy as np
import pytest

from _gpu_models import (
    DOUBLE_CONFIG,
    FAKE_GPU,
    GPU_DOUBLE_PY,
    GPU_INPUTS,
    IO,
    TARGET_CONFIG,
    TARGET_PY,
)
from _models import serving_frontends, serving_models, wait_until

# Sends IN to the model named by its "target" parameter as a GPU tensor, with the
# preferred_memory its "memory" parameter names, and reports what came back.
CALLER_PY = """
import gc
import json
import cupy
import numpy as np
import triton_python_backend_utils as pb_utils

STATS = getattr(cupy, "_fake_stats", dict)
MEMORY = {"cpu": pb_utils.TRITONSERVER_MEMORY_CPU, "gpu": pb_utils.TRITONSERVER_MEMORY_GPU}

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            p = json.loads(r.parameters())
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            if p.get("usage"):
                gc.collect()
                report = {"used": cupy.get_default_memory_pool().used_bytes(),
                          "stats": STATS()}
            else:
                kw = {}
                if p["memory"] != "default":
                    kw["preferred_memory"] = pb_utils.PreferredMemory(MEMORY[p["memory"]], 0)
                sent = pb_utils.Tensor.from_dlpack("IN", cupy.asarray(x))
                resp = pb_utils.InferenceRequest(
                    model_name=p["target"], inputs=[sent], requested_output_names=["OUT", "REPORT"],
                    **kw).exec()
                if resp.has_error():
                    raise pb_utils.TritonModelException(resp.error().message())
                got = pb_utils.get_output_tensor_by_name(resp, "OUT")
                try:
                    got.as_numpy()
                    as_numpy = "ok"
                except pb_utils.TritonModelException as exc:
                    as_numpy = str(exc)
                target = pb_utils.get_output_tensor_by_name(resp, "REPORT").as_numpy()[0]
                report = {"is_cpu": got.is_cpu(), "as_numpy": as_numpy,
                          "values": got.to_cpu().as_numpy().tolist(),
                          "target": json.loads(target), "stats": STATS()}
                del resp, got, sent
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor(
                "REPORT", np.array([json.dumps(report).encode()], np.object_))]))
        return out
"""

# Decoupled: three GPU responses, IN + 0, IN + 1, IN + 2, through the response sender.
STREAM_PY = """
import cupy
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            x = cupy.asarray(pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())
            sender = r.get_response_sender()
            for i in range(3):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor.from_dlpack("OUT", x + i)]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

# Streams from gpu_stream with exec(decoupled=True) and the preferred_memory of its "memory"
# parameter; reports where each response's tensor landed and its values.
STREAM_CALLER_PY = """
import json
import cupy
import numpy as np
import triton_python_backend_utils as pb_utils

STATS = getattr(cupy, "_fake_stats", dict)

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            memory = json.loads(r.parameters())["memory"]
            kw = {} if memory == "default" else {"preferred_memory": pb_utils.PreferredMemory(
                pb_utils.TRITONSERVER_MEMORY_CPU, 0)}
            x = pb_utils.get_input_tensor_by_name(r, "IN")
            seen = []
            opened = STATS().get("ipc_open", 0)
            for resp in pb_utils.InferenceRequest(
                    model_name="gpu_stream", inputs=[x], requested_output_names=["OUT"],
                    **kw).exec(decoupled=True):
                t = pb_utils.get_output_tensor_by_name(resp, "OUT")
                if t is not None:
                    seen.append([t.is_cpu(), t.to_cpu().as_numpy().tolist()])
            seen.append(STATS().get("ipc_open", 0) - opened)  # handles this stub mapped
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor(
                "REPORT", np.array([json.dumps(seen).encode()], np.object_))]))
        return out
"""

CALLER_CONFIG = IO + 'output [ { name: "REPORT", data_type: TYPE_STRING, dims: [ 1 ] } ]\n'

MODELS = {
    "gpu_double": (GPU_DOUBLE_PY, DOUBLE_CONFIG),
    "gpu_target": (TARGET_PY, TARGET_CONFIG + GPU_INPUTS),
    "cpu_target": (TARGET_PY, TARGET_CONFIG),
    "caller": (CALLER_PY, CALLER_CONFIG),
    "gpu_stream": (STREAM_PY, DOUBLE_CONFIG + "model_transaction_policy { decoupled: true }\n"),
    "stream_caller": (STREAM_CALLER_PY, CALLER_CONFIG),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    mp = pytest.MonkeyPatch()
    mp.setenv("PYTHONPATH", os.pathsep.join([str(FAKE_GPU), os.environ.get("PYTHONPATH", "")]))
    try:
        with serving_models(tmp_path_factory.mktemp("gpu"), MODELS) as srv:
            yield srv
    finally:
        mp.undo()


def infer(server, model: str, x: np.ndarray, **params) -> dict[str, np.ndarray]:
    (resp,) = list(server.model(model).infer({"IN": x}, parameters=params))
    assert resp.error is None, resp.error.message
    return {n: t.to_numpy() for n, t in resp.outputs.items()}


def call(server, target: str, memory: str, x: np.ndarray) -> dict:
    out = infer(server, "caller", x, target=target, memory=memory)
    return json.loads(out["REPORT"][0])


def usage(server) -> dict:
    return json.loads(infer(server, "caller", np.zeros(1, np.float32), usage=True)["REPORT"][0])


@pytest.mark.parametrize("n", [0, 4, 1 << 18])  # empty, inline, and 1 MiB (by shm handle)
def test_a_gpu_output_reaches_the_client_on_the_cpu(server, n: int) -> None:
    x = np.arange(n, dtype=np.float32)
    out = infer(server, "gpu_double", x)
    np.testing.assert_array_equal(out["OUT"], x * 2)


def test_a_gpu_output_over_http_and_grpc(tmp_path: Path, monkeypatch) -> None:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    from _models import write_model

    monkeypatch.setenv("PYTHONPATH",
                       os.pathsep.join([str(FAKE_GPU), os.environ.get("PYTHONPATH", "")]))
    write_model(tmp_path, "gpu_double", GPU_DOUBLE_PY, DOUBLE_CONFIG)
    x = np.arange(6, dtype=np.float32)
    with serving_frontends(tmp_path) as (_, fe):
        for mod, url in ((httpclient, f"127.0.0.1:{fe.http_port}"),
                         (grpcclient, f"127.0.0.1:{fe.grpc_port}")):
            client = mod.InferenceServerClient(url)  # type: ignore[attr-defined]
            inp = mod.InferInput("IN", [6], "FP32")
            inp.set_data_from_numpy(x)
            res = client.infer("gpu_double", [inp])
            np.testing.assert_array_equal(res.as_numpy("OUT"), x * 2)
            client.close()


def test_a_gpu_input_reaches_a_gpu_model_by_handle_and_comes_back_as_itself(server) -> None:
    x = np.arange(1000, dtype=np.float32)
    r = call(server, "gpu_target", "default", x)
    # FORCE_CPU_ONLY_INPUT_TENSORS "no": the target got the caller's device memory, mapped
    # through its IPC handle, not copied.
    assert r["target"]["is_cpu"] is False
    assert r["target"]["stats"]["d2h"] == 0 and r["target"]["stats"]["h2d"] == 0
    assert r["target"]["stats"]["open_now"] == 1
    # No preferred_memory: the output stays where the target made it (Triton's default). It
    # is the caller's own memory, come back (CUDA would refuse to open its own handle).
    assert r["is_cpu"] is False
    assert r["as_numpy"] == "Tensor is stored in GPU and cannot be converted to NumPy."
    assert r["values"] == x.tolist()


def test_by_default_a_model_gets_gpu_inputs_on_the_cpu(server) -> None:
    x = np.arange(10, dtype=np.float32)
    r = call(server, "cpu_target", "default", x)
    assert r["target"]["is_cpu"] is True  # FORCE_CPU_ONLY_INPUT_TENSORS defaults to "yes"
    assert r["target"]["stats"]["d2h"] >= 1
    assert r["is_cpu"] is True and r["as_numpy"] == "ok"  # a CPU output stays on the CPU
    assert r["values"] == x.tolist()


def test_an_empty_gpu_tensor_goes_as_an_empty_one(server) -> None:
    r = call(server, "gpu_target", "default", np.zeros(0, np.float32))
    assert r["values"] == [] and r["target"]["is_cpu"] is True  # no device memory to map


def test_preferred_memory_puts_bls_outputs_where_asked(server) -> None:
    x = np.arange(5, dtype=np.float32)
    cpu = call(server, "gpu_target", "cpu", x)
    assert cpu["target"]["is_cpu"] is False and cpu["is_cpu"] is True
    assert cpu["values"] == x.tolist()
    gpu = call(server, "cpu_target", "gpu", x)
    assert gpu["target"]["is_cpu"] is True and gpu["is_cpu"] is False
    assert gpu["values"] == x.tolist()


def test_a_decoupled_models_gpu_responses_through_bls_and_to_a_client(server) -> None:
    x = np.arange(3, dtype=np.float32)
    want = [(x + i).tolist() for i in range(3)]
    report = json.loads(infer(server, "stream_caller", x, memory="default")["REPORT"][0])
    assert report[:3] == [[False, v] for v in want] and report[3] == 3  # mapped by handle
    # CPU asked for: the target copies its GPU outputs to the host, the caller maps nothing.
    report = json.loads(infer(server, "stream_caller", x, memory="cpu")["REPORT"][0])
    assert report == [[True, v] for v in want] + [0]
    got = [r.outputs["OUT"].to_numpy().tolist()
           for r in server.model("gpu_stream").infer({"IN": x}) if r.outputs]
    assert got == want


def test_device_memory_is_given_back_and_mappings_reused(server) -> None:
    first = call(server, "gpu_target", "default", np.ones(1 << 16, np.float32))
    for _ in range(20):
        call(server, "gpu_target", "default", np.ones(1 << 16, np.float32))
        last = call(server, "gpu_target", "cpu", np.ones(1 << 16, np.float32))
    # The caller's pool hands the same allocations out again for the inputs (two may take
    # turns: one is on its way back while the next call starts): the target maps each once and
    # keeps the mapping for the next call, instead of a cudaIpcOpenMemHandle per call (40).
    opened = last["target"]["stats"]["ipc_open"] - first["target"]["stats"]["ipc_open"]
    assert opened <= 2 and last["target"]["stats"]["open_now"] <= 16
    # Each call's GPU input lives in the caller until the target's view of it is gone and
    # the releases have come back through the host: then nothing is held, nothing open.
    after = wait_until(lambda: (lambda u: u if u["used"] == 0 else None)(usage(server)), 10,
                       "the caller's device memory to be given back")
    assert after["stats"]["open_now"] == 0
    gc.collect()


@pytest.mark.gpu
def test_gpu_tensors_on_a_real_gpu(tmp_path: Path) -> None:
    x = np.arange(1 << 16, dtype=np.float32)
    with serving_models(tmp_path, MODELS) as srv:
        np.testing.assert_array_equal(infer(srv, "gpu_double", x)["OUT"], x * 2)
        r = call(srv, "gpu_target", "default", x)
        assert (r["target"]["is_cpu"], r["is_cpu"], r["values"]) == (False, False, x.tolist())
        r = call(srv, "cpu_target", "default", x)
        assert (r["target"]["is_cpu"], r["is_cpu"], r["values"]) == (True, True, x.tolist())
        r = call(srv, "gpu_target", "cpu", x)
        assert (r["is_cpu"], r["values"]) == (True, x.tolist())
        r = call(srv, "cpu_target", "gpu", x)
        assert (r["is_cpu"], r["values"]) == (False, x.tolist())
        wait_until(lambda: usage(srv)["used"] == 0, 10, "the caller's device memory back")
