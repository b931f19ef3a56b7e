"""A gRPC stream ends when its client stops sending right after its last request was answered.

The stream waited for its requests' tasks with ``while tasks: await asyncio.gather(...)``, and
the set empties in the tasks' done callbacks. On Python 3.12 and later, ``gather`` of tasks
that are already done returns without yielding to the event loop: a task whose callback had
not run yet kept the frontends' loop spinning for ever, every client with it. (It was found
when the suite ran on 3.12 and hung in a test's teardown.)

The hang needs one order of loop steps: the request's task ends in the step in which the
request stream ends. So the real service runs on a loop of its own, in a subprocess that is
killed if it does not end, fed by an async request iterator and a context that records the
writes: the gRPC transport is all that is stood in for. On Python 3.10 and 3.11 the
subprocess makes ``asyncio.gather`` behave as 3.12's does, so the test fails here too
without the fix.
"""
from __future__ import annotations

import subprocess
import sys

_SCENARIO = r'''
import asyncio
import sys

from tritonclient.grpc import service_pb2

from tritonpy import Server
from tritonpy._loop import run_loop
from tritonpy.frontends.dataplane import DataPlane
from tritonpy.frontends._grpc_service import GRPCService

if sys.version_info < (3, 12):
    _gather = asyncio.gather

    def gather(*aws, return_exceptions=False):
        """3.12's: awaitables that are all done give a future that is done already."""
        if aws and all(isinstance(a, asyncio.Future) and a.done() for a in aws):
            out = asyncio.get_running_loop().create_future()
            out.set_result([a.exception() or a.result() for a in aws])
            return out
        return _gather(*aws, return_exceptions=return_exceptions)

    asyncio.gather = gather


class Context:
    metadata = ()

    def __init__(self):
        self.written = []

    async def write(self, msg):
        self.written.append(msg)


async def requests():
    # A request that fails in its task's first step (no model name)...
    yield service_pb2.ModelInferRequest(model_name="", id="r1")
    # ...which runs in the next step of the loop, just before the stream ends in that step.
    await asyncio.sleep(0)


async def main():
    context = Context()
    await GRPCService(DataPlane(Server())).ModelStreamInfer(requests(), context)
    print("ENDED", [(m.infer_response.id, m.error_message) for m in context.written], flush=True)


run_loop(main())
'''


def test_stream_ends_when_its_last_task_ends_as_the_requests_do() -> None:
    proc = subprocess.Popen([sys.executable, "-c", _SCENARIO], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"the stream did not end (its loop spun): {out}{err[-2000:]}") from None
    assert proc.returncode == 0, err[-2000:]
    assert out.strip() == ("ENDED [('r1', \"the server is not started: call start() first "
                           "(or use 'with Server(...)')\")]")
