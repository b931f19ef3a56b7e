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

import numpy as np
import pytest
from _bls_models import collect
from _models import fp32, infer, io_config, serving, wait_until, write_model, write_step_ensemble

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


# Default mode, answering through the response sender: IN < 0 sends an error response.
SENDER_PY = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            sender = r.get_response_sender()
            if (x < 0).any():
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("negative")))
            else:
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


def _counts(server, model: str) -> tuple[int, int]:
    inf = server.statistics(model)["model_stats"][0]["inference_stats"]
    return inf["success"]["count"], inf["fail"]["count"]


def test_an_error_response_through_the_sender_is_a_success(tmp_path, shm_prefix):
    write_model(tmp_path, "sender", SENDER_PY)
    with serving(tmp_path, shm_prefix) as server:
        model = server.model("sender")
        assert infer(model, {"IN": fp32(1)}).error is None
        assert infer(model, {"IN": fp32(-1)}).error.message == "negative"
        # Counted when execute returns, which may be just after the response went out.
        wait_until(lambda: sum(_counts(server, "sender")) == 2, 10, "two requests counted")
        assert _counts(server, "sender") == (2, 0)
        st = server.statistics("sender")["model_stats"][0]
        assert (st["execution_count"], st["inference_count"]) == (2, 2)


# Decoupled, by IN[0]: 1 a response, an error response, then the final flag alone; 2 an error
# response with the final flag; 3 a response, then execute raises; 5 a response with the final
# flag, then execute raises.
DECOUPLED_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        for r in requests:
            k = int(pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()[0])
            sender = r.get_response_sender()
            ok = pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.ones(1, np.float32))])
            bad = pb_utils.InferenceResponse(error=pb_utils.TritonError("bad response"))
            if k == 1:
                sender.send(ok)
                sender.send(bad)
                sender.send(flags=final)
            elif k == 2:
                sender.send(bad, flags=final)
            elif k == 3:
                sender.send(ok)
                raise pb_utils.TritonModelException("raised after a response")
            elif k == 5:
                sender.send(ok, flags=final)
                raise pb_utils.TritonModelException("raised after the final flag")
        return None
"""


def test_a_decoupled_request_fails_only_when_its_execute_fails(tmp_path, shm_prefix):
    write_model(tmp_path, "dec", DECOUPLED_PY,
                io_config(extra="model_transaction_policy { decoupled: true }\n"))
    with serving(tmp_path, shm_prefix) as server:
        model = server.model("dec")
        got = [collect(model.infer({"IN": fp32(k)}), 20) for k in (1, 2, 2, 3, 5)]
        assert [r.error.message if r.error else "ok" for r in got[0]] == [
            "ok", "bad response", "ok"]
        assert [r.error.message for r in got[1] + got[2]] == ["bad response"] * 2
        assert "raised after a response" in got[3][-1].error.message
        assert [r.error for r in got[4]] == [None]
        wait_until(lambda: sum(_counts(server, "dec")) == 5, 10, "five requests counted")
        st = server.statistics("dec")["model_stats"][0]
        inf = st["inference_stats"]
        # Triton 2.51: requests 1, 2 and 2 succeeded (error responses are answers); 3 and 5
        # failed, 5 although its final response went out before execute raised.
        assert (inf["success"]["count"], inf["fail"]["count"]) == (3, 2)
        assert all(inf[k]["count"] == 3 for k in _TIMES)
        assert (st["execution_count"], st["inference_count"]) == (5, 3)
        assert st["response_stats"] == {}


BATCH_PY = STATS_PY.replace('self.version = int(args["model_version"])', "self.version = 1")


def test_an_error_response_in_a_batch_leaves_its_batch_all_successes(tmp_path, shm_prefix):
    write_model(tmp_path, "db", BATCH_PY, io_config(
        max_batch_size=4, extra="dynamic_batching { preferred_batch_size: [ 3 ] "
                                "max_queue_delay_microseconds: 5000000 }\n"))
    with serving(tmp_path, shm_prefix) as server:
        model = server.model("db")
        streams = [model.infer({"IN": np.array([[v]], np.float32)}) for v in (1, -1, 2)]
        answers = [s.get(timeout=20) for s in streams]
        assert [a.error.message if a.error else "ok" for a in answers] == ["ok", "negative", "ok"]
        st = server.statistics("db")["model_stats"][0]
        inf = st["inference_stats"]
        assert (inf["success"]["count"], inf["fail"]["count"]) == (3, 0)
        assert all(inf[k]["count"] == 3 for k in _TIMES)
        assert (st["execution_count"], st["inference_count"]) == (1, 3)
        assert [(b["batch_size"], b["compute_infer"]["count"]) for b in st["batch_stats"]] == [
            (3, 1)]


# Decoupled: a response, then the stub dies: in a thread after execute returned (MODE
# "after"), or within execute ("during").
DIES_PY = """
import os
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

MODE = "{mode}"

def die():
    time.sleep(0.2)
    os.kill(os.getpid(), 9)

class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            r.get_response_sender().send(
                pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.ones(1, np.float32))]))
        if MODE == "during":
            die()
        self.kept = requests  # open until the stub dies (one let go of would end at once)
        threading.Thread(target=die).start()
        return None
"""


def test_a_dead_stub_fails_only_the_requests_whose_execute_had_not_ended(tmp_path, shm_prefix):
    for mode in ("after", "during"):
        write_model(tmp_path, mode, DIES_PY.replace("{mode}", mode),
                    io_config(extra="model_transaction_policy { decoupled: true }\n"))
    with serving(tmp_path, shm_prefix) as server:
        for mode in ("after", "during"):
            got = collect(server.model(mode).infer({"IN": fp32(1)}), 20)
            assert got[0].error is None and "killed by signal" in got[-1].error.message
        # As Triton 2.51: "after" was counted when its execute returned (a success, an
        # execution); "during" fails with its execute, which is no execution.
        after, during = (server.statistics(m)["model_stats"][0] for m in ("after", "during"))
        assert _counts(server, "after") == (1, 0)
        assert (after["execution_count"], after["inference_count"]) == (1, 1)
        assert _counts(server, "during") == (0, 1)
        assert (during["execution_count"], during["inference_count"]) == (0, 0)
        # Not stopped while the dead stubs restart (that would race the stop).
        wait_until(server.ready, 15, "the dead stubs restarted")


# Answers with IN; a request whose parameters name a "gate" file holds its instance until the
# file exists (it touches "<gate>.in" first, so the test knows it runs).
GATED_PY = """
import json
import os
import time

import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            gate = json.loads(r.parameters()).get("gate")
            if gate:
                open(gate + ".in", "w").close()
                deadline = time.monotonic() + 20
                while not os.path.exists(gate) and time.monotonic() < deadline:
                    time.sleep(0.01)
            out.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())]))
        return out
"""

BOOM_PY = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        raise pb_utils.TritonModelException("execute failed")
"""


def test_failures_count_by_triton_reason(tmp_path, shm_prefix):
    # The reasons of Triton 2.51's nv_inference_request_failure, as it gives them (measured):
    # an execute that fails is BACKEND, a queue or request timeout REJECTED, a request
    # cancelled while queued CANCELED, a failed ensemble OTHER; a request refused as it is
    # queued (full queue, sequence without START) is no failure at all.
    import os
    import time

    write_model(tmp_path, "boom", BOOM_PY)
    write_model(tmp_path, "gated", GATED_PY)
    policy = ("dynamic_batching { default_queue_policy { max_queue_size: 1 timeout_action: "
              "REJECT default_timeout_microseconds: 100000 } }\n")
    write_model(tmp_path, "capped", GATED_PY, io_config(max_batch_size=1, extra=policy))
    write_model(tmp_path, "seq", GATED_PY, io_config(max_batch_size=1,
                                                     extra="sequence_batching { }\n"))
    write_step_ensemble(tmp_path, "ens", "boom")

    def held(model, gate, x):
        stream = model.infer({"IN": x}, parameters={"gate": str(gate)})
        wait_until(lambda: os.path.exists(str(gate) + ".in"), 15, "the gated execute started")
        return stream

    with serving(tmp_path, shm_prefix) as server:
        assert infer(server.model("boom"), {"IN": fp32(1)}).error is not None
        assert infer(server.model("ens"), {"IN": fp32(1)}).error is not None

        gated, gate = server.model("gated"), tmp_path / "gate1"
        first = held(gated, gate, fp32(1))
        late = gated.infer({"IN": fp32(2)}, timeout=50_000)  # 50 ms, no batcher: the host's timer
        dropped = gated.infer({"IN": fp32(3)})
        time.sleep(0.2)
        dropped.cancel()
        assert late.get(timeout=10).error.message == "Request timeout expired"
        gate.touch()
        assert first.get(timeout=20).error is None

        capped, gate = server.model("capped"), tmp_path / "gate2"
        row = np.ones((1, 1), np.float32)
        first = held(capped, gate, row)
        queued = capped.infer({"IN": row})  # times out in the queue after 100 ms
        over = capped.infer({"IN": row}).get(timeout=10)
        assert over.error is not None
        assert over.error.message == "[request id: <id_unknown>] Exceeds maximum queue size"
        assert queued.get(timeout=10).error.message == "Request timeout expired"
        gate.touch()
        assert first.get(timeout=20).error is None

        refused = infer(server.model("seq"), {"IN": row}, correlation_id=5)
        assert refused.error is not None and "START flag" in refused.error.message

        reasons = {(f["name"], reason): n for f in server.failures()
                   for reason, n in f["reasons"].items() if n}
        assert reasons == {("boom", "BACKEND"): 2, ("ens", "OTHER"): 1,
                           ("gated", "REJECTED"): 1, ("gated", "CANCELED"): 1,
                           ("capped", "REJECTED"): 1}
        # The statistics' failure counts are the same requests.
        assert {m: _counts(server, m)[1] for m in ("boom", "ens", "gated", "capped", "seq")} == {
            "boom": 2, "ens": 1, "gated": 2, "capped": 1, "seq": 0}


def test_a_timeout_that_passes_while_the_request_runs_does_not_end_it(tmp_path, shm_prefix):
    # As in Triton 2.51 (measured, QA L0_sequence_batcher's request timeout test): a request's
    # timeout is a time in the queue. Once an instance runs it, it runs to its end and is
    # answered and counted as a success; a request queued behind it still times out. tritonpy
    # answered the running one "Request timeout expired" at the deadline (counted a success).
    import time

    write_model(tmp_path, "gated", GATED_PY)
    write_model(tmp_path, "seq", GATED_PY, io_config(max_batch_size=1,
                                                     extra="sequence_batching { }\n"))
    with serving(tmp_path, shm_prefix) as server:
        for name, x, kw, why in (
                ("gated", fp32(1), {}, "Request timeout expired"),
                # START only: sequence 9 keeps the one slot (an END frees it once batched)
                ("seq", np.ones((1, 1), np.float32), {"correlation_id": 9, "flags": 1},
                 "timeout of the corresponding sequence has been expired")):  # (no free slot)
            model, gate = server.model(name), tmp_path / f"gate_{name}"
            running = model.infer({"IN": x}, parameters={"gate": str(gate)}, timeout=100_000,
                                  **kw)
            wait_until(lambda: (tmp_path / f"gate_{name}.in").exists(), 15,
                       "the gated execute started")
            queued = model.infer({"IN": x}, timeout=100_000,
                                 **({"correlation_id": 10, "flags": 3} if kw else {}))
            time.sleep(0.4)  # both deadlines passed
            gate.touch()
            answer = running.get(timeout=20)
            assert answer.error is None, answer.error
            assert answer.outputs["OUT"].to_numpy().tolist() == x.tolist()
            assert queued.get(timeout=20).error.message == why
            assert _counts(server, name) == (1, 1), name  # (success, failure)


# Awaits 0.4 s per request: an instance runs its executes side by side.
ASYNC_SLEEP_PY = """
import asyncio
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    async def execute(self, requests):
        await asyncio.sleep(0.4)
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())]) for r in requests]
"""


def test_side_by_side_async_executes_are_timed_as_they_ran(tmp_path, shm_prefix):
    # Four requests on one instance of an async execute run at once (0.4 s together). Each
    # was counted as queued behind the one before (queue 1.2 s of the 1.6 s), its compute
    # time the rest, against tritonpy's own pending count of 0 (QA L0_metrics, measured).
    import threading

    write_model(tmp_path, "aw", ASYNC_SLEEP_PY)
    with serving(tmp_path, shm_prefix) as server:
        model = server.model("aw")
        answers: list = []
        threads = [threading.Thread(target=lambda i=i: answers.append(infer(model, {"IN": fp32(i)})))
                   for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(answers) == 4 and all(a.error is None for a in answers)
        s = server.statistics("aw")["model_stats"][0]["inference_stats"]
    assert s["success"]["count"] == 4
    assert s["queue"]["ns"] < 4 * 0.1e9, s["queue"]  # dispatched at once, each
    assert s["compute_infer"]["ns"] >= 4 * 0.38e9, s["compute_infer"]  # 0.4 s each


# Sends its one response, final, then goes on for 0.4 s before its execute returns.
ANSWER_FIRST_PY = """
import time
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            r.get_response_sender().send(
                pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)]),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        time.sleep(0.4)
        return None
"""

ENS_CONFIG = """
platform: "ensemble"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ -1 ] } ]
model_transaction_policy { decoupled: true }
ensemble_scheduling { step [ { model_name: "first" model_version: -1
  input_map { key: "IN" value: "IN" } output_map { key: "OUT" value: "OUT" } } ] }
"""


def test_an_ensemble_counts_a_decoupled_step_whose_execute_outlasts_its_answer(
        tmp_path, shm_prefix):
    # As Triton 2.51 (measured, QA L0_metrics): an ensemble's compute times are the sums of
    # its steps', a decoupled step's whole execute included. tritonpy counted 0 for a step
    # that answered before its execute returned.
    write_model(tmp_path, "first", ANSWER_FIRST_PY,
                io_config(extra="model_transaction_policy { decoupled: true }\n"))
    write_model(tmp_path, "ens", "", ENS_CONFIG)
    with serving(tmp_path, shm_prefix) as server:
        got = collect(server.model("ens").infer({"IN": fp32(3)}))
        assert [r.outputs["OUT"].to_numpy().tolist() for r in got if r.outputs] == [[3.0]]
        wait_until(lambda: server.statistics("first")["model_stats"][0]["execution_count"]
                   == 1, 10, "the step's execute to end")
        ens = server.statistics("ens")["model_stats"][0]
    assert ens["inference_stats"]["success"]["count"] == 1
    assert ens["inference_stats"]["compute_infer"]["ns"] >= 0.38e9, ens["inference_stats"]
    assert ens["batch_stats"][0]["compute_infer"]["ns"] >= 0.38e9
