"""What ``tritonpy stress`` checks with: rows, one request and its answer, a server per
scenario that reports what it leaves behind (and is aborted, not drained, when the run is
interrupted), and the run of a scenario in a private ``/dev/shm``. The scenarios are in
:mod:`tritonpy.stress`."""
from __future__ import annotations

import itertools
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from .shm import janitor, list_segments

MiB = 1 << 20
OK, FAILED, SKIPPED = "ok", "FAILED", "skipped"
DOCKER_SHM = 64 * MiB
SMALL = np.arange(4096, dtype=np.int64).astype(np.uint8)
#: Each server gets ``<PREFIX><this pid>x<n>_``: a segment name tells which run made it, so
#: :func:`.stress.run` can sweep what a run that was killed left
#: (:func:`~tritonpy.shm.sweep_orphans` of PREFIX reads the run's pid), and a server's
#: leftovers are exactly the names of its own prefix.
PREFIX = "tritonpy_stress"
_servers = itertools.count()


@dataclass
class Row:
    """One check: what was done, what came back, how long it took, and the verdict."""

    scenario: str
    check: str
    outcome: str
    seconds: float | None = None
    verdict: str = OK


@dataclass
class Context:
    """What every scenario needs: the model repository and the run's settings."""

    repository: Path
    shm_size: int = DOCKER_SHM
    quick: bool = False
    private_shm: bool = False  # /dev/shm is a tmpfs of shm_size in our own mount namespace
    no_private_shm: str = ""  # why not, when it is not


def short(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


def mib(nbytes: int) -> str:
    return f"{nbytes / MiB:g} MiB"


# -- one request, and what came of it ---------------------------------------------------------

@dataclass
class Answer:
    """A request's single response: outputs, or the error's message; and how long it took."""

    outputs: dict[str, np.ndarray] | None
    error: str | None
    seconds: float


def infer(model: Any, inputs: dict[str, Any], timeout: float = 120.0) -> Answer:
    """Send one request through the in-process API and wait for its (only) response."""
    t0 = time.monotonic()
    try:
        resp = model.infer(inputs).get(timeout=timeout)
    except queue.Empty:
        return Answer(None, f"no answer in {timeout:g} s", time.monotonic() - t0)
    except Exception as exc:  # refused before it was queued: that is an answer too
        return Answer(None, f"{type(exc).__name__}: {exc}", time.monotonic() - t0)
    took = time.monotonic() - t0
    if resp.error is not None:
        return Answer(None, resp.error.message, took)
    return Answer({k: v.to_numpy() for k, v in resp.outputs.items()}, None, took)


def io_inputs(data: np.ndarray, out_bytes: int = -1) -> dict[str, np.ndarray]:
    return {"DATA": data, "OUT_BYTES": np.array([out_bytes], np.int64)}


def expect_error(scenario: str, check: str, answer: Answer, wanted: str,
                 after: Callable[[], str | None] | None = None) -> Row:
    """A row that passes when the answer is an error containing ``wanted`` (case aside) and
    ``after`` (the next request, say) returns None rather than what went wrong."""
    if answer.error is None:
        return Row(scenario, check, "served, where an error was expected", answer.seconds, FAILED)
    outcome = f"error: {short(answer.error)}"
    verdict = OK if wanted.lower() in answer.error.lower() else FAILED
    problem = after() if after is not None else None
    if problem:
        outcome += f"; then {problem}"
        verdict = FAILED
    elif after is not None:
        outcome += "; the next request is served"
    return Row(scenario, check, outcome, answer.seconds, verdict)


def expect_served(scenario: str, check: str, answer: Answer,
                  valid: Callable[[dict[str, np.ndarray]], str | None]) -> Row:
    """A row that passes when the answer has outputs that ``valid`` finds right (None)."""
    if answer.outputs is None:
        return Row(scenario, check, f"error: {short(answer.error or '')}", answer.seconds, FAILED)
    problem = valid(answer.outputs)
    if problem:
        return Row(scenario, check, problem, answer.seconds, FAILED)
    return Row(scenario, check, "served", answer.seconds, OK)


def small_request_problem(model: Any) -> str | None:
    """None when a 4 KiB identity request to ``stress_io`` comes back whole, else what failed."""
    answer = infer(model, io_inputs(SMALL))
    if answer.outputs is None:
        return f"a 4 KiB request failed: {short(answer.error or '')}"
    if not np.array_equal(answer.outputs["OUT"], SMALL):
        return "a 4 KiB request came back different"
    return None


# -- a server per scenario, and what it leaves ------------------------------------------------

def segments_of(prefix: str, *dirs: str) -> list[str]:
    return [entry for d in filter(None, dirs) for entry in list_segments(prefix, d)]


@contextmanager
def serving(ctx: Context, scenario: str, models: Sequence[str], rows: list[Row],
            backend: dict[str, str] | None = None) -> Iterator[Any]:
    """A started server with ``models`` loaded; on the way out it is stopped and a row says
    whether any of its segments or stub processes is left."""
    from .server import Server

    prefix = f"{PREFIX}{os.getpid()}x{next(_servers):x}_"
    config = {"shm-region-prefix-name": prefix, **(backend or {})}
    server = Server(str(ctx.repository), model_control_mode="explicit", load_models=list(models),
                    backend_config=config)
    server.start()
    stubs: list[psutil.Process] = []
    interrupted = False
    try:
        yield server
    except KeyboardInterrupt:  # (Ctrl-C or SIGTERM: see stress.main)
        interrupted = True
        raise
    finally:
        stubs = stub_processes()
        t0 = time.monotonic()
        if interrupted:  # no drain: what runs may wait for a consumer that is gone
            server.abort()
        server.stop()
        took = time.monotonic() - t0
        _, alive = psutil.wait_procs(stubs, timeout=5)
        dirs = ["/dev/shm", config.get("shm-fallback-directory", "")]
        left = segments_of(prefix, *dirs)
        if left or alive:
            rows.append(Row(scenario, "stop: nothing left behind",
                            f"{len(left)} segment(s) and {len(alive)} process(es) left: "
                            f"{short(', '.join(left))}", took, FAILED))
        else:
            rows.append(Row(scenario, "stop: nothing left behind",
                            "stopped; no segment and no stub process left", took, OK))


def stub_processes() -> list[psutil.Process]:
    """This process's live stubs (not whatever else it runs, e.g. multiprocessing's)."""
    return janitor.stubs_of(os.getpid())


def wait_until(cond: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def late_consumer(server: Any, count: int, nbytes: int) -> tuple[int, str, float]:
    """A ``stress_stream`` of ``count`` responses of ``nbytes`` whose consumer starts 1 s late:
    how many came in order, what went wrong ("" if nothing), and how long it all took."""
    t0 = time.monotonic()
    stream = server.model("stress_stream").infer(
        {"COUNT": np.array([count], np.int64), "BYTES": np.array([nbytes], np.int64)})
    time.sleep(1.0)
    got, problem = 0, ""
    try:
        while True:
            resp = stream.get(timeout=120)
            if resp.error is not None:
                problem = resp.error.message
                break
            if "INDEX" in resp.outputs:
                if int(resp.outputs["INDEX"].to_numpy()[0]) != got:
                    problem = f"response {got} came out of order"
                    break
                got += 1
            if resp.final:
                break
    except queue.Empty:
        problem = "no response for 120 s"
    return got, problem, time.monotonic() - t0


# -- running, in a private /dev/shm where one can be had --------------------------------------

def private_shm_unavailable(size: int) -> str | None:
    """None when this process may mount a tmpfs of ``size`` on /dev/shm in a new mount
    namespace (root, ``unshare``), else why not."""
    if shutil.which("unshare") is None:
        return "unshare(1) is not installed"
    probe = subprocess.run(["unshare", "-m", "sh", "-c",
                            f"mount -t tmpfs -o size={size} tmpfs /dev/shm"],
                           capture_output=True, text=True, timeout=30, check=False)
    if probe.returncode != 0:
        return f"cannot mount one here: {short(probe.stderr.strip()) or probe.returncode}"
    return None


def in_private_shm(ctx: Context) -> list[Row]:
    """Run ``shm-full`` again in a child whose /dev/shm is a fresh tmpfs of ``shm_size``."""
    script = (f"mount -t tmpfs -o size={ctx.shm_size} tmpfs /dev/shm && "
              'exec "$0" -m tritonpy stress --scenario shm-full --json --inside-private-shm '
              f"--shm-size {ctx.shm_size}" + (" --quick" if ctx.quick else ""))
    t0 = time.monotonic()
    child = subprocess.Popen(["unshare", "-m", "sh", "-c", script, sys.executable],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = child.communicate(timeout=600)
    except BaseException:  # interrupted (or 600 s): it stops its servers and removes its files
        child.terminate()
        try:
            child.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.communicate()
        raise
    proc = subprocess.CompletedProcess(child.args, child.returncode, out, err)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode in (0, 1) and lines:
        try:
            return [Row(**r) for r in json.loads(lines[-1])]
        except (ValueError, TypeError):
            pass
    how = (f"killed by {signal.Signals(-proc.returncode).name}" if proc.returncode < 0
           else f"exit status {proc.returncode}")
    tail = short(" | ".join(proc.stderr.strip().splitlines()[-3:]), 300)
    return [Row("shm full", "the run in a private /dev/shm", f"{how}: {tail}",
                time.monotonic() - t0, FAILED)]
