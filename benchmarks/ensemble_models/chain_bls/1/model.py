"""step_a -> step_b -> step_c with BLS, for benchmarks/ensemble_bench.py.

Each step's output array is handed on as the next request's input, as a BLS pipeline is
usually written.
"""

from __future__ import annotations

from typing import Any

import triton_python_backend_utils as pb_utils

STEPS = ("step_a", "step_b", "step_c")


class TritonPythonModel:
    """Run the three steps in order and answer with the last one's output."""

    def execute(self, requests: list[Any]) -> list[Any]:
        """One response per request; a failing step's error becomes the response's."""
        responses = []
        for request in requests:
            tensor = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            error = None
            for step in STEPS:
                reply = pb_utils.InferenceRequest(
                    model_name=step, requested_output_names=["OUTPUT0"],
                    inputs=[pb_utils.Tensor("INPUT0", tensor.as_numpy())],
                ).exec()
                if reply.has_error():
                    error = reply.error()
                    break
                tensor = pb_utils.get_output_tensor_by_name(reply, "OUTPUT0")
            if error is not None:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(error.message())))
            else:
                responses.append(pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor("OUTPUT0", tensor.as_numpy())]))
        return responses
