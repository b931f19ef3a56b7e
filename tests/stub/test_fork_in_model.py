"""A model that forks (os.fork, a multiprocessing pool) gets a child that shares the stub's
socket but none of its threads. As with Triton 2.51 (its QA test_multiprocess), BLS works in
the child: sync, decoupled, async, errors included, through the child's own link to its stub.
Every other pb_utils call that needs the server fails at once in the child, with a clear
error, before it touches shared memory, and the stub itself carries on. The child dies with
its stub."""
from __future__ import annotations

import json
import os
import signal

import numpy as np
import psutil
import pytest

from _models import infer, io_config, serving, wait_for, write_model

pytestmark = pytest.mark.timeout(60)

FORKER_PY = '''
import json
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils


def attempts():
    """What a forked child gets for each call that needs the server."""
    x = pb_utils.Tensor("IN", np.ones(1 << 16, np.float32))  # big: it would go through shm

    def request(model):
        return pb_utils.InferenceRequest(model_name=model, inputs=[x],
                                         requested_output_names=["OUT"])

    def exec_sum():
        resp = request("double").exec()
        return float(pb_utils.get_output_tensor_by_name(resp, "OUT").as_numpy().sum())

    def unknown():
        err = request("nope").exec().error()
        return [err.code() == pb_utils.TritonError.NOT_FOUND, err.message()]

    def stream():
        return [float(pb_utils.get_output_tensor_by_name(r, "OUT").as_numpy()[0])
                for r in request("repeat").exec(decoupled=True) if r.output_tensors()]

    def async_sum():
        import asyncio

        async def call():  # (async_exec needs a running event loop, as Triton's)
            return await request("double").async_exec()
        resp = asyncio.run(call())
        return float(pb_utils.get_output_tensor_by_name(resp, "OUT").as_numpy().sum())

    calls = {
        "exec": exec_sum, "unknown": unknown, "stream": stream, "async": async_sum,
        "shm_tensor": lambda: pb_utils.empty_shm_tensor("OUT", [4], np.float32),
    }
    out = {}
    for name, call in calls.items():
        try:
            out[name] = call()
        except pb_utils.TritonModelException as exc:
            out[name] = exc.message()
    return out


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child
                os.close(read)
                os.write(write, json.dumps(attempts()).encode())
                os.close(write)
                if json.loads(r.parameters()).get("linger"):
                    time.sleep(60)  # outlives the request: must die with the stub
                os._exit(0)
            os.close(write)
            with os.fdopen(read) as fh:
                report = fh.read()
            if not json.loads(r.parameters()).get("linger"):
                os.waitpid(pid, 0)
            # The stub itself still makes BLS calls.
            x = pb_utils.get_input_tensor_by_name(r, "IN")
            resp = pb_utils.InferenceRequest(
                model_name="double", inputs=[x], requested_output_names=["OUT"]).exec()
            out.append(pb_utils.InferenceResponse(
                [pb_utils.get_output_tensor_by_name(resp, "OUT")],
                parameters={"child": report, "child_pid": pid}))
        return out
'''

DOUBLE_PY = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() * 2)])
            for r in requests]
'''


REPEAT_PY = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            sender = r.get_response_sender()
            for k in (1, 2, 3):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x * k)]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''

# As Triton's QA test_multiprocess: a fork pool's workers each make a BLS call.
POOLED_PY = '''
import multiprocessing

import numpy as np
import triton_python_backend_utils as pb_utils


def doubled(value):
    resp = pb_utils.InferenceRequest(
        model_name="double", inputs=[pb_utils.Tensor("IN", np.array([value], np.float32))],
        requested_output_names=["OUT"]).exec()
    if resp.has_error():
        return -1.0
    return float(pb_utils.get_output_tensor_by_name(resp, "OUT").as_numpy()[0])


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            values = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy().tolist()
            with multiprocessing.get_context("fork").Pool(2) as pool:
                got = pool.map(doubled, values)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor(
                "OUT", np.array(got, np.float32))]))
        return out
'''


@pytest.fixture
def repo(tmp_path):
    path = tmp_path / "repo"
    write_model(path, "forker", FORKER_PY, io_config())
    write_model(path, "double", DOUBLE_PY, io_config())
    write_model(path, "repeat", REPEAT_PY, io_config(
        extra="model_transaction_policy { decoupled: true }\n"))
    write_model(path, "pooled", POOLED_PY, io_config())
    return path


def test_bls_works_in_a_forked_child_and_other_server_calls_fail_at_once(repo, shm_prefix):
    with serving(repo, shm_prefix) as srv:
        r = infer(srv.model("forker"), {"IN": np.array([1.5], np.float32)}, wait=20)
        assert r.error is None, r.error
        assert r.outputs["OUT"].to_numpy().tolist() == [3.0]
        child = json.loads(r.parameters["child"])
        assert child["exec"] == 2.0 * (1 << 16), child
        assert child["async"] == 2.0 * (1 << 16), child
        assert child["stream"] == [1.0, 2.0, 3.0], child
        found, message = child["unknown"]
        assert found is True and "nope" in message, child
        assert "not supported in a process forked by the model" in child["shm_tensor"], child
        # And again: the stub's channel and pool are intact.
        r = infer(srv.model("forker"), {"IN": np.array([2.0], np.float32)}, wait=20)
        assert r.error is None and r.outputs["OUT"].to_numpy().tolist() == [4.0]


def test_a_forked_child_dies_with_its_stub(repo, shm_prefix):
    with serving(repo, shm_prefix) as srv:
        r = infer(srv.model("forker"), {"IN": np.array([1.0], np.float32)}, wait=20,
                  parameters={"linger": True})
        assert r.error is None, r.error
        child = psutil.Process(int(r.parameters["child_pid"]))
        try:
            (inst,) = srv.runtime("forker").instances
            os.kill(inst.stub.pid, signal.SIGKILL)
            assert wait_for(lambda: not child.is_running() or child.status() == "zombie",
                            timeout=10)
        finally:
            if child.is_running():
                child.kill()


def test_a_fork_pool_makes_bls_calls(repo, shm_prefix):
    # As Triton 2.51, which passes its QA test_multiprocess; tritonpy refused such calls.
    with serving(repo, shm_prefix) as srv:
        for _ in range(2):  # the second time with new workers, and the links of the first gone
            r = infer(srv.model("pooled"), {"IN": np.arange(1, 7, dtype=np.float32)}, wait=30)
            assert r.error is None, r.error
            assert r.outputs["OUT"].to_numpy().tolist() == [2.0, 4.0, 6.0, 8.0, 10.0, 12.0]
        (inst,) = srv.runtime("pooled").instances
        # The stub's threads serving the workers' links end with them.
        assert wait_for(lambda: "stub-forked-bls" not in _thread_names(inst.stub.pid),
                        timeout=10)


def _thread_names(pid: int) -> list[str]:
    names = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/comm") as fh:
                names.append(fh.read().strip())
        except OSError:  # it ended meanwhile
            pass
    return names
