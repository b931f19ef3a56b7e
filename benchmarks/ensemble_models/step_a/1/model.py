"""A chain step for benchmarks/ensemble_bench.py: OUTPUT0 = INPUT0 + 1 (step_b and step_c link
here)."""

from __future__ import annotations

from typing import Any

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Add one to every element (so a chain of three is checkable: x + 3)."""

    def execute(self, requests: list[Any]) -> list[Any]:
        """One response per request."""
        responses = []
        for request in requests:
            data = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT0", data + 1)]))
        return responses
