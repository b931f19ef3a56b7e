"""Ensembles compared with Triton 2.51 case by case: the expected values here are what Triton
answered to the same repository and requests (over HTTP and gRPC, with ``tritonclient``).

A tensor that passes between a batching and a non-batching side (the ensemble's request, a
step, the ensemble's outputs) gains or loses a batch dimension of 1, as in Triton: a batching
receiver gets ``[1, ...]`` when the tensor already has its per-item dims, and a non-batching
one gets a batch of one without its batch dimension when the tensor does not fit its dims as
it is; a larger batch reaches a non-batching step as it is, and its shape check refuses it.
A response without outputs carries no sequence parameters. Asking for some of the outputs
where one of them feeds another step works here (Triton 2.51 fails it: a deliberate
difference).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from _models import PLUS1, SCALE2, io_config, serving_frontends, write_model


UPPER = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            up = [bytes(v).upper() + b"!" for v in x.reshape(-1)]
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor(
                "OUT", np.array(up, dtype=np.object_).reshape(x.shape))]))
        return out
"""


NOTHING = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([]) for r in requests]
"""


def step(model: str, inp: str, out: str) -> str:
    return (f'{{ model_name: "{model}" model_version: -1 input_map {{ key: "IN" value: "{inp}" }}'
            f' output_map {{ key: "OUT" value: "{out}" }} }}')


def ensemble(repo: Path, name: str, steps: list[str], max_batch_size: int = 0,
             dims: str = "-1", dtype: str = "TYPE_FP32", outputs: str = "OUT") -> None:
    outs = ", ".join(f'{{ name: "{o}", data_type: {dtype}, dims: [ {dims} ] }}'
                     for o in outputs.split())
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(
        f'platform: "ensemble"\nmax_batch_size: {max_batch_size}\n'
        f'input [ {{ name: "IN", data_type: {dtype}, dims: [ {dims} ] }} ]\n'
        f'output [ {outs} ]\nensemble_scheduling {{ step [ {", ".join(steps)} ] }}\n')


@pytest.fixture(scope="module")
def urls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    repo = tmp_path_factory.mktemp("ens_vs_triton")
    write_model(repo, "plus1", PLUS1, io_config())
    write_model(repo, "scale2", SCALE2, io_config())
    write_model(repo, "nothing", NOTHING, io_config())
    write_model(repo, "bplus1", PLUS1, io_config(max_batch_size=4))
    write_model(repo, "bscale2", SCALE2, io_config(max_batch_size=8))
    write_model(repo, "bupper", UPPER, io_config(max_batch_size=4, in_type="TYPE_STRING",
                                                 out_type="TYPE_STRING"))
    ensemble(repo, "nb_b", [step("bplus1", "IN", "t"), step("bscale2", "t", "OUT")])
    ensemble(repo, "nb_b_2d", [step("bplus1", "IN", "OUT")], dims="-1, -1")
    ensemble(repo, "b_nb", [step("plus1", "IN", "OUT")], max_batch_size=4)
    ensemble(repo, "b_nb_b", [step("bplus1", "IN", "t"), step("plus1", "t", "u"),
                              step("bscale2", "u", "OUT")], max_batch_size=4)
    ensemble(repo, "nb_b_nb", [step("plus1", "IN", "t"), step("bplus1", "t", "u"),
                               step("plus1", "u", "OUT")])
    ensemble(repo, "out_feeds", [step("plus1", "IN", "A"), step("scale2", "A", "B")],
             outputs="A B")
    ensemble(repo, "makes_nothing", [step("nothing", "IN", "OUT")])
    ensemble(repo, "nb_bytes", [step("bupper", "IN", "OUT")], dtype="TYPE_STRING")
    with serving_frontends(repo) as (_, fe):
        yield f"127.0.0.1:{fe.http_port}", f"127.0.0.1:{fe.grpc_port}"


def call(client: Any, module: Any, model: str, data: np.ndarray) -> np.ndarray:
    inp = module.InferInput("IN", list(data.shape), np_to_triton_dtype(data.dtype))
    inp.set_data_from_numpy(data)
    return client.infer(model, [inp]).as_numpy("OUT")


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("model, given, expected", [
    # non-batching ensemble, batching steps: each step gets [1, 2], the ensemble answers [2]
    ("nb_b", [1, 2], [4, 6]),
    ("nb_b_nb", [1, 2], [4, 5]),
    # ... and where the tensor already has the step's full shape, it goes as it is
    ("nb_b_2d", [[1, 2], [3, 4], [5, 6]], [[2, 3], [4, 5], [6, 7]]),
    ("nb_b_2d", [[1, 2]], [[2, 3]]),
    # batching ensemble, non-batching step: a batch of one loses its batch dimension there
    ("b_nb", [[1, 2]], [[2, 3]]),
    ("b_nb", [[1]], [[2]]),
    ("b_nb_b", [[1, 2]], [[6, 8]]),
])
def test_the_batch_dimension_is_added_and_removed_between_steps_as_tritons(
        urls: tuple[str, str], protocol: str, model: str, given: list, expected: list) -> None:
    module = httpclient if protocol == "http" else grpcclient
    client = module.InferenceServerClient(urls[0] if protocol == "http" else urls[1])
    try:
        out = call(client, module, model, np.array(given, np.float32))
    finally:
        client.close()
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, np.array(expected, np.float32))
    assert out.shape == np.array(expected).shape


def test_bytes_pass_a_batching_step_of_a_non_batching_ensemble(urls: tuple[str, str]) -> None:
    client = grpcclient.InferenceServerClient(urls[1])
    try:
        out = call(client, grpcclient, "nb_bytes", np.array([b"a", b"b\x00c"], np.object_))
    finally:
        client.close()
    assert out.tolist() == [b"A!", b"B\x00C!"]


@pytest.mark.parametrize("model, given, bad_shape", [
    ("b_nb", [[1, 2], [3, 4]], "[2,2]"),
    ("b_nb_b", [[1], [2]], "[2,1]"),
])
def test_a_larger_batch_reaching_a_non_batching_step_is_refused_by_its_shape_check(
        urls: tuple[str, str], model: str, given: list, bad_shape: str) -> None:
    client = httpclient.InferenceServerClient(urls[0])
    try:
        with pytest.raises(InferenceServerException) as info:
            call(client, httpclient, model, np.array(given, np.float32))
    finally:
        client.close()
    assert info.value.status() == "400"
    assert info.value.message() == (
        f"in ensemble '{model}', [request id: <id_unknown>] unexpected shape for input 'IN' "
        f"for model 'plus1'. Expected [-1], got {bad_shape}. ")  # (Triton's space, measured)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("requested, expected", [
    (None, {"A": [2], "B": [4]}), (["A"], {"A": [2]}), (["B"], {"B": [4]}),
    (["B", "A"], {"A": [2], "B": [4]}),
])
def test_some_outputs_of_an_ensemble_whose_output_feeds_a_step(
        urls: tuple[str, str], protocol: str, requested: list[str] | None,
        expected: dict[str, list[float]]) -> None:
    # Better than Triton 2.51, which fails A alone and B alone ("unexpected deadlock, at
    # least one output is not set while no more ensemble steps can be made").
    module = httpclient if protocol == "http" else grpcclient
    client = module.InferenceServerClient(urls[0] if protocol == "http" else urls[1])
    inp = module.InferInput("IN", [1], "FP32")
    inp.set_data_from_numpy(np.array([1], np.float32))
    outputs = [module.InferRequestedOutput(n) for n in requested] if requested else None
    try:
        result = client.infer("out_feeds", [inp], outputs=outputs)
    finally:
        client.close()
    got = {o["name"] for o in result.get_response(
        **({} if protocol == "http" else {"as_json": True}))["outputs"]}
    assert got == set(expected)
    for name, values in expected.items():
        np.testing.assert_array_equal(result.as_numpy(name), np.array(values, np.float32))


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_response_without_outputs_carries_no_sequence_parameters(
        urls: tuple[str, str], protocol: str) -> None:
    # As Triton 2.51: a step that makes none of the outputs asked for is answered with an
    # empty response, and only a response with outputs carries the sequence parameters.
    module = httpclient if protocol == "http" else grpcclient
    client = module.InferenceServerClient(urls[0] if protocol == "http" else urls[1])
    kwargs = {} if protocol == "http" else {"as_json": True}
    try:
        for model, outputs, has_params in (("makes_nothing", [], False),
                                           ("out_feeds", ["A", "B"], True)):
            inp = module.InferInput("IN", [1], "FP32")
            inp.set_data_from_numpy(np.array([1], np.float32))
            resp = client.infer(model, [inp]).get_response(**kwargs)
            assert sorted(o["name"] for o in resp.get("outputs", [])) == outputs
            assert ("parameters" in resp) is has_params, resp
    finally:
        client.close()
