"""Image preprocessing as in Triton's BLS docs: scale to [0, 1] and normalise per channel."""
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.mean = np.array([0.485, 0.456, 0.406], dtype=np.float32)
        self.std = np.array([0.229, 0.224, 0.225], dtype=np.float32)
        self.logger = pb_utils.Logger

    def execute(self, requests):
        responses = []
        for request in requests:
            raw = pb_utils.get_input_tensor_by_name(request, "RAW_IMAGE").as_numpy()
            image = raw.astype(np.float32) / 255.0
            normalized = (image - self.mean) / self.std
            responses.append(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("PROCESSED_IMAGE", normalized)]))
        self.logger.log_verbose(f"preprocessed {len(requests)} request(s)")
        return responses
