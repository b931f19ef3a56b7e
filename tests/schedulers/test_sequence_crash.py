"""A stateful model's stub that dies (real stubs, SIGKILLed by the model itself): the sequences
it held end with it, so the restarted instance never sees one go on without its START, and a
direct batch's null requests do not count as failed requests."""
from __future__ import annotations

import numpy as np
import pytest
from _models import new_prefix, serving, write_model
from _sched_models import ALL_CONTROLS, SEQ_PY, seq_config

pytestmark = pytest.mark.timeout(90)

START, END = 1, 2

# SEQ_PY (a running sum per correlation ID, kept in the stub) that dies at IN == 666.
DYING_PY = SEQ_PY.replace(
    "            x = float(pb_utils.get_input_tensor_by_name(r, \"IN\").as_numpy().reshape(-1)[0])\n",
    "            x = float(pb_utils.get_input_tensor_by_name(r, \"IN\").as_numpy().reshape(-1)[0])\n"
    "            if x == 666:\n"
    "                os.kill(os.getpid(), 9)\n")
assert DYING_PY != SEQ_PY

MODELS = {
    "direct": seq_config(controls=ALL_CONTROLS.replace("CORRID_TYPE", "TYPE_UINT64"),
                         max_batch_size=2),
    "single": seq_config(),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    for name, cfg in MODELS.items():
        write_model(repo, name, DYING_PY, cfg)
    with serving(repo, new_prefix(), backend_config={"restart-backoff-seconds": 0.05}) as srv:
        yield srv


def _send(server, model, v, cid, flags=0):
    x = np.array([[v]] if model == "direct" else [v], dtype=np.float32)
    return server.model(model).infer({"IN": x}, correlation_id=cid, flags=flags)


def _run(server, model, v, cid, flags=0):
    return _send(server, model, v, cid, flags).get(timeout=30)


def _sum(resp) -> float:
    assert resp.error is None, resp.error
    return float(resp.outputs["OUT"].to_numpy().reshape(-1)[0])


def _failed(server, model) -> int:
    stats = server.statistics(model)["model_stats"][0]["inference_stats"]
    return int(stats["fail"]["count"])


def test_the_sequences_of_a_dead_instance_need_start_again(server) -> None:
    # (QA) The restarted instance got the sequences' next requests without START: its running
    # sums were gone, and the model answered 2 where the sequence had summed to 3.
    assert _sum(_run(server, "direct", 1, 1, START)) == 1  # slot 0
    assert _sum(_run(server, "direct", 1, 2, START)) == 1  # slot 1
    failed = _failed(server, "direct")
    dead = _run(server, "direct", 666, 2)  # a batch of a null request (slot 0) and this one
    assert dead.error is not None and dead.error.code.name == "UNAVAILABLE", dead.error
    assert "not healthy" in dead.error.message
    # (QA) The null request counted as a second failed request.
    assert _failed(server, "direct") - failed == 1
    for cid in (1, 2):
        resp = _run(server, "direct", 2, cid)
        assert resp.error is not None and resp.error.code.name == "INVALID_ARG", resp.error
        assert resp.error.message == (
            f"inference request for sequence {cid} to model 'direct' must specify the START "
            "flag on the first request of the sequence")
    # They start again on the restarted instance, from nothing, in their slots.
    assert _sum(_run(server, "direct", 5, 1, START)) == 5
    assert _sum(_run(server, "direct", 7, 2, START)) == 7
    assert _sum(_run(server, "direct", 1, 1, END)) == 6
    assert _sum(_run(server, "direct", 1, 2, END)) == 8


def test_a_request_queued_behind_the_crash_is_answered_that_its_sequence_ended(server) -> None:
    assert _sum(_run(server, "single", 1, 3, START)) == 1
    dying = _send(server, "single", 666, 3)
    behind = _send(server, "single", 2, 3)  # queued: one request of a sequence at a time
    assert dying.get(timeout=30).error.code.name == "UNAVAILABLE"
    resp = behind.get(timeout=30)
    assert resp.error is not None and resp.error.code.name == "UNAVAILABLE", resp.error
    assert resp.error.message.startswith("sequence 3 of model 'single' ended: instance "
                                         "'single_0_0', which held it, died"), resp.error.message
    assert _sum(_run(server, "single", 4, 3, START | END)) == 4
