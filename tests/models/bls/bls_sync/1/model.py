"""Triton's BLS doc example, synchronous: forward INPUT0/INPUT1 to the model named by
MODEL_NAME with exec() and return its outputs; a failed BLS call fails this request."""
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            name = pb_utils.get_input_tensor_by_name(request, "MODEL_NAME").as_numpy()[0]
            name = name.decode() if isinstance(name, bytes) else str(name)
            infer_request = pb_utils.InferenceRequest(
                model_name=name,
                requested_output_names=["OUTPUT0", "OUTPUT1"],
                inputs=[pb_utils.get_input_tensor_by_name(request, "INPUT0"),
                        pb_utils.get_input_tensor_by_name(request, "INPUT1")])
            infer_response = infer_request.exec()
            if infer_response.has_error():
                raise pb_utils.TritonModelException(infer_response.error().message())
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.get_output_tensor_by_name(infer_response, "OUTPUT0"),
                pb_utils.get_output_tensor_by_name(infer_response, "OUTPUT1"),
            ]))
        return responses
