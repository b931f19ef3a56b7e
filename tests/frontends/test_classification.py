"""Triton's classification extension over HTTP and gRPC, with the real ``tritonclient``.

A requested output with ``class_count`` (the ``classification`` parameter) comes back as BYTES
``"<value>:<index>[:<label>]"``, highest first. The expected strings are what Triton 2.51 answers
for the same models and requests (checked side by side with the anchor server): per batch entry
for a batching model, over the whole tensor otherwise, equal values by index, floats with 6
decimals, labels from the output's ``label_filename`` where the file has that line. Where
Triton fails badly we give a clear 400: a BYTES output (Triton drops the connection and dies),
a count that is not a non-negative integer (Triton: 500), and a count past 2^32 (Triton
silently returns the raw tensor; here, every class).
"""
from __future__ import annotations

import json
import os
import secrets
import textwrap
import urllib.error
import urllib.request
from typing import Any, Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

import tritonpy
from tritonpy.frontends import Frontends

pytestmark = pytest.mark.timeout(60)

ECHO_PY = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUT", x), pb_utils.Tensor("OUT2", x),
                pb_utils.Tensor("F64", x.astype(np.float64)),
                pb_utils.Tensor("F16", x.astype(np.float16)),
                pb_utils.Tensor("U8", x.astype(np.uint8)),
                pb_utils.Tensor("I64", x.astype(np.int64)),
                pb_utils.Tensor("B", x > 1),
                pb_utils.Tensor("S", x.astype(np.bytes_).astype(np.object_))]))
        return out
'''


def _config(name: str, max_batch: int, dims: str, labels: str | None = '"labels.txt"') -> str:
    label = f" label_filename: {labels}" if labels else ""
    others = "".join(f', {{ name: "{n}" data_type: TYPE_{t} dims: {dims} }}' for n, t in (
        ("OUT2", "FP32"), ("F64", "FP64"), ("F16", "FP16"), ("U8", "UINT8"), ("I64", "INT64"),
        ("B", "BOOL"), ("S", "STRING")))
    return textwrap.dedent(f'''
        name: "{name}"
        backend: "python"
        max_batch_size: {max_batch}
        input [ {{ name: "IN" data_type: TYPE_FP32 dims: {dims} }} ]
        output [ {{ name: "OUT" data_type: TYPE_FP32 dims: {dims}{label} }}{others} ]
        ''')


@pytest.fixture(scope="module")
def urls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    repo = tmp_path_factory.mktemp("classification")
    models = {"cls": _config("cls", 0, "[ -1 ]"), "cls_b": _config("cls_b", 8, "[ 5 ]"),
              "cls_2d": _config("cls_2d", 0, "[ -1, -1 ]", None),
              "cls_nofile": _config("cls_nofile", 0, "[ -1 ]", '"missing.txt"'),
              "cls_escape": _config("cls_escape", 0, "[ -1 ]", '"../cls/labels.txt"')}
    for name, config in models.items():
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(config)
        (repo / name / "1" / "model.py").write_text(ECHO_PY)
        (repo / name / "labels.txt").write_text("zero\none\ntwo\n")  # classes 3 and 4: none
    os.remove(repo / "cls_nofile" / "labels.txt")
    prefix = f"tpyt{secrets.token_hex(4)}_"
    server = tritonpy.Server(str(repo), backend_config={"shm-region-prefix-name": prefix})
    server.start()
    fe = Frontends(server, http_port=0, grpc_port=0, metrics_port=0, http_address="127.0.0.1",
                   grpc_address="127.0.0.1", metrics_address="127.0.0.1", exit_timeout=5.0)
    try:
        fe.start_in_thread()
        yield f"127.0.0.1:{fe.http_port}", f"127.0.0.1:{fe.grpc_port}"
    finally:
        fe.stop_in_thread()
        server.stop()
    assert [n for n in os.listdir("/dev/shm") if n.startswith(prefix)] == []


X = np.array([0.5, 2.0, -1.0, 2.0, 7.25], np.float32)


def classify(urls: tuple[str, str], protocol: str, model: str, x: np.ndarray, output: str,
             count: int) -> tuple[np.ndarray, np.ndarray]:
    """(the classified output, OUT2 unchanged beside it) through ``protocol``."""
    mod: Any = httpclient if protocol == "HTTP" else grpcclient
    client = (httpclient.InferenceServerClient(urls[0]) if protocol == "HTTP"
              else grpcclient.InferenceServerClient(urls[1]))
    try:
        inp = mod.InferInput("IN", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        result = client.infer(model, [inp], outputs=[
            mod.InferRequestedOutput(output, class_count=count), mod.InferRequestedOutput("OUT2")])
        return result.as_numpy(output), result.as_numpy("OUT2")
    finally:
        client.close()


@pytest.mark.parametrize("protocol", ["HTTP", "gRPC"])
def test_top_classes_with_labels_as_triton_answers(urls, protocol) -> None:
    top2, raw = classify(urls, protocol, "cls", X, "OUT", 2)
    assert top2.tolist() == [b"7.250000:4", b"2.000000:1:one"]  # ties by index; no label 4
    np.testing.assert_array_equal(raw, X)  # the other output is the tensor, as asked
    every, _ = classify(urls, protocol, "cls", X, "OUT", 9)  # more than there are: all
    assert every.tolist() == [b"7.250000:4", b"2.000000:1:one", b"2.000000:3",
                              b"0.500000:0:zero", b"-1.000000:2:two"]
    plain, _ = classify(urls, protocol, "cls", X, "OUT", 0)  # 0: no classification
    np.testing.assert_array_equal(plain, X)


@pytest.mark.parametrize("protocol", ["HTTP", "gRPC"])
def test_a_batching_model_is_classified_per_batch_entry(urls, protocol) -> None:
    x = np.stack([X, np.array([3, 2, 1, 0, -1], np.float32)])
    top3, _ = classify(urls, protocol, "cls_b", x, "OUT", 3)
    assert top3.shape == (2, 3)
    assert top3.tolist() == [[b"7.250000:4", b"2.000000:1:one", b"2.000000:3"],
                             [b"3.000000:0:zero", b"2.000000:1:one", b"1.000000:2:two"]]


@pytest.mark.parametrize("output,expected", [
    ("F64", [b"9.000000:4", b"3.000000:1"]),
    ("U8", [b"9:4", b"3:1"]),  # integers print as integers
    ("I64", [b"9:4", b"3:1"]),
])
def test_any_other_shape_is_classified_over_all_its_elements(urls, output, expected) -> None:
    x = np.array([[0.5, 3.0, 1.25], [2.0, 9.0, 0.0]], np.float32)
    top2, _ = classify(urls, "HTTP", "cls_2d", x, output, 2)
    assert top2.tolist() == expected


@pytest.mark.parametrize("protocol", ["HTTP", "gRPC"])
@pytest.mark.parametrize("output,datatype", [("F16", "FP16"), ("B", "BOOL"), ("S", "BYTES")])
def test_unclassifiable_datatypes_are_a_clear_400(urls, protocol, output, datatype) -> None:
    with pytest.raises(InferenceServerException) as info:
        classify(urls, protocol, "cls", X, output, 2)
    assert f"class result not available for output '{output}' due to unsupported type " \
           f"'{datatype}'" in info.value.message()
    assert info.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
    again, _ = classify(urls, protocol, "cls", X, "OUT", 1)  # and the server serves on
    assert again.tolist() == [b"7.250000:4"]


def _post_json(urls: tuple[str, str], model: str, count: object) -> tuple[int, dict]:
    body = {"inputs": [{"name": "IN", "shape": [5], "datatype": "FP32", "data": X.tolist()}],
            "outputs": [{"name": "OUT", "parameters": {"classification": count}}]}
    req = urllib.request.Request(f"http://{urls[0]}/v2/models/{model}/infer",
                                 data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(req) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize("count", [-1, "2", 2.5, True])
def test_a_count_that_is_not_a_non_negative_integer_is_a_400(urls, count) -> None:
    status, body = _post_json(urls, "cls", count)
    assert status == 400
    assert body["error"] == ("output 'OUT': the 'classification' parameter must be a "
                             f"non-negative integer (how many classes to return), got {count!r}")


def test_json_output_and_a_count_past_32_bits(urls) -> None:
    status, body = _post_json(urls, "cls", 1 << 40)
    assert status == 200
    assert body["outputs"] == [{"name": "OUT", "datatype": "BYTES", "shape": [5], "data": [
        "7.250000:4", "2.000000:1:one", "2.000000:3", "0.500000:0:zero", "-1.000000:2:two"]}]


def test_grpc_negative_count_is_invalid_argument(urls) -> None:
    with pytest.raises(InferenceServerException) as info:
        classify(urls, "gRPC", "cls", X, "OUT", -3)
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "must be a non-negative integer" in info.value.message()


def test_label_files_are_read_at_load(urls) -> None:
    # As Triton: a label file that cannot be read fails the model's load, with its text. And
    # one outside the model directory is refused (a config can come over the network, and
    # labels go back to clients).
    client = httpclient.InferenceServerClient(urls[0])
    try:
        index = {m["name"]: m for m in client.get_model_repository_index()}
    finally:
        client.close()
    nofile, escape = index["cls_nofile"], index["cls_escape"]
    assert nofile["state"] == "UNAVAILABLE" and escape["state"] == "UNAVAILABLE"
    assert nofile["reason"].startswith("failed to open text file for read ")
    assert nofile["reason"].endswith("/cls_nofile/missing.txt: No such file or directory")
    assert "output 'OUT': label_filename '../cls/labels.txt' must name a file inside the " \
           "model directory" in escape["reason"]
