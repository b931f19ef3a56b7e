"""Implicit state (``sequence_batching.state``) as Triton 2.51's Python backend has it
(measured with the same model.py on both): the model gets each state input with its initial
value (zeros, or ``<model dir>/initial_state/<data_file>``) at every step; what it returns as
the state output is not carried to the next step, nor sent to the client. A model that reads
its state input used to get none (and failed every request).
"""
from __future__ import annotations

import numpy as np
import pytest

import tritonpy
from _models import new_prefix, serving, write_model

pytestmark = pytest.mark.timeout(60)

START, END = 1, 2

ACC_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            st = pb_utils.get_input_tensor_by_name(r, "INPUT_STATE").as_numpy()
            s = (st + x).astype(np.float32)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", s),
                                                   pb_utils.Tensor("OUTPUT_STATE", s)]))
        return out
"""


def _config(initial: str) -> str:
    return f"""
backend: "python"
max_batch_size: 4
input [ {{ name: "IN" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] }} ]
sequence_batching {{
  state [ {{ input_name: "INPUT_STATE" output_name: "OUTPUT_STATE" data_type: TYPE_FP32
            dims: [ 1 ] {initial} }} ]
}}
"""


def _steps(model, cid: int) -> list[float]:
    got = []
    for i, flags in enumerate((START, 0, END)):
        resp = model.infer({"IN": np.array([[i + 1]], np.float32)}, correlation_id=cid,
                           flags=flags).get(timeout=30)
        assert resp.error is None, resp.error
        assert list(resp.outputs) == ["OUT"]  # the state output is the server's, not sent
        got.append(float(resp.outputs["OUT"].to_numpy().reshape(-1)[0]))
    return got


def test_the_state_input_holds_its_initial_value_at_every_step(tmp_path):
    write_model(tmp_path, "zeros", ACC_PY, _config(
        'initial_state: { data_type: TYPE_FP32 dims: [ 1 ] zero_data: true name: "z" }'))
    write_model(tmp_path, "bare", ACC_PY, _config(""))
    mdir = write_model(tmp_path, "from_file", ACC_PY, _config(
        'initial_state: { data_type: TYPE_FP32 dims: [ 1 ] data_file: "ten" name: "f" }'))
    (mdir / "initial_state").mkdir()
    (mdir / "initial_state" / "ten").write_bytes(np.array([10], np.float32).tobytes())
    with serving(tmp_path, new_prefix()) as server:
        assert _steps(server.model("zeros"), 7) == [1.0, 2.0, 3.0]
        assert _steps(server.model("bare"), 8) == [1.0, 2.0, 3.0]
        assert _steps(server.model("from_file"), 9) == [11.0, 12.0, 13.0]
        # A state input is the server's to give: a client that sends one is refused.
        with pytest.raises(tritonpy.InvalidArgumentError, match="INPUT_STATE"):
            server.model("zeros").infer(
                {"IN": np.array([[1]], np.float32), "INPUT_STATE": np.array([[100]], np.float32)},
                correlation_id=10, flags=START | END)


def test_an_initial_state_file_that_cannot_be_read_fails_the_load(tmp_path):
    write_model(tmp_path, "missing", ACC_PY, _config(
        'initial_state: { data_type: TYPE_FP32 dims: [ 1 ] data_file: "nope" name: "f" }'))
    mdir = write_model(tmp_path, "short", ACC_PY, _config(
        'initial_state: { data_type: TYPE_FP32 dims: [ 1 ] data_file: "two" name: "f" }'))
    (mdir / "initial_state").mkdir()
    (mdir / "initial_state" / "two").write_bytes(b"\0\0")
    with serving(tmp_path, new_prefix()) as server:
        state = {m["name"]: m for m in server.models()}
        assert state["missing"]["state"] == "UNAVAILABLE"
        assert "initial state 'f' of state 'INPUT_STATE': cannot read" in state["missing"]["reason"]
        assert "initial_state/nope" in state["missing"]["reason"]
        assert state["short"]["state"] == "UNAVAILABLE"
        assert "holds 2 bytes, 1 TYPE_FP32 values need 4" in state["short"]["reason"]
