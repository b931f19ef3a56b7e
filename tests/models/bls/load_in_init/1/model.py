"""The model loading API in initialize, as Triton's docs show it: load 'lazy_target' if it is
not ready; execute forwards INPUT0 to it with BLS. Whatever initialize saw is logged."""
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.was_ready = pb_utils.is_model_ready(model_name="lazy_target")
        if not self.was_ready:
            pb_utils.load_model(model_name="lazy_target")
        pb_utils.Logger.log_info(f"lazy_target was ready before: {self.was_ready}")

    def execute(self, requests):
        responses = []
        for request in requests:
            r = pb_utils.InferenceRequest(
                model_name="lazy_target", requested_output_names=["OUTPUT0"],
                inputs=[pb_utils.get_input_tensor_by_name(request, "INPUT0")]).exec()
            if r.has_error():
                responses.append(pb_utils.InferenceResponse(error=r.error()))
                continue
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.get_output_tensor_by_name(r, "OUTPUT0")]))
        return responses
