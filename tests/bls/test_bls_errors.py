"""Every BLS error path, in real stubs: timeouts, parameters of the wrong type, a target that
raises or answers an error, unknown models and versions, bad inputs, BLS where Triton forbids
it (initialize) and from threads of the stub — and through all of it the caller's stub keeps
serving (same process, no restart)."""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator

import numpy as np
import pytest

import tritonpy
from _bls_models import (
    BLS_REPO,
    DECOUPLED_REPO,
    drive,
    fp32,
    infer_one,
    new_prefix,
    serve,
    text,
)

MODELS = ["bls_driver", "add_sub", "sleeper", "failing", "versioned", "echo_meta", "square",
          "bls_in_init", "bls_background", "identity", "queue_policy", "misuse_decoupled"]
# pb_utils.TritonError codes
INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, CANCELLED = 1, 2, 3, 4, 7


@pytest.fixture(scope="module")
def server() -> Iterator[tritonpy.Server]:
    with serve([BLS_REPO, DECOUPLED_REPO], new_prefix(), model_control_mode="explicit",
               load_models=MODELS) as srv:
        yield srv


@pytest.fixture(scope="module")
def driver_pid(server) -> int:
    (inst,) = server.runtime("bls_driver").instances
    return inst.stub.pid


def one(report: dict) -> dict:
    assert report["exception"] is None, report["exception"]
    (resp,) = report["responses"]
    return resp


def assert_driver_still_serves(server, driver_pid: int) -> None:
    (inst,) = server.runtime("bls_driver").instances
    assert inst.stub.pid == driver_pid and inst.state == "READY" and inst.restarts == 0
    report, _ = drive(server, {"model": "add_sub", "outputs": ["OUTPUT0"],
                               "inputs": {"INPUT0": fp32(1, 2), "INPUT1": fp32(3, 4)}})
    assert one(report)["outputs"]["OUTPUT0"]["values"] == [4.0, 6.0]


# -- timeout -------------------------------------------------------------------------------------
def test_timeout_answers_with_an_error_and_cancels_the_target(server, driver_pid) -> None:
    t0 = time.monotonic()
    report, _ = drive(server, {"model": "sleeper", "outputs": ["SLEPT"], "request_id": "slow-1",
                               "timeout": 200_000,  # µs
                               "inputs": {"MS": {"data": [3000], "dtype": "int32"}}})
    took = time.monotonic() - t0
    resp = one(report)
    assert resp["error"] is not None, resp
    assert "timeout" in resp["error"]["message"].lower()
    assert took < 2.5, f"the timeout answered after {took:.2f} s"
    # the target saw the cancellation and stopped early
    log_report, _ = drive(server, {"model": "sleeper", "outputs": ["LOG"],
                                   "inputs": {"MS": {"data": [0], "dtype": "int32"}}})
    log = json.loads(one(log_report)["outputs"]["LOG"]["values"][0])
    slow = [e for e in log if e["request_id"] == "slow-1"]
    assert slow and slow[-1]["cancelled"] and slow[-1]["slept_ms"] < 2500, log
    assert_driver_still_serves(server, driver_pid)


def test_timeout_of_a_request_still_queued(server) -> None:
    # The only sleeper instance is busy with a client request; the BLS call times out in the
    # queue and never runs.
    busy = server.model("sleeper").infer({"MS": np.array([1500], np.int32)})
    time.sleep(0.1)
    t0 = time.monotonic()
    report, _ = drive(server, {"model": "sleeper", "outputs": ["SLEPT"], "timeout": 100_000,
                               "request_id": "queued-1",
                               "inputs": {"MS": {"data": [0], "dtype": "int32"}}})
    resp = one(report)
    assert resp["error"] is not None and "timeout" in resp["error"]["message"].lower()
    assert time.monotonic() - t0 < 1.2  # answered while the sleeper is still busy
    assert busy.get(timeout=10).error is None
    log_report, _ = drive(server, {"model": "sleeper", "outputs": ["LOG"],
                                   "inputs": {"MS": {"data": [0], "dtype": "int32"}}})
    log = json.loads(one(log_report)["outputs"]["LOG"]["values"][0])
    assert "queued-1" not in [e["request_id"] for e in log], log


def test_a_generous_timeout_does_not_fire(server) -> None:
    report, _ = drive(server, {"model": "sleeper", "outputs": ["SLEPT"], "timeout": 5_000_000,
                               "inputs": {"MS": {"data": [20], "dtype": "int32"}}})
    resp = one(report)
    assert resp["error"] is None and resp["outputs"]["SLEPT"]["values"][0] >= 20


ROW = {"data": [[1.0, 2.0]], "dtype": "float32"}  # one batch row


def test_timeout_already_passed_when_the_batch_forms(server, driver_pid) -> None:
    # Triton's BLS test_timeout: a 5 µs timeout on a model whose queue policy lets requests
    # shorten it fails with the instance idle, as the policy applies when the batch forms.
    report, _ = drive(server, {"model": "queue_policy", "outputs": ["OUTPUT0"], "timeout": 5,
                               "inputs": {"INPUT0": ROW}})
    resp = one(report)
    assert resp["error"] is not None and resp["outputs"] == {}
    assert "Request timeout expired" in resp["error"]["message"]
    assert resp["error"]["code"] == UNAVAILABLE
    report, _ = drive(server, {"model": "queue_policy", "outputs": ["OUTPUT0"],
                               "timeout": 5_000_000, "inputs": {"INPUT0": ROW}})
    assert one(report)["outputs"]["OUTPUT0"]["values"] == [[2.0, 4.0]]
    stats = server.statistics("queue_policy")["model_stats"][0]["inference_stats"]
    assert (stats["success"]["count"], stats["fail"]["count"]) == (1, 1)
    assert_driver_still_serves(server, driver_pid)


# -- parameters ----------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [1.5, [1, 2], {"a": 1}, None])
def test_parameters_other_than_bool_int_str_are_rejected(server, driver_pid, bad) -> None:
    report, _ = drive(server, {"model": "echo_meta", "outputs": ["META"],
                               "parameters": {"ok": 1, "bad": bad},
                               "inputs": {"INPUT0": fp32(1)}})
    assert report["exception"] is not None
    assert "TritonModelException" in report["exception"]
    assert "bool/int/str" in report["exception"] and "bad" in report["exception"]
    assert report["responses"] == []  # refused before anything was sent
    assert_driver_still_serves(server, driver_pid)


# -- the target fails ----------------------------------------------------------------------------
@pytest.mark.parametrize("mode, text_in_message", [
    ("raise", "failing model was asked to raise"),
    ("model_exception", "failing model raised TritonModelException"),
])
def test_target_that_raises(server, driver_pid, mode, text_in_message) -> None:
    report, _ = drive(server, {"model": "failing", "outputs": ["OUTPUT0"],
                               "parameters": {"mode": mode}, "inputs": {"INPUT0": fp32(1)}})
    resp = one(report)
    assert resp["error"] is not None
    assert text_in_message in resp["error"]["message"]
    assert not resp["error"]["message"].startswith("Model ")  # it ran: Triton adds no prefix
    # The model's own frame, though its repository lies inside tritonpy's source checkout.
    assert "/failing/1/model.py(" in resp["error"]["message"]
    assert resp["error"]["code"] == INTERNAL
    assert resp["outputs"] == {}
    assert_driver_still_serves(server, driver_pid)


@pytest.mark.parametrize("code", [INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, CANCELLED])
def test_target_error_response_keeps_message_and_code(server, code) -> None:
    report, _ = drive(server, {"model": "failing", "outputs": ["OUTPUT0"],
                               "parameters": {"mode": "error", "code": code,
                                              "message": f"custom error {code}"},
                               "inputs": {"INPUT0": fp32(1)}})
    resp = one(report)
    assert resp["error"] == {"code": code, "message": f"custom error {code}"}


def test_a_decoupled_target_that_raises_after_a_response_ends_the_callers_stream(
        server, driver_pid) -> None:
    # Triton 2.51's iterator never ends here (QA measured it): the caller's instance waits for
    # good, an unload of the target stays UNLOADING, a stop waits out its exit timeout.
    report, _ = drive(server, {"model": "misuse_decoupled", "mode": "decoupled",
                               "outputs": ["OUT"], "parameters": {"mode": "send_then_raise"},
                               "inputs": {"IN": {"data": [1], "dtype": "int32"}}}, timeout=30)
    assert report["exception"] is None, report["exception"]
    first, *rest = report["responses"]
    assert first["error"] is None and first["outputs"]["OUT"]["values"] == [1]
    assert rest and rest[0]["error"] is not None
    assert "misuse_decoupled raised after a response" in rest[0]["error"]["message"]
    assert all(r["outputs"] == {} for r in rest)
    assert_driver_still_serves(server, driver_pid)
    (inst,) = server.runtime("misuse_decoupled").instances
    assert inst.state == "READY" and inst.restarts == 0


def test_target_that_succeeds_after_failures(server) -> None:
    report, _ = drive(server, {"model": "failing", "outputs": ["OUTPUT0"],
                               "inputs": {"INPUT0": fp32(7, 8)}})
    assert one(report)["outputs"]["OUTPUT0"]["values"] == [7.0, 8.0]


# -- unknown model / version ---------------------------------------------------------------------
@pytest.mark.parametrize("spec, needle", [
    ({"model": "no_such_model"}, "no_such_model"),
    ({"model": "versioned", "version": 7}, "7"),
])
def test_unknown_model_or_version_is_not_found(server, driver_pid, spec, needle) -> None:
    report, _ = drive(server, {**spec, "outputs": ["VERSION"], "inputs": {"INPUT0": fp32(1)}})
    resp = one(report)
    assert resp["error"] is not None
    assert resp["error"]["code"] == NOT_FOUND
    assert needle in resp["error"]["message"]
    # Triton's own words come first (models and Triton's tests match on them): its Python
    # backend's prefix for a request refused before it was queued, then core's sentence.
    assert resp["error"]["message"].startswith(
        f"Model {spec['model']} - Error when running inference: Failed for execute the "
        f"inference request. Model '{spec['model']}' is not ready.")
    assert_driver_still_serves(server, driver_pid)


def test_model_in_the_repository_but_not_loaded_is_not_found(server) -> None:
    # As Triton's core answers a model it has never loaded: not in its lifecycle at all.
    report, _ = drive(server, {"model": "lazy_target", "outputs": ["OUTPUT0"],
                               "inputs": {"INPUT0": fp32(1)}})
    resp = one(report)
    assert resp["error"] is not None and resp["error"]["code"] == NOT_FOUND
    assert resp["error"]["message"] == (
        "Model lazy_target - Error when running inference: Failed for execute the inference "
        "request. Model 'lazy_target' is not ready. (Request for unknown model: 'lazy_target' "
        "is not found)")


# -- bad inputs ----------------------------------------------------------------------------------
@pytest.mark.parametrize("inputs, outputs, needle", [
    ({"WRONG": fp32(1), "INPUT1": fp32(1)}, ["OUTPUT0"], "WRONG"),  # unknown input name
    ({"INPUT0": fp32(1)}, ["OUTPUT0"], "INPUT1"),  # a required input missing
    ({"INPUT0": {"data": [1], "dtype": "int32"}, "INPUT1": fp32(1)}, ["OUTPUT0"], "INPUT0"),
    ({"INPUT0": {"data": [[1.0]], "dtype": "float32"}, "INPUT1": fp32(1)}, ["OUTPUT0"], "INPUT0"),
    ({"INPUT0": fp32(1), "INPUT1": fp32(1)}, ["NOPE"], "NOPE"),  # unknown requested output
], ids=["name", "missing", "dtype", "shape", "output"])
def test_bad_inputs_are_invalid_arg(server, driver_pid, inputs, outputs, needle) -> None:
    report, _ = drive(server, {"model": "add_sub", "outputs": outputs, "inputs": inputs})
    resp = one(report)
    assert resp["error"] is not None, resp
    assert resp["error"]["code"] == INVALID_ARG, resp["error"]
    assert needle in resp["error"]["message"]
    assert resp["error"]["message"].startswith("Model add_sub - Error when running inference: ")
    assert_driver_still_serves(server, driver_pid)


def test_exec_without_decoupled_on_a_decoupled_model_is_refused_in_tritons_words(
        server, driver_pid) -> None:
    report, _ = drive(server, {"model": "square", "outputs": ["OUT"],
                               "inputs": {"IN": {"data": [2], "dtype": "int32"}}})
    resp = one(report)
    assert resp["error"] is not None and resp["error"]["code"] == INVALID_ARG
    assert resp["error"]["message"] == (
        "Model square - Error when running inference: Model square is using the decoupled. The "
        "current BLS request call doesn't support models using the decoupled transaction "
        "policy. Please use 'decoupled=True' argument to the 'exec' or 'async_exec' calls for "
        "decoupled models.")
    assert_driver_still_serves(server, driver_pid)


def test_an_input_named_twice_is_invalid_arg(server, driver_pid) -> None:
    # INPUT0 from the spec and again as the forwarded DATA: Triton 2.51 answers the call with
    # "input 'INPUT0' already exists in request"; the second one used to win silently.
    report, _ = drive(server, {"model": "add_sub", "outputs": ["OUTPUT0"], "data_as": "INPUT0",
                               "inputs": {"INPUT0": fp32(1), "INPUT1": fp32(1)}},
                      data=np.array([2.0], np.float32))
    resp = one(report)
    assert resp["error"] is not None, resp
    assert resp["error"]["code"] == INVALID_ARG, resp["error"]
    assert resp["error"]["message"] == (
        "Model add_sub - Error when running inference: input 'INPUT0' already exists in request")
    assert_driver_still_serves(server, driver_pid)


def test_many_errors_in_a_row_leave_the_caller_healthy(server, driver_pid) -> None:
    report, _ = drive(server, {"model": "no_such_model", "outputs": ["X"], "repeat": 200,
                               "inputs": {"INPUT0": fp32(1)}})
    assert report["calls"] == 200 and report["errors"] == 200
    assert_driver_still_serves(server, driver_pid)


# -- where BLS may run ---------------------------------------------------------------------------
def test_exec_in_initialize_fails_clearly_and_execute_still_works(server) -> None:
    report = text(infer_one(server, "bls_in_init", {"INPUT0": np.array([2, 3], np.float32)}),
                  "REPORT")
    assert report["raised"] == "TritonModelException"
    assert "BLS is only supported during the 'execute' function." in report["message"]
    assert "initialize" in report["message"]
    assert report["execute_bls_ok"] is True
    assert report["execute_bls_out"] == [4.0, 6.0]


@pytest.mark.parametrize("mode", ["thread", "thread_decoupled"])
def test_bls_from_a_thread_during_execute_works(server, mode) -> None:
    spec = ({"model": "add_sub", "outputs": ["OUTPUT0"],
             "inputs": {"INPUT0": fp32(1, 2), "INPUT1": fp32(1, 1)}} if mode == "thread" else
            {"model": "square", "outputs": ["OUT"],
             "inputs": {"IN": {"data": [2], "dtype": "int32"}}})
    report, _ = drive(server, {**spec, "mode": mode, "thread_timeout": 10})
    assert report["thread_hung"] is False
    assert report["exception"] is None, report["exception"]
    if mode == "thread":
        assert [r["outputs"]["OUTPUT0"]["values"] for r in report["responses"]] == [[2.0, 3.0]]
    else:
        assert [r["outputs"].get("OUT", {}).get("values") for r in report["responses"]] == \
            [[2], [2], None]


@pytest.mark.parametrize("decoupled", [False, True])
def test_bls_from_a_thread_after_execute_returned_works(server, decoupled) -> None:
    first = text(infer_one(server, "bls_background", {"INPUT0": np.array([5.0], np.float32)},
                           parameters={"action": "start", "decoupled": decoupled}), "REPORT")
    assert first == {"done": False}
    deadline = time.monotonic() + 10
    while True:
        rec = text(infer_one(server, "bls_background", {"INPUT0": np.zeros(1, np.float32)},
                             parameters={"action": "report"}), "REPORT")
        if rec["done"] or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert rec["done"], "the background BLS call never finished (hung)"
    assert rec["exception"] is None, rec
    assert rec["output"] == ([[2], [2]] if decoupled else [10.0])
    assert rec["seconds"] < 5


def test_target_stub_dying_mid_call(server, driver_pid) -> None:
    report, _ = drive(server, {"model": "failing", "outputs": ["OUTPUT0"],
                               "parameters": {"mode": "exit"}, "inputs": {"INPUT0": fp32(1)}})
    resp = one(report)
    assert resp["error"] is not None and resp["error"]["code"] == UNAVAILABLE
    assert "exited with code 3" in resp["error"]["message"]
    assert_driver_still_serves(server, driver_pid)
    # the target is restarted and serves BLS calls again
    deadline = time.monotonic() + 20
    while True:
        report, _ = drive(server, {"model": "failing", "outputs": ["OUTPUT0"],
                                   "inputs": {"INPUT0": fp32(5)}})
        resp = one(report)
        if resp["error"] is None or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert resp["error"] is None and resp["outputs"]["OUTPUT0"]["values"] == [5.0], resp


def test_exec_in_finalize_fails_clearly(caplog) -> None:
    caplog.set_level(logging.INFO, logger="tritonpy.model.bls_in_init")
    with serve(BLS_REPO, new_prefix(), model_control_mode="explicit",
               load_models=["bls_in_init", "add_sub"]) as srv:
        srv.unload("bls_in_init")
        deadline = time.monotonic() + 10
        while "finalize BLS" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
    lines = [r.getMessage() for r in caplog.records if "finalize BLS" in r.getMessage()]
    assert len(lines) == 1, caplog.text
    assert "TritonModelException" in lines[0] and "finalize" in lines[0], lines[0]
