"""preprocess -> model -> postprocess with BLS: text numbers are parsed by pp_pre, added and
subtracted by add_sub, and formatted back to text by pp_post."""
import triton_python_backend_utils as pb_utils


def call(model, inputs, outputs):
    response = pb_utils.InferenceRequest(
        model_name=model, requested_output_names=outputs, inputs=inputs).exec()
    if response.has_error():
        raise pb_utils.TritonModelException(f"{model}: {response.error().message()}")
    return [pb_utils.get_output_tensor_by_name(response, n) for n in outputs]


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            (v0,) = call("pp_pre", [pb_utils.Tensor(
                "TEXT", pb_utils.get_input_tensor_by_name(request, "TEXT0").as_numpy())],
                ["VALUES"])
            (v1,) = call("pp_pre", [pb_utils.Tensor(
                "TEXT", pb_utils.get_input_tensor_by_name(request, "TEXT1").as_numpy())],
                ["VALUES"])
            s, d = call("add_sub", [pb_utils.Tensor("INPUT0", v0.as_numpy()),
                                    pb_utils.Tensor("INPUT1", v1.as_numpy())],
                        ["OUTPUT0", "OUTPUT1"])
            (st,) = call("pp_post", [pb_utils.Tensor("VALUES", s.as_numpy())], ["TEXT"])
            (dt,) = call("pp_post", [pb_utils.Tensor("VALUES", d.as_numpy())], ["TEXT"])
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("SUM_TEXT", st.as_numpy()),
                pb_utils.Tensor("DIFF_TEXT", dt.as_numpy())]))
        return responses
