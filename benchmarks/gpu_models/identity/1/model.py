"""GPU identity for benchmarks/bls_bench.py --gpu: OUTPUT0 is INPUT0, on the GPU, not copied."""

from __future__ import annotations

from typing import Any

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Echo INPUT0 back as OUTPUT0 without touching the data."""

    def execute(self, requests: list[Any]) -> list[Any]:
        """Answer each request with its own input renamed OUTPUT0 (a GPU tensor stays one)."""
        responses = []
        for request in requests:
            tensor = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            out = (pb_utils.Tensor("OUTPUT0", tensor.as_numpy()) if tensor.is_cpu()
                   else pb_utils.Tensor.from_dlpack("OUTPUT0", tensor))
            responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
        return responses
