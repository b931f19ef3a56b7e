"""The model loading API from execute: request parameters 'action' (ready | load | unload |
infer) and 'model'; REPORT (JSON) says what happened, including any exception's message."""
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            params = json.loads(request.parameters())
            action, model = params.get("action", "ready"), params.get("model", "")
            report = {"action": action, "model": model, "error": None}
            try:
                if action == "load":
                    pb_utils.load_model(model_name=model)
                elif action == "unload":
                    pb_utils.unload_model(model_name=model)
                elif action == "infer":
                    in0 = pb_utils.get_input_tensor_by_name(request, "INPUT0")
                    r = pb_utils.InferenceRequest(model_name=model, inputs=[in0],
                                                  requested_output_names=["OUTPUT0"]).exec()
                    report["infer_error"] = r.error().message() if r.has_error() else None
                    if not r.has_error():
                        report["output"] = pb_utils.get_output_tensor_by_name(
                            r, "OUTPUT0").as_numpy().tolist()
                report["ready"] = pb_utils.is_model_ready(model_name=model)
            except pb_utils.TritonModelException as exc:
                report["error"] = exc.message()
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("REPORT", np.array([json.dumps(report)], dtype=np.object_))]))
        return responses
