"""Reports what the request carried: id, correlation id (and its type), flags, parameters,
requested outputs and this model's version, as META (JSON)."""
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.version = args["model_version"]

    def execute(self, requests):
        responses = []
        for request in requests:
            corr = request.correlation_id()
            meta = {
                "request_id": request.request_id(),
                "correlation_id": corr,
                "correlation_id_type": type(corr).__name__,
                "flags": request.flags(),
                "parameters": json.loads(request.parameters()),
                "parameters_text": request.parameters(),
                "requested_outputs": sorted(request.requested_output_names()),
                "model_version": self.version,
                "timeout": request.timeout(),
            }
            in0 = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("META", np.array([json.dumps(meta)], dtype=np.object_)),
                pb_utils.Tensor("OUTPUT0", in0 * 2)]))
        return responses
