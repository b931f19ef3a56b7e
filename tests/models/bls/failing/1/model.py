"""Fails on demand (request parameter 'mode'): 'raise' raises a ValueError, 'model_exception'
raises TritonModelException, 'error' returns an error response with parameter 'code'
(a pb_utils.TritonError code) and 'message', 'exit' ends the stub process with exit code 3;
anything else succeeds."""
import json
import os

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            params = json.loads(request.parameters())
            mode = params.get("mode", "ok")
            if mode == "exit":
                os._exit(3)
            if mode == "raise":
                raise ValueError("failing model was asked to raise")
            if mode == "model_exception":
                raise pb_utils.TritonModelException("failing model raised TritonModelException")
            if mode == "error":
                # Triton's codes are an enum of their own: the number picks its member.
                number = int(params.get("code", 1))
                code = next(v for k, v in vars(pb_utils.TritonError).items()
                            if not k.startswith("_") and k.isupper() and v == number)
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    params.get("message", "failing model error"), code)))
                continue
            in0 = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            responses.append(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("OUTPUT0", in0.as_numpy())]))
        return responses
