"""What msgpack cannot carry never leaves a request unanswered.

A str holding a lone surrogate (``"\\ud800"``, e.g. from ``bytes.decode(errors="surrogateescape")``)
cannot be encoded as UTF-8. In an error message, an exception's text or a parameter of a
response, it used to make the stub's frame fail to encode: the request waited for ever. In a BLS
request (its id, its model name) the shared memory of inputs already copied for it leaked. Now
the request gets an error that says why (a BLS call or a response sender's send raises it in the
model), what was copied is given back, and the stub keeps serving.
"""
from __future__ import annotations

import numpy as np
import pytest

import tritonpy
from _models import infer, io_config, serving_models, wait_for

pytestmark = pytest.mark.timeout(90)

MODEL_PY = '''
import json
import numpy as np
import triton_python_backend_utils as pb_utils

BIG = np.ones(1 << 20, np.float32)  # 4 MiB: it travels in the stub's shared memory


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            mode = json.loads(r.parameters())["mode"]
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            if mode == "ok":
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x * 2)]))
            elif mode == "error_message":
                out.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError("bad \\ud800 text")))
            elif mode == "exception":
                raise ValueError("bad \\ud800 text")
            elif mode == "parameter":
                try:
                    pb_utils.InferenceResponse([], parameters={"k": "\\ud800"})
                    text = "accepted"
                except pb_utils.TritonModelException as e:
                    text = str(e)
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)],
                                                      parameters={"caught": text}))
            elif mode == "bls":
                try:
                    pb_utils.InferenceRequest(
                        model_name="unsendable", request_id="\\ud800",
                        inputs=[pb_utils.Tensor("IN", BIG)],
                        requested_output_names=["OUT"]).exec()
                    text = "sent"
                except pb_utils.TritonModelException as e:
                    text = str(e)
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)],
                                                      parameters={"caught": text}))
        return out
'''

SENDER_PY = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            sender = r.get_response_sender()
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            try:
                sender.send(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError("bad \\ud800 text")),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                text = "sent"
            except pb_utils.TritonModelException as e:
                text = str(e)
            # Nothing went, so the sender is still open: a good final response goes instead.
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)],
                                                   parameters={"caught": text}),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''

DECOUPLED = io_config(extra="model_transaction_policy { decoupled: true }\n")
CANNOT = "the response cannot be sent: UnicodeEncodeError"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    with serving_models(repo, {"unsendable": (MODEL_PY, io_config()),
                               "sender": (SENDER_PY, DECOUPLED)}) as srv:
        yield srv


def used(srv: tritonpy.Server, instance: str) -> int:
    return next(p["used_bytes"] for p in srv.shm_usage() if p["pool"] == instance)


def ok(model: tritonpy.Model) -> None:
    r = infer(model, {"IN": np.arange(3, dtype=np.float32)}, wait=10,
              parameters={"mode": "ok"})
    assert r.error is None, r.error
    np.testing.assert_array_equal(r.outputs["OUT"].to_numpy(), [0, 2, 4])


@pytest.mark.parametrize("mode, words", [
    ("error_message", [CANNOT]),
    # The exception's text goes, the surrogate escaped.
    ("exception", ["ValueError: bad \\ud800 text"]),
])
def test_an_unencodable_response_fails_its_request_and_the_stub_keeps_serving(server, mode,
                                                                                words):
    model = server.model("unsendable")
    ok(model)
    r = infer(model, {"IN": np.arange(3, dtype=np.float32)}, wait=10, parameters={"mode": mode})
    assert isinstance(r.error, tritonpy.InternalError), r
    assert r.error.message.startswith(
        "Failed to process the request(s) for model 'unsendable_0', message: "), r.error.message
    for w in words:
        assert w in r.error.message, r.error.message
    ok(model)


def test_a_parameter_that_is_not_utf8_is_refused_as_the_response_is_built(server):
    r = infer(server.model("unsendable"), {"IN": np.arange(3, dtype=np.float32)}, wait=10,
              parameters={"mode": "parameter"})
    assert r.error is None, r.error
    assert "parameters must be valid UTF-8 text" in r.parameters["caught"]
    assert "(key 'k')" in r.parameters["caught"]


def test_an_unencodable_bls_request_raises_in_the_model_and_frees_its_inputs(server):
    model = server.model("unsendable")
    ok(model)
    before = used(server, "unsendable_0")
    r = infer(model, {"IN": np.arange(3, dtype=np.float32)}, wait=10,
              parameters={"mode": "bls"})
    assert r.error is None, r.error
    assert r.parameters["caught"].startswith(
        "the request cannot be sent: UnicodeEncodeError"), r.parameters["caught"]
    ok(model)
    assert wait_for(lambda: used(server, "unsendable_0") <= before, timeout=5), \
        used(server, "unsendable_0")


def test_an_unencodable_send_raises_and_leaves_the_sender_open(server):
    model = server.model("sender")
    stream = model.infer({"IN": np.arange(3, dtype=np.float32)})
    responses = [stream.get(timeout=10)]
    while not responses[-1].final:
        responses.append(stream.get(timeout=10))
    got = [r for r in responses if r.outputs or r.error]
    assert len(got) == 1 and got[0].error is None, responses
    np.testing.assert_array_equal(got[0].outputs["OUT"].to_numpy(), [0, 1, 2])
    assert got[0].parameters["caught"].startswith(
        "Unable to send response. " + CANNOT), got[0].parameters
