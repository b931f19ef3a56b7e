"""The per-model Prometheus counters across reloads and unloads, read from the /metrics text,
with real stubs, as Triton 2.51 keeps them (measured side by side with it):

- a reload that replaces a version's runtime (new files) restarts its statistics but not its
  counters: success, counts, durations and failures go on from their values;
- an instance-group update keeps the runtime, so its statistics and counters both go on;
- an unload takes the version's series off the page and its next load starts them at 0,
  except ``nv_inference_request_failure``, which stays with its values and goes on from them.
"""
from __future__ import annotations

import pytest
from _models import fp32, infer, io_config, serving, wait_until, write_model
from _sched_models import params

from tritonpy import InvalidArgumentError
from tritonpy.metrics import metrics_text

pytestmark = pytest.mark.timeout(90)

# OUT = IN; 99 makes execute raise (a BACKEND failure), a negative IN gets an error response
# (a success, as Triton counts it). TAG makes a new file, hence a real reload.
COUNTED_PY = """
import triton_python_backend_utils as pb_utils

TAG = {tag!r}

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            if x.size and x[0] == 99:
                raise pb_utils.TritonModelException("execute raised")
            if x.size and x[0] < 0:
                out.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("negative")))
            else:
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)],
                                                      parameters={{"tag": TAG}}))
        return out
"""

_REASONS = ("OTHER", "BACKEND", "CANCELED", "REJECTED")


def counted(tag: str) -> str:
    return COUNTED_PY.format(tag=tag)


def series(server, model: str = "m", version: str = "1") -> dict[str, float]:
    """The page's samples of ``model`` ``version``: family (with its reason, for failures)
    -> value."""
    out = {}
    for line in metrics_text(server).splitlines():
        if line.startswith("#") or f'model="{model}"' not in line \
                or f'version="{version}"' not in line:
            continue
        name, value = line.rsplit(" ", 1)
        family = name.split("{", 1)[0]
        if family == "nv_inference_request_failure":
            family += "." + name.split('reason="', 1)[1].split('"', 1)[0]
        out[family] = float(value)
    return out


def run(server, *values: float) -> None:
    """One request per value; 99 fails, the others are successes."""
    for v in values:
        response = infer(server.model("m"), {"IN": fp32(v)})
        assert (response.error is not None) == (v == 99 or v < 0), (v, response.error)


def counts(page: dict[str, float]) -> tuple[float, ...]:
    return (page["nv_inference_request_success"], page["nv_inference_count"],
            page["nv_inference_exec_count"], page["nv_inference_request_failure.BACKEND"])


def stats(server) -> dict:
    return server.statistics("m", "1")["model_stats"][0]


def test_a_reload_restarts_the_statistics_and_not_the_counters(tmp_path, shm_prefix):
    # Triton 2.51 (measured): success 3, BACKEND 1, count 3, exec 4 stay through real
    # reloads and go on (1 ok and 1 error response later: 5, 1, 5, 6); /stats restarts at 0.
    mdir = write_model(tmp_path, "m", counted("v1"))
    with serving(tmp_path, shm_prefix, model_control_mode="explicit",
                 load_models=["m"]) as server:
        run(server, 1, 2, -1, 99)
        before = series(server)
        assert counts(before) == (3, 3, 4, 1)
        assert before["nv_inference_request_duration_us"] > 0
        old = server.runtime("m", 1)
        (mdir / "1" / "model.py").write_text(counted("v2"))
        server.load("m")
        assert server.runtime("m", 1) is not old  # a real reload: a new runtime
        assert stats(server)["inference_count"] == 0
        assert stats(server)["inference_stats"]["fail"]["count"] == 0
        after = series(server)
        assert counts(after) == (3, 3, 4, 1)
        for family, value in before.items():  # durations too; the pending gauge is 0
            assert after[family] == value, family
        # The replaced runtime finishes and is folded: the counters stay.
        wait_until(lambda: old.state == "UNAVAILABLE", 30, "the old runtime's retirement")
        assert series(server) == after
        run(server, 3, -1)
        assert params(infer(server.model("m"), {"IN": fp32(4)}))["tag"] == "v2"
        page = series(server)
        assert counts(page) == (6, 6, 7, 1)
        assert page["nv_inference_request_duration_us"] > before["nv_inference_request_duration_us"]
        assert page["nv_inference_compute_infer_duration_us"] \
            > before["nv_inference_compute_infer_duration_us"]
        body = stats(server)
        assert (body["inference_count"], body["execution_count"]) == (3, 3)
        assert body["inference_stats"]["success"]["count"] == 3
        # A second real reload adds the second runtime's counts to the first's.
        (mdir / "1" / "model.py").write_text(counted("v3"))
        server.load("m")
        run(server, 99, 5)
        assert counts(series(server)) == (7, 7, 9, 2)
        assert stats(server)["inference_count"] == 1


def test_an_instance_group_update_keeps_the_runtime_its_statistics_and_its_counters(
        tmp_path, shm_prefix):
    mdir = write_model(tmp_path, "m", counted("v1"))
    with serving(tmp_path, shm_prefix, model_control_mode="explicit",
                 load_models=["m"]) as server:
        run(server, 1, 99)
        old = server.runtime("m", 1)
        (mdir / "config.pbtxt").write_text(io_config(
            extra="instance_group [ { count: 2, kind: KIND_CPU } ]\n"))
        server.load("m")
        assert server.runtime("m", 1) is old and len(old.instances) == 2  # updated in place
        assert counts(series(server)) == (1, 1, 2, 1)
        run(server, 2)
        assert counts(series(server)) == (2, 2, 3, 1)
        assert stats(server)["inference_count"] == 2  # nothing restarted


def test_an_unload_restarts_the_counters_and_keeps_the_failures(tmp_path, shm_prefix):
    # Triton 2.51 (measured): after an unload success, count, exec_count (and the durations)
    # leave the page, nv_inference_request_failure stays with every reason and its values;
    # the next load starts the others at 0 and the failures go on.
    mdir = write_model(tmp_path, "m", counted("v1"))
    with serving(tmp_path, shm_prefix, model_control_mode="explicit",
                 load_models=["m"]) as server:
        run(server, 1, 99)
        (mdir / "1" / "model.py").write_text(counted("v2"))
        server.load("m")  # a reload first: its carried counts go with the unload too
        run(server, 2, 99)
        assert counts(series(server)) == (2, 2, 4, 2)
        server.unload("m")
        assert series(server) == {
            f"nv_inference_request_failure.{r}": (2 if r == "BACKEND" else 0) for r in _REASONS}
        with pytest.raises(InvalidArgumentError):  # /stats go with the model (Triton's too)
            stats(server)
        server.load("m")
        assert stats(server)["inference_count"] == 0
        page = series(server)
        assert counts(page) == (0, 0, 0, 2)
        assert page["nv_inference_request_duration_us"] == 0
        assert page["nv_inference_request_failure.OTHER"] == 0
        run(server, 3, 99)
        assert counts(series(server)) == (1, 1, 2, 3)
        # Unloading without waiting: the series leave at once, the failures stay.
        failures = {f"nv_inference_request_failure.{r}": (3 if r == "BACKEND" else 0)
                    for r in _REASONS}
        server.unload("m", wait=False)
        assert series(server) == failures
        wait_until(lambda: [m["state"] for m in server.models()] == ["UNAVAILABLE"], 30,
                   "the unload")
        assert series(server) == failures


def test_a_version_a_reload_leaves_out_keeps_only_its_failures(tmp_path, shm_prefix):
    # Version 2 arrives and the latest-one policy drops version 1: for the metrics, version
    # 1 is unloaded (its failures stay), version 2 starts at 0.
    mdir = write_model(tmp_path, "m", counted("v1"))
    with serving(tmp_path, shm_prefix, model_control_mode="explicit",
                 load_models=["m"]) as server:
        run(server, 1, 99)
        (mdir / "2").mkdir()
        (mdir / "2" / "model.py").write_text(counted("v2"))
        server.load("m")
        assert series(server, version="1") == {
            f"nv_inference_request_failure.{r}": (1 if r == "BACKEND" else 0) for r in _REASONS}
        assert counts(series(server, version="2")) == (0, 0, 0, 0)


def test_a_replaced_runtime_still_draining_counts_until_it_is_folded():
    # What the old runtime of a reload still finishes after the swap counts in the version's
    # counters; folding it once unloaded changes no value. After an unload only its failures
    # count (the ones its draining requests add included).
    from tritonpy._stats import CounterCarry, ModelStats

    carry = CounterCarry()
    old, new = ModelStats("m", 1), ModelStats("m", 1)
    carry.serving(old)
    old.execution(1, [(1, 1000, 10)], [], 1, 2, 3)
    carry.serving(new)  # the reload's swap
    old.execution(1, [(1, 1000, 10)], [500], 1, 2, 3)  # in flight at the swap
    new.execution(2, [(2, 3000, 20)], [], 1, 2, 3)
    counters = carry.counters("", "m", 1)
    assert counters is not None and "failures" not in counters
    assert (counters["inference_count"], counters["execution_count"]) == (4, 3)
    assert counters["inference_stats"]["success"] == {"count": 3, "ns": 5000}
    carry.finished(old)
    assert carry.counters("", "m", 1) == counters
    assert carry.failures() == [("", "m", 1, {"REJECTED": 0, "CANCELED": 0, "BACKEND": 1,
                                               "OTHER": 0})]
    carry.unloaded("", "m", 1)
    assert carry.counters("", "m", 1) is None
    new.request_failed(100, "REJECTED")  # drained after the unload
    carry.finished(new)
    again = ModelStats("m", 1)
    carry.serving(again)
    assert carry.counters("", "m", 1)["execution_count"] == 0  # type: ignore[index]
    assert carry.failures() == [("", "m", 1, {"REJECTED": 1, "CANCELED": 0, "BACKEND": 1,
                                               "OTHER": 0})]
