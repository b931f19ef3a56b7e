"""Decoupled response streams in real stubs: ``ResponseSender.send(response, flags)`` with
``TRITONSERVER_RESPONSE_COMPLETE_FINAL``; zero, one or many responses per request; a final flag
with no response; Triton's documented examples (repeat, square); responses reaching the
in-process API (sync and asyncio) and BLS callers (exec and async_exec) *as they are sent*.

"As they are sent" is proven by order, not by time: ``stream_n`` with a ``gate`` sends its first
response and then waits until the gate file exists, which the test creates only after it has
received that first response. A transport that held responses back until the stream ended
would never deliver the first one, and the bounded wait fails the test.
"""
from __future__ import annotations

import asyncio
import contextlib
import pathlib
import queue
from collections.abc import Iterator

import numpy as np
import pytest

import tritonpy
from _bls_models import DECOUPLED_REPO, collect, new_prefix, serve

MODELS = ["repeat", "square", "stream_n", "bls_relay", "bls_relay_async"]
WAIT_S = 15.0  # bounds every wait: a bug fails an assertion instead of hanging the run


@pytest.fixture(scope="module")
def server() -> Iterator[tritonpy.Server]:
    with serve(DECOUPLED_REPO, new_prefix(), model_control_mode="explicit",
               load_models=MODELS) as srv:
        yield srv


def i32(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def out(resp: tritonpy.InferenceResponse, name: str = "OUT") -> int:
    assert resp.error is None, resp.error
    return int(resp.outputs[name].to_numpy()[0])


def next_response(stream, timeout: float = WAIT_S) -> tritonpy.InferenceResponse:
    try:
        return stream.get(timeout=timeout)
    except queue.Empty:
        raise AssertionError(f"no response within {timeout} s") from None


@contextlib.contextmanager
def gate_file(tmp_path: pathlib.Path) -> Iterator[pathlib.Path]:
    """A gate path; opened on the way out even when the test fails, so no execute stays
    blocked on it."""
    gate = tmp_path / "gate"
    try:
        yield gate
    finally:
        gate.touch()


# -- send / flags ----------------------------------------------------------------------------
def test_many_responses_then_a_bare_final_flag(server):
    responses = collect(server.model("stream_n").infer({"N": i32(5)}), WAIT_S)
    assert [out(r) for r in responses[:-1]] == [0, 1, 2, 3, 4]
    assert [r.final for r in responses] == [False] * 5 + [True]
    # The final flag sent with no response reaches the caller as an empty final response.
    assert responses[-1].outputs == {} and responses[-1].error is None


def test_final_flag_sent_with_the_last_response(server):
    responses = collect(server.model("stream_n").infer(
        {"N": i32(3)}, parameters={"final_with_last": True}), WAIT_S)
    assert [out(r) for r in responses] == [0, 1, 2]
    assert [r.final for r in responses] == [False, False, True]


def test_exactly_one_response(server):
    responses = collect(server.model("stream_n").infer(
        {"N": i32(1)}, parameters={"final_with_last": True}), WAIT_S)
    assert len(responses) == 1 and responses[0].final and out(responses[0]) == 0


def test_zero_responses_only_the_final_flag(server):
    for model, inputs in (("stream_n", {"N": i32(0)}), ("square", {"IN": i32(0)})):
        responses = collect(server.model(model).infer(inputs), WAIT_S)
        assert len(responses) == 1, (model, responses)
        assert responses[0].final and responses[0].outputs == {} and responses[0].error is None


def test_triton_square_example(server):
    responses = collect(server.model("square").infer({"IN": i32(4)}), WAIT_S)
    assert [out(r) for r in responses[:-1]] == [4, 4, 4, 4]
    assert responses[-1].final and responses[-1].outputs == {}


def test_triton_repeat_example_from_a_thread(server):
    values = [4, 2, 0, 1]
    responses = collect(server.model("repeat").infer({
        "IN": i32(*values), "DELAY": np.array([1, 2, 3, 4], np.uint32),
        "WAIT": np.array([5], np.uint32)}), WAIT_S)
    assert [out(r) for r in responses[:-1]] == values
    assert [out(r, "IDX") for r in responses[:-1]] == [0, 1, 2, 3]
    assert [r.final for r in responses] == [False] * 4 + [True]


def test_concurrent_streams_each_get_their_own_responses(server):
    streams = [server.model("square").infer({"IN": i32(n)}) for n in (1, 2, 3, 5)]
    for n, stream in zip((1, 2, 3, 5), streams):
        responses = collect(stream, WAIT_S)
        assert [out(r) for r in responses[:-1]] == [n] * n


# -- streaming: responses arrive as they are sent --------------------------------------------
def _gated(server, model: str, gate: pathlib.Path, n: int = 4):
    return server.model(model).infer({"N": i32(n)}, parameters={"gate": str(gate)})


@pytest.mark.parametrize("model", ["stream_n", "bls_relay", "bls_relay_async"])
def test_first_response_arrives_before_the_model_sends_the_rest(server, tmp_path, model):
    # stream_n: directly to the in-process API; bls_relay(_async): stream_n's responses go
    # through a BLS iterator (exec / async_exec, decoupled=True) in another stub and are
    # forwarded from there.
    with gate_file(tmp_path) as gate:
        stream = _gated(server, model, gate)
        first = next_response(stream)
        assert out(first) == 0 and not first.final
        # The model is now waiting for the gate, so nothing else can have been sent.
        with pytest.raises(queue.Empty):
            stream.get(timeout=0.05)
        gate.touch()
        rest = collect(stream, WAIT_S)
    assert [out(r) for r in rest[:-1]] == [1, 2, 3]
    assert rest[-1].final and rest[-1].outputs == {}


def test_async_infer_streams_as_responses_are_sent(server, tmp_path):
    async def run(gate: pathlib.Path) -> tuple[int, list]:
        stream = server.model("stream_n").async_infer({"N": i32(3)},
                                                      parameters={"gate": str(gate)})
        first = await asyncio.wait_for(stream.__anext__(), WAIT_S)
        gate.touch()

        async def rest() -> list:
            return [r async for r in stream]

        return out(first), await asyncio.wait_for(rest(), WAIT_S)

    with gate_file(tmp_path) as gate:
        first, rest = asyncio.run(run(gate))
    assert first == 0
    assert [out(r) for r in rest[:-1]] == [1, 2]
    assert rest[-1].final


@pytest.mark.parametrize("model", ["bls_relay", "bls_relay_async"])
def test_bls_caller_gets_every_response_and_the_end(server, model):
    responses = collect(server.model(model).infer({"N": i32(6)}), WAIT_S)
    assert [out(r) for r in responses[:-1]] == list(range(6))
    assert responses[-1].final
    none = collect(server.model(model).infer({"N": i32(0)}), WAIT_S)
    assert len(none) == 1 and none[0].final and none[0].outputs == {}
