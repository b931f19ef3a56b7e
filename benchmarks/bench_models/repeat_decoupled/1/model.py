"""Decoupled source for benchmarks/decoupled_bench.py: COUNT responses of SIZE bytes."""

from __future__ import annotations

from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils


def _scalar(request: Any, name: str) -> int:
    return int(pb_utils.get_input_tensor_by_name(request, name).as_numpy().reshape(-1)[0])


class TritonPythonModel:
    """Stream COUNT responses, then the final flag with no response."""

    def execute(self, requests: list[Any]) -> None:
        """Send every response through the request's sender; decoupled models return None."""
        for request in requests:
            sender = request.get_response_sender()
            count, size = _scalar(request, "COUNT"), _scalar(request, "SIZE")
            if count < 0 or size < 0:
                sender.send(
                    pb_utils.InferenceResponse(error=pb_utils.TritonError(f"bad COUNT={count} SIZE={size}")),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                )
                continue
            # One payload for all responses: the benchmark measures the stream, not numpy.
            payload = np.ones(size, dtype=np.uint8)
            for _ in range(count):
                sender.send(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUT", payload)]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
