"""A model that forks (os.fork, a multiprocessing pool) gets a child that shares the stub's
socket but none of its threads. With Triton such a child's BLS call hangs; here every pb_utils
call that needs the server fails at once in the child, with a clear error, before it touches
shared memory, and the stub itself carries on. The child dies with its stub."""
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
    calls = {
        "exec": lambda: pb_utils.InferenceRequest(
            model_name="double", inputs=[x], requested_output_names=["OUT"]).exec(),
        "shm_tensor": lambda: pb_utils.empty_shm_tensor("OUT", [4], np.float32),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = "no error"
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


@pytest.fixture
def repo(tmp_path):
    path = tmp_path / "repo"
    write_model(path, "forker", FORKER_PY, io_config())
    write_model(path, "double", DOUBLE_PY, io_config())
    return path


def test_server_calls_fail_at_once_in_a_forked_child(repo, shm_prefix):
    with serving(repo, shm_prefix) as srv:
        r = infer(srv.model("forker"), {"IN": np.array([1.5], np.float32)}, wait=20)
        assert r.error is None, r.error
        assert r.outputs["OUT"].to_numpy().tolist() == [3.0]
        child = json.loads(r.parameters["child"])
        for call in ("exec", "shm_tensor"):
            assert "not supported in a process forked by the model" in child[call], child
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
