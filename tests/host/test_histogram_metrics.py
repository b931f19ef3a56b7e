"""``--metrics-config histogram_latencies=true`` as Triton 2.51 takes it (measured against the
anchor, tritonserver 2.51.0): the setting is accepted and changes nothing. Triton 2.51 has no
latency histogram: after requests to a decoupled model (several responses, an error first, the
final flag alone), an ensemble, a decoupled ensemble and a BLS model streaming from a decoupled
one, its metrics page has no ``nv_inference_first_response_histogram_ms`` (a family of later
Triton releases) and no histogram of any kind, and its model config has no ``model_metrics``
field to set the buckets of one. tritonpy's page has the same ``nv_inference_*`` families as
Triton's, with or without the setting.
"""
from __future__ import annotations

import numpy as np
import pytest
from _models import serving, write_model

from tritonpy import MetricsConfig
from tritonpy._cli_settings import metrics_config
from tritonpy.cli import build_parser
from tritonpy.metrics import metrics_text

pytestmark = pytest.mark.timeout(60)

# IN >= 0: three responses then the final flag; -1: an error response first, then one
# response and the flag; -2: the final flag alone, no response.
DECOUPLED_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            sender = r.get_response_sender()
            if x[0] == -1:
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("first")))
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x.copy())]))
            elif x[0] >= 0:
                for _ in range(3):
                    sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x.copy())]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""
PLAIN_PY = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy().copy())])
            for r in requests]
"""
# Counts the responses with outputs that a BLS stream from the decoupled model brought.
BLS_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            call = pb_utils.InferenceRequest(
                model_name="dec", inputs=[pb_utils.get_input_tensor_by_name(r, "IN")],
                requested_output_names=["OUT"])
            n = sum(1 for resp in call.exec(decoupled=True) if resp.output_tensors())
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUT", np.array([n], np.float32))]))
        return out
"""
IO = ('backend: "python"\ninput [ { name: "IN", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
      'output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 1 ] } ]\n')
DECOUPLED = IO + "model_transaction_policy { decoupled: true }\n"


def _ensemble(step: str) -> str:
    return ('platform: "ensemble"\n'
            'input [ { name: "EIN", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
            'output [ { name: "EOUT", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
            f'ensemble_scheduling {{ step [ {{ model_name: "{step}" model_version: -1 '
            'input_map { key: "IN" value: "EIN" } output_map { key: "OUT" value: "EOUT" } '
            "} ] }\n")


# The nv_inference_* families of Triton 2.51's page for these models, histogram_latencies=true
# and every request below made (its other families are the CPU's and its pinned memory's).
TRITON_FAMILIES = {
    "nv_inference_compute_infer_duration_us", "nv_inference_compute_input_duration_us",
    "nv_inference_compute_output_duration_us", "nv_inference_count",
    "nv_inference_exec_count", "nv_inference_pending_request_count",
    "nv_inference_queue_duration_us", "nv_inference_request_duration_us",
    "nv_inference_request_failure", "nv_inference_request_success"}


def _stream(model, value: float, name: str = "IN") -> list:
    """Every response of one request, up to the final one."""
    stream = model.infer({name: np.array([value], np.float32)})
    responses = [stream.get(timeout=30)]
    while not responses[-1].final:
        responses.append(stream.get(timeout=30))
    return responses


def _families(text: str) -> set[str]:
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}


def test_the_setting_is_read_and_changes_no_setting() -> None:
    assert MetricsConfig.parse(["histogram_latencies=true"]) == MetricsConfig()
    args = build_parser().parse_args(["serve", "--metrics-config", "histogram_latencies=true",
                                      "--metrics-config", "summary_latencies=true"])
    assert metrics_config(args) == MetricsConfig(summary_latencies=True)


def test_no_latency_histogram_on_the_metrics_page(tmp_path, shm_prefix) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "dec", DECOUPLED_PY, DECOUPLED)
    write_model(repo, "plain", PLAIN_PY, IO)
    write_model(repo, "bls", BLS_PY, IO)
    write_model(repo, "ens", "", _ensemble("plain"))
    write_model(repo, "dens", "", _ensemble("dec"))
    config = MetricsConfig.parse(["histogram_latencies=true"])
    with serving(repo, shm_prefix, metrics_config=config) as server:
        before = metrics_text(server)
        dec = server.model("dec")
        assert [r.error is None and not r.empty for r in _stream(dec, 2)] == [True] * 3 + [False]
        first = _stream(dec, -1)
        assert first[0].error is not None and first[1].error is None
        assert all(r.empty for r in _stream(dec, -2))
        assert len(_stream(server.model("dens"), 1, "EIN")) == 4
        assert _stream(server.model("ens"), 1, "EIN")[0].error is None
        bls = _stream(server.model("bls"), 5)
        assert float(bls[0].outputs["OUT"].to_numpy()[0]) == 3.0
        after = metrics_text(server)
    for text in (before, after):
        assert "histogram" not in text and "_bucket{" not in text and "first_response" not in text
    assert {f for f in _families(after) if f.startswith("nv_inference_")} == TRITON_FAMILIES
