"""Triton's BLS doc example, asynchronous: several async_exec() calls in flight at once,
awaited with asyncio.gather. Call i sends INPUT0 + i; row i of SUMS / DIFFS is its answer."""
import asyncio
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            calls = int(json.loads(request.parameters()).get("calls", 4))
            in0 = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            in1 = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            awaits = []
            for i in range(calls):
                infer_request = pb_utils.InferenceRequest(
                    model_name="add_sub",
                    requested_output_names=["OUTPUT0", "OUTPUT1"],
                    inputs=[pb_utils.Tensor("INPUT0", (in0 + i).astype(np.float32)),
                            pb_utils.Tensor("INPUT1", in1)])
                awaits.append(infer_request.async_exec())
            infer_responses = await asyncio.gather(*awaits)
            for r in infer_responses:
                if r.has_error():
                    raise pb_utils.TritonModelException(r.error().message())
            sums = np.stack([pb_utils.get_output_tensor_by_name(r, "OUTPUT0").as_numpy()
                             for r in infer_responses])
            diffs = np.stack([pb_utils.get_output_tensor_by_name(r, "OUTPUT1").as_numpy()
                              for r in infer_responses])
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("SUMS", sums), pb_utils.Tensor("DIFFS", diffs)]))
        return responses
