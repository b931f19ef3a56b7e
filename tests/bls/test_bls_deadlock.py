"""BLS calls that can never be served are answered with an error naming the cycle, instead of
hanging as the real Triton does: a model calling itself with every instance busy, and A <-> B
with both busy. Calls that *can* be served (another instance is free) must not be refused.

chain1 and chain_b have one instance each, chain2 has two; request parameter 'hops' lists the
models each link calls next (see tests/models/bls/chain1/1/model.py). The achain* models are
the same links with ``async def execute`` awaiting ``async_exec`` (asyncio.gather of 'fan'
calls); achain1 and achain_b run one execute at a time, achain2 two.
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
               load_models=["chain1", "chain2", "chain_b", "achain1", "achain2",
                            "achain_b"]) as srv:
        yield srv


def start(server, model: str, hops: str, delay_ms: int = 0, fan: int = 1):
    return server.model(model).infer({"INPUT0": np.ones(2, np.float32)},
                                     parameters={"hops": hops, "delay_ms": delay_ms, "fan": fan})


def call(server, model: str, hops: str, delay_ms: int = 0, fan: int = 1):
    (resp,) = collect(start(server, model, hops, delay_ms, fan), timeout=ANSWER_WITHIN_S)
    return resp


def path(resp) -> list[str]:
    assert resp.error is None, resp.error
    return [p.decode() for p in resp.outputs["PATH"].to_numpy().tolist()]


def one_refused_one_served(server, first: tuple[str, str], second: tuple[str, str]):
    """Start two (model, hops) requests at once (each sleeps 300 ms first, so that both callers
    are busy together); exactly one is refused, which frees its caller for the other. Returns
    (the refused response, the served one)."""
    streams = [start(server, model, hops, delay_ms=300) for model, hops in (first, second)]
    responses = [collect(s, timeout=ANSWER_WITHIN_S)[0] for s in streams]
    failed = [r for r in responses if r.error is not None]
    served = [r for r in responses if r.error is None]
    assert len(failed) == 1 and len(served) == 1, responses
    return failed[0], served[0]


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
    failed, served = one_refused_one_served(server, ("chain1", "chain_b"), ("chain_b", "chain1"))
    assert_deadlock_error(failed, "chain1", "chain_b")
    assert len(path(served)) == 2


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


# -- async execute awaiting async_exec ---------------------------------------------------------
def test_async_self_call_with_its_only_execute_slot_busy(server) -> None:
    before = server.bls.deadlocks
    t0 = time.monotonic()
    resp = call(server, "achain1", "achain1")
    assert time.monotonic() - t0 < ANSWER_WITHIN_S
    assert_deadlock_error(resp, "achain1", "achain1_0_0")
    assert resp.error.code.value == UNAVAILABLE
    assert server.bls.deadlocks - before == 1
    assert path(call(server, "achain1", "")) == ["achain1_0_0"]


def test_async_a_calls_b_calls_a(server) -> None:
    assert_deadlock_error(call(server, "achain1", "achain_b,achain1"), "achain1", "achain_b")
    assert path(call(server, "achain1", "achain_b")) == ["achain1_0_0", "achain_b_0_0"]


def test_async_self_call_in_a_free_execute_slot_is_served(server) -> None:
    # achain2 runs two executes at once: the call runs beside its caller.
    before = server.bls.deadlocks
    resp = call(server, "achain2", "achain2")
    assert path(resp) == ["achain2_0_0", "achain2_0_0"]
    assert int(resp.outputs["DEPTH"].to_numpy()[0]) == 1
    # deeper than its two slots: refused
    assert_deadlock_error(call(server, "achain2", "achain2,achain2"), "achain2")
    assert server.bls.deadlocks - before == 1


def test_gathered_calls_that_queue_behind_each_other_are_not_a_deadlock(server) -> None:
    # Three calls awaited together: achain_b serves them one after another, and in achain2 one
    # slot serves them while the caller holds the other. Waiting in a queue is not a cycle.
    before = server.bls.deadlocks
    assert path(call(server, "achain1", "achain_b", fan=3)) == ["achain1_0_0", "achain_b_0_0"]
    assert path(call(server, "achain2", "achain2", fan=3)) == ["achain2_0_0", "achain2_0_0"]
    assert server.bls.deadlocks == before


def test_gather_with_one_call_that_can_never_run(server) -> None:
    # achain1 awaits two calls to itself: neither can ever get its only execute slot.
    assert_deadlock_error(call(server, "achain1", "achain1", fan=2), "achain1")
    assert path(call(server, "achain1", "")) == ["achain1_0_0"]


def test_sync_and_async_links_in_one_cycle(server) -> None:
    # chain1 (sync exec) -> achain1 (async_exec) -> chain1, whose only instance is waiting.
    assert_deadlock_error(call(server, "chain1", "achain1,chain1"), "chain1", "achain1")
    assert path(call(server, "chain1", "achain1")) == ["chain1_0_0", "achain1_0_0"]


def test_two_async_executes_both_waiting_on_their_own_model(server) -> None:
    # Two client requests fill achain2's two slots, each awaiting a call to achain2: one call
    # is refused, which ends its caller's execute, and the other call then runs in that slot.
    failed, served = one_refused_one_served(server, ("achain2", "achain2"), ("achain2", "achain2"))
    assert_deadlock_error(failed, "achain2")
    assert path(served) == ["achain2_0_0", "achain2_0_0"]


def test_a_call_sent_behind_an_execute_that_then_waits_on_it_is_not_a_deadlock(server) -> None:
    # chain2's first instance runs X, which calls chain_b after 5 ms; its second runs W for
    # 300 ms. Meanwhile chain_b's only instance runs Z, which calls chain2: with both chain2
    # instances busy and short executes so far, that call is sent behind X (execute prefetch).
    # X then waits on chain_b, which waits on that call: it must go back to chain2's queue
    # (not sit behind X) and run once W is done. Nothing here can deadlock; all three succeed.
    before = server.bls.deadlocks
    for _ in range(3):  # chain2's instances have run short executes: both prefetch
        path(call(server, "chain2", ""))
    x = start(server, "chain2", "chain_b", delay_ms=5)
    w = start(server, "chain2", "", delay_ms=300)
    z = start(server, "chain_b", "chain2")
    px, pw, pz = (path(collect(s, timeout=ANSWER_WITHIN_S)[0]) for s in (x, w, z))
    assert px[1:] == ["chain_b_0_0"] and len(pw) == 1 and pz[0] == "chain_b_0_0"
    assert px[0] != pw[0] and pz[1] == pw[0]  # Z's call ran where W had run
    assert server.bls.deadlocks == before
