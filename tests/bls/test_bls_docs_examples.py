"""BLS as Triton's docs show it, in real stubs: the sync, async (``asyncio.gather`` of several
``async_exec``), decoupled-sync and decoupled-async examples, a preprocess -> model ->
postprocess pipeline, a stateful target driven through correlation IDs and flags, and every
request field (version, id, parameters, correlation id, flags) reaching the target.

One server per module (explicit mode, only the models these tests use): starting stubs is the
slow part, and these tests only read.
"""
from __future__ import annotations

import importlib.util
import json
import time
from collections.abc import Iterator

import numpy as np
import pytest

import tritonpy
from _bls_models import (
    BLS_REPO,
    DECOUPLED_REPO,
    bytes_tensor,
    collect,
    drive,
    fp32,
    infer_one,
    new_prefix,
    serve,
)

MODELS = ["add_sub", "bls_sync", "bls_async", "square", "bls_decoupled_sync",
          "bls_decoupled_async", "pipeline", "pp_pre", "pp_post", "stateful", "bls_driver",
          "echo_meta", "versioned", "stream_n", "cancel_poll", "bls_fanout",
          "add_sub_batched"]
START = 1
END = 2


@pytest.fixture(scope="module")
def server() -> Iterator[tritonpy.Server]:
    with serve([BLS_REPO, DECOUPLED_REPO], new_prefix(), model_control_mode="explicit",
               load_models=MODELS) as srv:
        yield srv


def outputs(resp) -> dict:
    assert resp.error is None, resp.error
    return {n: t.to_numpy() for n, t in resp.outputs.items()}


# -- the four examples of Triton's BLS page ------------------------------------------------------
def test_sync_exec_forwards_to_the_named_model(server) -> None:
    in0 = np.array([1, 2, 3, 4], np.float32)
    in1 = np.array([10, 20, 30, 40], np.float32)
    out = outputs(infer_one(server, "bls_sync", {
        "MODEL_NAME": bytes_tensor("add_sub"), "INPUT0": in0, "INPUT1": in1}))
    np.testing.assert_array_equal(out["OUTPUT0"], in0 + in1)
    np.testing.assert_array_equal(out["OUTPUT1"], in0 - in1)


def test_sync_exec_of_an_unknown_model_fails_the_callers_request(server) -> None:
    resp = infer_one(server, "bls_sync", {
        "MODEL_NAME": bytes_tensor("no_such_model"),
        "INPUT0": np.ones(2, np.float32), "INPUT1": np.ones(2, np.float32)})
    assert resp.error is not None
    assert "no_such_model" in resp.error.message


@pytest.mark.parametrize("calls", [1, 4, 8])
def test_async_exec_gathered(server, calls: int) -> None:
    in0 = np.array([1.5, -2.0, 3.0], np.float32)
    in1 = np.array([0.5, 0.5, 1.0], np.float32)
    out = outputs(infer_one(server, "bls_async", {"INPUT0": in0, "INPUT1": in1},
                            parameters={"calls": calls}))
    # gather keeps order: row i answers the call that sent INPUT0 + i
    expect_sums = np.stack([in0 + i + in1 for i in range(calls)])
    expect_diffs = np.stack([in0 + i - in1 for i in range(calls)])
    np.testing.assert_array_equal(out["SUMS"], expect_sums)
    np.testing.assert_array_equal(out["DIFFS"], expect_diffs)


@pytest.mark.parametrize("n", [0, 1, 5])
def test_decoupled_sync_iterates_every_response_and_an_empty_last(server, n: int) -> None:
    out = outputs(infer_one(server, "bls_decoupled_sync", {"IN": np.array([n], np.int32)}))
    assert out["OUT"].tolist() == [n] * n
    # n responses with OUT, then the bare COMPLETE_FINAL flag as one empty response
    assert out["NRESP"].tolist() == [n + 1]


def test_decoupled_async_gathers_two_streams(server) -> None:
    out = outputs(infer_one(server, "bls_decoupled_async", {"IN": np.array([3], np.int32)}))
    assert out["OUT"].tolist() == [3, 3, 3, 4, 4, 4, 4]
    assert out["NRESP"].tolist() == [4, 5]


def test_decoupled_stream_via_driver_reports_each_response(server) -> None:
    report, _ = drive(server, {"model": "stream_n", "mode": "decoupled", "outputs": ["OUT"],
                               "inputs": {"N": {"data": [3], "dtype": "int32"}}})
    assert report["exception"] is None
    values = [r["outputs"].get("OUT", {}).get("values") for r in report["responses"]]
    assert values == [[0], [1], [2], None]  # the last one carries no tensors
    assert all(r["error"] is None for r in report["responses"])


def test_decoupled_iterator_cancel_reaches_the_target(server) -> None:
    t0 = time.monotonic()
    report, _ = drive(server, {"model": "cancel_poll", "mode": "decoupled_cancel",
                               "outputs": ["OUT"], "request_id": "bls-cancel-1",
                               "parameters": {"mode": "poll"},
                               "inputs": {"IN": {"data": [0], "dtype": "int32"}}})
    assert time.monotonic() - t0 < 5, "cancel() did not end the stream promptly"
    assert report["exception"] is None, report["exception"]
    first, *rest = report["responses"]
    assert first["error"] is None and first["outputs"]["OUT"]["values"] == [0]
    # the iterator ends after cancel(): at most one more, final, response (CANCELLED)
    assert len(rest) <= 1
    if rest:
        assert rest[0]["error"] is not None and rest[0]["error"]["code"] == 7
    # the target saw is_cancelled() turn True
    stream = server.model("cancel_poll").infer({"IN": np.array([0], np.int32)},
                                               parameters={"mode": "report"})
    seen = json.loads(collect(stream)[0].outputs["REPORT"].to_numpy()[0])["seen"]
    assert seen["bls-cancel-1"]["cancelled"] is True, seen


def test_decoupled_target_without_decoupled_true_is_an_error_not_a_hang(server) -> None:
    report, _ = drive(server, {"model": "square", "outputs": ["OUT"],
                               "inputs": {"IN": {"data": [2], "dtype": "int32"}}})
    (resp,) = report["responses"]
    assert resp["error"] is not None
    assert "decoupled" in resp["error"]["message"]


# -- a pipeline ----------------------------------------------------------------------------------
def test_preprocess_model_postprocess_pipeline(server) -> None:
    out = outputs(infer_one(server, "pipeline", {
        "TEXT0": bytes_tensor("1.5", "10", "-2"), "TEXT1": bytes_tensor("0.5", "2.5", "3")}))
    assert [t.decode() for t in out["SUM_TEXT"].tolist()] == ["2.0", "12.5", "1.0"]
    assert [t.decode() for t in out["DIFF_TEXT"].tolist()] == ["1.0", "7.5", "-5.0"]


def test_pipeline_error_in_a_stage_reaches_the_client(server) -> None:
    resp = infer_one(server, "pipeline", {"TEXT0": bytes_tensor("1", "x"),
                                          "TEXT1": bytes_tensor("1", "2")})
    assert resp.error is not None
    assert "pp_pre" in resp.error.message


# -- a stateful target -----------------------------------------------------------------------------
def _seq_call(server, corr, value: int, flags: int) -> dict:
    report, _ = drive(server, {"model": "stateful", "outputs": ["ACC", "SEEN"],
                               "inputs": {"INPUT": {"data": [value], "dtype": "int32"}},
                               "correlation_id": corr, "flags": flags})
    assert report["exception"] is None, report
    (resp,) = report["responses"]
    assert resp["error"] is None, resp["error"]
    seen = json.loads(resp["outputs"]["SEEN"]["values"][0])
    return {"acc": resp["outputs"]["ACC"]["values"][0], **seen}


@pytest.mark.parametrize("corr_a, corr_b", [(17, 23), ("seq-a", "seq-b")])
def test_stateful_target_through_correlation_id_and_flags(server, corr_a, corr_b) -> None:
    first = _seq_call(server, corr_a, 5, START)
    assert first["acc"] == 5
    assert first["correlation_id"] == corr_a
    assert first["correlation_id_type"] == type(corr_a).__name__
    assert first["flags"] == START
    # two sequences interleaved keep separate state
    assert _seq_call(server, corr_b, 100, START)["acc"] == 100
    assert _seq_call(server, corr_a, 7, 0)["acc"] == 12
    assert _seq_call(server, corr_b, 1, 0)["acc"] == 101
    last = _seq_call(server, corr_a, 1, END)
    assert last["acc"] == 13 and last["flags"] == END
    assert _seq_call(server, corr_b, 0, END)["acc"] == 101
    # START|END in one request: a sequence of one
    single = _seq_call(server, corr_a, 9, START | END)
    assert single["acc"] == 9 and single["flags"] == START | END
    # Past INT32 the sum wraps, as a C++ accumulator's would (NumPy 2 refused to make ACC).
    assert _seq_call(server, corr_a, 2**31 - 1, START)["acc"] == 2**31 - 1
    assert _seq_call(server, corr_a, 1, END)["acc"] == -2**31


def test_stateful_target_rejects_a_sequence_without_start(server) -> None:
    report, _ = drive(server, {"model": "stateful", "outputs": ["ACC"],
                               "inputs": {"INPUT": {"data": [1], "dtype": "int32"}},
                               "correlation_id": 999, "flags": 0})
    (resp,) = report["responses"]
    assert resp["error"] is not None


# -- request fields reach the target -------------------------------------------------------------
def test_request_id_parameters_correlation_and_flags_reach_the_target(server) -> None:
    params = {"flag": True, "count": -42, "name": "hello", "zero": 0}
    report, _ = drive(server, {"model": "echo_meta", "outputs": ["META", "OUTPUT0"],
                               "inputs": {"INPUT0": {"data": [1.0, 2.0], "dtype": "float32"}},
                               "request_id": "req-7", "correlation_id": "corr-x",
                               "flags": 0, "parameters": params, "timeout": 5_000_000})
    (resp,) = report["responses"]
    assert resp["error"] is None, resp
    meta = json.loads(resp["outputs"]["META"]["values"][0])
    assert meta["request_id"] == "req-7"
    assert meta["correlation_id"] == "corr-x" and meta["correlation_id_type"] == "str"
    assert meta["parameters"] == params
    assert type(meta["parameters"]["flag"]) is bool
    # The text, as Triton's core writes it (compact; a model comparing strings sees that).
    assert meta["parameters_text"] == '{"flag":true,"count":-42,"name":"hello","zero":0}'
    assert meta["requested_outputs"] == ["META", "OUTPUT0"]
    assert meta["timeout"] == 5_000_000
    assert resp["outputs"]["OUTPUT0"]["values"] == [2.0, 4.0]


def test_requested_outputs_limit_what_comes_back(server) -> None:
    report, _ = drive(server, {"model": "echo_meta", "outputs": ["OUTPUT0"],
                               "inputs": {"INPUT0": {"data": [3.0], "dtype": "float32"}}})
    (resp,) = report["responses"]
    assert list(resp["outputs"]) == ["OUTPUT0"]


def test_int_correlation_id_stays_an_int(server) -> None:
    report, _ = drive(server, {"model": "echo_meta", "outputs": ["META"],
                               "inputs": {"INPUT0": {"data": [1.0], "dtype": "float32"}},
                               "correlation_id": 2**40 + 3})
    meta = json.loads(report["responses"][0]["outputs"]["META"]["values"][0])
    assert meta["correlation_id"] == 2**40 + 3 and meta["correlation_id_type"] == "int"


@pytest.mark.parametrize("version, expect", [(1, 1), (2, 2), (-1, 2)])
def test_model_version_selects_the_version(server, version: int, expect: int) -> None:
    report, _ = drive(server, {"model": "versioned", "outputs": ["VERSION"], "version": version,
                               "inputs": {"INPUT0": {"data": [0.0], "dtype": "float32"}}})
    (resp,) = report["responses"]
    assert resp["error"] is None, resp
    assert resp["outputs"]["VERSION"]["values"] == [expect]


def test_a_negative_model_version_other_than_minus_one_is_not_found(server) -> None:
    # -1 is the latest; -5 was served as the latest too, where Triton looks it up by number.
    report, _ = drive(server, {"model": "versioned", "outputs": ["VERSION"], "version": -5,
                               "inputs": {"INPUT0": {"data": [0.0], "dtype": "float32"}}})
    (resp,) = report["responses"]
    assert resp["error"] is not None, resp
    assert "'versioned' version -5 is not found" in resp["error"]["message"], resp


def test_bls_calls_count_in_the_targets_statistics(server) -> None:
    def success_count() -> int:
        (stats,) = server.statistics("echo_meta")["model_stats"]
        return int(stats["inference_stats"]["success"]["count"])

    before = success_count()
    report, _ = drive(server, {"model": "echo_meta", "outputs": ["OUTPUT0"], "repeat": 5,
                               "inputs": {"INPUT0": {"data": [1.0], "dtype": "float32"}}})
    assert report["calls"] == 5 and report["errors"] == 0
    assert success_count() - before == 5


def test_bls_result_is_also_correct_for_a_large_tensor(server) -> None:
    data = np.arange(1 << 18, dtype=np.float32)  # 1 MiB: travels by shm handle
    out = outputs(infer_one(server, "bls_sync", {
        "MODEL_NAME": bytes_tensor("add_sub"), "INPUT0": data, "INPUT1": data}))
    np.testing.assert_array_equal(out["OUTPUT0"], data * 2)
    np.testing.assert_array_equal(out["OUTPUT1"], np.zeros_like(data))


def test_async_bls_calls_are_batched_by_the_targets_dynamic_batcher(server) -> None:
    def counts() -> tuple[int, int]:
        (stats,) = server.statistics("add_sub_batched")["model_stats"]
        return int(stats["inference_count"]), int(stats["execution_count"])

    inf0, exe0 = counts()
    out = outputs(infer_one(server, "bls_fanout", {"INPUT0": np.array([10.0], np.float32)},
                            parameters={"calls": 8}))
    assert out["OUTPUT0"].tolist() == [11.0 + i for i in range(8)]
    inf1, exe1 = counts()
    assert inf1 - inf0 == 8
    # eight requests in flight at once, a 100 ms queue delay, max batch 8: batched like a
    # client's requests would be (fewer executes than requests)
    assert 1 <= exe1 - exe0 < 8, (exe1 - exe0)


@pytest.mark.parametrize("kind", [1, 2])  # TRITONSERVER_MEMORY_CPU, _CPU_PINNED
def test_preferred_memory_cpu_is_accepted_and_honoured(server, kind: int) -> None:
    report, _ = drive(server, {"model": "add_sub", "outputs": ["OUTPUT0"],
                               "preferred_memory": [kind, 0],
                               "inputs": {"INPUT0": fp32(1, 2), "INPUT1": fp32(1, 1)}})
    assert report["exception"] is None, report["exception"]
    (resp,) = report["responses"]
    assert resp["error"] is None
    assert resp["outputs"]["OUTPUT0"]["values"] == [2.0, 3.0]


def test_preferred_memory_gpu_without_cupy_leaves_outputs_on_the_cpu(server) -> None:
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed here: this is about a stub without it")
    report, _ = drive(server, {"model": "add_sub", "outputs": ["OUTPUT0"],
                               "preferred_memory": [0, 0],  # TRITONSERVER_MEMORY_GPU
                               "inputs": {"INPUT0": fp32(1, 2), "INPUT1": fp32(1, 1)}})
    assert report["exception"] is None, report["exception"]
    (resp,) = report["responses"]
    assert resp["error"] is None
    assert resp["outputs"]["OUTPUT0"]["values"] == [2.0, 3.0]
