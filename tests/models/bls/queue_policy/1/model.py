"""Doubles INPUT0 into OUTPUT0; its config rejects requests whose queue timeout passed."""
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUTPUT0", 2 * pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())])
            for r in requests]
