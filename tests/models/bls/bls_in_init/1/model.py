"""Tries a BLS exec() in initialize (not allowed) and keeps what happened; execute reports it
(REPORT, JSON) and shows that BLS in execute still works. finalize tries again and logs the
outcome ("finalize BLS: <exception type>: <message>")."""
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.init = {"raised": None, "message": None}
        request = pb_utils.InferenceRequest(
            model_name="add_sub", requested_output_names=["OUTPUT0"],
            inputs=[pb_utils.Tensor("INPUT0", np.ones(2, np.float32)),
                    pb_utils.Tensor("INPUT1", np.ones(2, np.float32))])
        try:
            response = request.exec()
            self.init["raised"] = False
            self.init["message"] = response.error().message() if response.has_error() else None
        except Exception as exc:
            self.init["raised"] = type(exc).__name__
            self.init["message"] = str(exc)

    def execute(self, requests):
        responses = []
        for request in requests:
            in0 = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            r = pb_utils.InferenceRequest(
                model_name="add_sub", requested_output_names=["OUTPUT0"],
                inputs=[pb_utils.Tensor("INPUT0", in0), pb_utils.Tensor("INPUT1", in0)]).exec()
            report = dict(self.init)
            report["execute_bls_ok"] = not r.has_error()
            report["execute_bls_out"] = pb_utils.get_output_tensor_by_name(
                r, "OUTPUT0").as_numpy().tolist() if not r.has_error() else None
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("REPORT", np.array([json.dumps(report)], dtype=np.object_))]))
        return responses

    def finalize(self):
        request = pb_utils.InferenceRequest(
            model_name="add_sub", requested_output_names=["OUTPUT0"],
            inputs=[pb_utils.Tensor("INPUT0", np.ones(2, np.float32)),
                    pb_utils.Tensor("INPUT1", np.ones(2, np.float32))])
        try:
            request.exec()
            outcome = "no exception"
        except Exception as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        pb_utils.Logger.log_info(f"finalize BLS: {outcome}")
