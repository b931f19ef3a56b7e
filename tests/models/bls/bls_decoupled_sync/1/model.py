"""Triton's BLS doc example for decoupled targets, synchronous: exec(decoupled=True) on the
decoupled 'square' model, iterate its responses (the last may be empty) and return what came:
OUT holds every OUT value received, NRESP counts the iterations including an empty last."""
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            infer_request = pb_utils.InferenceRequest(
                model_name="square",
                requested_output_names=["OUT"],
                inputs=[pb_utils.get_input_tensor_by_name(request, "IN")])
            values, count = [], 0
            for infer_response in infer_request.exec(decoupled=True):
                count += 1
                if infer_response.has_error():
                    raise pb_utils.TritonModelException(infer_response.error().message())
                if len(infer_response.output_tensors()) > 0:
                    out = pb_utils.get_output_tensor_by_name(infer_response, "OUT")
                    values.extend(out.as_numpy().tolist())
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUT", np.array(values, dtype=np.int32)),
                pb_utils.Tensor("NRESP", np.array([count], dtype=np.int32))]))
        return responses
