"""Sends 'calls' (request parameter, default 8) async_exec requests at once to 'model'
(default add_sub_batched), call i with INPUT0 = [[INPUT0 + i]] and INPUT1 = [[1]], gathers
them; OUTPUT0 lists each call's OUTPUT0 in order. With a dynamic batcher on the target they
arrive together and may be batched into one execute."""
import asyncio
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            params = json.loads(request.parameters())
            model = params.get("model", "add_sub_batched")
            base = float(pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()[0])
            awaits = [pb_utils.InferenceRequest(
                model_name=model, requested_output_names=["OUTPUT0"],
                inputs=[pb_utils.Tensor("INPUT0", np.array([[base + i]], np.float32)),
                        pb_utils.Tensor("INPUT1", np.array([[1.0]], np.float32))]).async_exec()
                for i in range(int(params.get("calls", 8)))]
            values = []
            for r in await asyncio.gather(*awaits):
                if r.has_error():
                    raise pb_utils.TritonModelException(r.error().message())
                values.append(float(pb_utils.get_output_tensor_by_name(r, "OUTPUT0")
                                    .as_numpy().reshape(-1)[0]))
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUTPUT0", np.array(values, np.float32))]))
        return responses
