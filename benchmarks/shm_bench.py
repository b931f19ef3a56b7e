"""Benchmark of the shared-memory substrate against the machine's own limits, in one run.

Prints markdown tables:

* channel round trip: a small frame to a peer process and back through a real ``Channel``
  (msgpack, SOCK_SEQPACKET), beside the floor measured in the same run: a one-byte pipe
  ping-pong between two processes (and a raw SOCK_SEQPACKET ping-pong for reference); once
  with both ends sleeping in ``recv()``, once with both polling for up to 1 ms first, as
  tritonpy's host loop, idle stubs and sync BLS callers wait (``idle-spin-microseconds``,
  ``bls-spin-microseconds``): on a VM a sleeping peer on the other CPU costs a wake-up of
  tens of µs, which polling saves;
* tensor transfer, 4 KiB .. 256 MiB: the sender encodes a private array into shm (one copy)
  and sends the handle; the receiver decodes the zero-copy view, touches every page, drops
  the view (the release flows back) and replies. Beside it: one numpy memcpy of the same
  size, and the same transfer of an array already in shm (forwarded by handle, no copy);
* pool allocate+free per second, raw blocks and arrays with their finalizer.

Targets (SPEC §7): round trip within 2x of the floor; a 64 MiB transfer within 2x of one
memcpy. Usage: ``python benchmarks/shm_bench.py [--quick]``.
"""
from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from typing import Callable

import numpy as np

from tritonpy.shm import Channel, Cmd, Pool, TensorTransport, socket_pair, sweep_orphans

PREFIX = "tritonpy_bench_"
POLL_US = 1000  # idle-spin-microseconds' default
KiB, MiB = 1 << 10, 1 << 20


# -- child roles ----------------------------------------------------------------------------------
def child_channel(fd: int, spin_us: int = 0) -> None:
    """Echo PING bodies; for EXECUTE decode the tensor, touch every page, drop it, reply.
    ``spin_us``: poll that long for each frame before sleeping."""
    pool = Pool(prefix=PREFIX, label="bench-child")
    transport = TensorTransport(pool)
    ch = Channel(socket.socket(fileno=fd), transport, name="bench-child")
    peer = ch.peer
    spin_s = spin_us / 1e6
    try:
        while True:
            msg = ch.recv(spin_s)
            if msg is None:
                break
            cmd, cid, body = msg
            if cmd == Cmd.PING:
                ch.send(Cmd.REPLY, cid, body)
            elif cmd == Cmd.EXECUTE:
                _, arr = transport.decode(body, peer)
                flat = arr.reshape(-1).view(np.uint8)
                touched = int(flat[::4096].sum()) + int(flat[-1]) if flat.size else 0
                del arr, flat  # the release is queued before the reply goes out
                ch.send(Cmd.REPLY, cid, touched)
    finally:
        ch.close()
        pool.close()
        transport.segments.close()


def child_pipe(rfd: int, wfd: int) -> None:
    read, write = os.read, os.write
    while True:
        b = read(rfd, 1)
        if not b:
            return
        write(wfd, b)


def child_seqpacket(fd: int) -> None:
    s = socket.socket(fileno=fd)
    buf = bytearray(256)
    while True:
        n = s.recv_into(buf)
        if not n:
            return
        s.send(buf[:n])


def _spawn(args: list[str], fds: list[int]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), *args], pass_fds=fds)


# -- measurements ---------------------------------------------------------------------------------
def _samples(fn: Callable[[], None], n: int) -> list[int]:
    clock = time.perf_counter_ns
    out = []
    for _ in range(n):
        t = clock()
        fn()
        out.append(clock() - t)
    return out


class PipeFloor:
    """One-byte ping-pong over two pipes with a child process: the cross-process floor."""

    def __init__(self) -> None:
        r1, self.w1 = os.pipe()
        self.r2, w2 = os.pipe()
        self.proc = _spawn(["--child-pipe", str(r1), str(w2)], [r1, w2])
        os.close(r1)
        os.close(w2)

    def once(self) -> None:
        os.write(self.w1, b"x")
        os.read(self.r2, 1)

    def close(self) -> None:
        os.close(self.w1)
        os.close(self.r2)
        self.proc.wait()


class SeqpacketFloor:
    """The channel's socket without msgpack or Python framing: a 16-byte datagram ping-pong."""

    def __init__(self) -> None:
        self.sock, b = socket_pair()
        self.proc = _spawn(["--child-seqpacket", str(b.fileno())], [b.fileno()])
        b.close()
        self.buf = bytearray(256)

    def once(self) -> None:
        self.sock.send(b"x" * 16)
        self.sock.recv_into(self.buf)

    def close(self) -> None:
        self.sock.close()
        self.proc.wait()


class Peer:
    """The parent's end of a channel to a ``child_channel`` process; both ends poll for
    ``spin_us`` before sleeping in recv()."""

    def __init__(self, spin_us: int = 0) -> None:
        self.pool = Pool(prefix=PREFIX, label="bench")
        self.transport = TensorTransport(self.pool)
        a, b = socket_pair()
        self.proc = _spawn(["--child-channel", str(b.fileno()), str(spin_us)], [b.fileno()])
        b.close()
        self.ch = Channel(a, self.transport, name="bench")
        self.body = {"id": 7, "x": b"\x00" * 16}
        self.spin_s = spin_us / 1e6

    def call(self, cmd: Cmd, body: object) -> object:
        self.ch.send(cmd, 1, body)
        msg = self.ch.recv(self.spin_s)  # RELEASE frames are consumed in here
        assert msg is not None and msg[0] == Cmd.REPLY, msg
        return msg[2]

    def once(self) -> None:
        self.call(Cmd.PING, self.body)

    def close(self) -> None:
        self.ch.close()
        self.proc.wait()
        self.pool.close()
        self.transport.segments.close()


def round_trips(paths: list[Callable[[], None]], n: int, rounds: int = 20) -> list[float]:
    """Median µs of each path, measured in interleaved rounds so all see the same load."""
    for fn in paths:
        for _ in range(max(2, n // 10)):
            fn()
    samples: list[list[int]] = [[] for _ in paths]
    for _ in range(rounds):
        for fn, out in zip(paths, samples):
            out.extend(_samples(fn, max(1, n // rounds)))
    return [statistics.median(s) / 1e3 for s in samples]


PLACEMENTS = ("unpinned", "one CPU", "two CPUs")


def channel_round_trips(ends: list, n: int) -> dict[str, list[float]]:
    """Median µs of each end's ``once``, by placement: unpinned, every process on one CPU,
    and the children on another CPU than this process. On a VM the placement decides more
    than the transport: a peer sleeping on the other CPU costs a wake-up of tens of µs, one
    on the same CPU a context switch of a few."""
    out: dict[str, list[float]] = {}
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    original = set(cpus)
    for placement in PLACEMENTS:
        if placement != "unpinned":
            if len(cpus) < 2:
                continue
            mine = {cpus[0]}
            theirs = mine if placement == "one CPU" else {cpus[1]}
            os.sched_setaffinity(0, mine)
            for end in ends:
                os.sched_setaffinity(end.proc.pid, theirs)
        try:
            out[placement] = round_trips([end.once for end in ends], n)
        finally:
            if placement != "unpinned":
                os.sched_setaffinity(0, original)
                for end in ends:
                    os.sched_setaffinity(end.proc.pid, original)
    return out


def print_round_trips(table: dict[str, list[float]]) -> None:
    labels = ["pipe ping-pong, 1 byte (floor)", "raw SOCK_SEQPACKET ping-pong, 16 B",
              "Channel PING → REPLY (msgpack, small body), both ends sleeping",
              f"the same, both ends polling up to {POLL_US} µs first (as tritonpy waits)"]
    cols = list(table)
    print("## Channel round trip (median µs, and × the pipe floor in the same placement)\n")
    print("| path | " + " | ".join(cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for i, label in enumerate(labels):
        cells = [f"{table[c][i]:.1f} ({table[c][i] / table[c][0]:.2f}×)" for c in cols]
        print(f"| {label} | " + " | ".join(cells) + " |")
    print()
    for col in cols:
        floor, sleeping, polled = table[col][0], table[col][2], table[col][3]
        best = min(sleeping, polled)
        verdict = "meets" if best <= 2 * floor else "MISSES"
        print(f"Target, {col}: the channel within 2× of the floor — {verdict} "
              f"({best / floor:.2f}×, {'polling' if polled < sleeping else 'sleeping'}).")
    print()


def transfer(peer: Peer, nbytes: int, reps: int) -> tuple[float, float, float]:
    """Median seconds of: a copy-in transfer, a forward of an array in shm, one memcpy."""
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    dst[:] = 1
    encode = peer.transport.encode
    p = peer.ch.peer

    def copy_in() -> None:
        peer.call(Cmd.EXECUTE, encode("x", src, p))

    in_shm = peer.pool.copy_in(src)

    def forward() -> None:
        peer.call(Cmd.EXECUTE, encode("x", in_shm, p))

    def memcpy() -> None:
        np.copyto(dst, src)

    out = round_trips([copy_in, forward, memcpy], reps, rounds=min(reps, 5))
    del in_shm
    return out[0] / 1e6, out[1] / 1e6, out[2] / 1e6


def pool_rates(seconds: float) -> tuple[float, float]:
    pool = Pool(prefix=PREFIX, label="bench-pool")
    try:
        alloc, free = pool.allocate, pool.free
        n = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for _ in range(1000):
                seg, off = alloc(4096)
                free(seg, off, 4096)
            n += 1000
        raw = n / (time.perf_counter() - t0)
        new = pool.new_array
        n = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for _ in range(1000):
                a = new(np.uint8, (4096,))
                del a
            n += 1000
        arrays = n / (time.perf_counter() - t0)
        return raw, arrays
    finally:
        pool.close()
        pool.segments.close()


def _size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer samples, sizes up to 64 MiB")
    args = ap.parse_args()
    n_rt = 3000 if args.quick else 20000
    sizes = [4 * KiB, 64 * KiB, MiB, 16 * MiB, 64 * MiB] + ([] if args.quick else [256 * MiB])

    print(f"# tritonpy shm substrate — {platform.node()}, {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}, numpy {np.__version__}\n")
    pipe, seqp, peer, polling = PipeFloor(), SeqpacketFloor(), Peer(), Peer(POLL_US)
    try:
        try:
            table = channel_round_trips([pipe, seqp, peer, polling], n_rt)
        finally:
            pipe.close()
            seqp.close()
            polling.close()
        print_round_trips(table)
        print("## Tensor transfer (sender copy into shm → receiver view, every page touched, "
              "released)\n")
        print("| size | transfer GB/s | forward (already in shm) GB/s | memcpy GB/s "
              "| transfer time / memcpy time |")
        print("|---:|---:|---:|---:|---:|")
        ratio64 = None
        for nbytes in sizes:
            reps = max(5, min(2000, (256 * MiB) // nbytes // (4 if args.quick else 1)))
            t_copy, t_fwd, t_mem = transfer(peer, nbytes, reps)
            gb = nbytes / 1e9
            ratio = t_copy / t_mem
            if nbytes == 64 * MiB:
                ratio64 = ratio
            print(f"| {_size(nbytes)} | {gb / t_copy:.2f} | {gb / t_fwd:.2f} | "
                  f"{gb / t_mem:.2f} | {ratio:.2f} |")
        if ratio64 is not None:
            verdict = "meets" if ratio64 <= 2 else "MISSES"
            print(f"\nTarget: 64 MiB within 2× of one memcpy — {verdict} ({ratio64:.2f}×).\n")
    finally:
        peer.close()

    raw, arrays = pool_rates(0.5 if args.quick else 2.0)
    print("## Pool (4 KiB blocks)\n")
    print("| operation | per second |")
    print("|---|---:|")
    print(f"| allocate + free | {raw:,.0f} |")
    print(f"| new_array + drop (finalizer frees) | {arrays:,.0f} |")
    sweep_orphans(PREFIX)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1].startswith("--child-"):
        role, rest = sys.argv[1], [int(x) for x in sys.argv[2:]]
        {"--child-channel": child_channel, "--child-pipe": child_pipe,
         "--child-seqpacket": child_seqpacket}[role](*rest)
    else:
        main()
