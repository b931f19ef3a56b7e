"""Triton's BLS doc example for decoupled targets, asynchronous: two async_exec(decoupled=True)
calls on 'square' (IN and IN + 1) awaited with asyncio.gather, each result iterated with a
plain for loop as the doc does. OUT: the values of both streams in order; NRESP: iterations
of each stream (including an empty last response)."""
import asyncio

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            base = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            awaits = []
            for i in range(2):
                infer_request = pb_utils.InferenceRequest(
                    model_name="square",
                    requested_output_names=["OUT"],
                    inputs=[pb_utils.Tensor("IN", (base + i).astype(np.int32))])
                awaits.append(infer_request.async_exec(decoupled=True))
            async_responses = await asyncio.gather(*awaits)
            values, counts = [], []
            for infer_responses in async_responses:
                n = 0
                for infer_response in infer_responses:
                    n += 1
                    if infer_response.has_error():
                        raise pb_utils.TritonModelException(infer_response.error().message())
                    if len(infer_response.output_tensors()) > 0:
                        out = pb_utils.get_output_tensor_by_name(infer_response, "OUT")
                        values.extend(out.as_numpy().tolist())
                counts.append(n)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUT", np.array(values, dtype=np.int32)),
                pb_utils.Tensor("NRESP", np.array(counts, dtype=np.int32))]))
        return responses
