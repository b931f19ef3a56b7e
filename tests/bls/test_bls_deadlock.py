"""BLS calls that can never be served are answered with an error naming the cycle, instead of
hanging as the real Triton does: a model calling itself with every instance busy, and A <-> B
with both busy. Calls that *can* be served (another instance is free) must not be refused.

chain1 and chain_b have one instance each, chain2 has two; request parameter 'hops' lists the
models each link calls next (see tests/models/bls/chain1/1/model.py).
"""
from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

import tritonpy
from _bls_models import BLS_REPO, collect, new_prefix, serve

UNAVAILABLE = "UNAVAILABLE"
# A detected deadlock is answered within a fraction of a second; this bound only keeps a
# regression (a real hang) from hanging the run.
ANSWER_WITHIN_S = 5.0


@pytest.fixture(scope="module")
def server() -> Iterator[tritonpy.Server]:
    with serve(BLS_REPO, new_prefix(), model_control_mode="explicit",
               load_models=["chain1", "chain2", "chain_b"]) as srv:
        yield srv


def start(server, model: str, hops: str, delay_ms: int = 0):
    return server.model(model).infer({"INPUT0": np.ones(2, np.float32)},
                                     parameters={"hops": hops, "delay_ms": delay_ms})


def call(server, model: str, hops: str, delay_ms: int = 0):
    (resp,) = collect(start(server, model, hops, delay_ms), timeout=ANSWER_WITHIN_S)
    return resp


def path(resp) -> list[str]:
    assert resp.error is None, resp.error
    return [p.decode() for p in resp.outputs["PATH"].to_numpy().tolist()]


def assert_deadlock_error(resp, *names: str) -> None:
    assert resp.error is not None, "a call that can never run was served?"
    msg = resp.error.message
    assert "deadlock" in msg.lower(), msg
    for name in names:
        assert name in msg, f"the error does not name {name!r}: {msg}"


def test_self_call_with_its_only_instance_busy(server) -> None:
    t0 = time.monotonic()
    resp = call(server, "chain1", "chain1")
    assert time.monotonic() - t0 < ANSWER_WITHIN_S
    assert_deadlock_error(resp, "chain1", "chain1_0_0")
    assert resp.error.code.value == UNAVAILABLE
    # and the model keeps serving
    assert path(call(server, "chain1", "")) == ["chain1_0_0"]


def test_a_calls_b_calls_a(server) -> None:
    resp = call(server, "chain1", "chain_b,chain1")
    assert_deadlock_error(resp, "chain1", "chain_b")
    assert path(call(server, "chain1", "chain_b")) == ["chain1_0_0", "chain_b_0_0"]


def test_a_and_b_both_busy_calling_each_other(server) -> None:
    # Two client requests start at once: chain1 calls chain_b while chain_b calls chain1. Both
    # instances are busy waiting on each other; one call is refused, which frees its caller,
    # so the other completes.
    to_a = start(server, "chain1", "chain_b", delay_ms=300)
    to_b = start(server, "chain_b", "chain1", delay_ms=300)
    (ra,) = collect(to_a, timeout=ANSWER_WITHIN_S)
    (rb,) = collect(to_b, timeout=ANSWER_WITHIN_S)
    failed = [r for r in (ra, rb) if r.error is not None]
    served = [r for r in (ra, rb) if r.error is None]
    assert len(failed) == 1 and len(served) == 1, (ra, rb)
    assert_deadlock_error(failed[0], "chain1", "chain_b")
    assert len(path(served[0])) == 2


def test_self_call_with_a_free_instance_is_served(server) -> None:
    # chain2 has two instances: one calls the other, no deadlock.
    resp = call(server, "chain2", "chain2")
    assert resp.error is None, resp.error
    assert int(resp.outputs["DEPTH"].to_numpy()[0]) == 1
    p = path(resp)
    assert len(p) == 2 and p[0] != p[1] and all(x.startswith("chain2_") for x in p)


def test_self_call_deeper_than_the_instances(server) -> None:
    # chain2 -> chain2 -> chain2 needs three instances; it has two.
    resp = call(server, "chain2", "chain2,chain2")
    assert_deadlock_error(resp, "chain2")
    assert path(call(server, "chain2", "chain2")) != []


def test_deadlocks_are_counted_and_the_server_recovers(server) -> None:
    before = server.bls.deadlocks
    for _ in range(3):
        assert_deadlock_error(call(server, "chain1", "chain1"), "chain1")
    assert server.bls.deadlocks - before == 3
    # a long chain through busy instances that can all progress is never taken for one
    for _ in range(5):
        p = path(call(server, "chain1", "chain_b,chain2,chain2"))
        assert p[:2] == ["chain1_0_0", "chain_b_0_0"]
        assert len(p) == 4 and p[2] != p[3] and all(x.startswith("chain2_") for x in p[2:])
    assert server.bls.deadlocks - before == 3
