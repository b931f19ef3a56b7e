"""Postprocess: FP32 values -> text with one decimal."""
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "VALUES").as_numpy()
            text = np.array([f"{v:.1f}".encode() for v in values.tolist()], dtype=np.object_)
            responses.append(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("TEXT", text)]))
        return responses
