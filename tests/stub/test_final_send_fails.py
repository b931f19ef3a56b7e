"""A final send that fails after its execute returned leaves the request open, as any failed
send does.

A response sender takes its request for answered when ``send(..., flags=FINAL)`` starts, and
for unanswered again when nothing went. An execute that returns in between (a thread of the
model sends the final response) sees the sender closed and takes the request for ended. When
the send then fails, the request is still open, and must stay so for the stub: the model may
send another final response, a CANCEL from the client must still reach ``is_cancelled()``, and
letting go of the request and its sender must still end it with an error (a client waiting for
ever otherwise).

Two ways a final send fails, "how" below: "frame", a frame msgpack refuses (its parameters made
to hold a lone surrogate as it is built), and "body", a response whose body cannot be built (a
BYTES element that is not UTF-8 text).
The model orders the race itself, with no sleeps: the failing response holds a BYTES element
whose ``str()`` (model code, run while the stub builds the body, after the sender took the
request for answered) lets the execute return, then waits for the next execute of the
instance, which runs only once the one before is over (a sync model runs one execute at a
time, and the stub says so only after it looked at which requests the execute ended).
"""
from __future__ import annotations

import json
import queue

import numpy as np
import pytest

from _models import new_prefix, serving, write_model

pytestmark = pytest.mark.timeout(90)

WAIT_S = 15.0

CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "OUT", data_type: TYPE_STRING, dims: [ -1 ] } ]
instance_group [ { count: 1, kind: KIND_CPU } ]
model_transaction_policy { decoupled: true }
"""

# Each request's "mode" parameter says what the model does with it; "race" requests also say
# how the final send fails ("how") and what the model does after ("then").
MODEL_PY = r'''
import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

WAIT_S = 10.0
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def text(value):
    return pb_utils.Tensor("OUT", np.array([value.encode()], dtype=object))


class Stall:
    """A BYTES element whose str() runs while the stub builds the frame of the final send."""

    def __init__(self, model, value):
        self.model = model
        self.value = value
        self.spoil = None  # a response whose frame it makes unencodable, as it is built

    def __str__(self):
        self.model.sending.set()  # the sender is closed now: the execute may return
        self.model.go.wait(WAIT_S)  # ... and has been seen to end
        if self.spoil is not None:
            # The parameters are read after the outputs: the frame is built, and msgpack
            # refuses it. (A test's hook into the response: no public call can do this, as
            # parameters are checked and copied when the response is made. Real ones: an
            # error message holding a lone surrogate, a spilled frame with no shm left.)
            self.spoil._parameters = {"note": "\ud800"}
        return self.value


class TritonPythonModel:
    def initialize(self, args):
        self.sending = threading.Event()  # the race's final send is under way
        self.go = threading.Event()  # the execute of the race is over: the send goes on
        self.reported = threading.Event()  # the race's thread has recorded what it saw
        self.seen = {}

    def execute(self, requests):
        for r in requests:
            params = json.loads(r.parameters())
            mode = params["mode"]
            sender = r.get_response_sender()
            if mode == "race":
                self.sending.clear()
                self.go.clear()
                self.reported.clear()
                self.seen = {}
                threading.Thread(target=self.race, args=(r, sender, params["how"],
                                                         params["then"])).start()
                # Return while the thread's final send is under way (not yet failed).
                if not self.sending.wait(WAIT_S):
                    raise RuntimeError("the final send did not start")
            elif mode == "go":
                # This instance runs one execute at a time: the race's execute is over.
                self.go.set()
                sender.send(pb_utils.InferenceResponse([text("went")]), flags=FINAL)
            elif mode == "mark":
                sender.send(pb_utils.InferenceResponse([text("marked")]), flags=FINAL)
            elif mode == "report":
                self.reported.wait(WAIT_S)
                sender.send(pb_utils.InferenceResponse(
                    [text(json.dumps(self.seen))]), flags=FINAL)
        return None

    def race(self, request, sender, how, then):
        if how == "frame":
            stall = Stall(self, "fine")
            bad = pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", np.array([stall], dtype=object))])
            stall.spoil = bad
        else:  # "body": the element is no UTF-8 text, the frame is never built
            bad = pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", np.array([Stall(self, "\ud800")], dtype=object))])
        try:
            sender.send(bad, flags=FINAL)
            caught = "nothing: the send went"
        except Exception as e:
            caught = f"{type(e).__name__}: {e}"
        if then == "resend":
            sender.send(pb_utils.InferenceResponse([text("resent")],
                                                   parameters={"caught": caught}), flags=FINAL)
        elif then in ("cancel", "cancelled_before"):
            if then == "cancel":  # tells the client that the model now waits for its cancel
                sender.send(pb_utils.InferenceResponse([text("waiting")]))
            deadline = time.monotonic() + 5.0
            while not request.is_cancelled() and time.monotonic() < deadline:
                time.sleep(0.005)
            self.seen = {"caught": caught, "cancelled": request.is_cancelled(),
                         "sender_cancelled": sender.is_cancelled()}
            sender.send(flags=FINAL)
            self.reported.set()
        # "let_go": returning lets go of the request and its sender
'''

HOWS = ["frame", "body"]


@pytest.fixture
def server(tmp_path):
    write_model(tmp_path, "racer", MODEL_PY, CONFIG)
    # A request a failing test left open holds the stop for exit_timeout.
    with serving(tmp_path, new_prefix(), exit_timeout=3.0) as srv:
        yield srv


def start(server, mode: str, rid: str, **params):
    return server.model("racer").infer({"IN": np.array([1.0], np.float32)}, request_id=rid,
                                       parameters={"mode": mode, **params})


def next_response(stream, what: str):
    try:
        return stream.get(timeout=WAIT_S)
    except queue.Empty:
        raise AssertionError(f"no response within {WAIT_S:.0f} s: {what}") from None


def texts(resp) -> list[str]:
    return [v.decode() for v in resp.outputs["OUT"].to_numpy().tolist()]


def rest(stream, what: str) -> list:
    got = [next_response(stream, what)]
    while not got[-1].final:
        got.append(next_response(stream, what))
    return got


def go(server) -> None:
    """Let the race's final send go on (and fail): the next execute of the instance."""
    (resp,) = rest(start(server, "go", "go"), "the execute after the race")
    assert resp.error is None and texts(resp) == ["went"], resp


def report(server) -> dict:
    (resp,) = rest(start(server, "report", "report"), "the model's report")
    assert resp.error is None, resp.error
    return json.loads(texts(resp)[0])


def assert_failed(caught: str, how: str) -> None:
    """The model's first final send failed, the way ``how`` says (not some other way)."""
    if how == "frame":
        assert caught.startswith("TritonModelException: Unable to send response. the response "
                                 "cannot be sent: UnicodeEncodeError"), caught
    else:
        assert caught.startswith("UnicodeEncodeError: 'utf-8' codec can't encode"), caught


def assert_cancelled(resp) -> None:
    assert resp.final, resp
    assert resp.error is not None and resp.error.code.value == "CANCELLED", resp.error


@pytest.mark.parametrize("how", HOWS)
def test_another_final_response_goes_after_the_failed_one(server, how):
    stream = start(server, "race", "r1", how=how, then="resend")
    go(server)
    got = rest(stream, "the final response sent after the failed one")
    assert [r.error for r in got if r.error] == [], got
    with_outputs = [r for r in got if r.outputs]
    assert len(with_outputs) == 1 and texts(with_outputs[0]) == ["resent"], got
    assert got[-1].final
    assert_failed(with_outputs[0].parameters["caught"], how)


@pytest.mark.parametrize("how", HOWS)
def test_a_request_let_go_after_the_failed_send_ends_with_an_error(server, how):
    stream = start(server, "race", "r1", how=how, then="let_go")
    go(server)
    got = rest(stream, "the end of a request let go of after its final send failed")
    assert len(got) == 1 and got[0].final and got[0].error is not None, got
    msg = got[0].error.message
    assert "let go of request 'r1'" in msg and "final flag" in msg, msg


@pytest.mark.parametrize("how", HOWS)
def test_a_cancel_after_the_failed_send_reaches_the_model(server, how):
    stream = start(server, "race", "r1", how=how, then="cancel")
    go(server)
    first = next_response(stream, "the model's 'waiting' response")
    assert first.error is None and not first.final and texts(first) == ["waiting"], first
    stream.cancel()
    assert_cancelled(next_response(stream, "CANCELLED"))
    seen = report(server)
    assert_failed(seen["caught"], how)
    assert seen["cancelled"] is True and seen["sender_cancelled"] is True, seen


@pytest.mark.parametrize("how", HOWS)
def test_a_cancel_while_the_failing_send_is_under_way_reaches_the_model(server, how):
    # The CANCEL comes after the execute returned (which took the request for ended) and
    # before the send fails: it must not be lost once the request is open again.
    stream = start(server, "race", "r1", how=how, then="cancelled_before")
    # 'mark' runs only once the race's execute is over; the send is still held.
    (marked,) = rest(start(server, "mark", "mark"), "the execute after the race")
    assert marked.error is None and texts(marked) == ["marked"], marked
    stream.cancel()
    assert_cancelled(next_response(stream, "CANCELLED"))
    go(server)  # the CANCEL frame went to the stub before this request's EXECUTE
    seen = report(server)
    assert_failed(seen["caught"], how)
    assert seen["cancelled"] is True and seen["sender_cancelled"] is True, seen
