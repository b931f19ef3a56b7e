"""Misuse of the response sender and of execute's return value is a clear error, never a crash
and never a hang: sending after the final flag, two responses in default mode, a decoupled
execute returning responses, a default execute returning None without using its sender. And
what Triton allows: a default-mode model answering through its sender (one response plus the
final flag, together or apart) reaches the caller as exactly one response.

After every misuse the stub must still be the same process (no crash, no restart) and serve.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import numpy as np
import pytest

import tritonpy
from _bls_models import DECOUPLED_REPO, collect, new_prefix, serve, text

WAIT_S = 15.0


@pytest.fixture(scope="module")
def server() -> Iterator[tritonpy.Server]:
    with serve(DECOUPLED_REPO, new_prefix(), model_control_mode="explicit",
               load_models=["misuse_default", "misuse_decoupled"]) as srv:
        yield srv


def run(server, model: str, mode: str, value: int = 5) -> list:
    return collect(server.model(model).infer({"IN": np.array([value], np.int32)},
                                             parameters={"mode": mode}), WAIT_S)


def report(server, model: str) -> dict:
    (resp,) = run(server, model, "report")
    return text(resp, "REPORT")


def out(resp) -> int:
    assert resp.error is None, resp.error
    return int(resp.outputs["OUT"].to_numpy()[0])


def stub_pid(server, model: str) -> int:
    (inst,) = server.runtime(model).instances
    assert inst.state == "READY" and inst.stub is not None
    return inst.stub.pid


# -- default mode ------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["sender_ok", "sender_split"])
def test_default_model_may_answer_through_its_sender(server, mode):
    # sender_ok: send(response, COMPLETE_FINAL); sender_split: send(response), then
    # send(flags=COMPLETE_FINAL). Either way the caller of a default model gets one response.
    responses = run(server, "misuse_default", mode, 41)
    assert len(responses) == 1, responses
    assert responses[0].final and out(responses[0]) == 41


def test_default_model_second_response_raises(server):
    pid = stub_pid(server, "misuse_default")
    responses = run(server, "misuse_default", "two_responses", 7)
    assert len(responses) == 1 and out(responses[0]) == 7  # the first one, and only it
    seen = report(server, "misuse_default")
    assert seen["raised"] == "TritonModelException"
    assert "more than one response" in seen["message"]
    assert stub_pid(server, "misuse_default") == pid


def test_default_model_response_after_final_names_the_default_mode_limit(server):
    # Triton checks the default-mode limit before whether the sender is closed.
    responses = run(server, "misuse_default", "second_after_final", 4)
    assert len(responses) == 1 and out(responses[0]) == 4
    assert report(server, "misuse_default")["message"] == (
        "Unable to send response. Non-decoupled model cannot send more than one response.")


def test_default_model_bare_final_flag_first_raises(server):
    responses = run(server, "misuse_default", "final_only", 9)
    # The refused flag did not end the request: the returned response still reaches the caller.
    assert len(responses) == 1 and out(responses[0]) == 9
    seen = report(server, "misuse_default")
    assert seen["raised"] == "TritonModelException"
    assert "final" in seen["message"]


@pytest.mark.parametrize("mode", ["after_return", "after_return_list"])
def test_default_model_may_answer_through_its_sender_after_execute_returned(server, mode):
    # As with Triton: execute returns None (or None for that request) and a thread of the
    # model sends the one response later.
    pid = stub_pid(server, "misuse_default")
    responses = run(server, "misuse_default", mode, 23)
    assert len(responses) == 1 and responses[0].final and out(responses[0]) == 23
    (ok,) = run(server, "misuse_default", "", 4)
    assert out(ok) == 4
    assert stub_pid(server, "misuse_default") == pid


def test_default_model_raising_after_its_response_went_out_keeps_the_response(server, caplog):
    # Triton's client sees the response the sender sent; the error after it goes to the log.
    with caplog.at_level(logging.ERROR, logger="tritonpy"):
        responses = run(server, "misuse_default", "raise_after_send", 12)
    assert len(responses) == 1 and responses[0].final and out(responses[0]) == 12
    assert any("raised after its response went out" in r.getMessage() for r in caplog.records)
    (ok,) = run(server, "misuse_default", "", 5)
    assert out(ok) == 5


def test_default_model_returning_a_response_after_its_sender_answered(server):
    # The sender's response (with the final flag) is the one; the returned one is dropped.
    def counts() -> tuple[int, int]:
        (st,) = server.statistics("misuse_default")["model_stats"]
        return int(st["inference_stats"]["success"]["count"]), int(
            st["inference_stats"]["fail"]["count"])

    ok0, fail0 = counts()
    responses = run(server, "misuse_default", "return_after_send", 30)
    assert len(responses) == 1 and responses[0].final and out(responses[0]) == 30
    # As with Triton, a request is counted when its execute returns, which may be after its
    # sender's response reached the caller. The one instance's next answer comes after that.
    (ok,) = run(server, "misuse_default", "", 5)
    assert out(ok) == 5
    assert counts() == (ok0 + 2, fail0)  # each request counted once, as a success


def test_default_model_returning_none_without_sender_is_an_error(server):
    pid = stub_pid(server, "misuse_default")
    (resp,) = run(server, "misuse_default", "return_none")
    assert resp.final and resp.error is not None
    assert resp.error.code.value == "INTERNAL"
    assert "returned None" in resp.error.message
    # Same process, still serving.
    (ok,) = run(server, "misuse_default", "", 3)
    assert out(ok) == 3
    assert stub_pid(server, "misuse_default") == pid


# -- decoupled mode ----------------------------------------------------------------------------
def test_send_after_final_raises_and_nothing_more_arrives(server):
    pid = stub_pid(server, "misuse_decoupled")
    responses = run(server, "misuse_decoupled", "send_after_final")
    assert [r.final for r in responses] == [False, True]
    assert out(responses[0]) == 1 and responses[1].outputs == {}
    seen = report(server, "misuse_decoupled")
    assert seen["raised"] == "TritonModelException" and "closed" in seen["message"]
    assert stub_pid(server, "misuse_decoupled") == pid


def test_final_flag_twice_raises(server):
    responses = run(server, "misuse_decoupled", "final_twice")
    assert len(responses) == 1 and responses[0].final and out(responses[0]) == 1
    seen = report(server, "misuse_decoupled")
    assert seen["raised"] == "TritonModelException" and "closed" in seen["message"]


def test_bad_send_arguments_raise_in_tritons_words(server):
    pid = stub_pid(server, "misuse_decoupled")
    responses = run(server, "misuse_decoupled", "bad_calls")
    assert len(responses) == 1 and responses[0].final and out(responses[0]) == 9
    assert report(server, "misuse_decoupled")["messages"] == [
        "Unable to send response. Unsupported flag provided.",
        "Inference Response object must be provided when the response flags is set to zero.",
        "Unable to send response. Unsupported flag provided.",
    ]
    assert stub_pid(server, "misuse_decoupled") == pid


def test_decoupled_execute_returning_responses_is_an_error(server):
    pid = stub_pid(server, "misuse_decoupled")
    (resp,) = run(server, "misuse_decoupled", "return_list")
    assert resp.final and resp.error is not None
    assert resp.error.code.value == "INTERNAL"
    assert "decoupled" in resp.error.message and "return None" in resp.error.message
    assert stub_pid(server, "misuse_decoupled") == pid


def test_decoupled_return_after_a_complete_stream_is_logged(server, caplog):
    # The stream already ended, so no caller can get the error: the host log says it.
    def logged() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR
                and "misuse_decoupled" in r.getMessage() and "return None" in r.getMessage()]

    with caplog.at_level(logging.ERROR, logger="tritonpy"):
        responses = run(server, "misuse_decoupled", "send_then_return")
        # The final response can overtake the end of execute: wait (bounded) for the log.
        deadline = time.monotonic() + WAIT_S
        while not logged() and time.monotonic() < deadline:
            time.sleep(0.01)
    assert len(responses) == 1 and responses[0].final and out(responses[0]) == 1
    assert logged(), [r.getMessage() for r in caplog.records]


def test_decoupled_execute_raising_ends_the_stream_with_the_error(server):
    pid = stub_pid(server, "misuse_decoupled")
    (resp,) = run(server, "misuse_decoupled", "raise")
    assert resp.final and resp.error is not None
    assert "raised on purpose" in resp.error.message
    # Still the same process, still serving.
    (ok,) = run(server, "misuse_decoupled", "report")
    assert ok.error is None and "REPORT" in ok.outputs
    assert stub_pid(server, "misuse_decoupled") == pid
