"""Statistics per model and version in Triton's ModelStatistics shape, from real stubs:
success and failure counts, queue and compute times, execution and inference counts, batch
statistics. The counts are Triton 2.51's, measured side by side with it: a request that
``execute`` ran is a success unless ``execute`` failed, even when its response is an error
(``InferenceResponse(error=...)``), decoupled or not; only successes add to
``inference_count`` and are timed; every execute counts in ``execution_count`` and
``batch_stats``, a failed one too; ``response_stats`` stays empty (Triton 2.51's Python
backend reports none).
"""
from __future__ import annotations

import pytest
from _models import fp32, infer, io_config, serving, write_model

from tritonpy import InvalidArgumentError

pytestmark = pytest.mark.timeout(60)

# OUT = IN * version; a negative IN gets an error response.
STATS_PY = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.version = int(args["model_version"])

    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            if (x < 0).any():
                out.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("negative")))
            else:
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x * self.version)]))
        return out
"""

_TIMES = ("queue", "compute_input", "compute_infer", "compute_output")


def test_statistics_per_model_and_version(tmp_path, shm_prefix):
    write_model(tmp_path, "st", STATS_PY, io_config(extra="version_policy: { all { } }\n"),
                versions=(1, 2))
    with serving(tmp_path, shm_prefix) as server:
        v1, v2 = server.model("st", 1), server.model("st", 2)
        for i in range(3):
            assert infer(v1, {"IN": fp32(i)}).error is None
        failed = infer(v1, {"IN": fp32(-1)})
        assert failed.error is not None and failed.error.message == "negative"
        resp = infer(v2, {"IN": fp32(3)})
        assert resp.outputs["OUT"].to_numpy()[0] == 6

        everything = server.statistics()["model_stats"]
        assert sorted((s["name"], s["version"]) for s in everything) == [("st", "1"), ("st", "2")]
        stats = {s["version"]: s for s in server.statistics("st")["model_stats"]}
        assert set(stats) == {"1", "2"}
        one = stats["1"]
        assert set(one) >= {"name", "version", "last_inference", "inference_count",
                            "execution_count", "inference_stats", "batch_stats"}
        inf = one["inference_stats"]
        assert set(inf) >= {"success", "fail", "queue", "compute_input", "compute_infer",
                            "compute_output"}
        # The error response is the model's answer, not a failed request: Triton counts (and
        # times) it as a success.
        assert (inf["success"]["count"], inf["fail"]["count"]) == (4, 0)
        for key in _TIMES:
            assert inf[key]["count"] == 4, key
            assert inf[key]["ns"] > 0, key
        assert inf["success"]["ns"] >= inf["compute_infer"]["ns"]
        assert one["execution_count"] == 4
        assert one["inference_count"] == 4
        assert one["last_inference"] > 0
        assert one["batch_stats"] == [{
            "batch_size": 1, **{k: {"count": 4, "ns": one["batch_stats"][0][k]["ns"]}
                                for k in ("compute_input", "compute_infer", "compute_output")}}]
        assert all(one["batch_stats"][0][k]["ns"] > 0
                   for k in ("compute_input", "compute_infer", "compute_output"))

        two = stats["2"]["inference_stats"]
        assert (two["success"]["count"], two["fail"]["count"]) == (1, 0)
        assert stats["2"]["execution_count"] == 1

        only = server.statistics("st", "2")["model_stats"]
        assert [(s["name"], s["version"]) for s in only] == [("st", "2")]
        # Triton's INVALID_ARG, for the model, then for a version it does not have.
        with pytest.raises(InvalidArgumentError, match="^requested model 'nope' is not available$"):
            server.statistics("nope")
        with pytest.raises(InvalidArgumentError,
                           match="^requested model version is not available for model 'st'$"):
            server.statistics("st", "9")


def test_a_failed_execute_is_an_execution_but_no_inference(tmp_path, shm_prefix):
    write_model(tmp_path, "boom", """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        raise pb_utils.TritonModelException("execute failed")
""")
    with serving(tmp_path, shm_prefix) as server:
        resp = infer(server.model("boom"), {"IN": fp32(1)})
        assert resp.error is not None and "execute failed" in resp.error.message
        st = server.statistics("boom")["model_stats"][0]
        inf = st["inference_stats"]
        assert (inf["success"]["count"], inf["fail"]["count"]) == (0, 1)
        assert inf["fail"]["ns"] > 0
        assert all(inf[k]["count"] == 0 for k in _TIMES)
        # As Triton: the execute happened (execution and batch statistics), but a request's
        # rows count as inferences only when it succeeds.
        assert (st["execution_count"], st["inference_count"]) == (1, 0)
        assert [(b["batch_size"], b["compute_infer"]["count"]) for b in st["batch_stats"]] == [
            (1, 1)]
        assert st["last_inference"] > 0

