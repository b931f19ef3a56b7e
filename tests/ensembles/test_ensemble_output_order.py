"""The order of an ensemble's outputs in its responses, as Triton 2.51 gives it (measured with
the anchor over HTTP JSON, HTTP binary, gRPC and a gRPC stream: every expected order here is
what it answered). Triton walks a ``std::unordered_map`` of the ensemble's outputs, so the
order is neither the config's nor the request's; a request that names some outputs gets those
in the same relative order. Plain Python models keep the order their ``execute`` made.
"""
from __future__ import annotations

import json
import queue
import random
import shutil
import string
import subprocess
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from _models import serving_frontends, write_model
from tritonpy._ensemble_order import triton_output_order

pytestmark = pytest.mark.timeout(90)

# A step that answers every output of its config, valued IN + its index, in reverse config
# order (decoupled: two responses, then the final flag alone).
MULTI_PY = """
import json
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        self.outs = [o["name"] for o in cfg["output"]]
        self.decoupled = cfg.get("model_transaction_policy", {}).get("decoupled", False)

    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            tensors = [pb_utils.Tensor(n, x + i) for i, n in enumerate(self.outs)][::-1]
            if self.decoupled:
                sender = r.get_response_sender()
                sender.send(pb_utils.InferenceResponse(tensors))
                sender.send(pb_utils.InferenceResponse(tensors))
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                out.append(pb_utils.InferenceResponse(tensors))
        return None if self.decoupled else out
"""

BIG = [f"OUTPUT{i}" for i in range(16)] + ["logits", "probabilities", "labels",
                                           "scores_with_a_long_name", "x"]
# Triton 2.51's order of BIG (21 outputs: its map grew from 13 to 29 buckets on the way).
BIG_ORDER = ["scores_with_a_long_name", "probabilities", "OUTPUT15", "OUTPUT14", "OUTPUT0",
             "OUTPUT13", "OUTPUT10", "labels", "OUTPUT11", "OUTPUT1", "OUTPUT4", "OUTPUT2",
             "OUTPUT5", "OUTPUT6", "logits", "OUTPUT8", "OUTPUT3", "OUTPUT7", "OUTPUT9", "x",
             "OUTPUT12"]
REAL = ["logits", "probabilities", "labels", "OUTPUT0", "OUTPUT1"]


def _config(outputs: list[str], extra: str = "") -> str:
    outs = ", ".join(f'{{ name: "{n}", data_type: TYPE_FP32, dims: [ 1 ] }}' for n in outputs)
    return ('backend: "python"\ninput [ { name: "IN", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
            f"output [ {outs} ]\n{extra}")


def _ensemble(repo: Path, name: str, outputs: list[str],
              steps: list[tuple[str, list[tuple[str, str]]]]) -> None:
    outs = ", ".join(f'{{ name: "{n}", data_type: TYPE_FP32, dims: [ 1 ] }}' for n in outputs)
    body = ", ".join(
        f'{{ model_name: "{model}" model_version: -1 input_map {{ key: "IN" value: "EIN" }} '
        + " ".join(f'output_map {{ key: "{k}" value: "{v}" }}' for k, v in maps) + " }"
        for model, maps in steps)
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(
        'platform: "ensemble"\ninput [ { name: "EIN", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
        f"output [ {outs} ]\nensemble_scheduling {{ step [ {body} ] }}\n")


@pytest.fixture(scope="module")
def urls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    repo = tmp_path_factory.mktemp("ens_order")
    write_model(repo, "m1", MULTI_PY, _config(["P", "Q"]))
    write_model(repo, "m2", MULTI_PY, _config(["R", "S"]))
    write_model(repo, "m3", MULTI_PY, _config(["U", "V", "W"]))
    write_model(repo, "mbig", MULTI_PY, _config(BIG))
    write_model(repo, "mdec", MULTI_PY, _config(REAL, "model_transaction_policy { "
                                                     "decoupled: true }\n"))
    write_model(repo, "plain", MULTI_PY, _config(["Z", "A", "M"]))
    # Two steps, outputs listed Z A M B in the config.
    _ensemble(repo, "two_steps", ["Z", "A", "M", "B"],
              [("m1", [("P", "M"), ("Q", "A")]), ("m2", [("R", "B"), ("S", "Z")])])
    # Seven outputs from three steps; some share a bucket in Triton's map.
    _ensemble(repo, "seven", ["A", "B", "C", "D", "E", "G", "H"],
              [("m3", [("U", "H"), ("V", "A"), ("W", "D")]), ("m1", [("P", "B"), ("Q", "G")]),
               ("m2", [("R", "C"), ("S", "E")])])
    _ensemble(repo, "big", BIG, [("mbig", [(n, n) for n in BIG])])
    _ensemble(repo, "dec", REAL, [("mdec", [(n, n) for n in REAL])])
    with serving_frontends(repo) as (_, fe):
        yield f"127.0.0.1:{fe.http_port}", f"127.0.0.1:{fe.grpc_port}"


def _orders(urls: tuple[str, str], model: str, requested: list[str] | None,
            inp: str = "EIN") -> list[list[str]]:
    """The output names of one response, in order: over HTTP JSON, HTTP binary and gRPC."""
    http_url, grpc_url = urls
    body: dict[str, Any] = {"inputs": [{"name": inp, "shape": [1], "datatype": "FP32",
                                        "data": [1.0]}]}
    if requested:
        body["outputs"] = [{"name": n} for n in requested]
    request = urllib.request.Request(f"http://{http_url}/v2/models/{model}/infer",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        orders = [[o["name"] for o in json.loads(answer.read())["outputs"]]]
    for mod, url in ((httpclient, http_url), (grpcclient, grpc_url)):
        client = mod.InferenceServerClient(url)
        tensor = mod.InferInput(inp, [1], "FP32")
        tensor.set_data_from_numpy(np.ones(1, np.float32))
        outputs = [mod.InferRequestedOutput(n) for n in requested] if requested else None
        result = client.infer(model, [tensor], outputs=outputs).get_response()
        orders.append([o["name"] for o in result["outputs"]] if mod is httpclient
                      else [o.name for o in result.outputs])
        client.close()
    return orders


@pytest.mark.parametrize("model, requested, expected", [
    ("two_steps", None, ["B", "M", "A", "Z"]),
    ("two_steps", ["Z", "M", "A", "B"], ["B", "M", "A", "Z"]),
    ("two_steps", ["B", "Z", "A"], ["B", "A", "Z"]),
    ("two_steps", ["A", "M"], ["M", "A"]),
    ("seven", None, ["G", "E", "H", "B", "D", "C", "A"]),
    ("seven", ["G", "A", "E"], ["G", "E", "A"]),
    ("big", None, BIG_ORDER),
    ("big", ["x", "OUTPUT3", "labels", "OUTPUT12"], ["labels", "OUTPUT3", "x", "OUTPUT12"]),
])
def test_an_ensemble_lists_its_outputs_in_tritons_order(urls: tuple[str, str], model: str,
                                                        requested: list[str] | None,
                                                        expected: list[str]) -> None:
    assert _orders(urls, model, requested) == [expected] * 3


def test_a_plain_model_keeps_the_order_its_execute_made(urls: tuple[str, str]) -> None:
    # As Triton 2.51: the order of the model's InferenceResponse (here its config's, reversed).
    assert _orders(urls, "plain", None, inp="IN") == [["M", "A", "Z"]] * 3
    assert _orders(urls, "plain", ["Z", "M"], inp="IN") == [["M", "Z"]] * 3


def test_each_response_of_a_decoupled_ensemble_in_tritons_order(urls: tuple[str, str]) -> None:
    client = grpcclient.InferenceServerClient(urls[1])
    got: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        for requested, expected in (
                (None, ["OUTPUT1", "OUTPUT0", "labels", "probabilities", "logits"]),
                (["OUTPUT1", "logits", "labels"], ["OUTPUT1", "labels", "logits"])):
            tensor = grpcclient.InferInput("EIN", [1], "FP32")
            tensor.set_data_from_numpy(np.ones(1, np.float32))
            client.async_stream_infer("dec", [tensor], outputs=[
                grpcclient.InferRequestedOutput(n) for n in requested] if requested else None)
            for _ in range(2):
                result, error = got.get(timeout=30)
                assert error is None
                assert [o.name for o in result.get_response().outputs] == expected
    finally:
        client.stop_stream()
        client.close()


def test_the_order_model_against_measured_orders() -> None:
    assert triton_output_order(["Z", "A", "M", "B"]) == ("B", "M", "A", "Z")
    assert triton_output_order(["b", "c", "a"]) == ("a", "c", "b")
    assert triton_output_order(list("ABCDEGH")) == tuple("GEHBDCA")
    assert triton_output_order(BIG) == tuple(BIG_ORDER)
    assert triton_output_order(REAL) == ("OUTPUT1", "OUTPUT0", "labels", "probabilities",
                                         "logits")
    assert triton_output_order([]) == ()


_WALK_CC = r"""
#include <iostream>
#include <sstream>
#include <string>
#include <unordered_map>
int main() {
  std::string line;
  while (std::getline(std::cin, line)) {
    std::unordered_map<std::string, int> outputs;
    std::istringstream names(line);
    std::string name;
    while (names >> name) outputs[name] = 0;
    const char* sep = "";
    for (const auto& entry : outputs) { std::cout << sep << entry.first; sep = " "; }
    std::cout << "\n";
  }
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (libstdc++)")
def test_the_order_model_against_libstdcxx(tmp_path: Path) -> None:
    """Random output names, 1 to 600 of them (bucket growth included), walked by the C++
    library Triton is built with."""
    source, exe = tmp_path / "walk.cc", tmp_path / "walk"
    source.write_text(_WALK_CC)
    subprocess.run(["g++", "-O1", "-o", str(exe), str(source)], check=True, timeout=60)
    rng = random.Random(7)
    alphabet = string.ascii_letters + string.digits + "_"
    cases = []
    for size in [*range(1, 40), 59, 60, 61, 127, 128, 129, 257, 258, 600]:
        names: dict[str, None] = {}
        while len(names) < size:
            length = rng.choice([1, 2, 3, 7, 8, 9, 15, 16, 17, 33])
            names["".join(rng.choice(alphabet) for _ in range(length))
                  + ("é" if rng.random() < 0.05 else "")] = None
        cases.append(list(names))
    walked = subprocess.run([str(exe)], input="\n".join(" ".join(c) for c in cases) + "\n",
                            capture_output=True, text=True, check=True, timeout=60).stdout
    for names, line in zip(cases, walked.splitlines(), strict=True):
        assert list(triton_output_order(names)) == line.split(), len(names)
