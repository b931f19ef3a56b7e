"""A BYTES (string) model: upper-cases every element and reports its length in bytes."""
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy()
            upper = np.array([t.decode("utf-8").upper().encode("utf-8") for t in text.ravel()],
                             dtype=np.object_).reshape(text.shape)
            length = np.array([len(t) for t in text.ravel()], dtype=np.int32).reshape(text.shape)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("UPPER", upper), pb_utils.Tensor("LENGTH", length)]))
        return responses
