"""Closed-loop load: ``concurrency`` threads, each sending its next call as soon as the last
one returned; latencies are kept for the calls started inside a timed window after a warm-up.
Shared by ``e2e_bench.py`` and ``batching_bench.py``."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np


def closed_loop(make_call: Callable[[], tuple[Callable[[], None], Callable[[], None]]],
                concurrency: int, warmup: float, duration: float) -> np.ndarray:
    """Latencies (seconds) of the calls started inside the window; ``len / duration`` is the rate.

    ``make_call`` runs in each thread (a gevent-based HTTP client belongs to the thread that
    built it) and returns ``(call, close)``. Two rendezvous: every client built, then the window
    is fixed and all threads go. The last calls end just after the window, which counting over
    the window's length absorbs.
    """
    built, go = threading.Barrier(concurrency + 1), threading.Barrier(concurrency + 1)
    samples: list[list[tuple[float, float]]] = [[] for _ in range(concurrency)]
    errors: list[BaseException] = []
    window: list[float] = []

    def worker(i: int) -> None:
        try:
            call, close = make_call()
        except BaseException as exc:
            errors.append(exc)
            built.abort()
            return
        try:
            built.wait()
            go.wait()
            stop = window[1]
            mine = samples[i]
            while True:
                t0 = time.perf_counter()
                if t0 >= stop:
                    return
                call()
                mine.append((t0, time.perf_counter() - t0))
        except BaseException as exc:  # reported by the main thread after join
            errors.append(exc)
        finally:
            close()  # an open connection delays the real Triton's shutdown

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(concurrency)]
    for t in threads:
        t.start()
    try:
        built.wait()
        start = time.perf_counter()
        window.extend([start + warmup, start + warmup + duration])
        go.wait()
    except threading.BrokenBarrierError:
        go.abort()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return np.array([d for s in samples for (t0, d) in s if window[0] <= t0 < window[1]])
