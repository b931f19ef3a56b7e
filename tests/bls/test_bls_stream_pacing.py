"""A decoupled BLS stream is paced by the model that reads it.

A model iterating ``exec(decoupled=True)`` (or ``async_exec``) slowly used to let its producer
send as fast as it could: every response waited in the caller's stub, each holding its block
of the producer's shared memory (2,000 responses of 64 KiB: 125 MiB). Now the caller's stub
tells the host how many responses its model has taken, the host passes that on to the
producer's stub as it does for a client's stream, and the producer's ``send`` waits once
``HOLD_BYTES`` (lowered to 4 MiB here: the host runs in this process) wait unread. A cancel of
the iterator, a caller that returns without reading the stream, a caller stub that dies and a
producer that fails all still end the stream, and leave the producer free.

Triton 2.51 has no such pacing (measured with these models): its producer ran 1,875 responses
ahead of a caller reading 10 ms apart, and its shm regions grew by 125 MiB.

A caller keeps every response it read (iterating again replays them, as in Triton): those hold
their blocks until it drops the iterator, so the bound is checked while it reads slowly.
"""
from __future__ import annotations

import json
import logging
import queue
import time

import numpy as np
import pytest
from _bls_models import REPORT_CALLER_CONFIG
from _models import serving, wait_for, write_model

from tritonpy import _request

pytestmark = pytest.mark.timeout(90)

MiB = 1 << 20
COUNT = 2000  # responses of 64 KiB: 125 MiB in all

PRODUCER_CONFIG = """
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "COUNT", data_type: TYPE_INT32, dims: [ 1 ] },
        { name: "FAIL_AT", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_UINT8, dims: [ -1 ] },
         { name: "SENT", data_type: TYPE_INT32, dims: [ 1 ] } ]
instance_group [ { count: 1, kind: KIND_CPU } ]
"""
# COUNT responses of 64 KiB (every byte: the response's number mod 256) as fast as it can,
# then SENT in the final one; it stops once cancelled, and raises at response FAIL_AT (>= 0).
PRODUCER_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            count = int(pb_utils.get_input_tensor_by_name(request, "COUNT").as_numpy()[0])
            fail_at = int(pb_utils.get_input_tensor_by_name(request, "FAIL_AT").as_numpy()[0])
            sender = request.get_response_sender()
            sent = 0
            for i in range(count):
                if request.is_cancelled():
                    break
                if i == fail_at:
                    raise pb_utils.TritonModelException(f"producer failed at {i}")
                sender.send(pb_utils.InferenceResponse([
                    pb_utils.Tensor("OUT", np.full(64 << 10, i % 256, np.uint8))]))
                sent += 1
            sender.send(pb_utils.InferenceResponse([
                pb_utils.Tensor("SENT", np.array([sent], np.int32))]),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""
CALLER_CONFIG = REPORT_CALLER_CONFIG
# Reads the producer's stream: the first SLOW responses 10 ms apart, the rest at once, each
# checked whole; then reports what it saw. Parameters: "slow"; "then": "cancel" (cancel()
# after the slow ones, then read on), "return" (return without reading the rest), "die";
# "fail_at" for the producer.
_CALLER_BODY = """
import json
import os
import numpy as np
import triton_python_backend_utils as pb_utils

def bls(count, fail_at, target="producer"):
    return pb_utils.InferenceRequest(
        model_name=target, requested_output_names=["OUT", "SENT"], inputs=[
            pb_utils.Tensor("COUNT", np.array([count], np.int32)),
            pb_utils.Tensor("FAIL_AT", np.array([fail_at], np.int32))])

def begin(request):  # COUNT, the request's parameters, a fresh tally of the stream
    count = int(pb_utils.get_input_tensor_by_name(request, "COUNT").as_numpy()[0])
    return count, json.loads(request.parameters()), new_seen()

def new_seen():
    return {"taken": 0, "bad": 0, "sent": -1, "error": None}

def look(resp, seen):
    if resp.has_error():
        seen["error"] = resp.error().message()
        return
    out = pb_utils.get_output_tensor_by_name(resp, "OUT")
    if out is not None:
        a = out.as_numpy()
        if a.nbytes != 64 << 10 or not (a == seen["taken"] % 256).all():
            seen["bad"] += 1
        seen["taken"] += 1
    sent = pb_utils.get_output_tensor_by_name(resp, "SENT")
    if sent is not None:
        seen["sent"] = int(sent.as_numpy()[0])

def report(seen):
    return pb_utils.InferenceResponse([pb_utils.Tensor(
        "REPORT", np.array([json.dumps(seen).encode()], np.object_))])
"""
CALLER_PY = _CALLER_BODY + """
import time

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            count, p, seen = begin(request)
            stream = bls(count, p.get("fail_at", -1), p.get("target", "producer")).exec(
                decoupled=True)
            for resp in stream:
                look(resp, seen)
                if seen["taken"] <= p["slow"]:
                    time.sleep(0.01)
                if seen["taken"] == p["slow"]:
                    if p.get("then") == "return":
                        break
                    if p.get("then") == "die":
                        os._exit(1)
                    if p.get("then") == "cancel":
                        stream.cancel()
            out.append(report(seen))
        return out
"""
ASYNC_CALLER_PY = _CALLER_BODY + """
import asyncio

class TritonPythonModel:
    async def execute(self, requests):
        out = []
        for request in requests:
            count, p, seen = begin(request)
            stream = await bls(count, p.get("fail_at", -1),
                               p.get("target", "producer")).async_exec(decoupled=True)
            async for resp in stream:
                look(resp, seen)
                if seen["taken"] <= p["slow"]:
                    await asyncio.sleep(0.01)
                if seen["taken"] == p["slow"] and p.get("then") == "return":
                    break
            out.append(report(seen))
        return out
"""
# The producer as the one step of a decoupled ensemble (the "target" parameter of a caller).
ENSEMBLE_CONFIG = """
platform: "ensemble"
max_batch_size: 0
input [ { name: "COUNT", data_type: TYPE_INT32, dims: [ 1 ] },
        { name: "FAIL_AT", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_UINT8, dims: [ -1 ] },
         { name: "SENT", data_type: TYPE_INT32, dims: [ 1 ] } ]
ensemble_scheduling { step [ { model_name: "producer" model_version: -1
  input_map { key: "COUNT" value: "COUNT" } input_map { key: "FAIL_AT" value: "FAIL_AT" }
  output_map { key: "OUT" value: "OUT" } output_map { key: "SENT" value: "SENT" } } ] }
"""
# That ensemble as the one step of another.
NESTED_CONFIG = ENSEMBLE_CONFIG.replace('"producer"', '"producer_ensemble"')
# Small segments, so that the producer's pool peak follows what its live responses hold.
POOLS = {"shm-default-byte-size": str(4 * MiB), "shm-growth-byte-size": str(4 * MiB)}
SLOW = 200  # responses read 10 ms apart first
SAMPLE_S = 1.0  # within those: the caller keeps at most 100 of them (6 MiB)
BOUND = 16 * MiB  # that, 4 MiB held back, a few in flight


@pytest.fixture
def server(tmp_path, shm_prefix, monkeypatch):
    monkeypatch.setattr(_request, "HOLD_BYTES", 4 * MiB)
    repo = tmp_path / "repo"
    write_model(repo, "producer", PRODUCER_PY, PRODUCER_CONFIG)
    write_model(repo, "caller", CALLER_PY, CALLER_CONFIG)
    write_model(repo, "async_caller", ASYNC_CALLER_PY, CALLER_CONFIG)
    write_model(repo, "producer_ensemble", "", ENSEMBLE_CONFIG)
    with serving(repo, shm_prefix, backend_config=POOLS) as srv:
        yield srv


def producer_pool(srv) -> dict:
    return {p["pool"]: p for p in srv.shm_usage()}["producer_0_0"]


def call(srv, model: str, count: int = COUNT, **params):
    """Run the caller; the most its producer's pool held while the caller read slowly (the
    caller keeps the responses it read for replay: they hold their blocks until it returns)."""
    stream = srv.model(model).infer({"COUNT": np.array([count], np.int32)}, parameters=params)
    most = 0
    start = time.monotonic()
    while time.monotonic() - start < SAMPLE_S:
        most = max(most, producer_pool(srv)["used_bytes"])
        time.sleep(0.02)
    try:
        resp = stream.get(timeout=60)
    except queue.Empty:
        raise AssertionError(f"{model} did not answer within 60 s") from None
    return resp, most


def report(resp) -> dict:
    assert resp.error is None, resp.error
    return json.loads(resp.outputs["REPORT"].to_numpy()[0])


def assert_producer_free(srv) -> None:
    """The producer's instance takes the next request at once, and its responses' blocks all
    went back."""
    stream = srv.model("producer").infer({"COUNT": np.array([3], np.int32),
                                          "FAIL_AT": np.array([-1], np.int32)})
    assert [r.error for r in (stream.get(timeout=10) for _ in range(4))] == [None] * 4
    assert wait_for(lambda: producer_pool(srv)["used_bytes"] == 0, 5.0), producer_pool(srv)


@pytest.mark.parametrize("caller,target", [("caller", "producer"),
                                           ("async_caller", "producer"),
                                           ("caller", "producer_ensemble"),
                                           ("async_caller", "producer_ensemble")])
def test_a_slow_bls_reader_paces_its_producer(server, caller: str, target: str) -> None:
    """The caller takes 200 responses 10 ms apart, then the rest at once: every response
    arrives whole and in order, while the producer's shared memory held little more than
    what the caller had read meanwhile (all 125 MiB before). The same when the producer is
    the step of a decoupled ensemble that the caller calls (the ensemble held back nothing
    before: 125 MiB too)."""
    resp, most = call(server, caller, slow=SLOW, target=target)
    assert most <= BOUND, f"the producer's pool grew to {most / MiB:.0f} MiB"
    assert report(resp) == {"taken": COUNT, "bad": 0, "sent": COUNT, "error": None}
    assert_producer_free(server)


@pytest.mark.parametrize("caller,then", [("caller", "cancel"), ("caller", "return"),
                                         ("async_caller", "return"), ("caller", "error")])
def test_a_paced_bls_stream_still_ends(server, caller: str, then: str) -> None:
    """The producer is held (the caller reads 200 responses slowly), then: the caller cancels
    the iterator (the rest is a CANCELLED error), or its execute returns without reading the
    rest (the producer goes on at the pace the dropped responses are given back, to its end),
    or the producer fails at response 600 (the caller gets its error after the 600). The
    producer's pool stays small throughout, and its instance is free after."""
    params: dict = {"slow": SLOW, "then": then}
    if then == "error":
        params["fail_at"] = 600
    resp, most = call(server, caller, **params)
    assert most <= BOUND, f"the producer's pool grew to {most / MiB:.0f} MiB"
    seen = report(resp)
    if then == "cancel":
        assert seen["taken"] < COUNT and seen["sent"] == -1, seen
        assert "cancelled" in seen["error"].lower(), seen
    elif then == "return":
        assert seen == {"taken": SLOW, "bad": 0, "sent": -1, "error": None}
    else:
        assert seen["taken"] == 600 and seen["bad"] == 0, seen
        assert "producer failed at 600" in seen["error"], seen
    assert_producer_free(server)


def test_a_paced_bls_stream_ends_when_its_caller_dies(server) -> None:
    """The caller's stub dies while the producer waits for it: the producer's request is
    cancelled, and its instance is free again."""
    resp, most = call(server, "caller", slow=SLOW, then="die")
    assert most <= BOUND, f"the producer's pool grew to {most / MiB:.0f} MiB"
    assert resp.error is not None, resp
    assert_producer_free(server)


# Issues stream A (COUNT responses) and then stream B (3) to the one producer instance, and
# reads B first: B is served only once A has ended, so A's producer must not wait for a reader
# that waits for B.
REVERSED_PY = _CALLER_BODY + """
class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            count = int(pb_utils.get_input_tensor_by_name(request, "COUNT").as_numpy()[0])
            first, second = bls(count, -1).exec(decoupled=True), bls(3, -1).exec(decoupled=True)
            seen_b = new_seen()
            for resp in second:
                look(resp, seen_b)
            seen = new_seen()
            for resp in first:
                look(resp, seen)
            seen["b"] = seen_b
            out.append(report(seen))
        return out
"""
ASYNC_REVERSED_PY = _CALLER_BODY + """
class TritonPythonModel:
    async def execute(self, requests):
        out = []
        for request in requests:
            count = int(pb_utils.get_input_tensor_by_name(request, "COUNT").as_numpy()[0])
            first = await bls(count, -1).async_exec(decoupled=True)
            second = await bls(3, -1).async_exec(decoupled=True)
            seen_b = new_seen()
            async for resp in second:
                look(resp, seen_b)
            seen = new_seen()
            async for resp in first:
                look(resp, seen)
            seen["b"] = seen_b
            out.append(report(seen))
        return out
"""


@pytest.mark.parametrize("code", [REVERSED_PY, ASYNC_REVERSED_PY], ids=["sync", "async"])
def test_streams_read_out_of_order_do_not_stall(tmp_path, shm_prefix, monkeypatch, caplog,
                                                code: str) -> None:
    """While the model waits for stream B, stream A (issued first, so B waits for A's end in
    the producer's one instance) is paced no more: the host finds the cycle, and both end at
    once. Paced, A's producer waited for a reader that waited for B until the 60 s stall limit
    cancelled A."""
    monkeypatch.setattr(_request, "HOLD_BYTES", 4 * MiB)
    caplog.set_level(logging.INFO, logger="tritonpy.bls")
    repo = tmp_path / "repo"
    write_model(repo, "producer", PRODUCER_PY, PRODUCER_CONFIG)
    write_model(repo, "reversed", code, CALLER_CONFIG)
    with serving(repo, shm_prefix, backend_config=POOLS) as srv:
        t0 = time.monotonic()
        stream = srv.model("reversed").infer({"COUNT": np.array([COUNT], np.int32)})
        try:
            resp = stream.get(timeout=30)
        except queue.Empty:
            raise AssertionError("the caller did not answer within 30 s") from None
        assert time.monotonic() - t0 < 30
        assert report(resp) == {"taken": COUNT, "bad": 0, "sent": COUNT, "error": None,
                                "b": {"taken": 3, "bad": 0, "sent": 3, "error": None}}
        assert "is paced no more" in caplog.text
        assert_producer_free(srv)


POST_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_UINT8, dims: [ -1 ] } ]
output [ { name: "FIRST", data_type: TYPE_INT32, dims: [ 1 ] } ]
instance_group [ { count: 1, kind: KIND_CPU } ]
"""
# A postprocessor: the first byte of IN, after "delay_ms"; with "via": true it first reads a
# stream of one response from the producer (whose one instance may be what its caller reads).
POST_PY = """
import json
import time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            p = json.loads(request.parameters())
            time.sleep(p.get("delay_ms", 0) / 1000)
            if p.get("via"):
                for _ in pb_utils.InferenceRequest(
                        model_name="producer", requested_output_names=["SENT"], inputs=[
                            pb_utils.Tensor("COUNT", np.array([1], np.int32)),
                            pb_utils.Tensor("FAIL_AT", np.array([-1], np.int32))]).exec(
                                decoupled=True):
                    pass
            first = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0]
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("FIRST", np.array([first], np.int32))]))
        return out
"""
# Reads the producer's stream and hands each response to the postprocessor as it comes (a
# BLS call per response), checking its answer: the first SLOW calls take 10 ms each.
_INTERLEAVED_BODY = _CALLER_BODY + """
def post(resp, seen, p):
    out = pb_utils.get_output_tensor_by_name(resp, "OUT")
    if out is None:
        return None
    delay = 10 if seen["taken"] <= p["slow"] else 0
    return pb_utils.InferenceRequest(
        model_name="post", requested_output_names=["FIRST"], inputs=[
            pb_utils.Tensor("IN", out.as_numpy())],
        parameters={"delay_ms": delay, "via": bool(p.get("via"))})

def check(answer, seen):
    if answer.has_error():
        seen["error"] = answer.error().message()
    elif int(pb_utils.get_output_tensor_by_name(answer, "FIRST").as_numpy()[0]) != (
            seen["taken"] - 1) % 256:
        seen["bad"] += 1
"""
INTERLEAVED_PY = _INTERLEAVED_BODY + """
class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            count, p, seen = begin(request)
            for resp in bls(count, -1, p.get("target", "producer")).exec(decoupled=True):
                look(resp, seen)
                call = post(resp, seen, p)
                if call is not None:
                    check(call.exec(), seen)
            out.append(report(seen))
        return out
"""
ASYNC_INTERLEAVED_PY = _INTERLEAVED_BODY + """
class TritonPythonModel:
    async def execute(self, requests):
        out = []
        for request in requests:
            count, p, seen = begin(request)
            async for resp in await bls(count, -1, p.get("target", "producer")).async_exec(
                    decoupled=True):
                look(resp, seen)
                call = post(resp, seen, p)
                if call is not None:
                    check(await call.async_exec(), seen)
            out.append(report(seen))
        return out
"""


@pytest.fixture
def pipeline(tmp_path, shm_prefix, monkeypatch):
    monkeypatch.setattr(_request, "HOLD_BYTES", 4 * MiB)
    repo = tmp_path / "repo"
    write_model(repo, "producer", PRODUCER_PY, PRODUCER_CONFIG)
    write_model(repo, "post", POST_PY, POST_CONFIG)
    write_model(repo, "interleaved", INTERLEAVED_PY, CALLER_CONFIG)
    write_model(repo, "async_interleaved", ASYNC_INTERLEAVED_PY, CALLER_CONFIG)
    write_model(repo, "producer_ensemble", "", ENSEMBLE_CONFIG)
    write_model(repo, "producer_nested", "", NESTED_CONFIG)
    with serving(repo, shm_prefix, backend_config=POOLS) as srv:
        yield srv


@pytest.mark.parametrize("caller", ["interleaved", "async_interleaved"])
def test_a_reader_that_calls_a_postprocessor_per_response_still_paces(pipeline,
                                                                      caller: str) -> None:
    """The reader hands each response to a postprocessor model (a BLS call that takes 10 ms
    for the first 200): its producer stays paced while it waits for those calls. Before, any
    wait of the reader for another call released its streams for good, and the producer sent
    all 125 MiB ahead."""
    resp, most = call(pipeline, caller, slow=SLOW)
    assert most <= BOUND, f"the producer's pool grew to {most / MiB:.0f} MiB"
    assert report(resp) == {"taken": COUNT, "bad": 0, "sent": COUNT, "error": None}
    assert_producer_free(pipeline)


@pytest.mark.parametrize("caller,target", [("interleaved", "producer"),
                                           ("async_interleaved", "producer"),
                                           ("interleaved", "producer_ensemble"),
                                           ("async_interleaved", "producer_ensemble"),
                                           ("interleaved", "producer_nested")])
def test_a_postprocessor_that_needs_the_paced_producer_ends_the_pacing(
        pipeline, caller: str, target: str, caplog) -> None:
    """The postprocessor itself calls the producer, whose one instance waits for the reader,
    which waits for the postprocessor: the host finds that cycle and paces the stream no
    more, so all three go on (paced, they waited for each other until the 60 s stall limit
    cancelled the stream). The same when the reader reads the producer through a decoupled
    ensemble, or through an ensemble of that ensemble: the cycle runs through the steps."""
    caplog.set_level(logging.INFO, logger="tritonpy.bls")
    t0 = time.monotonic()
    resp, _ = call(pipeline, caller, count=300, slow=0, via=True, target=target)
    assert time.monotonic() - t0 < 30
    assert report(resp) == {"taken": 300, "bad": 0, "sent": 300, "error": None}
    assert "is paced no more" in caplog.text
    assert_producer_free(pipeline)
