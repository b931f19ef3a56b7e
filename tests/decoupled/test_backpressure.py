"""Back-pressure on decoupled streams: a model streams at its consumer's pace.

The stub running a decoupled request of ``Model.async_infer`` (every HTTP and gRPC stream) or
``Model.infer`` keeps at most ``HOLD_BYTES`` of tensors (and ``HOLD_RESPONSES`` responses) that the consumer
has not taken yet: past that, the model's next ``response_sender.send()`` waits until the
consumer has taken half of them, as the host acknowledges. So a fast producer and a slow
client no longer fill shared memory with responses nobody reads yet. A consumer that stops
reading altogether has its request cancelled after ``HELD_STALLED_S``, and the waiting model goes on
(it sees ``is_cancelled()``).

The limits are lowered here (the host runs in this process) so that a few MiB show it.
"""
from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from _models import serving, write_model

from tritonpy import _request

pytestmark = pytest.mark.timeout(90)

MiB = 1 << 20
CONFIG = """
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "COUNT", data_type: TYPE_INT32, dims: [ 1 ] },
        { name: "THREADS", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_UINT8, dims: [ -1 ] },
         { name: "SENT", data_type: TYPE_INT32, dims: [ 1 ] } ]
"""
# Sends COUNT responses of 1 MiB each (every byte is the response's number, mod 256) as fast as
# it can, from THREADS threads (response i from thread i % THREADS), then an empty final one.
# It stops early once the request is cancelled; the final response says how many it sent.
FLOOD_PY = """
import threading
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            count = int(pb_utils.get_input_tensor_by_name(request, "COUNT").as_numpy()[0])
            threads = int(pb_utils.get_input_tensor_by_name(request, "THREADS").as_numpy()[0])
            sender = request.get_response_sender()
            sent = [0]

            def produce(first):
                for i in range(first, count, threads):
                    if request.is_cancelled():
                        return
                    sender.send(pb_utils.InferenceResponse([
                        pb_utils.Tensor("OUT", np.full(1 << 20, i % 256, np.uint8))]))
                    sent[0] += 1

            workers = [threading.Thread(target=produce, args=(t,)) for t in range(threads)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            sender.send(pb_utils.InferenceResponse([
                pb_utils.Tensor("SENT", np.array([sent[0]], np.int32))]),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""
# Small segments, so that the stub pool's peak follows what its live responses hold.
POOLS = {"shm-default-byte-size": str(4 * MiB), "shm-growth-byte-size": str(4 * MiB)}


def stub_peak(srv) -> int:
    return {p["pool"]: p for p in srv.shm_usage()}["flood_0"]["peak_bytes"]


def inputs(count: int, threads: int = 1) -> dict:
    return {"COUNT": np.array([count], np.int32), "THREADS": np.array([threads], np.int32)}


def stream_to(model, count: int, pause_s: float, threads: int = 1,
              how: str = "async") -> tuple[list[int], int]:
    """Ask for ``count`` responses and read them, ``pause_s`` apart, with ``model.async_infer``
    (``how`` "async") or ``model.infer`` ("sync"): the number in each OUT (checked whole), and
    the model's count from the final response."""
    if how == "sync":
        return read_slowly_sync(model.infer(inputs(count, threads)), pause_s)

    async def read() -> tuple[list[int], int]:
        return await read_slowly(model.async_infer(inputs(count, threads)), pause_s)

    return asyncio.run(read())


def _number(resp, numbers: list[int]) -> int:
    """Appends OUT's number to ``numbers`` (-1), or returns the final response's SENT."""
    assert resp.error is None, resp.error
    if "SENT" in resp.outputs:
        return int(resp.outputs["SENT"].to_numpy()[0])
    out = resp.outputs["OUT"].to_numpy()
    assert out.nbytes == MiB and (out == out[0]).all()
    numbers.append(int(out[0]))
    return -1


async def read_slowly(stream, pause_s: float) -> tuple[list[int], int]:
    numbers: list[int] = []
    sent = -1
    async for resp in stream:
        sent = max(sent, _number(resp, numbers))
        del resp
        await asyncio.sleep(pause_s)
    return numbers, sent


def read_slowly_sync(stream, pause_s: float) -> tuple[list[int], int]:
    numbers: list[int] = []
    sent = -1
    for resp in stream:
        sent = max(sent, _number(resp, numbers))
        del resp
        time.sleep(pause_s)
    return numbers, sent


@pytest.mark.parametrize("threads,how", [(1, "async"), (2, "async"), (1, "sync")])
def test_a_model_streams_at_its_slow_consumers_pace(tmp_path, shm_prefix, monkeypatch,
                                                   threads: int, how: str) -> None:
    """60 MiB streamed to a consumer that reads 1 MiB every 10 ms: the model's sends wait, so
    the stub's pool never holds much more than the 8 MiB limit (it held all 60 MiB before), and
    every response arrives whole and in order (in each sending thread's order with two). The
    same with ``async_infer`` and ``infer``."""
    monkeypatch.setattr(_request, "HOLD_BYTES", 8 * MiB)
    write_model(tmp_path, "flood", FLOOD_PY, CONFIG)
    with serving(tmp_path, shm_prefix, backend_config=POOLS) as srv:
        model = srv.model("flood")

        numbers, sent = stream_to(model, 60, 0.01, threads, how)
        assert sent == 60
        if threads == 1:
            assert numbers == [i % 256 for i in range(60)]
        else:
            assert sorted(numbers) == list(range(60))
            for t in range(threads):
                mine = [n for n in numbers if n % threads == t]
                assert mine == sorted(mine)
        peak = stub_peak(srv)
        assert peak <= 16 * MiB, f"the stub's pool grew to {peak / MiB:.0f} MiB"
        # A fast consumer is not held back.
        assert stream_to(model, 20, 0, how=how) == (list(range(20)), 20)


# A decoupled ensemble of the flood model: alone, or with a default-mode step after it that
# copies each OUT (a postprocessor, taking the request's "copy_sleep" seconds; the final
# response, SENT alone, gives it no IN and it answers nothing); SENT comes straight from the
# flood model's final response.
COPY_PY = """
import json
import time
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            time.sleep(json.loads(r.parameters()).get("copy_sleep", 0))
            given = pb_utils.get_input_tensor_by_name(r, "IN")
            out.append(pb_utils.InferenceResponse(
                [] if given is None else [pb_utils.Tensor("OUT", given.as_numpy().copy())]))
        return out
"""
COPY_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_UINT8, dims: [ -1 ], optional: true } ]
output [ { name: "OUT", data_type: TYPE_UINT8, dims: [ -1 ] } ]
"""
_ENSEMBLE = """
platform: "ensemble"
max_batch_size: 0
input [ { name: "COUNT", data_type: TYPE_INT32, dims: [ 1 ] },
        { name: "THREADS", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_UINT8, dims: [ -1 ] },
         { name: "SENT", data_type: TYPE_INT32, dims: [ 1 ] } ]
ensemble_scheduling { %s step [
  { model_name: "flood" model_version: -1
    input_map { key: "COUNT" value: "COUNT" } input_map { key: "THREADS" value: "THREADS" }
    output_map { key: "OUT" value: "%s" } output_map { key: "SENT" value: "SENT" } } %s ] }
"""
_COPY_STEP = """, { model_name: "copy" model_version: -1
    input_map { key: "IN" value: "RAW" } output_map { key: "OUT" value: "OUT" } }"""
ENSEMBLES = {"flood_alone": _ENSEMBLE % ("", "OUT", ""),
             "flood_then_copy": _ENSEMBLE % ("", "RAW", _COPY_STEP),
             "flood_limited": _ENSEMBLE % ("max_inflight_requests: 4", "RAW", _COPY_STEP),
             # flood_alone as the one step of another ensemble
             "flood_nested": _ENSEMBLE.replace('"flood"', '"flood_alone"') % ("", "OUT", "")}


def write_ensembles(repo) -> None:
    """The flood model, the copy model and the ensembles of them."""
    write_model(repo, "flood", FLOOD_PY, CONFIG)
    write_model(repo, "copy", COPY_PY, COPY_CONFIG)
    for name, config in ENSEMBLES.items():
        write_model(repo, name, "", config)


def read_all(stream) -> tuple[list[int], int]:
    """Every response of ``stream`` at once: the numbers in OUT, and SENT."""
    return read_slowly_sync(stream, 0)


@pytest.mark.parametrize("ensemble,how", [("flood_alone", "async"), ("flood_alone", "sync"),
                                          ("flood_nested", "async"), ("flood_limited", "sync")])
def test_a_decoupled_ensembles_consumer_paces_its_decoupled_step(
        tmp_path, shm_prefix, monkeypatch, ensemble: str, how: str) -> None:
    """The same through a decoupled ensemble, whose request runs in no stub: its consumer's
    pace reaches the flood step, alone or through an ensemble whose step is the first one. 60
    MiB streamed 10 ms apart: the flood model's pool peaked at 12-16 MiB (the step's 8 MiB
    limit and 4 MiB unread; 56 MiB before: the ensemble let its decoupled step send all it
    could), and every response arrives whole and in order; a fast consumer is not held back.
    With a postprocessor after the step, under ``max_inflight_requests`` (what bounds the
    steps between, as in Triton), both apply."""
    monkeypatch.setattr(_request, "HOLD_BYTES", 8 * MiB)
    write_ensembles(tmp_path)
    with serving(tmp_path, shm_prefix, backend_config=POOLS) as srv:
        model = srv.model(ensemble)
        numbers, sent = stream_to(model, 60, 0.01, how=how)
        assert sent == 60 and numbers == [i % 256 for i in range(60)]
        peak = stub_peak(srv)
        assert peak <= 20 * MiB, f"the flood model's pool grew to {peak / MiB:.0f} MiB"
        assert stream_to(model, 20, 0, how=how) == (list(range(20)), 20)


def test_a_slow_step_after_the_paced_one_is_not_a_stalled_consumer(tmp_path, shm_prefix,
                                                                   monkeypatch) -> None:
    """The consumer reads at once, but the postprocessor takes 0.8 s a response: what waits is
    the postprocessor, not the consumer, and the request is not cancelled as a stalled
    consumer's (HELD_STALLED_S is 0.5 s here); every response arrives. (Counting the
    postprocessor's queue against the consumer had it cancelled with 0 responses.)"""
    monkeypatch.setattr(_request, "HOLD_BYTES", 4 * MiB)
    monkeypatch.setattr(_request, "HELD_STALLED_S", 0.5)
    write_ensembles(tmp_path)
    with serving(tmp_path, shm_prefix, backend_config=POOLS) as srv:
        stream = srv.model("flood_then_copy").infer(inputs(4), parameters={"copy_sleep": 0.8})
        assert read_all(stream) == (list(range(4)), 4)


RATE_LIMITED = """
instance_group [ { count: 1, kind: KIND_CPU,
                   rate_limiter { resources [ { name: "R", count: 1 } ] } } ]
"""


def test_a_pipeline_whose_steps_share_a_rate_limiter_resource(tmp_path, shm_prefix,
                                                             monkeypatch) -> None:
    """The flood model and the copy after it need the one rate limiter resource there is, so
    copy runs only once flood's execute has ended. Read 10 ms apart, every response arrives
    (counting copy's queue against the consumer held flood, which held the resource: nothing
    came until the stall limit cancelled the request)."""
    monkeypatch.setattr(_request, "HOLD_BYTES", 4 * MiB)
    monkeypatch.setattr(_request, "HELD_STALLED_S", 3.0)
    write_model(tmp_path, "flood", FLOOD_PY, CONFIG + RATE_LIMITED)
    write_model(tmp_path, "copy", COPY_PY, COPY_CONFIG + RATE_LIMITED)
    write_model(tmp_path, "flood_then_copy", "", ENSEMBLES["flood_then_copy"])
    with serving(tmp_path, shm_prefix, backend_config=POOLS, rate_limit="execution_count",
                 rate_limit_resources=["R:1"]) as srv:
        assert stream_to(srv.model("flood_then_copy"), 20, 0.01, how="sync") == \
            (list(range(20)), 20)


def test_a_stop_lets_a_held_pipeline_stream_run_to_its_end(tmp_path, shm_prefix,
                                                          monkeypatch) -> None:
    """The consumer has read one response of 40 (the flood step is held) and a second request
    waits behind it when the server stops: the pacing is lifted, and the ensemble is unloaded
    before its steps, so both streams get every response. (Its step 'copy' was unloaded
    under them: "depends on 'copy' which has no loaded version".)"""
    monkeypatch.setattr(_request, "HOLD_BYTES", 4 * MiB)
    write_ensembles(tmp_path)
    with serving(tmp_path, shm_prefix, backend_config=POOLS, exit_timeout=60) as srv:
        model = srv.model("flood_then_copy")
        first, second = model.infer(inputs(40)), model.infer(inputs(40))
        numbers: list[int] = []
        assert _number(first.get(timeout=30), numbers) == -1 and numbers == [0]
        time.sleep(0.5)  # held by now
        srv.stop()
        assert read_all(first) == (list(range(1, 40)), 40)
        assert read_all(second) == (list(range(40)), 40)


@pytest.mark.parametrize("name", ["flood", "flood_alone"])
def test_a_consumer_that_stops_reading_has_its_held_request_cancelled(
        tmp_path, shm_prefix, monkeypatch, name: str) -> None:
    """The consumer takes two responses and stops: the model waits in send() until the request
    is cancelled HELD_STALLED_S later, then sees is_cancelled() and ends; the consumer, reading
    again, gets what waited, then the error. The instance then serves the next request. The
    same through a decoupled ensemble (its step is cancelled with it)."""
    monkeypatch.setattr(_request, "HOLD_BYTES", 4 * MiB)
    monkeypatch.setattr(_request, "HELD_STALLED_S", 0.5)
    write_ensembles(tmp_path)
    with serving(tmp_path, shm_prefix, backend_config=POOLS) as srv:
        model = srv.model(name)

        async def run() -> tuple[int, str, float]:
            stream = model.async_infer(inputs(1000))
            it = stream.__aiter__()
            for _ in range(2):
                assert (await it.__anext__()).error is None
            start = time.monotonic()
            await asyncio.sleep(1.5)  # read nothing meanwhile
            taken, error = 2, ""
            async for resp in it:
                if resp.error is not None:
                    error = resp.error.message
                    break
                taken += 1
            return taken, error, time.monotonic() - start

        taken, error, _ = asyncio.run(run())
        assert "the client did not read its responses" in error, error
        assert taken < 20, f"{taken} responses: the model was not held"
        assert stream_to(model, 3, 0) == ([0, 1, 2], 3)
        # The same with the sync API.
        stream = model.infer(inputs(1000))
        for _ in range(2):
            assert stream.get(timeout=30).error is None
        time.sleep(1.5)
        taken, error = 2, ""
        for resp in stream:
            if resp.error is not None:
                error = resp.error.message
                break
            taken += 1
        assert "the client did not read its responses" in error, error
        assert taken < 20, f"{taken} responses: the model was not held"
        assert stream_to(model, 3, 0, how="sync") == ([0, 1, 2], 3)


def test_a_consumer_that_pauses_while_the_model_waits_keeps_its_stream(
        tmp_path, shm_prefix, monkeypatch) -> None:
    """A pause is not an abandon: the consumer reads two responses, reads nothing for 6 s
    (longer than the 5 s after which a held stream used to be cancelled; nothing grows
    meanwhile) while the model waits in send(), then reads on and gets all of them, in order.
    Only the hold limit is lowered here, not HELD_STALLED_S."""
    monkeypatch.setattr(_request, "HOLD_BYTES", 4 * MiB)
    write_model(tmp_path, "flood", FLOOD_PY, CONFIG)
    with serving(tmp_path, shm_prefix, backend_config=POOLS) as srv:
        stream = srv.model("flood").infer(inputs(40))
        numbers: list[int] = []
        sent = -1
        for _ in range(2):
            sent = max(sent, _number(stream.get(timeout=30), numbers))
        time.sleep(6.0)
        assert stub_peak(srv) <= 12 * MiB  # the model was held, not sending all 40 MiB
        for resp in stream:
            sent = max(sent, _number(resp, numbers))
        assert numbers == list(range(40)) and sent == 40


# FLOOD_PY's model with an ``async def execute`` (one thread: its event loop's), up to 2 at once;
# it lets the loop run other requests' executes between its sends.
ASYNC_FLOOD_PY = """
import asyncio
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    async def execute(self, requests):
        for request in requests:
            count = int(pb_utils.get_input_tensor_by_name(request, "COUNT").as_numpy()[0])
            sender = request.get_response_sender()
            for i in range(count):
                sender.send(pb_utils.InferenceResponse([
                    pb_utils.Tensor("OUT", np.full(1 << 20, i % 256, np.uint8))]))
                await asyncio.sleep(0)
            sender.send(pb_utils.InferenceResponse([
                pb_utils.Tensor("SENT", np.array([count], np.int32))]),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


def test_a_slow_consumer_never_holds_the_event_loop_of_async_execute(
        tmp_path, shm_prefix, monkeypatch) -> None:
    """An async execute sends on the instance's event loop, which its other requests share: a
    consumer that stops reading does not make that send wait, so another request of the same
    instance is answered while the first consumer still reads nothing."""
    monkeypatch.setattr(_request, "HOLD_BYTES", 4 * MiB)
    write_model(tmp_path, "flood", ASYNC_FLOOD_PY,
                CONFIG + 'parameters { key: "max_concurrent_executes" '
                         'value: { string_value: "2" } }\n')
    with serving(tmp_path, shm_prefix, backend_config=POOLS) as srv:
        model = srv.model("flood")

        async def run() -> list[str]:
            events: list[str] = []

            async def slow() -> None:
                it = model.async_infer(inputs(30)).__aiter__()
                assert (await it.__anext__()).error is None
                events.append("slow reads nothing")
                await asyncio.sleep(1.5)
                events.append("slow reads again")
                assert await read_slowly(it, 0) == ([i % 256 for i in range(1, 30)], 30)

            async def quick() -> None:
                await asyncio.sleep(0.3)  # the first stream holds its sends by now, were it to
                assert await read_slowly(model.async_infer(inputs(3)), 0) == ([0, 1, 2], 3)
                events.append("quick done")

            await asyncio.gather(slow(), quick())
            return events

        assert asyncio.run(run()) == ["slow reads nothing", "quick done", "slow reads again"]


@pytest.mark.parametrize("name", ["flood", "flood_alone"])
def test_a_grpc_client_reading_slowly_paces_the_model(tmp_path, monkeypatch, name: str) -> None:
    """The same over the network: tritonclient's gRPC stream, whose callback takes 20 ms a
    response. HTTP/2 flow control stops the server's writes, the frontend stops taking the
    stream's responses, and the model's sends wait: the stub's pool peaked at 8 MiB (36 MiB
    without back-pressure) of the 40 MiB streamed, and every response arrives, in order. The
    same through a decoupled ensemble (36 MiB before it was paced)."""
    import tritonclient.grpc as grpcclient
    from _models import serving_frontends

    monkeypatch.setattr(_request, "HOLD_BYTES", 4 * MiB)
    write_ensembles(tmp_path)
    got: list = []
    with serving_frontends(tmp_path, backend_config=POOLS) as (srv, fe):
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{fe.grpc_port}")

        def slow(result, error) -> None:
            if error is not None:
                got.append(error)
            else:
                out = result.as_numpy("OUT")
                got.append(out if out is not None else int(result.as_numpy("SENT")[0]))
            time.sleep(0.02)

        try:
            client.start_stream(callback=slow)
            request = []
            for input_name, value in inputs(40).items():
                request.append(grpcclient.InferInput(input_name, [1], "INT32"))
                request[-1].set_data_from_numpy(value)
            client.async_stream_infer(name, request)
            deadline = time.monotonic() + 60
            while len(got) < 41 and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            client.stop_stream()
            client.close()
        peak = stub_peak(srv)
    assert len(got) == 41 and got[40] == 40, [str(g) for g in got[-1:]]
    outs = got[:40]
    assert all(isinstance(o, np.ndarray) and o.nbytes == MiB and (o == i).all()
               for i, o in enumerate(outs)), [type(o) for o in outs]
    assert peak <= 16 * MiB, f"the stub's pool grew to {peak / MiB:.0f} MiB"


def test_malformed_acknowledgements_leave_the_stub_serving(tmp_path, shm_prefix,
                                                           monkeypatch) -> None:
    """ACK and CANCEL frames of any shape (a bad id, a count that is not one, not a list) are
    ignored by the stub, which goes on pacing and serving."""
    from tritonpy.shm import Cmd

    monkeypatch.setattr(_request, "HOLD_BYTES", 4 * MiB)
    write_model(tmp_path, "flood", FLOOD_PY, CONFIG)
    with serving(tmp_path, shm_prefix, backend_config=POOLS) as srv:
        stub = srv.runtime("flood").instances[0].stub
        for body in (None, 7, "x", [None], [[1]], [[[1], 2]], [["a", 1]], [[1, "b"]],
                     [[1, 2, 3]], {"a": 1}):
            stub.send(Cmd.ACK, 0, body)
            stub.send(Cmd.CANCEL, 0, body)
        assert stream_to(srv.model("flood"), 12, 0.01) == ([i for i in range(12)], 12)
        assert stub.alive and srv.runtime("flood").instances[0].stub is stub
