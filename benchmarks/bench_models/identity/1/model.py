"""Identity model: returns INPUT0 as OUTPUT0 (the BLS target, the e2e byte test; identity_fp32
and the batching benchmark's models link here)."""

from __future__ import annotations

from typing import Any

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Echo INPUT0 back as OUTPUT0 without touching the data."""

    def execute(self, requests: list[Any]) -> list[Any]:
        """Answer each request with its own input renamed OUTPUT0."""
        responses = []
        for request in requests:
            data = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT0", data)]))
        return responses
