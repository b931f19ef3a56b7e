"""Per-model statistics in the shape of Triton's ModelStatistics (counts and nanoseconds).

They count what Triton 2.51 counts: a request the model's ``execute`` ran is a success unless
``execute`` itself failed (raised, or returned what the backend rejects), even when its
response carries a ``pb_utils.TritonError``; its rows count in ``inference_count`` and its
times in queue and compute. A failure is counted with its duration only. Every execute counts
in ``execution_count`` and ``batch_stats``, a failed one too, and stamps ``last_inference``.
``response_stats`` stays empty: Triton 2.51's Python backend reports none, decoupled or not.

Failures also count by Triton's reasons (the ``reason`` label of ``nv_inference_request_failure``):
BACKEND (an execute failed, or the model's stub died or cannot serve), REJECTED (a queue or
request timeout passed), CANCELED (cancelled while queued), OTHER (an ensemble that failed). A
request refused as it is queued (a full queue, a sequence without its START) is not counted,
as in Triton.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Iterable

_KEYS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output",
         "cache_hit", "cache_miss")
#: Triton's failure reasons, in the order its exporter lists them.
FAILURE_REASONS = ("REJECTED", "CANCELED", "BACKEND", "OTHER")


class ModelStats:
    """Accumulators updated by the scheduler; ``as_dict`` renders Triton's JSON form."""

    def __init__(self, name: str, version: int) -> None:
        self.name = name
        self.version = version
        self._lock = threading.Lock()
        self.inference_count = 0
        self.execution_count = 0
        self.last_inference_ms = 0
        self.stats = {k: [0, 0] for k in _KEYS}
        self.batch: dict[int, dict[str, list[int]]] = {}
        self.failures = dict.fromkeys(FAILURE_REASONS, 0)

    def request_failed(self, total_ns: int, reason: str) -> None:
        """A request failed after ``total_ns`` for ``reason`` (one of :data:`FAILURE_REASONS`)
        outside an execute that ended (those count in :meth:`execution`)."""
        with self._lock:
            s = self.stats["fail"]
            s[0] += 1
            s[1] += total_ns
            self.failures[reason] += 1

    def cache_hit(self, total_ns: int, lookup_ns: int) -> None:
        """A request answered from the response cache: a success (and a queue entry, as
        Triton counts it), and a hit timed by its lookup."""
        with self._lock:
            s = self.stats
            s["success"][0] += 1
            s["success"][1] += total_ns
            s["queue"][0] += 1
            s["cache_hit"][0] += 1
            s["cache_hit"][1] += lookup_ns

    def cache_miss(self, lookup_ns: int) -> None:
        with self._lock:
            self.stats["cache_miss"][0] += 1
            self.stats["cache_miss"][1] += lookup_ns

    def cache_inserted(self, ns: int) -> None:
        """A miss's answer was kept: its insertion counts in the miss's time, as Triton's."""
        with self._lock:
            self.stats["cache_miss"][1] += ns

    def failures_by_reason(self) -> dict[str, int]:
        with self._lock:
            return dict(self.failures)

    def execution(self, batch_size: int, succeeded: Iterable[tuple[int, int, int]],
                  failed: Iterable[int], input_ns: int, infer_ns: int, output_ns: int) -> None:
        """One execute of ``batch_size`` rows ended.

        Args:
            batch_size: the rows it ran (its batch statistics entry).
            succeeded: ``(rows, request ns, queue ns)`` of each request it ran that counts as a
                success.
            failed: the request ns of each request that failed with it.
            input_ns: time to prepare its inputs.
            infer_ns: time in ``execute``.
            output_ns: time to take its outputs.
        """
        with self._lock:
            self.execution_count += 1
            self.last_inference_ms = int(time.time() * 1000)
            stats = self.stats
            ok, q, fail = stats["success"], stats["queue"], stats["fail"]
            n = 0
            for rows, total_ns, queue_ns in succeeded:
                n += 1
                self.inference_count += rows
                ok[1] += total_ns
                q[1] += queue_ns
            ok[0] += n
            q[0] += n
            for total_ns in failed:
                fail[0] += 1
                fail[1] += total_ns
                self.failures["BACKEND"] += 1
            for key, ns in (("compute_input", input_ns), ("compute_infer", infer_ns),
                            ("compute_output", output_ns)):
                stats[key][0] += n
                stats[key][1] += ns * n
            b = self.batch.get(batch_size)
            if b is None:
                b = self.batch[batch_size] = {k: [0, 0] for k in (
                    "compute_input", "compute_infer", "compute_output")}
            for key, ns in (("compute_input", input_ns), ("compute_infer", infer_ns),
                            ("compute_output", output_ns)):
                b[key][0] += 1
                b[key][1] += ns

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            return {
                "name": self.name,
                "version": str(self.version),
                "last_inference": self.last_inference_ms,
                "inference_count": self.inference_count,
                "execution_count": self.execution_count,
                "inference_stats": {k: {"count": v[0], "ns": v[1]} for k, v in self.stats.items()},
                "batch_stats": [
                    {"batch_size": bs, **{k: {"count": v[0], "ns": v[1]} for k, v in d.items()}}
                    for bs, d in sorted(self.batch.items())
                ],
                "response_stats": {},  # Triton 2.51's Python backend reports none either
                "memory_usage": [],
            }
