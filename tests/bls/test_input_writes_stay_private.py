"""A model that writes into an input array writes into its own copy, as with Triton (whose
models get copies): the write never reaches the sender's view of the tensor, the other models
given the same tensor, or responses already sent from it (real stubs; tensors big enough to
travel by handle)."""
from __future__ import annotations

import numpy as np
import pytest

from _models import io_config, new_prefix, serving, write_model

pytestmark = pytest.mark.timeout(60)

N = 100_000  # 400 KB of FP32: by handle

# Writes 7 into its input; OUT holds the input's sum after the write.
MUTATOR_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            a = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            a[:] = 7
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", a)]))
        return out
"""

# Passes its own request input to MUTATOR by BLS, then reads it again: OUT = [sum before,
# sum after, sum of what the mutator answered].
CALLER_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN")
            before = float(x.as_numpy().sum())
            resp = pb_utils.InferenceRequest(model_name="mutator", requested_output_names=["OUT"],
                                             inputs=[x]).exec()
            if resp.has_error():
                raise pb_utils.TritonModelException(resp.error().message())
            got = pb_utils.get_output_tensor_by_name(resp, "OUT").as_numpy()
            after = float(x.as_numpy().sum())
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor(
                "OUT", np.array([before, after, float(got.sum())], np.float32))]))
        return out
"""

# Decoupled: writes i into its input and sends it, four times.
REUSE_PY = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            a = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            sender = r.get_response_sender()
            for i in range(4):
                a[:] = i
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", a)]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

# Returns a copy of its input, read after a while (after its sibling step wrote, if it could).
SLOW_ECHO_PY = """
import time
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        time.sleep(0.3)
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy().copy())])
            for r in requests]
"""

# double's OUT feeds both mutator and slow_echo; E is slow_echo's answer.
ENSEMBLE = """
platform: "ensemble"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "E", data_type: TYPE_FP32, dims: [ -1 ] },
         { name: "M", data_type: TYPE_FP32, dims: [ -1 ] } ]
ensemble_scheduling { step [
  { model_name: "double" model_version: -1
    input_map { key: "IN" value: "IN" } output_map { key: "OUT" value: "S" } },
  { model_name: "mutator" model_version: -1
    input_map { key: "IN" value: "S" } output_map { key: "OUT" value: "M" } },
  { model_name: "slow_echo" model_version: -1
    input_map { key: "IN" value: "S" } output_map { key: "OUT" value: "E" } } ] }
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    write_model(repo, "mutator", MUTATOR_PY)
    write_model(repo, "caller", CALLER_PY)
    write_model(repo, "reuse", REUSE_PY, io_config(
        extra="model_transaction_policy { decoupled: true }\n"))
    write_model(repo, "slow_echo", SLOW_ECHO_PY)
    write_model(repo, "double")
    write_model(repo, "ens", "", ENSEMBLE)
    with serving(repo, new_prefix()) as srv:
        yield srv


def test_a_bls_callers_input_is_not_changed_by_the_target_writing_into_it(server) -> None:
    # (QA) The caller read 7e5 after the call: the mutator wrote into the caller's own input.
    resp = server.model("caller").infer({"IN": np.ones(N, np.float32)}).get(timeout=30)
    assert resp.error is None, resp.error
    assert resp.outputs["OUT"].to_numpy().tolist() == [N, N, 7 * N]


def test_an_ensemble_step_does_not_see_its_siblings_writes(server) -> None:
    # (QA) slow_echo answered 7s: mutator, given the same tensor, had written into it.
    resp = server.model("ens").infer({"IN": np.ones(N, np.float32)}).get(timeout=30)
    assert resp.error is None, resp.error
    assert set(resp.outputs["E"].to_numpy().tolist()) == {2.0}
    assert set(resp.outputs["M"].to_numpy().tolist()) == {7.0}


def test_responses_sent_from_an_input_keep_what_it_held_when_sent(server) -> None:
    # (QA) Every response held 3s: sent by handle, each was the input the model went on
    # writing into.
    got = [r.outputs["OUT"].to_numpy() for r in server.model("reuse").infer(
        {"IN": np.zeros(N, np.float32)}) if not r.empty]
    assert [sorted(set(a.tolist())) for a in got] == [[0.0], [1.0], [2.0], [3.0]]
