"""Preprocess: numbers written as text -> FP32 values."""
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy()
            values = np.array([float(t.decode() if isinstance(t, bytes) else t) for t in text],
                              dtype=np.float32)
            responses.append(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("VALUES", values)]))
        return responses
