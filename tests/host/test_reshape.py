"""A config's ``reshape``, applied as Triton applies it (measured against Triton 2.51): the
model sees an input in its ``reshape`` form, and an output the model makes in that form leaves
in its ``dims`` form, to in-process callers, HTTP clients, BLS callers and ensemble steps.
Real stubs, the real tritonclient over loopback.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from _models import DOUBLE_PY, infer, new_prefix, serving, serving_frontends, write_model

from tritonpy.testing import ModelRunner
from tritonpy.validation import reshaped

pytestmark = pytest.mark.timeout(90)

# Reports the shapes of the inputs it got (parameter "shapes") and returns OUT = IN as it got
# it, or reshaped to the request parameter "out_shape".
SHAPES_PY = """
import json
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            shapes = {t.name(): list(t.as_numpy().shape) for t in r.inputs()}
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            want = json.loads(r.parameters()).get("out_shape")
            if want is not None:
                x = x.reshape(json.loads(want))
            out.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", x)], parameters={"shapes": json.dumps(shapes)}))
        return out
"""

# Makes OUT in its reshape form [2, 2] whatever shape IN has (it has no reshape itself).
SQUARE_PY = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy().reshape(2, 2))])
            for r in requests]
"""

# Calls "rs_out" through BLS with its own input and returns the output it got, reporting its shape.
BLS_PY = """
import json
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            resp = pb_utils.InferenceRequest(
                model_name="rs_out", requested_output_names=["OUT"],
                inputs=[pb_utils.get_input_tensor_by_name(r, "IN")]).exec()
            if resp.has_error():
                raise pb_utils.TritonModelException(resp.error().message())
            y = pb_utils.get_output_tensor_by_name(resp, "OUT").as_numpy()
            out.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", y)], parameters={"seen": json.dumps(list(y.shape))}))
        return out
"""


def _io(mbs: int, dims: str, reshape: str) -> str:
    return (f'backend: "python"\nmax_batch_size: {mbs}\n'
            f'input [ {{ name: "IN", data_type: TYPE_FP32, dims: {dims}, '
            f'reshape: {{ shape: {reshape} }} }} ]\n'
            f'output [ {{ name: "OUT", data_type: TYPE_FP32, dims: {dims}, '
            f'reshape: {{ shape: {reshape} }} }} ]\n')


FIXED4 = ('backend: "python"\nmax_batch_size: 0\n'
          'input [ { name: "IN", data_type: TYPE_FP32, dims: [ 4 ] } ]\n'
          'output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 4 ] } ]\n')
RS_OUT = ('backend: "python"\nmax_batch_size: 0\n'
          'input [ { name: "IN", data_type: TYPE_FP32, dims: [ 4 ] } ]\n'
          'output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 4 ], '
          'reshape: { shape: [ 2, 2 ] } } ]\n')
ENSEMBLE = """
platform: "ensemble"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 4 ] } ]
ensemble_scheduling { step [
  { model_name: "rs_out", model_version: -1,
    input_map { key: "IN", value: "IN" }, output_map { key: "OUT", value: "mid" } },
  { model_name: "fixed4", model_version: -1,
    input_map { key: "IN", value: "mid" }, output_map { key: "OUT", value: "OUT" } }
] }
"""
SQUARE22 = ('backend: "python"\nmax_batch_size: 0\n'
            'input [ { name: "IN", data_type: TYPE_FP32, dims: [ 2, 2 ] } ]\n'
            'output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 2, 2 ] } ]\n')
# The ensemble's own reshape: its IN ([4] for clients) reaches the [2, 2] step as [2, 2], and
# its OUT, made [2, 2] by that step, leaves as [4].
ENSEMBLE_OWN = """
platform: "ensemble"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_FP32, dims: [ 4 ], reshape: { shape: [ 2, 2 ] } } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 4 ], reshape: { shape: [ 2, 2 ] } } ]
ensemble_scheduling { step [
  { model_name: "double22", model_version: -1,
    input_map { key: "IN", value: "IN" }, output_map { key: "OUT", value: "OUT" } }
] }
"""
MODELS = {
    "rs": (SHAPES_PY, _io(0, "[ 4 ]", "[ 2, 2 ]")),
    "rs_batch": (SHAPES_PY, _io(8, "[ 1 ]", "[ ]")),
    "rs_var": (SHAPES_PY, _io(4, "[ -1, 6 ]", "[ -1, 2, 3 ]")),
    "rs_out": (SQUARE_PY, RS_OUT),
    "fixed4": (DOUBLE_PY, FIXED4),
    "double22": (DOUBLE_PY, SQUARE22),
    "bls_rs": (BLS_PY, FIXED4),
}


def _repo(root):
    for name, (model_py, config) in MODELS.items():
        write_model(root, name, model_py, config)
    for name, text in (("ens", ENSEMBLE), ("ens_own", ENSEMBLE_OWN)):
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(text)
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(_repo(tmp_path_factory.mktemp("repo")), new_prefix()) as srv:
        yield srv


def _seen(resp) -> dict:
    assert resp.error is None, resp.error
    return json.loads(resp.parameters["shapes"])


@pytest.mark.parametrize("model, sent, seen", [
    ("rs", (4,), [2, 2]),
    ("rs_batch", (3, 1), [3]),  # an empty reshape: one scalar per batch item
    ("rs_var", (2, 5, 6), [2, 5, 2, 3]),  # the variable dimension carried over
])
def test_the_model_sees_the_reshape_and_the_caller_the_dims(server, model, sent, seen) -> None:
    x = np.arange(int(np.prod(sent)), dtype=np.float32).reshape(sent)
    resp = infer(server.model(model), {"IN": x})
    assert _seen(resp) == {"IN": seen}
    np.testing.assert_array_equal(resp.outputs["OUT"].to_numpy(), x)  # back in dims form


def test_an_output_that_does_not_fit_its_reshape_is_an_error_and_nothing_else(server) -> None:
    x = np.arange(4, dtype=np.float32)
    resp = infer(server.model("rs"), {"IN": x}, parameters={"out_shape": "[1, 4]"})
    # [1, 4] holds 4 elements: Triton relabels it [4] as well (its dims are fixed).
    np.testing.assert_array_equal(resp.outputs["OUT"].to_numpy(), x)
    bad = infer(server.model("rs_var"), {"IN": np.ones((1, 2, 6), np.float32)},
                parameters={"out_shape": "[1, 12]"})
    assert bad.error is not None and bad.error.code.name == "INTERNAL"
    assert bad.error.message == (
        "model 'rs_var': output 'OUT' has shape [1,12], which does not fit the reshape "
        "[batch] + [-1,2,3] of its configuration (dims [-1,6])")
    assert _seen(infer(server.model("rs_var"), {"IN": np.ones((1, 2, 6), np.float32)})) == {
        "IN": [1, 2, 2, 3]}


def test_bls_callers_and_ensemble_steps_get_outputs_in_dims_form(server) -> None:
    x = np.arange(4, dtype=np.float32)
    resp = infer(server.model("bls_rs"), {"IN": x})
    assert resp.error is None, resp.error
    assert json.loads(resp.parameters["seen"]) == [4]
    np.testing.assert_array_equal(resp.outputs["OUT"].to_numpy(), x)
    # rs's OUT ([2, 2] in the model) feeds a model whose input dims are [4].
    resp = infer(server.model("ens"), {"IN": x})
    assert resp.error is None, resp.error
    np.testing.assert_array_equal(resp.outputs["OUT"].to_numpy(), x * 2)


def test_an_ensembles_own_reshape_applies_to_its_inputs_and_outputs(server) -> None:
    x = np.arange(4, dtype=np.float32)
    resp = infer(server.model("ens_own"), {"IN": x})
    assert resp.error is None, resp.error
    np.testing.assert_array_equal(resp.outputs["OUT"].to_numpy(), x * 2)  # [4], as its dims


def test_http_and_grpc_clients_get_the_shape_the_metadata_names(tmp_path) -> None:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    with serving_frontends(_repo(tmp_path)) as (_, fe):
        x = np.arange(4, dtype=np.float32)
        for mod, port in ((httpclient, fe.http_port), (grpcclient, fe.grpc_port)):
            client = mod.InferenceServerClient(f"127.0.0.1:{port}")
            try:
                meta = client.get_model_metadata("rs_out")
                if mod is grpcclient:
                    shape = list(meta.outputs[0].shape)
                else:
                    shape = meta["outputs"][0]["shape"]
                assert shape == [4]
                inp = mod.InferInput("IN", [4], "FP32")
                inp.set_data_from_numpy(x)
                result = client.infer("rs_out", [inp])
                np.testing.assert_array_equal(result.as_numpy("OUT"), x)  # [4], not [2, 2]
            finally:
                client.close()


def test_model_runner_gives_the_model_its_inputs_reshaped(tmp_path) -> None:
    mdir = write_model(tmp_path, "rs", SHAPES_PY, _io(8, "[ 1 ]", "[ ]"))
    with ModelRunner(mdir) as runner:
        (resp,) = runner.execute([{"IN": np.ones((3, 1), np.float32)}])
        assert json.loads(resp.parameters())["shapes"] == json.dumps({"IN": [3]})


@pytest.mark.parametrize("shape, src, dst, batched, out", [
    ((4,), (4,), (2, 2), False, [2, 2]),
    ((2, 2), (2, 2), (4,), False, [4]),
    ((3, 1), (1,), (), True, [3]),
    ((3,), (), (1,), True, [3, 1]),
    ((2, 5, 6), (-1, 6), (-1, 2, 3), True, [2, 5, 2, 3]),
    ((2, 5, 2, 3), (-1, 2, 3), (-1, 6), True, [2, 5, 6]),
    ((7, 2), (-1, -1), (-1, 1, -1), False, [7, 1, 2]),
    ((1, 12), (-1, 2, 3), (-1, 6), True, None),  # missing a variable dimension
    ((3,), (2, 2), (4,), False, None),  # 3 elements cannot be 4
])
def test_reshaped(shape, src, dst, batched, out) -> None:
    assert reshaped(shape, src, dst, batched) == out
