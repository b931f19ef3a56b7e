"""add_sub with a batch dimension, two instances and dynamic batching.

Each response also says which instance served it (OUTPUT parameters), so you can watch the two
instances share the load.
"""
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.instance = args["model_instance_name"]

    def execute(self, requests):
        responses = []
        for request in requests:
            in0 = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            in1 = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            responses.append(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("OUTPUT0", in0 + in1),
                                pb_utils.Tensor("OUTPUT1", in0 - in1)],
                parameters={"instance": self.instance, "batch": len(requests)}))
        return responses
