"""The model loading API from execute: request parameters 'action' (ready | load | unload |
infer) and 'model'; for load also 'config' (a JSON config override) and 'files' (JSON: path ->
text, sent as bytes; 'bytes_paths' sends the paths as bytes too), for unload 'unload_dependents', for ready 'version'; 'model_hex' gives
the model name as bytes instead. REPORT (JSON) says what happened, including any exception's
type and message."""
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            params = json.loads(request.parameters())
            action, model = params.get("action", "ready"), params.get("model", "")
            report = {"action": action, "model": model, "error": None, "error_type": None}
            if "model_hex" in params:  # bytes, UTF-8 or not (Triton's std::string takes any)
                model = bytes.fromhex(params["model_hex"])
            try:
                if action == "load":
                    kwargs = {}
                    if "config" in params:
                        kwargs["config"] = params["config"]
                    if "files" in params:
                        kwargs["files"] = {
                            (k.encode() if params.get("bytes_paths") else k): v.encode()
                            for k, v in json.loads(params["files"]).items()}
                    pb_utils.load_model(model_name=model, **kwargs)
                elif action == "unload":
                    pb_utils.unload_model(
                        model_name=model,
                        unload_dependents=bool(params.get("unload_dependents", False)))
                elif action == "infer":
                    in0 = pb_utils.get_input_tensor_by_name(request, "INPUT0")
                    r = pb_utils.InferenceRequest(model_name=model, inputs=[in0],
                                                  requested_output_names=["OUTPUT0"]).exec()
                    report["infer_error"] = r.error().message() if r.has_error() else None
                    if not r.has_error():
                        report["output"] = pb_utils.get_output_tensor_by_name(
                            r, "OUTPUT0").as_numpy().tolist()
                report["ready"] = pb_utils.is_model_ready(
                    model_name=model, model_version=str(params.get("version", "")))
            except Exception as exc:
                report["error_type"] = type(exc).__name__
                report["error"] = exc.message() if hasattr(exc, "message") else str(exc)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("REPORT", np.array([json.dumps(report)], dtype=np.object_))]))
        return responses
