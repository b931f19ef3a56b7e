"""``InferenceRequest.async_exec()`` sends the request at once, as Triton's does (it returns a
Future): a call not awaited yet runs meanwhile, one never awaited runs too, and without a
running event loop it fails as Triton's does (real stubs)."""
from __future__ import annotations

import numpy as np
import pytest

from _models import new_prefix, serving, write_model

pytestmark = pytest.mark.timeout(60)

# Writes the file its request names (parameter "mark"), then answers OUT = IN.
MARKER_PY = """
import json
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            open(json.loads(r.parameters())["mark"], "w").close()
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())]) for r in requests]
"""

# mode "later": calls async_exec, then (its event loop blocked) waits up to 10 s for the
# target's mark, then awaits the call; "forget": never awaits it, and waits for the mark;
# "no_loop" (a plain execute): calls async_exec outside any event loop. OUT: [mark seen,
# the response's OUT or -1].
CALLER_PY = """
import asyncio, json, os, time
import numpy as np
import triton_python_backend_utils as pb_utils

def wait_for(path):
    deadline = time.monotonic() + 10
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    return os.path.exists(path)

class TritonPythonModel:
    async def execute(self, requests):
        out = []
        for r in requests:
            params = json.loads(r.parameters())
            bls = pb_utils.InferenceRequest(
                model_name="marker", requested_output_names=["OUT"],
                inputs=[pb_utils.Tensor("IN", np.array([5.0], np.float32))],
                parameters={"mark": params["mark"]})
            call = bls.async_exec()
            seen = wait_for(params["mark"])  # (blocks the loop: only a call sent already runs)
            value = -1.0
            if params["mode"] == "later":
                resp = await call
                value = float(pb_utils.get_output_tensor_by_name(resp, "OUT").as_numpy()[0])
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor(
                "OUT", np.array([float(seen), value], np.float32))]))
        return out
"""

NO_LOOP_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        bls = pb_utils.InferenceRequest(
            model_name="marker", requested_output_names=["OUT"],
            inputs=[pb_utils.Tensor("IN", np.array([5.0], np.float32))])
        try:
            bls.async_exec()
            words = "no error"
        except RuntimeError as exc:
            words = str(exc)
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", np.array([words.encode()], np.object_))]) for r in requests]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    write_model(repo, "marker", MARKER_PY)
    write_model(repo, "caller", CALLER_PY)
    write_model(repo, "no_loop", NO_LOOP_PY, 'backend: "python"\nmax_batch_size: 0\n'
                'input [ { name: "IN", data_type: TYPE_FP32, dims: [ -1 ] } ]\n'
                'output [ { name: "OUT", data_type: TYPE_STRING, dims: [ 1 ] } ]\n')
    with serving(repo, new_prefix()) as srv:
        yield srv


@pytest.mark.parametrize("mode, value", [("later", 5.0), ("forget", -1.0)])
def test_async_exec_sends_the_request_before_it_is_awaited(server, tmp_path, mode,
                                                           value) -> None:
    # (QA) async_exec() returned a coroutine that sent nothing until awaited: a call never
    # awaited never ran ("coroutine ... was never awaited"), and one awaited later had not
    # run meanwhile (Triton runs both).
    mark = str(tmp_path / f"{mode}.mark")
    resp = server.model("caller").infer({"IN": np.zeros(1, np.float32)},
                                        parameters={"mode": mode, "mark": mark}).get(timeout=30)
    assert resp.error is None, resp.error
    assert resp.outputs["OUT"].to_numpy().tolist() == [1.0, value]


def test_async_exec_needs_a_running_event_loop_as_in_triton(server) -> None:
    # (QA) asyncio.run(request.async_exec()) worked, where Triton raises "no running event
    # loop": code that ran here failed there.
    resp = server.model("no_loop").infer({"IN": np.zeros(1, np.float32)}).get(timeout=30)
    assert resp.error is None, resp.error
    assert resp.outputs["OUT"].to_numpy().tolist() == [b"no running event loop"]
