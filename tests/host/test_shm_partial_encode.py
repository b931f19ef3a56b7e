"""A message whose second tensor finds shared memory exhausted is never sent: the blocks already
taken for its first tensors are given back at once, not held until the process ends."""
from __future__ import annotations

import numpy as np
import pytest
from _models import serving, wait_until, write_model

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20
CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "IN1", data_type: TYPE_UINT8, dims: [ -1 ] },
        { name: "IN2", data_type: TYPE_UINT8, dims: [ -1 ] } ]
output [ { name: "OUT1", data_type: TYPE_UINT8, dims: [ -1 ] },
         { name: "OUT2", data_type: TYPE_UINT8, dims: [ -1 ] } ]
"""
# Answers with two new arrays the size its inputs ask for (IN1[0], IN2[0] MiB).
TWO_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            a = int(pb_utils.get_input_tensor_by_name(r, "IN1").as_numpy()[0])
            b = int(pb_utils.get_input_tensor_by_name(r, "IN2").as_numpy()[0])
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUT1", np.ones(a << 20, np.uint8)),
                pb_utils.Tensor("OUT2", np.ones(b << 20, np.uint8))]))
        return out
"""


# Calls "two" with two new 3 MiB inputs (the second does not fit its pool) and answers with the
# text of the error exec() raised.
BLS_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            big = [pb_utils.Tensor(n, np.ones(3 << 20, np.uint8)) for n in ("IN1", "IN2")]
            try:
                pb_utils.InferenceRequest(model_name="two", inputs=big,
                                          requested_output_names=["OUT1"]).exec()
                text = "sent"
            except Exception as exc:
                text = str(exc)
            del big
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor(
                "OUT1", np.array([text.encode()], np.object_))]))
        return out
"""
BLS_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "IN1", data_type: TYPE_UINT8, dims: [ -1 ] } ]
output [ { name: "OUT1", data_type: TYPE_STRING, dims: [ 1 ] } ]
"""


def used(srv, pool: str) -> int:
    return {p["pool"]: p["used_bytes"] for p in srv.shm_usage()}[pool]


def test_a_half_encoded_request_or_response_holds_no_shared_memory(tmp_path, shm_prefix) -> None:
    write_model(tmp_path, "two", TWO_PY, CONFIG)
    write_model(tmp_path, "bls_two", BLS_PY, BLS_CONFIG)
    cap = {"shm-default-byte-size": str(4 * MiB), "shm-growth-byte-size": str(4 * MiB),
           "shm-total-byte-cap": str(4 * MiB)}
    with serving(tmp_path, shm_prefix, backend_config=cap) as srv:
        model = srv.model("two")
        # The stub's response: OUT1 (3 MiB) is copied into its pool, OUT2 (3 MiB) does not fit.
        small = np.array([3], np.uint8)
        (resp,) = list(model.infer({"IN1": small, "IN2": small}))
        assert resp.error is not None and "exhausted" in resp.error.message
        assert wait_until(lambda: used(srv, "two_0") == 0, 5, "the stub's pool to be empty")
        # The host's request: IN1 (3 MiB) is copied into the host's pool, IN2 does not fit.
        big = np.ones(3 * MiB, np.uint8)
        big[0] = 1
        (resp,) = list(model.infer({"IN1": big, "IN2": big.copy()}))
        assert resp.error is not None and "exhausted" in resp.error.message
        assert used(srv, "host") == 0
        # A BLS call from a stub: IN1 is copied into the caller's pool, IN2 does not fit.
        (resp,) = list(srv.model("bls_two").infer({"IN1": small}))
        assert b"exhausted" in resp.outputs["OUT1"].to_numpy()[0]
        assert wait_until(lambda: used(srv, "bls_two_0") == 0, 5, "the caller's pool to be empty")
        # Both pools still serve what fits.
        (ok,) = list(model.infer({"IN1": np.array([1], np.uint8), "IN2": np.array([1], np.uint8)}))
        assert ok.error is None and ok.outputs["OUT1"].to_numpy().size == MiB
