"""A request whose model lets go of it unanswered ends with an error instead of waiting for ever.

A decoupled model ends each request with the final flag, sent through its response sender. One
that forgets it (takes the sender and drops it, sends some responses and returns, never takes
the sender at all) leaves the request open with nobody left to end it: with Triton 2.51 its
client waits for ever, and so did a server stop. Here, once the model holds neither the
request nor its sender, the request ends with an error that says why, after whatever it had
sent. A model that keeps either one (in a thread, in a list) is left alone.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from _models import io_config, serving, write_model

pytestmark = pytest.mark.timeout(60)

DECOUPLED = io_config(extra="model_transaction_policy { decoupled: true }\n")

# What the model does with each request is its "mode" parameter.
MODEL_PY = """
import threading
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.kept = []

    def execute(self, requests):
        for r in requests:
            mode = r.parameters()
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            if "drop_sender" in mode:
                r.get_response_sender()
            elif "send_one" in mode:
                r.get_response_sender().send(
                    pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)]))
            elif "thread" in mode:
                sender = r.get_response_sender()

                def later(sender=sender, x=x):
                    time.sleep(1.0)
                    sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)]),
                                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

                threading.Thread(target=later).start()
            elif "keep" in mode:
                self.kept.append(r)
            elif "finish_kept" in mode:
                for k in self.kept:
                    k.get_response_sender().send(
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                self.kept = []
                r.get_response_sender().send(
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            # "nothing": neither the sender nor the request is kept
        return None
"""

# Default mode: execute takes the sender and returns None, having sent nothing, or its response
# without the final flag ("send_one").
DEFAULT_PY = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            sender = r.get_response_sender()
            if "send_one" in r.parameters():
                x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x * 3)]))
        return None
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    write_model(repo, "dropper", MODEL_PY, DECOUPLED)
    write_model(repo, "default_dropper", DEFAULT_PY, io_config())
    from _models import new_prefix
    with serving(repo, new_prefix()) as srv:
        yield srv


def _all(stream, wait: float = 10.0) -> list:
    got = [stream.get(timeout=wait)]
    while not got[-1].final:
        got.append(stream.get(timeout=wait))
    return got


def _call(server, mode: str, model: str = "dropper"):
    return server.model(model).infer({"IN": np.array([1.0, 2.0], np.float32)},
                                     parameters={mode: True}, request_id=f"r-{mode}")


@pytest.mark.parametrize("mode", ["drop_sender", "nothing"])
def test_a_request_let_go_unanswered_ends_with_an_error(server, mode):
    got = _all(_call(server, mode))
    assert len(got) == 1 and got[0].final and got[0].error is not None
    msg = got[0].error.message
    assert "'dropper_0'" in msg and "r-" + mode in msg and "final flag" in msg, msg


def test_the_responses_sent_before_come_first(server):
    got = _all(_call(server, "send_one"))
    assert [r.error is None for r in got] == [True, False]
    assert got[0].outputs["OUT"].to_numpy().tolist() == [1.0, 2.0]
    assert "final flag" in got[1].error.message


def test_a_default_mode_request_whose_sender_sent_nothing(server):
    got = _all(_call(server, "drop_sender", model="default_dropper"))
    assert len(got) == 1 and got[0].error is not None
    assert "final flag" in got[0].error.message


def test_a_default_mode_response_sent_without_the_flag_is_the_answer(server, caplog):
    # Its one response came; the missing flag is the model's fault, which the log tells.
    with caplog.at_level(logging.ERROR, logger="tritonpy"):
        got = _all(_call(server, "send_one", model="default_dropper"))
    assert len(got) == 1 and got[0].final and got[0].error is None, got
    assert got[0].outputs["OUT"].to_numpy().tolist() == [3.0, 6.0]
    assert any("final flag" in rec.getMessage() and "default_dropper_0" in rec.getMessage()
               for rec in caplog.records)


def test_a_sender_kept_by_a_thread_is_left_alone(server):
    t0 = time.monotonic()
    got = _all(_call(server, "thread"))
    assert time.monotonic() - t0 >= 0.9
    assert len(got) == 1 and got[0].error is None and got[0].final
    assert got[0].outputs["OUT"].to_numpy().tolist() == [1.0, 2.0]


def test_a_request_the_model_keeps_stays_open_and_ends_when_it_says(server):
    kept = _call(server, "keep")
    with pytest.raises(Exception):  # queue.Empty: nothing yet, and no error either
        kept.get(timeout=1.0)
    done = _all(_call(server, "finish_kept"))
    assert done[-1].final and done[-1].error is None
    got = _all(kept)
    assert len(got) == 1 and got[0].final and got[0].error is None and got[0].empty
