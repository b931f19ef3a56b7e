"""``tritonpy stress``: drive a real server into exhaustion on purpose and print what a user sees.

Each scenario starts a :class:`~tritonpy.Server` on the models of :mod:`._stress_models` (real
stubs, real shared memory), pushes it past one limit, and checks that the request at fault gets
a clear error, that nothing else is lost, that the server serves on, and that no segment or
process is left when it stops:

* ``shm-full``: a tiny ``/dev/shm`` (a private tmpfs of ``--shm-size`` bytes in a mount
  namespace of its own, Docker's 64 MiB by default; where none can be mounted, a pool cap
  instead). Inputs, outputs and a BLS input larger than it, ``/dev/shm`` filled by another
  process, a model loaded then, a stream of big responses to a late consumer, the pools giving
  idle segments back, and the file-backed fallback.
* ``gpu-memory-full``: a model that allocates GPU memory until CUDA refuses (needs a GPU and
  CuPy, else skipped with the reason); the next request must find the memory given back.
* ``message-queue-full``: floods on the channels between host and stub: thousands of requests
  at once, a stream of responses to a consumer that pauses, a BLS stream into a stub that does
  not read for a second, and an async model that awaits thousands of BLS calls at once.
* ``stub-killed``: SIGKILL of a stub in the middle of ``execute`` (as the OOM killer does), and
  of a decoupled stub whose responses wait unread in its segments.
* ``stub-hung``: SIGSTOP of a stub in the middle of ``execute``, caught by
  ``stub-timeout-seconds``.
* ``host-killed``: SIGKILL of the server process itself, its host and stubs holding segments:
  the stubs die with it and its janitor removes the segments.

The table has one row per check; the exit status is 1 when a check failed.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import numpy as np

from ._gpus import visible_gpu_count
from ._stress_checks import (
    DOCKER_SHM, FAILED, OK, PREFIX, SKIPPED, SMALL, Answer, Context, MiB, Row, expect_error,
    expect_served, in_private_shm, infer, io_inputs, late_consumer, mib,
    private_shm_unavailable, serving, short, small_request_problem, stub_processes, wait_until,
)
from ._stress_models import write_repository
from .shm import janitor, list_segments, sweep_orphans
from .shm.sweep import owner_pid
from .shm.segment import free_bytes

# -- shm full ---------------------------------------------------------------------------------

def _fill_dev_shm(path: Path, leave: int) -> int:
    """Reserve all of ``/dev/shm`` but ``leave`` bytes in one file (another tenant's); its size."""
    size = max(0, free_bytes(None) - leave)
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
        where = (f"/dev/shm of {mib(size)}" if ctx.private_shm
                 else f"a host pool capped at {mib(size)}")
        rows.append(expect_error(name, f"client input of {mib(big.nbytes)}, {where}",
                                 infer(model, io_inputs(big)), "shared memory exhausted",
                                 lambda: small_request_problem(model)))
        if not ctx.private_shm:
            why = f"needs a private /dev/shm ({ctx.no_private_shm})"
            for check in ("model output larger than /dev/shm", "/dev/shm filled by another process",
                          "a model loaded while /dev/shm is full", "BLS input larger than /dev/shm",
                          "a stream of big responses to a late consumer",
                          "the file-backed fallback", "a server started while /dev/shm is full"):
                rows.append(Row(name, check, why, None, SKIPPED))
            return rows
        rows.append(expect_error(name, f"model output of {mib(big.nbytes)}",
                                 infer(model, io_inputs(SMALL, big.nbytes)),
                                 "shared memory exhausted", lambda: small_request_problem(model)))
        del big
        # Another process takes all but 1 MiB. The pools' segments are already reserved, so a
        # request that fits in them still goes; one that needs a new segment fails alone.
        filler = Path("/dev/shm") / f"tritonpy-stress-filler-{os.getpid()}"
        half = np.full(size // 2, 3, np.uint8)
        try:
            taken = _fill_dev_shm(filler, MiB)
            rows.append(expect_error(
                name, f"/dev/shm filled by another process ({mib(taken)}): "
                      f"input of {mib(half.nbytes)}",
                infer(model, io_inputs(half)), "shared memory exhausted",
                lambda: small_request_problem(model)))
            rows.append(expect_error(name, f"the same: output of {mib(half.nbytes)}",
                                     infer(model, io_inputs(SMALL, half.nbytes)),
                                     "shared memory exhausted"))
            rows.append(_load_while_full(ctx, server, name))
        finally:
            filler.unlink(missing_ok=True)
        rows.append(expect_served(
            name, f"the other process gone: input of {mib(half.nbytes)}",
            infer(model, io_inputs(half)),
            lambda out: None if np.array_equal(out["OUT"], half) else "came back different"))
        rows += _bls_and_stream(server, name, size)
    with tempfile.TemporaryDirectory(prefix="tritonpy-stress-") as spill:
        with serving(ctx, name, ["stress_io"], rows, {"shm-fallback-directory": spill}) as server:
            data = np.full(2 * size, 5, np.uint8)
            rows.append(expect_served(
                name, f"shm-fallback-directory (on disk): input of {mib(data.nbytes)}",
                infer(server.model("stress_io"), io_inputs(data)),
                lambda out: None if np.array_equal(out["OUT"], data) else "came back different"))
    rows.append(_start_while_full(name))
    return rows


def _start_while_full(scenario: str) -> Row:
    """A server started while another process holds all of /dev/shm: refused at once, with a
    clear error, leaving nothing behind."""
    from .server import Server

    check = "a server started while /dev/shm is full"
    filler = Path("/dev/shm") / f"tritonpy-stress-filler-{os.getpid()}"
    prefix = f"{PREFIX}{os.getpid()}xf_"
    t0 = time.monotonic()
    try:
        _fill_dev_shm(filler, 0)
        server = Server(None, backend_config={"shm-region-prefix-name": prefix})
        try:
            server.start()
        except Exception as exc:
            outcome, ok = f"refused: {short(str(exc))}", "shared memory exhausted" in str(exc)
        else:
            server.stop()
            outcome, ok = "started, where a refusal was expected", False
    finally:
        filler.unlink(missing_ok=True)
    took = time.monotonic() - t0
    left = list_segments(prefix) + [p.name() for p in stub_processes()]
    if left:
        return Row(scenario, check, f"{outcome}; left behind: {short(', '.join(left))}", took,
                   FAILED)
    return Row(scenario, check, outcome, took, OK if ok else FAILED)


def _bls_and_stream(server: Any, scenario: str, size: int) -> list[Row]:
    """A BLS input that /dev/shm cannot hold; a stream of big responses to a late consumer,
    and whether the stub gives the stream's segments back once they are idle."""
    bls = server.model("stress_bls_io")

    def small_bls_problem() -> str | None:
        answer = infer(bls, {"BYTES": np.array([4096], np.int64)})
        if answer.outputs is None:
            return f"a 4 KiB BLS call failed: {short(answer.error or '')}"
        if int(answer.outputs["RETURNED"][0]) != 4096:
            return "a 4 KiB BLS call came back wrong"
        return None

    rows = [expect_error(scenario, f"BLS call with an input of {mib(2 * size)}",
                         infer(bls, {"BYTES": np.array([2 * size], np.int64)}),
                         "shared memory exhausted", small_bls_problem)]
    count, each = 16, 8 * MiB
    check = f"stream of {count} responses of {mib(each)} to a consumer 1 s late"
    got, problem, took = late_consumer(server, count, each)
    if got == count and not problem:
        rows.append(Row(scenario, check, f"all {count} came, in order", took, OK))
    else:
        ok = "shared memory exhausted" in problem
        rows.append(Row(scenario, check, f"{got} came, then: {short(problem)}", took,
                        OK if ok else FAILED))
    # Every pool keeps its first segment; the others go back once idle (5 s), and /dev/shm
    # has the room again once every process that mapped them has let go.
    keep = server.options.shm_default_byte_size

    def extra() -> int:
        return sum(max(0, p.get("mapped_bytes", 0) - keep) for p in server.shm_usage())

    before, free_before, t0 = extra(), free_bytes(None), time.monotonic()
    back = wait_until(lambda: extra() == 0, 30)
    rows.append(Row(scenario, "idle segments given back (every pool)",
                    f"{mib(before)} mapped beyond the pools' first segments, then "
                    f"{mib(extra())}; /dev/shm free {mib(free_before)} -> {mib(free_bytes(None))}",
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
        return Row(scenario, check, f"load refused: {short(text)}", time.monotonic() - t0,
                   OK if ok else FAILED)
    answer = infer(server.model("stress_slow"), {"SLEEP_MS": np.array([0], np.int64)})
    if answer.outputs is None:
        ok = "shared memory" in (answer.error or "").lower()
        return Row(scenario, check, f"loaded; its request: error: {short(answer.error or '')}",
                   time.monotonic() - t0, OK if ok else FAILED)
    return Row(scenario, check, "loaded and served (its tensors travel in the messages)",
               time.monotonic() - t0, OK)


# -- GPU memory full --------------------------------------------------------------------------

def gpu_memory_full(ctx: Context) -> list[Row]:
    """A model that allocates until CUDA refuses: that request fails, the memory comes back."""
    name = "GPU memory full"
    if visible_gpu_count() == 0:
        forced = os.environ.get("TRITONPY_GPU_COUNT")
        why = (f"TRITONPY_GPU_COUNT={forced}" if forced is not None
               else "nvidia-smi -L lists none (TRITONPY_GPU_COUNT unset)")
        return [Row(name, "CuPy allocations until CUDA runs out", f"no GPU: {why}", None, SKIPPED)]
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
        streams = [io.infer(io_inputs(d)) for d in datas]
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
                        outcome + (f"; first error: {short(first_error)}" if first_error else ""),
                        took, OK if good == requests else FAILED))
        got, problem, took = late_consumer(server, responses, 16)
        check = f"stream of {responses:,} responses to a consumer 1 s late"
        if problem or got != responses:
            rows.append(Row(name, check, f"{got:,} of {responses:,} came"
                            + (f", then: {short(problem)}" if problem else ""), took, FAILED))
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
        if not wait_until(lambda: inst.running >= 1, 30):
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
                            f"{len(errors)} failed: {short(errors[0])}", took, FAILED))
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
                        problem = f"error: {short(resp.error.message)}"
                    break
                out = resp.outputs["OUT"].to_numpy()
                if out.nbytes != each or not (out == whole % 251).all():
                    problem = f"response {whole} came damaged"
                    break
                whole += 1
                del resp, out
        except queue.Empty:
            problem = "no error for 60 s"
        check = f"SIGKILL mid-stream, {sent} responses of {mib(each)} unread"
        if problem or whole != sent:
            rows.append(Row(name, check, problem or f"{whole} of {sent} came", None, FAILED))
        else:
            rows.append(Row(name, check, f"the {sent} came whole, then the error naming SIGKILL",
                            time.monotonic() - t0, OK))
        del stream
        # Its segments outlive it while the host maps them; they go once the responses have.
        dead = f"{server.options.shm_region_prefix_name}{pid}x"
        where = server.options.shm_fallback_directory or None
        gone = wait_until(lambda: not list_segments(dead, where), 10)
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
    timeout = 2  # not less: a restarted stub on a loaded machine must not look hung
    return _mid_request(ctx, "stub hung", signal.SIGSTOP, "stub-timeout-seconds",
                        {"stub-timeout-seconds": str(timeout)})


# -- the server itself killed ------------------------------------------------------------------

# A server in a process of its own: loads two models, has a stub make an output of 4 MiB (so
# that the host and a stub hold segments), says "ready", then waits to be killed.
_HOST = """
import sys
import numpy as np
import tritonpy
repo, prefix = sys.argv[1], sys.argv[2]
server = tritonpy.Server(repo, model_control_mode="explicit",
                         load_models=["stress_io", "stress_slow"],
                         backend_config={"shm-region-prefix-name": prefix})
server.start()
resp = server.model("stress_io").infer({"DATA": np.zeros(4 << 20, np.uint8),
                                        "OUT_BYTES": np.array([4 << 20], np.int64)}).get(timeout=120)
print("ready" if resp.error is None else "error: " + resp.error.message, flush=True)
sys.stdin.read()
"""


def host_killed(ctx: Context) -> list[Row]:
    """SIGKILL to the server process itself (the OOM killer's pick): its stubs die with it
    and its janitor removes every segment they and it held; nothing waits for a next start."""
    name = "host killed"
    prefix = f"{PREFIX}host{os.getpid()}_"
    proc = subprocess.Popen([sys.executable, "-c", _HOST, str(ctx.repository), prefix],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = (proc.stdout.readline() if proc.stdout else "").strip()
        held = list_segments(prefix)
        if line != "ready" or not held:
            return [Row(name, "set-up", short(line) or "the server did not start", None, FAILED)]
        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        gone = wait_until(lambda: not list_segments(prefix), 20)
        took = time.monotonic() - t0
        stubs = janitor.stubs_of(proc.pid)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()
    owners = len({owner_pid(seg, prefix) for seg in held})
    check = f"SIGKILL to the server, {len(held)} segments held by {owners} processes"
    if not gone:
        left = list_segments(prefix)
        sweep_orphans(prefix)
        return [Row(name, check, f"{len(left)} left in /dev/shm after 20 s", took, FAILED)]
    if stubs:
        return [Row(name, check, f"segments gone, but {len(stubs)} stub(s) still run", took,
                    FAILED)]
    return [Row(name, check, "its stubs died with it; every segment gone", took, OK)]


SCENARIOS: dict[str, Callable[[Context], list[Row]]] = {
    "shm-full": shm_full,
    "gpu-memory-full": gpu_memory_full,
    "message-queue-full": message_queue_full,
    "stub-killed": stub_killed,
    "stub-hung": stub_hung,
    "host-killed": host_killed,
}


# -- running ----------------------------------------------------------------------------------

def run(names: Sequence[str], ctx: Context, inside_private_shm: bool = False) -> list[Row]:
    """The rows of the named scenarios, in order."""
    if not inside_private_shm:
        sweep_orphans(PREFIX)  # what an earlier run that was killed left
    rows: list[Row] = []
    for name in names:
        if name == "shm-full" and not inside_private_shm:
            reason = private_shm_unavailable(ctx.shm_size)
            if reason is None:
                rows += in_private_shm(ctx)
                continue
            ctx.no_private_shm = reason
        try:
            rows += SCENARIOS[name](ctx)
        except Exception as exc:  # the tool reports, it does not die half-way
            rows.append(Row(name.replace("-", " "), "the scenario itself",
                            f"{type(exc).__name__}: {short(str(exc))}",
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
                       "mid-request, the server killed) and print a table of what a user sees: one row per check, "
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
    # Ctrl-C and SIGTERM stop the run: the servers it started stop and its files go. (Both
    # set here: a shell that runs it in the background hands it SIGINT ignored.)
    caught: list[int] = []

    def interrupted(signum: int, frame: Any) -> None:
        caught.append(signum)
        raise KeyboardInterrupt

    handlers = ({s: signal.signal(s, interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
                if threading.current_thread() is threading.main_thread() else {})
    try:
        with tempfile.TemporaryDirectory(prefix="tritonpy-stress-") as tmp:
            ctx = Context(write_repository(Path(tmp) / "models"), args.shm_size, args.quick,
                          private_shm=args.inside_private_shm)
            rows = run(names, ctx, inside_private_shm=args.inside_private_shm)
    except KeyboardInterrupt:
        signum = caught[0] if caught else signal.SIGINT
        print(f"tritonpy stress: interrupted ({signal.Signals(signum).name}): the servers it "
              "started are stopped and its files removed", file=sys.stderr, flush=True)
        return 128 + signum
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    print(json.dumps([asdict(r) for r in rows]) if args.json else format_table(rows), flush=True)
    return 1 if any(r.verdict == FAILED for r in rows) else 0
