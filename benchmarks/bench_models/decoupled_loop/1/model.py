"""Decoupled-stream probe used by benchmarks/decoupled_bench.py.

Issues one ``exec(decoupled=True)`` BLS request to ``repeat_decoupled`` and iterates every
response; the rate is timed with ``time.perf_counter`` inside ``execute`` from the call to the
end of the stream. Only documented ``pb_utils`` calls are used.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

SOURCE = "repeat_decoupled"


def _scalar(request: Any, name: str) -> int:
    return int(pb_utils.get_input_tensor_by_name(request, name).as_numpy().reshape(-1)[0])


class TritonPythonModel:
    """Drain a decoupled stream and report responses/s and MB/s."""

    def execute(self, requests: list[Any]) -> list[Any]:
        """One stream per request; an error in the stream becomes that request's error."""
        responses = []
        for request in requests:
            count, size = _scalar(request, "COUNT"), _scalar(request, "SIZE")
            try:
                rate, mb_rate = self._drain(count, size)
            except pb_utils.TritonModelException as exc:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))))
                continue
            responses.append(
                pb_utils.InferenceResponse(
                    output_tensors=[
                        pb_utils.Tensor("RESPONSES_PER_S", np.array([rate], dtype=np.float64)),
                        pb_utils.Tensor("MB_PER_S", np.array([mb_rate], dtype=np.float64)),
                    ]
                )
            )
        return responses

    def _drain(self, count: int, size: int) -> tuple[float, float]:
        inputs = [
            pb_utils.Tensor("COUNT", np.array([count], dtype=np.int64)),
            pb_utils.Tensor("SIZE", np.array([size], dtype=np.int64)),
        ]
        request = pb_utils.InferenceRequest(model_name=SOURCE, requested_output_names=["OUT"], inputs=inputs)
        received = 0
        start = time.perf_counter()
        for response in request.exec(decoupled=True):
            if response.has_error():
                raise pb_utils.TritonModelException(response.error().message())
            tensors = response.output_tensors()
            if not tensors:
                continue  # the final flag may arrive as an empty response
            if received == 0:
                # Checked once: reading the data is not part of what is measured.
                got = tensors[0].as_numpy().nbytes
                if got != size:
                    raise pb_utils.TritonModelException(f"{SOURCE} sent {got} bytes, expected {size}")
            received += 1
        elapsed = time.perf_counter() - start
        if received != count:
            raise pb_utils.TritonModelException(f"{SOURCE} sent {received} responses, expected {count}")
        return received / elapsed, received * size / elapsed / 1e6
