"""Per-model statistics in the shape of Triton's ModelStatistics (counts and nanoseconds)."""
from __future__ import annotations

import threading
import time
from typing import Any

_KEYS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output",
         "cache_hit", "cache_miss")


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

    def request_done(self, ok: bool, total_ns: int) -> None:
        with self._lock:
            s = self.stats["success" if ok else "fail"]
            s[0] += 1
            s[1] += total_ns
            self.last_inference_ms = int(time.time() * 1000)

    def execution(self, batch_size: int, queue_ns: list[int], input_ns: int, infer_ns: int,
                  output_ns: int) -> None:
        with self._lock:
            self.execution_count += 1
            self.inference_count += batch_size
            n = len(queue_ns)
            q = self.stats["queue"]
            q[0] += n
            q[1] += sum(queue_ns)
            for key, ns in (("compute_input", input_ns), ("compute_infer", infer_ns),
                            ("compute_output", output_ns)):
                self.stats[key][0] += n
                self.stats[key][1] += ns * n
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
                "response_stats": {},  # per-response statistics: not kept (Triton's key, empty)
                "memory_usage": [],
            }
