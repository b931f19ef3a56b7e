"""BLS from async def execute: a blocking exec() on 'double', three async_exec() on 'double'
gathered, and async_exec(decoupled=True) on 'square' iterated with async for."""
import asyncio

import numpy as np
import triton_python_backend_utils as pb_utils


def request_double(values):
    return pb_utils.InferenceRequest(model_name="double", requested_output_names=["OUT"],
                                     inputs=[pb_utils.Tensor("IN", values.astype(np.int32))])


def value(response, name="OUT"):
    if response.has_error():
        raise pb_utils.TritonModelException(response.error().message())
    return pb_utils.get_output_tensor_by_name(response, name).as_numpy()


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            sync = value(request_double(x).exec())
            gathered = await asyncio.gather(*[request_double(x + i).async_exec()
                                              for i in range(3)])
            square = pb_utils.InferenceRequest(
                model_name="square", requested_output_names=["OUT"],
                inputs=[pb_utils.Tensor("IN", np.array([3], dtype=np.int32))])
            streamed = []
            async for r in await square.async_exec(decoupled=True):
                if r.output_tensors():
                    streamed.extend(value(r).tolist())
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("SYNC", sync),
                pb_utils.Tensor("GATHERED", np.stack([value(g) for g in gathered])),
                pb_utils.Tensor("STREAMED", np.array(streamed, dtype=np.int32))]))
        return responses
