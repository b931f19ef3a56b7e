"""``tritonpy stress``: drive a real server into exhaustion on purpose and print what a user sees.

Each scenario starts a :class:`~tritonpy.Server` on the models of :mod:`._stress_models` (real
stubs, real shared memory), pushes it past one limit, and checks that the request at fault gets
a clear error, that nothing else is lost, that the server serves on, and that no segment or
process is left when it stops:

* ``shm-full``: a tiny ``/dev/shm`` (a private tmpfs of ``--shm-size`` bytes in a mount
  namespace of its own, Docker's 64 MiB by default; where none can be mounted, a pool cap
  instead). Inputs and outputs larger than it, ``/dev/shm`` filled by another process, a model
  loaded then, and the file-backed fallback.
* ``gpu-memory-full``: a model that allocates GPU memory until CUDA refuses (needs a GPU and
  CuPy, else skipped with the reason).
* ``message-queue-full``: floods on the channels between host and stub: thousands of requests
  at once, a stream of responses to a consumer that pauses, and a BLS stream into a stub that
  does not read for a second.
* ``stub-killed``: SIGKILL of a stub in the middle of ``execute`` (as the OOM killer does).
* ``stub-hung``: SIGSTOP of a stub in the middle of ``execute``, caught by
  ``stub-timeout-seconds``.

The table has one row per check; the exit status is 1 when a check failed.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from ._gpus import visible_gpu_count
from ._stress_models import write_repository
from .shm import list_segments, sweep_orphans

MiB = 1 << 20
OK, FAILED, SKIPPED = "ok", "FAILED", "skipped"
DOCKER_SHM = 64 * MiB
_SMALL = np.arange(4096, dtype=np.int64).astype(np.uint8)
#: Each server gets ``<PREFIX><this pid>x<n>_``: a segment name tells which run made it, so
#: :func:`run` can sweep what a run that was killed left (:func:`sweep_orphans` of PREFIX reads
#: the run's pid), and a server's leftovers are exactly the names of its own prefix.
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


def _short(text: str, limit: int = 150) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _mib(nbytes: int) -> str:
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


def _io(data: np.ndarray, out_bytes: int = -1) -> dict[str, np.ndarray]:
    return {"DATA": data, "OUT_BYTES": np.array([out_bytes], np.int64)}


def expect_error(scenario: str, check: str, answer: Answer, wanted: str,
                 after: Callable[[], str | None] | None = None) -> Row:
    """A row that passes when the answer is an error containing ``wanted`` (case aside) and
    ``after`` (the next request, say) returns None rather than what went wrong."""
    if answer.error is None:
        return Row(scenario, check, "served, where an error was expected", answer.seconds, FAILED)
    outcome = f"error: {_short(answer.error)}"
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
        return Row(scenario, check, f"error: {_short(answer.error or '')}", answer.seconds, FAILED)
    problem = valid(answer.outputs)
    if problem:
        return Row(scenario, check, problem, answer.seconds, FAILED)
    return Row(scenario, check, "served", answer.seconds, OK)


def small_request_problem(model: Any) -> str | None:
    """None when a 4 KiB identity request to ``stress_io`` comes back whole, else what failed."""
    answer = infer(model, _io(_SMALL))
    if answer.outputs is None:
        return f"a 4 KiB request failed: {_short(answer.error or '')}"
    if not np.array_equal(answer.outputs["OUT"], _SMALL):
        return "a 4 KiB request came back different"
    return None


# -- a server per scenario, and what it leaves ------------------------------------------------

def _segments(prefix: str, *dirs: str) -> list[str]:
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
    try:
        yield server
    finally:
        stubs = _stub_processes()
        t0 = time.monotonic()
        server.stop()
        took = time.monotonic() - t0
        _, alive = psutil.wait_procs(stubs, timeout=5)
        dirs = ["/dev/shm", config.get("shm-fallback-directory", "")]
        left = _segments(prefix, *dirs)
        if left or alive:
            rows.append(Row(scenario, "stop: nothing left behind",
                            f"{len(left)} segment(s) and {len(alive)} process(es) left: "
                            f"{_short(', '.join(left))}", took, FAILED))
        else:
            rows.append(Row(scenario, "stop: nothing left behind",
                            "stopped; no segment and no stub process left", took, OK))


def _stub_processes() -> list[psutil.Process]:
    """This process's stub children (not whatever else it runs, e.g. multiprocessing's)."""
    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "tritonpy.stub" in child.cmdline():
                out.append(child)
        except psutil.Error:
            continue
    return out


def _wait(cond: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


# -- shm full ---------------------------------------------------------------------------------

def _fill_dev_shm(path: Path, leave: int) -> int:
    """Reserve all of ``/dev/shm`` but ``leave`` bytes in one file (another tenant's); its size."""
    st = os.statvfs("/dev/shm")
    size = max(0, st.f_bavail * st.f_frsize - leave)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if size:
            os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)
    return size


def shm_full(ctx: Context) -> list[Row]:
    """Inputs and outputs past a tiny /dev/shm, a /dev/shm filled by others, the fallback."""
    name, size = "shm full", ctx.shm_size
    rows: list[Row] = []
    backend = {} if ctx.private_shm else {"shm-total-byte-cap": str(size)}
    big = np.zeros(2 * size, np.uint8)
    models = ["stress_io"] + ["stress_stream", "stress_bls_io"] * ctx.private_shm
    with serving(ctx, name, models, rows, backend) as server:
        model = server.model("stress_io")
        where = (f"/dev/shm of {_mib(size)}" if ctx.private_shm
                 else f"a host pool capped at {_mib(size)}")
        rows.append(expect_error(name, f"client input of {_mib(big.nbytes)}, {where}",
                                 infer(model, _io(big)), "shared memory exhausted",
                                 lambda: small_request_problem(model)))
        if not ctx.private_shm:
            why = f"needs a private /dev/shm ({ctx.no_private_shm})"
            for check in ("model output larger than /dev/shm", "/dev/shm filled by another process",
                          "a model loaded while /dev/shm is full", "BLS input larger than /dev/shm",
                          "a stream of big responses to a late consumer",
                          "the file-backed fallback"):
                rows.append(Row(name, check, why, None, SKIPPED))
            return rows
        rows.append(expect_error(name, f"model output of {_mib(big.nbytes)}",
                                 infer(model, _io(_SMALL, big.nbytes)), "shared memory exhausted",
                                 lambda: small_request_problem(model)))
        del big
        # Another process takes all but 1 MiB. The pools' segments are already reserved, so a
        # request that fits in them still goes; one that needs a new segment fails alone.
        filler = Path("/dev/shm") / f"tritonpy-stress-filler-{os.getpid()}"
        half = np.full(size // 2, 3, np.uint8)
        try:
            taken = _fill_dev_shm(filler, MiB)
            rows.append(expect_error(
                name, f"/dev/shm filled by another process ({_mib(taken)}): "
                      f"input of {_mib(half.nbytes)}",
                infer(model, _io(half)), "shared memory exhausted",
                lambda: small_request_problem(model)))
            rows.append(expect_error(name, f"the same: output of {_mib(half.nbytes)}",
                                     infer(model, _io(_SMALL, half.nbytes)),
                                     "shared memory exhausted"))
            rows.append(_load_while_full(ctx, server, name))
        finally:
            filler.unlink(missing_ok=True)
        rows.append(expect_served(
            name, f"the other process gone: input of {_mib(half.nbytes)}", infer(model, _io(half)),
            lambda out: None if np.array_equal(out["OUT"], half) else "came back different"))
        rows += _bls_and_stream(server, name, size)
    with tempfile.TemporaryDirectory(prefix="tritonpy-stress-") as spill:
        with serving(ctx, name, ["stress_io"], rows, {"shm-fallback-directory": spill}) as server:
            data = np.full(2 * size, 5, np.uint8)
            rows.append(expect_served(
                name, f"shm-fallback-directory (on disk): input of {_mib(data.nbytes)}",
                infer(server.model("stress_io"), _io(data)),
                lambda out: None if np.array_equal(out["OUT"], data) else "came back different"))
    return rows


def _bls_and_stream(server: Any, scenario: str, size: int) -> list[Row]:
    """A BLS input that /dev/shm cannot hold; a stream of big responses to a late consumer,
    and whether the stub gives the stream's segments back once they are idle."""
    bls = server.model("stress_bls_io")

    def small_bls_problem() -> str | None:
        answer = infer(bls, {"BYTES": np.array([4096], np.int64)})
        if answer.outputs is None:
            return f"a 4 KiB BLS call failed: {_short(answer.error or '')}"
        return None if int(answer.outputs["RETURNED"][0]) == 4096 else "a 4 KiB BLS call came back wrong"

    rows = [expect_error(scenario, f"BLS call with an input of {_mib(2 * size)}",
                         infer(bls, {"BYTES": np.array([2 * size], np.int64)}),
                         "shared memory exhausted", small_bls_problem)]
    count, each = 16, 8 * MiB
    check = f"stream of {count} responses of {_mib(each)} to a consumer 1 s late"
    got, problem, took = late_consumer(server, count, each)
    if got == count and not problem:
        rows.append(Row(scenario, check, f"all {count} came, in order", took, OK))
    else:
        ok = "shared memory exhausted" in problem
        rows.append(Row(scenario, check, f"{got} came, then: {_short(problem)}", took,
                        OK if ok else FAILED))
    # Every pool keeps its first segment; the others go back once idle (5 s), and /dev/shm
    # has the room again once every process that mapped them has let go.
    keep = server.options.shm_default_byte_size

    def extra() -> int:
        return sum(max(0, p.get("mapped_bytes", 0) - keep) for p in server.shm_usage())

    def free() -> int:
        st = os.statvfs("/dev/shm")
        return st.f_bavail * st.f_frsize

    before, free_before, t0 = extra(), free(), time.monotonic()
    back = _wait(lambda: extra() == 0, 30)
    rows.append(Row(scenario, "idle segments given back (every pool)",
                    f"{_mib(before)} mapped beyond the pools' first segments, then "
                    f"{_mib(extra())}; /dev/shm free {_mib(free_before)} -> {_mib(free())}",
                    time.monotonic() - t0, OK if back else FAILED))
    return rows


def _load_while_full(ctx: Context, server: Any, scenario: str) -> Row:
    """Load ``stress_slow`` while /dev/shm has no room: served, or refused with a clear error."""
    check = "a model loaded while /dev/shm is full"
    t0 = time.monotonic()
    try:
        server.load("stress_slow")
    except Exception as exc:
        text = str(exc)
        ok = "shared memory" in text.lower() or "/dev/shm" in text
        return Row(scenario, check, f"load refused: {_short(text)}", time.monotonic() - t0,
                   OK if ok else FAILED)
    answer = infer(server.model("stress_slow"), {"SLEEP_MS": np.array([0], np.int64)})
    if answer.outputs is None:
        ok = "shared memory" in (answer.error or "").lower()
        return Row(scenario, check, f"loaded; its request: error: {_short(answer.error or '')}",
                   time.monotonic() - t0, OK if ok else FAILED)
    return Row(scenario, check, "loaded and served (its tensors travel in the messages)",
               time.monotonic() - t0, OK)


# -- GPU memory full --------------------------------------------------------------------------

def gpu_memory_full(ctx: Context) -> list[Row]:
    """A model that allocates until CUDA refuses: that request fails, the memory comes back."""
    name = "GPU memory full"
    if visible_gpu_count() == 0:
        return [Row(name, "CuPy allocations until CUDA runs out",
                    "no GPU: nvidia-smi -L lists none (TRITONPY_GPU_COUNT unset)", None, SKIPPED)]
    if find_spec("cupy") is None:
        return [Row(name, "CuPy allocations until CUDA runs out",
                    "CuPy is not installed (pip install 'tritonpy[gpu]')", None, SKIPPED)]
    rows: list[Row] = []
    block = 256
    with serving(ctx, name, ["stress_gpu"], rows) as server:
        model = server.model("stress_gpu")
        ask = {"MODE": np.array([0], np.int64), "BLOCK_MB": np.array([block], np.int64)}
        rows.append(expect_error(name, f"execute allocates {block} MiB blocks until CUDA refuses",
                                 infer(model, ask), "out of memory"))
        probe = {"MODE": np.array([1], np.int64), "BLOCK_MB": np.array([0], np.int64)}

        def given_back(out: dict[str, np.ndarray]) -> str | None:
            used = int(out["USED_BYTES"][0])
            if used:
                return f"{used} bytes of the failed request's arrays are still held"
            if out["SQUARES"].tolist() != [0, 1, 4, 9]:
                return f"the GPU computed {out['SQUARES'].tolist()}"
            return None

        rows.append(expect_served(name, "the next request: memory given back, GPU computes",
                                  infer(model, probe), given_back))
    return rows


# -- message queue full -----------------------------------------------------------------------

def message_queue_full(ctx: Context) -> list[Row]:
    """Floods on the host <-> stub channels: every message arrives, in order, none is lost."""
    name = "message queue full"
    rows: list[Row] = []
    requests = 500 if ctx.quick else 5_000
    responses = 20_000 if ctx.quick else 100_000
    bls = 5_000 if ctx.quick else 20_000
    fanout = 1_000 if ctx.quick else 10_000
    models = ["stress_io", "stress_stream", "stress_bls_reader", "stress_fanout"]
    with serving(ctx, name, models, rows) as server:
        io = server.model("stress_io")
        t0 = time.monotonic()
        datas = [np.full(64, i % 251, np.uint8) for i in range(requests)]
        streams = [io.infer(_io(d)) for d in datas]
        good, first_error = 0, ""
        for data, stream in zip(datas, streams):
            try:
                resp = stream.get(timeout=120)
            except queue.Empty:
                first_error = first_error or "no answer in 120 s"
                continue
            if resp.error is None and np.array_equal(resp.outputs["OUT"].to_numpy(), data):
                good += 1
            elif not first_error:
                first_error = resp.error.message if resp.error else "an answer came back different"
        took = time.monotonic() - t0
        outcome = f"{good:,}/{requests:,} answered right ({good / took:,.0f}/s)"
        rows.append(Row(name, f"{requests:,} requests at once to one instance",
                        outcome + (f"; first error: {_short(first_error)}" if first_error else ""),
                        took, OK if good == requests else FAILED))
        got, problem, took = late_consumer(server, responses, 16)
        check = f"stream of {responses:,} responses to a consumer 1 s late"
        if problem or got != responses:
            rows.append(Row(name, check, f"{got:,} of {responses:,} came"
                            + (f", then: {_short(problem)}" if problem else ""), took, FAILED))
        else:
            rows.append(Row(name, check, f"all {responses:,} came, in order", took, OK))
        reader = server.model("stress_bls_reader")
        answer = infer(reader, {"COUNT": np.array([bls], np.int64),
                                "PAUSE_MS": np.array([1000], np.int64)}, timeout=300)

        def whole(out: dict[str, np.ndarray]) -> str | None:
            got, bad = int(out["RECEIVED"][0]), int(out["FIRST_OUT_OF_ORDER"][0])
            if got != bls:
                return f"{got:,} of {bls:,} responses came"
            return f"response {bad} came out of order" if bad >= 0 else None

        row = expect_served(name, f"BLS stream of {bls:,} into a stub not reading for 1 s",
                            answer, whole)
        if row.verdict == OK:
            row.outcome = f"all {bls:,} came, in order"
        rows.append(row)
        answer = infer(server.model("stress_fanout"), {"CALLS": np.array([fanout], np.int64)},
                       timeout=300)
        row = expect_served(
            name, f"an async model awaits {fanout:,} BLS calls at once", answer,
            lambda out: None if int(out["ANSWERED"][0]) == fanout else
            f"{int(out['ANSWERED'][0]):,} of {fanout:,} answered")
        if row.verdict == OK:
            row.outcome = f"all {fanout:,} answered right ({fanout / answer.seconds:,.0f}/s)"
        rows.append(row)
    return rows


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


# -- a stub killed or hung mid-request --------------------------------------------------------

def _mid_request(ctx: Context, name: str, sig: signal.Signals, wanted: str,
                 backend: dict[str, str] | None = None) -> list[Row]:
    """``sig`` to the stub while it executes one request with three more queued behind it."""
    rows: list[Row] = []
    with serving(ctx, name, ["stress_slow"], rows, backend) as server:
        model = server.model("stress_slow")
        inst = server.runtime("stress_slow").instances[0]
        pid = inst.stub.pid
        executing = model.infer({"SLEEP_MS": np.array([60_000], np.int64)})
        if not _wait(lambda: inst.running >= 1, 30):
            rows.append(Row(name, "set-up", "the slow request never started", None, FAILED))
            executing.cancel()
            return rows
        queued = [model.infer({"SLEEP_MS": np.array([0], np.int64)}) for _ in range(3)]
        t0 = time.monotonic()
        os.kill(pid, sig)
        try:
            resp = executing.get(timeout=60)
            answer = Answer(None, resp.error.message, time.monotonic() - t0) if resp.error else \
                Answer({}, None, time.monotonic() - t0)
        except queue.Empty:
            answer = Answer(None, "no answer in 60 s", time.monotonic() - t0)
        rows.append(expect_error(name, f"{sig.name} to the stub in execute: that request",
                                 answer, wanted))
        pids, errors = set(), []
        for stream in queued:
            try:
                resp = stream.get(timeout=60)
            except queue.Empty:
                errors.append("no answer in 60 s")
                continue
            if resp.error is not None:
                errors.append(resp.error.message)
            else:
                pids.add(int(resp.outputs["PID"].to_numpy()[0]))
        took = time.monotonic() - t0
        if errors:
            rows.append(Row(name, "the 3 requests queued behind it",
                            f"{len(errors)} failed: {_short(errors[0])}", took, FAILED))
        elif pid in pids:
            rows.append(Row(name, "the 3 requests queued behind it",
                            "served by the old stub", took, FAILED))
        else:
            rows.append(Row(name, "the 3 requests queued behind it",
                            f"served by the restarted stub (pid {pids.pop()}), "
                            f"counted from the signal", took, OK))
    return rows


def _mid_stream(ctx: Context, name: str) -> list[Row]:
    """SIGKILL to a decoupled stub whose first responses wait, unread, in its segments."""
    rows: list[Row] = []
    sent, each = 5, MiB
    with serving(ctx, name, ["stress_stream"], rows) as server:
        pid = server.runtime("stress_stream").instances[0].stub.pid
        stream = server.model("stress_stream").infer(
            {"COUNT": np.array([2 * sent], np.int64), "BYTES": np.array([each], np.int64),
             "STALL_AFTER": np.array([sent], np.int64)})
        time.sleep(1.0)  # the first responses reach the host; the model sleeps before the next
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        whole, problem = 0, ""
        try:
            while True:
                resp = stream.get(timeout=60)
                if resp.error is not None:
                    if "SIGKILL" not in resp.error.message:
                        problem = f"error: {_short(resp.error.message)}"
                    break
                out = resp.outputs["OUT"].to_numpy()
                if out.nbytes != each or not (out == whole % 251).all():
                    problem = f"response {whole} came damaged"
                    break
                whole += 1
                del resp, out
        except queue.Empty:
            problem = "no error for 60 s"
        check = f"SIGKILL mid-stream, {sent} responses of {_mib(each)} unread"
        if problem or whole != sent:
            rows.append(Row(name, check, problem or f"{whole} of {sent} came", None, FAILED))
        else:
            rows.append(Row(name, check, f"the {sent} came whole, then the error naming SIGKILL",
                            time.monotonic() - t0, OK))
        del stream
        # Its segments outlive it while the host maps them; they go once the responses have.
        dead = f"{server.options.shm_region_prefix_name}{pid}x"
        gone = _wait(lambda: not list_segments(dead, server.options.shm_fallback_directory or None), 10)
        rows.append(Row(name, "the dead stub's segments, once its responses are read",
                        "gone" if gone else f"left: {', '.join(list_segments(dead))}",
                        time.monotonic() - t0, OK if gone else FAILED))
    return rows


def stub_killed(ctx: Context) -> list[Row]:
    """SIGKILL mid-execute (what the kernel's OOM killer sends), and mid-stream."""
    return (_mid_request(ctx, "stub killed", signal.SIGKILL, "SIGKILL")
            + _mid_stream(ctx, "stub killed"))


def stub_hung(ctx: Context) -> list[Row]:
    """SIGSTOP mid-execute: the stub stops answering; stub-timeout-seconds ends it."""
    timeout = 1 if ctx.quick else 2
    return _mid_request(ctx, "stub hung", signal.SIGSTOP, "stub-timeout-seconds",
                        {"stub-timeout-seconds": str(timeout)})


SCENARIOS: dict[str, Callable[[Context], list[Row]]] = {
    "shm-full": shm_full,
    "gpu-memory-full": gpu_memory_full,
    "message-queue-full": message_queue_full,
    "stub-killed": stub_killed,
    "stub-hung": stub_hung,
}


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
        return f"cannot mount one here: {_short(probe.stderr.strip()) or probe.returncode}"
    return None


def _in_private_shm(ctx: Context) -> list[Row]:
    """Run ``shm-full`` again in a child whose /dev/shm is a fresh tmpfs of ``shm_size``."""
    script = (f"mount -t tmpfs -o size={ctx.shm_size} tmpfs /dev/shm && "
              'exec "$0" -m tritonpy stress --scenario shm-full --json --inside-private-shm '
              f"--shm-size {ctx.shm_size}" + (" --quick" if ctx.quick else ""))
    t0 = time.monotonic()
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script, sys.executable],
                          capture_output=True, text=True, timeout=600, check=False)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode in (0, 1) and lines:
        try:
            return [Row(**r) for r in json.loads(lines[-1])]
        except (ValueError, TypeError):
            pass
    how = (f"killed by {signal.Signals(-proc.returncode).name}" if proc.returncode < 0
           else f"exit status {proc.returncode}")
    tail = _short(" | ".join(proc.stderr.strip().splitlines()[-3:]), 300)
    return [Row("shm full", "the run in a private /dev/shm", f"{how}: {tail}",
                time.monotonic() - t0, FAILED)]


def run(names: Sequence[str], ctx: Context, inside_private_shm: bool = False) -> list[Row]:
    """The rows of the named scenarios, in order."""
    if not inside_private_shm:
        sweep_orphans(PREFIX)  # what an earlier run that was killed left
    rows: list[Row] = []
    for name in names:
        if name == "shm-full" and not inside_private_shm:
            reason = private_shm_unavailable(ctx.shm_size)
            if reason is None:
                rows += _in_private_shm(ctx)
                continue
            ctx.no_private_shm = reason
        try:
            rows += SCENARIOS[name](ctx)
        except Exception as exc:  # the tool reports, it does not die half-way
            rows.append(Row(name.replace("-", " "), "the scenario itself", f"{type(exc).__name__}: {_short(str(exc))}",
                            None, FAILED))
    return rows


def format_table(rows: Sequence[Row]) -> str:
    """The rows as an aligned text table, with a last line counting the verdicts."""
    head = ("scenario", "check", "seconds", "verdict", "outcome")
    body = [(r.scenario, r.check, "" if r.seconds is None else f"{r.seconds:.2f}", r.verdict,
             r.outcome) for r in rows]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(4)]
    lines = ["  ".join([*(c.ljust(w) for c, w in zip(line[:4], widths)), line[4]]).rstrip()
             for line in [head, *body]]
    lines.insert(1, "  ".join(["-" * w for w in widths] + ["-" * 7]))
    counts = {v: sum(r.verdict == v for r in rows) for v in (OK, FAILED, SKIPPED)}
    lines.append(f"\n{counts[OK]} ok, {counts[FAILED]} failed, {counts[SKIPPED]} skipped")
    return "\n".join(lines)


def add_parser(sub: Any) -> None:
    """The ``stress`` subcommand's flags."""
    s = sub.add_parser("stress", help="push a server into exhaustion and print what a user sees",
                       description="Push real servers past their limits on purpose (shared "
                       "memory full, GPU memory full, message floods, a stub killed or hung "
                       "mid-request) and print a table of what a user sees: one row per check, "
                       "exit status 1 when one failed.")
    s.add_argument("--scenario", action="append", choices=list(SCENARIOS), default=[],
                   help="run this scenario (repeatable); default: all")
    s.add_argument("--shm-size", type=int, default=DOCKER_SHM, metavar="BYTES",
                   help="size of the private /dev/shm of 'shm-full' (default: Docker's 64 MiB)")
    s.add_argument("--quick", action="store_true", help="smaller floods, shorter timeouts")
    s.add_argument("--json", action="store_true", help="print the rows as one JSON list")
    s.add_argument("--inside-private-shm", action="store_true", help=argparse.SUPPRESS)


def main(args: argparse.Namespace) -> int:
    """Run the scenarios and print the table; 1 when a check failed."""
    if args.shm_size < DOCKER_SHM:
        print(f"error: --shm-size must be at least {DOCKER_SHM} bytes (64 MiB): the pools' "
              f"first segments take 16 MiB each", file=sys.stderr)
        return 2
    names = args.scenario or list(SCENARIOS)
    with tempfile.TemporaryDirectory(prefix="tritonpy-stress-") as tmp:
        ctx = Context(write_repository(Path(tmp) / "models"), args.shm_size, args.quick,
                      private_shm=args.inside_private_shm)
        rows = run(names, ctx, inside_private_shm=args.inside_private_shm)
    print(json.dumps([asdict(r) for r in rows]) if args.json else format_table(rows), flush=True)
    return 1 if any(r.verdict == FAILED for r in rows) else 0
