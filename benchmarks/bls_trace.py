"""Where the time of one small BLS call goes: per-hop timestamps across the three processes.

A BLS call is two round trips through the host: the caller stub sends BLS_INFER, the host
routes it and sends EXECUTE to the target stub, the target answers EXECUTE_DONE, the host
sends BLS_RESPONSE back. With ``TRITONPY_FRAME_TRACE`` set, every process records when each
frame leaves (``send()`` called) and arrives (``recv`` returned); this script runs the
``bls_loop`` bench model (sync ``exec()`` of ``identity``, 16 B by default) in a child process
with the trace on, merges the records (one clock: CLOCK_MONOTONIC) and prints the median of
each segment of a call: the four hops (a frame in flight, mostly waking the receiver) and the
work in each process between them. Beside it, this machine's cost of a wake-up: two processes
ping-ponging a datagram with blocking receives, and with receivers that spin.

Usage: ``python benchmarks/bls_trace.py [--calls N] [--size BYTES] [--gpu]``. ``--gpu``: the
tensor is a CuPy array on GPU 0, passed by CUDA IPC handle (``benchmarks/gpu_models``, as
``bls_bench.py --gpu``). The trace itself adds a few µs per frame; compare segments with each
other, not with bls_bench's figures.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _limits import print_table  # noqa: E402

BLS_INFER, EXECUTE, EXECUTE_DONE, BLS_RESPONSE = 20, 10, 11, 21
CALLER, TARGET = "bls_loop_0_0", "identity_0_0"
# One call, frame by frame: (channel, direction, command); the last is the next call's start.
CALL = [
    (f"stub:{CALLER}", "send", BLS_INFER), (f"host:{CALLER}", "recv", BLS_INFER),
    (f"host:{TARGET}", "send", EXECUTE), (f"stub:{TARGET}", "recv", EXECUTE),
    (f"stub:{TARGET}", "send", EXECUTE_DONE), (f"host:{TARGET}", "recv", EXECUTE_DONE),
    (f"host:{CALLER}", "send", BLS_RESPONSE), (f"stub:{CALLER}", "recv", BLS_RESPONSE),
    (f"stub:{CALLER}", "send", BLS_INFER),
]
SEGMENTS = [
    "hop: caller stub -> host", "host: route, validate, schedule, send EXECUTE",
    "hop: host -> target stub", "target stub: decode, execute, send EXECUTE_DONE",
    "hop: target stub -> host", "host: response, statistics, send BLS_RESPONSE",
    "hop: host -> caller stub", "caller stub: response, next request, send",
]


def serve(trace_dir: str, size: int, calls: int, repo: str) -> None:
    """Child: run bls_loop with the trace on (set before tritonpy is imported)."""
    os.environ["TRITONPY_FRAME_TRACE"] = trace_dir
    import numpy as np

    import tritonpy

    inputs = {"SIZE": np.array([size], np.int64), "ITERS": np.array([calls], np.int64),
              "MODE": np.array([0], np.int64)}
    with tritonpy.Server(str(HERE / repo), model_control_mode="explicit",
                         load_models=["bls_loop", "identity"],
                         backend_config={"shm-region-prefix-name": f"tptrace{os.getpid()}_"}) as srv:
        for _ in range(2):  # the first pass warms up; both are traced, the pattern is the same
            for resp in srv.model("bls_loop").infer(inputs):
                if resp.error is not None:
                    raise SystemExit(f"bls_loop failed: {resp.error}")


def segments(trace_dir: str) -> list[list[int]]:
    """ns of each segment of every complete call found in the merged trace."""
    events = []
    for path in Path(trace_dir).glob("*.tsv"):
        for line in path.read_text().splitlines():
            fields = line.split("\t")
            if len(fields) == 5:  # (a process killed while it wrote leaves a cut line)
                events.append((int(fields[0]), fields[1], fields[2], int(fields[3])))
    events.sort()
    wanted = set(CALL)
    seq = [e for e in events if (e[1], e[2], e[3]) in wanted]
    out: list[list[int]] = [[] for _ in SEGMENTS]
    i = 0
    while i + len(CALL) <= len(seq):
        window = seq[i:i + len(CALL)]
        if all((e[1], e[2], e[3]) == c for e, c in zip(window, CALL)):
            for k in range(len(SEGMENTS)):
                out[k].append(window[k + 1][0] - window[k][0])
            i += len(CALL) - 1
        else:
            i += 1
    return out


def ping_pong(spin: bool, rounds: int = 5000) -> float:
    """Mean µs of a 200-byte datagram round trip between two processes."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)

    def recv(s: socket.socket, buf: bytearray) -> None:
        while spin:
            try:
                s.recv_into(buf, 0, socket.MSG_DONTWAIT)
                return
            except BlockingIOError:
                pass
        s.recv_into(buf)

    buf = bytearray(1024)
    pid = os.fork()
    if pid == 0:
        a.close()
        for _ in range(rounds + 100):
            recv(b, buf)
            b.send(b"x" * 200)
        os._exit(0)
    b.close()
    for _ in range(100):
        a.send(b"y" * 200)
        recv(a, buf)
    t0 = time.perf_counter()
    for _ in range(rounds):
        a.send(b"y" * 200)
        recv(a, buf)
    elapsed = time.perf_counter() - t0
    os.waitpid(pid, 0)
    a.close()
    return elapsed / rounds * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=3000, help="BLS calls per pass (two passes)")
    ap.add_argument("--size", type=int, default=16, help="tensor bytes (inline up to 48 KiB)")
    ap.add_argument("--gpu", action="store_true", help="GPU tensors (CuPy), by CUDA IPC")
    ap.add_argument("--serve", metavar="DIR", help=argparse.SUPPRESS)
    args = ap.parse_args()
    repo = "gpu_models" if args.gpu else "bench_models"
    if args.serve:
        serve(args.serve, args.size, args.calls, repo)
        return
    if args.gpu:
        from bls_bench import gpu_missing

        missing = gpu_missing()
        if missing:
            raise SystemExit(f"--gpu: {missing}")
    with tempfile.TemporaryDirectory(prefix="tritonpy-trace-") as trace_dir:
        subprocess.run([sys.executable, __file__, "--serve", trace_dir, "--size", str(args.size),
                        "--calls", str(args.calls)] + (["--gpu"] if args.gpu else []),
                       check=True)
        found = segments(trace_dir)
    if not found[0]:
        raise SystemExit("no complete call found in the trace")
    medians = [statistics.median(s) / 1000 for s in found]
    total = sum(medians)
    rows = [(name, f"{m:.1f}", f"{m / total * 100:.0f} %") for name, m in zip(SEGMENTS, medians)]
    rows.append(("one call (sum of medians)", f"{total:.1f}", "100 %"))
    print_table(f"One {args.size} B {'GPU ' if args.gpu else ''}BLS call, {len(found[0])} calls "
                "traced (median µs per segment)", ["segment", "µs", "share"], rows)
    hops = sum(m for name, m in zip(SEGMENTS, medians) if name.startswith("hop"))
    print(f"the four hops: {hops:.1f} µs; the work in the three processes: {total - hops:.1f} µs")
    print_table("This machine's wake-up cost: a 200-byte datagram round trip between two "
                "processes (mean µs)", ["receivers", "µs"],
                [("blocking (a wake-up per message)", f"{ping_pong(False):.1f}"),
                 ("spinning (no wake-up)", f"{ping_pong(True):.1f}")])


if __name__ == "__main__":
    main()
