"""The event loop an ``async def execute`` runs on: uvloop's where it is installed (a stub in the
server's own environment), asyncio's own where it is not (e.g. a model's EXECUTION_ENV_PATH
interpreter without uvloop). Both run a coroutine to completion."""
from __future__ import annotations

import asyncio
import sys

import pytest

from tritonpy.stub._runtime import _new_event_loop


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
