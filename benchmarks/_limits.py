"""Machine limits measured in the same run as the benchmarks, and a table printer.

The limits are what no transport can beat on this machine:

* numpy memcpy bandwidth into a warm (already faulted-in) destination — a tensor that crosses
  a process boundary through shared memory costs at least one copy of it;
* the cross-process round-trip floor — the median time for two processes to ping-pong one
  byte through a pipe (and, if ``posix_ipc`` is importable, through a POSIX semaphore pair),
  which bounds a small BLS call from below.

Run ``python benchmarks/_limits.py [--quick]`` to print them alone.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger(__name__)

KIB = 1024
MIB = 1024 * 1024
MEMCPY_SIZES = (1 * MIB, 16 * MIB, 64 * MIB, 256 * MIB)


@dataclass
class Limits:
    """The limits of this machine, measured now.

    Attributes:
        memcpy_gbps: size in bytes -> GB/s (1 GB = 1e9 bytes) of one warm ``np.copyto``.
        memcpy_us: size in bytes -> µs of one warm copy of that size.
        round_trip_us: label -> median µs of one cross-process round trip.
        floor_us: the round trip used as "the" floor (unpinned pipe ping-pong).
    """

    memcpy_gbps: dict[int, float] = field(default_factory=dict)
    memcpy_us: dict[int, float] = field(default_factory=dict)
    round_trip_us: dict[str, float] = field(default_factory=dict)
    floor_us: float = float("nan")

    def copy_us(self, size: int) -> float:
        """µs for one copy of ``size`` bytes: measured if available, else scaled linearly
        from the nearest measured size (small sizes cost ~0 next to a round trip)."""
        if size in self.memcpy_us:
            return self.memcpy_us[size]
        if not self.memcpy_us:
            return 0.0
        nearest = min(self.memcpy_us, key=lambda s: abs(s - size))
        return self.memcpy_us[nearest] * size / nearest

    def limit_us(self, size: int) -> float:
        """The lower bound of one BLS round trip moving ``size`` bytes: the cross-process
        round-trip floor plus one memcpy of the tensor."""
        return self.floor_us + self.copy_us(size)


def fmt_size(size: int) -> str:
    """Human size label: 16 B, 4 KiB, 1 MiB ..."""
    for unit, name in ((MIB, "MiB"), (KIB, "KiB")):
        if size >= unit and size % unit == 0:
            return f"{size // unit} {name}"
    return f"{size} B"


def measure_memcpy(size: int, repeats: int = 5) -> float:
    """Best seconds of ``np.copyto`` of ``size`` bytes into a warm destination.

    The best of the repeats, not the median: this is a limit, and the two CPUs are shared
    with whatever else runs, which only ever makes a copy slower.
    """
    src = np.ones(size, dtype=np.uint8)
    dst = np.empty_like(src)
    # First touch of fresh pages runs at ~1 GB/s here (page faults); measure warm copies
    # only, since shm pools are kept warm too.
    np.copyto(dst, src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return min(times)


def _pin(cpu: int | None) -> None:
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})


def _ping_pong(
    rounds: int,
    parent_cpu: int | None,
    child_cpu: int | None,
    make: Callable[[], tuple[Callable[[], None], Callable[[], None], Callable[[], None]]],
) -> float:
    """Fork a child that answers each ping; return the parent's median round trip in µs.

    ``make`` builds (ping-and-wait, child-serve-one, cleanup) before the fork so both sides
    share the primitives.
    """
    ping, serve_one, cleanup = make()
    original = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    pid = os.fork()
    if pid == 0:  # child: answer rounds+warm-up pings, then leave without running atexit
        try:
            _pin(child_cpu)
            for _ in range(rounds + 100):
                serve_one()
        finally:
            os._exit(0)
    try:
        _pin(parent_cpu)
        samples = []
        for i in range(rounds + 100):
            t0 = time.perf_counter_ns()
            ping()
            if i >= 100:  # the first rounds warm caches and the scheduler up
                samples.append(time.perf_counter_ns() - t0)
        return statistics.median(samples) / 1e3
    finally:
        os.waitpid(pid, 0)
        if original is not None:
            os.sched_setaffinity(0, original)
        cleanup()


def _pipe_pair() -> tuple[Callable[[], None], Callable[[], None], Callable[[], None]]:
    to_child_r, to_child_w = os.pipe()
    to_parent_r, to_parent_w = os.pipe()

    def ping() -> None:
        os.write(to_child_w, b"x")
        os.read(to_parent_r, 1)

    def serve_one() -> None:
        os.read(to_child_r, 1)
        os.write(to_parent_w, b"y")

    def cleanup() -> None:
        for fd in (to_child_r, to_child_w, to_parent_r, to_parent_w):
            os.close(fd)

    return ping, serve_one, cleanup


def _semaphore_pair() -> tuple[Callable[[], None], Callable[[], None], Callable[[], None]]:
    import posix_ipc  # optional: only in tritonpy's venv

    # Named semaphores live in /dev/shm as sem.*; cleanup unlinks them, and the pid in the
    # name lets _servers.sweep_orphans remove them if this process is killed first.
    name = f"/tpbench_{os.getpid()}_sem{uuid.uuid4().hex[:8]}"
    to_child = posix_ipc.Semaphore(f"{name}_a", posix_ipc.O_CREX, initial_value=0)
    to_parent = posix_ipc.Semaphore(f"{name}_b", posix_ipc.O_CREX, initial_value=0)

    def ping() -> None:
        to_child.release()
        to_parent.acquire()

    def serve_one() -> None:
        to_child.acquire()
        to_parent.release()

    def cleanup() -> None:
        # Unlink by name before closing: a closed Semaphore object can no longer unlink.
        for sem in (to_child, to_parent):
            try:
                posix_ipc.unlink_semaphore(sem.name)
            except posix_ipc.ExistentialError:
                pass
            sem.close()

    return ping, serve_one, cleanup


def measure_round_trips(rounds: int = 3000) -> dict[str, float]:
    """Median µs of a cross-process round trip: unpinned, same CPU and across two CPUs."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    placements: list[tuple[str, int | None, int | None]] = [("", None, None)]
    if len(cpus) >= 2:
        placements += [(" same CPU", cpus[0], cpus[0]), (" across CPUs", cpus[0], cpus[1])]
    kinds: list[tuple[str, Callable[[], tuple[Callable[[], None], Callable[[], None], Callable[[], None]]]]] = [
        ("pipe", _pipe_pair)
    ]
    try:
        import posix_ipc  # noqa: F401

        kinds.append(("POSIX semaphores", _semaphore_pair))
    except ImportError:
        log.info("posix_ipc not importable: semaphore round trip skipped")
    results: dict[str, float] = {}
    for kind, make in kinds:
        for suffix, parent_cpu, child_cpu in placements:
            results[kind + suffix] = _ping_pong(rounds, parent_cpu, child_cpu, make)
    return results


def measure_limits(quick: bool = False, sizes: Sequence[int] = MEMCPY_SIZES) -> Limits:
    """Measure memcpy bandwidth at ``sizes`` and the round-trip floor.

    Call this before starting any server or client thread: it forks.
    """
    limits = Limits()
    for size in sizes:
        seconds = measure_memcpy(size, repeats=3 if quick else 7)
        limits.memcpy_us[size] = seconds * 1e6
        limits.memcpy_gbps[size] = size / seconds / 1e9
    limits.round_trip_us = measure_round_trips(rounds=1000 if quick else 5000)
    limits.floor_us = limits.round_trip_us["pipe"]
    return limits


def print_limits(limits: Limits) -> None:
    """Print the limits as two small tables."""
    print_table(
        "Machine limits: numpy memcpy, warm destination",
        ["size", "GB/s", "µs per copy"],
        [[fmt_size(s), f"{limits.memcpy_gbps[s]:.1f}", f"{limits.memcpy_us[s]:,.0f}"] for s in limits.memcpy_gbps],
    )
    print_table(
        "Machine limits: cross-process round trip (median)",
        ["primitive", "µs"],
        [[k, f"{v:.1f}"] for k, v in limits.round_trip_us.items()],
    )
    print(f"round-trip floor used for ratios: {limits.floor_us:.1f} µs (unpinned pipe)\n")


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """Print an aligned plain-text table that is also valid markdown.

    The first column is left-aligned, the others right-aligned (they hold numbers).
    """
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    ncols = max(len(r) for r in cells)
    for r in cells:
        r.extend([""] * (ncols - len(r)))
    widths = [max(3, *(len(r[i]) for r in cells)) for i in range(ncols)]  # markdown needs ---

    def line(row: list[str]) -> str:
        parts = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        return "| " + " | ".join(parts) + " |"

    sep = "| " + " | ".join([":" + "-" * (widths[0] - 1)] + ["-" * (w - 1) + ":" for w in widths[1:]]) + " |"
    print(f"\n{title}\n")
    print(line(cells[0]))
    print(sep)
    for row in cells[1:]:
        print(line(row))
    print(flush=True)


def main() -> None:
    """Print this machine's limits."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    print_limits(measure_limits(quick=args.quick))


if __name__ == "__main__":
    main()
