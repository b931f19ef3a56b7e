"""The event loop an ``async def execute`` runs on: uvloop's where it is installed (a stub in the
server's own environment), asyncio's own where it is not (e.g. a model's EXECUTION_ENV_PATH
interpreter without uvloop). Both run a coroutine to completion. A model that blocks it is
told where (a real stub)."""
from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

import pytest

from _models import fp32, infer, serving, wait_until, write_model
from tritonpy.stub._execute import _new_event_loop


def _run(loop: asyncio.AbstractEventLoop) -> int:
    async def twice(x: int) -> int:
        await asyncio.sleep(0)
        return 2 * x

    try:
        return loop.run_until_complete(twice(21))
    finally:
        loop.close()


def test_uvloop_where_installed() -> None:
    import uvloop  # a dependency of tritonpy on Linux

    loop = _new_event_loop()
    assert isinstance(loop, uvloop.Loop)
    assert _run(loop) == 42


def test_asyncio_loop_without_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop raises ImportError
    loop = _new_event_loop()
    assert type(loop).__module__.startswith("asyncio")
    assert _run(loop) == 42


# Two requests on one instance: the first blocks the loop of ``async def execute`` with a
# time.sleep instead of awaiting (a common mistake), so the second waits behind it.
BLOCKING_ASYNC_PY = """
import asyncio
import time
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    async def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            if x[0] > 0:
                time.sleep(float(x[0]))
            else:
                await asyncio.sleep(0)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x * 2)]))
        return out
"""


def test_a_blocked_async_execute_loop_is_logged_with_the_models_line(
        tmp_path: Path, shm_prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    write_model(tmp_path, "blocking", BLOCKING_ASYNC_PY)
    caplog.set_level(logging.WARNING, logger="tritonpy.model.blocking")
    with serving(tmp_path, shm_prefix, backend_config={"loop-stall-seconds": "1"}) as server:
        model = server.model("blocking")
        assert infer(model, {"IN": fp32(0)}).error is None  # the loop started, and ran
        slow = model.infer({"IN": fp32(3.5)})
        answer = next(iter(slow))
        assert answer.error is None and answer.outputs["OUT"].to_numpy().tolist() == [7.0]
        wait_until(lambda: any("runs again" in r.getMessage() for r in caplog.records), 10,
                   "the end of the stall to be logged")
    texts = [r.getMessage() for r in caplog.records]
    stalled = [t for t in texts if "has run nothing for" in t]
    assert len(stalled) == 1, texts
    # Where it is stuck: the model's own line, and what to do about it.
    assert "time.sleep(float(x[0]))" in stalled[0] and "asyncio.to_thread" in stalled[0]
    assert stalled[0].startswith("[blocking_0] the event loop of async def execute")
