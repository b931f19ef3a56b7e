"""BLS round-trip probe used by benchmarks/bls_bench.py.

The timing is taken with ``time.perf_counter`` inside ``execute`` around the whole loop, so
the figure is the cost of one BLS call (request out, identity's execute, response back) as a
model sees it, free of the client's HTTP overhead. Only documented ``pb_utils`` calls are
used so that the same file runs on the real Triton and on tritonpy.

With the config parameter ``TENSOR_DEVICE: "gpu"`` (``benchmarks/gpu_models``, which links this
file) the tensor is a CuPy array on the GPU, sent with ``Tensor.from_dlpack``.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

TARGET = "identity"
IN_FLIGHT = 8  # async mode: calls awaited together by one asyncio.gather
SYNC, ASYNC, SYNC_NEW = 0, 1, 2  # MODE: sync calls, async ×IN_FLIGHT, sync with a new Tensor each


def _scalar(request: Any, name: str) -> int:
    return int(pb_utils.get_input_tensor_by_name(request, name).as_numpy().reshape(-1)[0])


def _check(response: Any) -> None:
    if response.has_error():
        raise pb_utils.TritonModelException(response.error().message())


class TritonPythonModel:
    """Loop BLS calls to ``identity`` and report mean µs per call."""

    def initialize(self, args: dict[str, str]) -> None:
        """Read where the tensor lives: the CPU, or the GPU (CuPy) when the config says so."""
        params = json.loads(args["model_config"]).get("parameters", {})
        self.cupy: Any = None
        if params.get("TENSOR_DEVICE", {}).get("string_value") == "gpu":
            import cupy

            self.cupy = cupy

    async def execute(self, requests: list[Any]) -> list[Any]:
        """``async def`` so that MODE 1 may await ``async_exec``; MODE 0 never awaits."""
        responses = []
        for request in requests:
            try:
                per_call_us = await self._run(
                    _scalar(request, "SIZE"), _scalar(request, "ITERS"), _scalar(request, "MODE")
                )
            except pb_utils.TritonModelException as exc:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))))
                continue
            out = pb_utils.Tensor("OUTPUT", np.array([per_call_us], dtype=np.float64))
            responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
        return responses

    async def _run(self, size: int, iters: int, mode: int) -> float:
        if size < 0 or iters < 1 or mode not in (SYNC, ASYNC, SYNC_NEW):
            raise pb_utils.TritonModelException(f"bad SIZE={size} ITERS={iters} MODE={mode}")
        # In modes 0 and 1 the tensor is built once and sent by every call (a constant input,
        # the common BLS case): both servers keep its shared-memory copy after the first sends.
        # Mode 2 wraps the data in a new Tensor for each call, which costs a copy each time.
        if self.cupy is None:
            data = np.ones(size, dtype=np.uint8)
            tensor = pb_utils.Tensor("INPUT0", data)
        else:
            data = self.cupy.ones(size, dtype=self.cupy.uint8)
            tensor = pb_utils.Tensor.from_dlpack("INPUT0", data)

        def make_request() -> Any:
            return pb_utils.InferenceRequest(
                model_name=TARGET, requested_output_names=["OUTPUT0"], inputs=[tensor]
            )

        def make_new_request() -> Any:
            return pb_utils.InferenceRequest(
                model_name=TARGET, requested_output_names=["OUTPUT0"],
                inputs=[pb_utils.Tensor("INPUT0", data)],
            )

        # Two untimed calls check the output size (done here only: reading the output is not
        # part of what is measured) and warm up the target and both pools; they also bring
        # both servers to their steady state (the real Triton keeps a Tensor's shm copy from
        # its first send, tritonpy from its second).
        for _ in range(2):
            first = make_request().exec()
            _check(first)
            out = pb_utils.get_output_tensor_by_name(first, "OUTPUT0")
            got = out.as_numpy().nbytes if out.is_cpu() else int(np.prod(out.shape()))
            if got != size:
                raise pb_utils.TritonModelException(f"identity returned {got} bytes, sent {size}")
            del first

        start = time.perf_counter()
        if mode == SYNC:
            for _ in range(iters):
                _check(make_request().exec())
        elif mode == SYNC_NEW:
            for _ in range(iters):
                _check(make_new_request().exec())
        else:
            done = 0
            while done < iters:
                batch = min(IN_FLIGHT, iters - done)
                for response in await asyncio.gather(*(make_request().async_exec() for _ in range(batch))):
                    _check(response)
                done += batch
        return (time.perf_counter() - start) / iters * 1e6
