"""``async def execute`` runs concurrently in one instance, in default mode too (the real
Triton serialises it there), bounded per instance by the model-config parameter
``max_concurrent_executes``; sync and async BLS work inside it.

Concurrency is proven by overlap, not by time: every request of a group waits at a barrier
until ``n`` requests of the group are inside ``execute`` at the same moment. The bound is
proven the same way: with a bound of k, a group of k + 1 can never meet at the barrier, so
the first k give up (their barrier has a timeout) and only then does the last one get in.

* ``async_barrier``: default mode, one instance, max_concurrent_executes 4.
* ``async_stream``: decoupled, one instance, max_concurrent_executes 3; after the barrier each
  request sends REPORT, then OUT from a blocking ``exec()`` on 'double', then OUT from an
  ``await async_exec()`` on 'double'.
* ``async_bls``: default mode; blocking ``exec()``, ``asyncio.gather`` of ``async_exec()``, and
  ``async_exec(decoupled=True)`` on 'square' iterated with ``async for``.
"""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

import tritonpy
from _bls_models import DECOUPLED_REPO, collect, new_prefix, serve, text

MODELS = ["async_barrier", "async_stream", "async_bls", "double", "square"]
WAIT_S = 20.0
BOUND = {"async_barrier": 4, "async_stream": 3}


@pytest.fixture(scope="module")
def server() -> Iterator[tritonpy.Server]:
    with serve(DECOUPLED_REPO, new_prefix(), model_control_mode="explicit",
               load_models=MODELS) as srv:
        yield srv


def barrier_reports(server, model: str, group: str, count: int, n: int,
                    timeout_s: float) -> list[dict]:
    """Send ``count`` requests of ``group`` at once; the REPORT each one got."""
    params = {"group": group, "n": n, "timeout_s": timeout_s}
    streams = [server.model(model).infer({"IN": np.array([i], np.int32)}, parameters=params)
               for i in range(count)]
    reports = []
    for stream in streams:
        responses = collect(stream, WAIT_S)
        first = next(r for r in responses if "REPORT" in r.outputs)
        reports.append(text(first, "REPORT"))
    return reports


def test_default_mode_executes_overlap(server):
    # Four requests meet inside execute of one instance: they ran concurrently. (The barrier's
    # timeout is long: reaching it is the point, not how fast.)
    reports = barrier_reports(server, "async_barrier", "overlap", 4, 4, 15)
    assert all(r["reached"] for r in reports), reports
    assert max(r["peak"] for r in reports) >= 4


def test_decoupled_executes_overlap_with_sync_and_async_bls_inside(server):
    params = {"group": "overlap", "n": 3, "timeout_s": 15}
    streams = {v: server.model("async_stream").infer({"IN": np.array([v, v + 1], np.int32)},
                                                     parameters=params) for v in (1, 10, 100)}
    for v, stream in streams.items():
        responses = collect(stream, WAIT_S)
        assert len(responses) == 4, responses
        assert text(responses[0], "REPORT")["reached"] is True
        assert responses[1].outputs["OUT"].to_numpy().tolist() == [2 * v, 2 * (v + 1)]
        assert responses[2].outputs["OUT"].to_numpy().tolist() == [2 * (v + 1), 2 * (v + 2)]
        assert responses[3].final and responses[3].outputs == {}


@pytest.mark.parametrize("model", sorted(BOUND))
def test_concurrency_is_bounded_per_instance(server, model):
    bound = BOUND[model]
    # bound + 1 requests that each wait (up to 2 s) for bound + 1 of them inside at once:
    # only `bound` fit, so those give up; the last one enters after, and finds the group full.
    # (The barrier counts arrivals: once the first gives up, the last one gets in and also
    # releases those still waiting, so on a loaded machine only the first is sure to fail.)
    reports = barrier_reports(server, model, f"bounded-{bound}", bound + 1, bound + 1, 2)
    assert reports[0]["reached"] is False, reports  # the bound was full: nobody more got in
    assert reports[-1]["reached"] is True, reports  # ... until a slot freed
    assert max(r["peak"] for r in reports) == bound, reports


def test_sync_and_async_bls_inside_async_execute(server):
    x = np.array([1, 2, 3], np.int32)
    (resp,) = collect(server.model("async_bls").infer({"IN": x}), WAIT_S)
    assert resp.error is None, resp.error
    assert resp.outputs["SYNC"].to_numpy().tolist() == (2 * x).tolist()
    assert resp.outputs["GATHERED"].to_numpy().tolist() == [(2 * (x + i)).tolist()
                                                            for i in range(3)]
    assert resp.outputs["STREAMED"].to_numpy().tolist() == [3, 3, 3]


def test_many_async_bls_requests_in_flight(server):
    streams = [server.model("async_bls").infer({"IN": np.array([i], np.int32)})
               for i in range(12)]
    for i, stream in enumerate(streams):
        (resp,) = collect(stream, WAIT_S)
        assert resp.error is None, resp.error
        assert resp.outputs["SYNC"].to_numpy().tolist() == [2 * i]


@pytest.mark.parametrize("value", ["0", "-2", "abc"])
def test_a_concurrency_bound_below_one_is_refused_at_load(tmp_path, value):
    # "0" loaded READY, and every request to its async execute waited for ever.
    from _models import io_config, write_model
    write_model(tmp_path, "bounded", ASYNC_DOUBLE_PY, io_config(
        extra='parameters { key: "max_concurrent_executes" value: { string_value: "%s" } }'
        % value))
    with tritonpy.Server(str(tmp_path), model_control_mode="explicit",
                         backend_config={"shm-region-prefix-name": new_prefix()}) as srv:
        with pytest.raises(tritonpy.InvalidArgumentError,
                           match="parameter max_concurrent_executes must be an integer of 1 "
                                 f"or more, got '{value}'"):
            srv.load("bounded")


ASYNC_DOUBLE_PY = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    async def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() * 2)]) for r in requests]
"""
