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

import collections
import dataclasses
import logging
import math
import random
import threading
import time
from typing import Any, Iterable, Sequence

log = logging.getLogger(__name__)

_KEYS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output",
         "cache_hit", "cache_miss")
#: Triton's failure reasons (its exporter lists them the other way round, newest first).
FAILURE_REASONS = ("REJECTED", "CANCELED", "BACKEND", "OTHER")


#: Triton's summary quantiles, each with the error its estimate may have.
DEFAULT_QUANTILES = ((0.5, 0.05), (0.9, 0.01), (0.95, 0.001), (0.99, 0.001), (0.999, 0.001))
#: The durations a model's summaries observe (Triton's ``nv_inference_<key>_summary_us``).
SUMMARY_KEYS = ("request", "queue", "compute_input", "compute_infer", "compute_output")


@dataclasses.dataclass(frozen=True)
class MetricsConfig:
    """Triton's ``--metrics-config`` settings: the duration counters (on unless
    ``counter_latencies=false``) and the duration summaries (``summary_latencies=true``, with
    ``summary_quantiles=q:e,...``)."""

    counter_latencies: bool = True
    summary_latencies: bool = False
    summary_quantiles: tuple[tuple[float, float], ...] = DEFAULT_QUANTILES

    @classmethod
    def parse(cls, settings: Iterable[str]) -> MetricsConfig:
        """Read ``setting=value`` items as Triton does: an item without ``=`` raises
        ValueError; unknown settings are ignored; only the exact values ``false`` and
        ``true`` turn the counters off and the summaries on; a malformed quantile is logged
        and skipped (none left: the defaults)."""
        values: dict[str, Any] = {}
        for item in settings:
            key, eq, value = item.partition("=")
            if not eq:
                raise ValueError(f"--metrics-config option format is <setting>=<value>. "
                                 f"Got {item}")
            group, comma, name = key.rpartition(",")
            if comma:
                if group:  # a named group's settings are not the models' (Triton's global)
                    continue
                key = name
            if key == "counter_latencies":
                values["counter_latencies"] = value != "false"
            elif key == "summary_latencies":
                values["summary_latencies"] = value == "true"
            elif key == "summary_quantiles":
                quantiles = _quantiles(value)
                if quantiles:
                    values["summary_quantiles"] = quantiles
        return cls(**values)


def _quantiles(text: str) -> tuple[tuple[float, float], ...]:
    pairs = []
    for item in text.split(","):
        q, colon, e = item.partition(":")
        if not colon:
            log.error("Invalid option: [%s]. No ':' delimiter found. Expected format is "
                      "<quantile>:<error>", item)
            continue
        try:
            pairs.append((float(q), float(e)))
        except ValueError as exc:
            log.error("Invalid option: [%s]. Error: %s", item, exc)
    return tuple(pairs)


class LatencySummary:
    """Count, sum and quantiles of durations (µs) for a Prometheus summary, as Triton's
    (prometheus-cpp) keeps them: the quantiles cover about the last minute, in five age
    buckets that rotate every 12 s. Each bucket keeps up to ``KEEP`` observations, a uniform
    sample of them beyond that, so a busy model costs bounded memory; the quantiles are then
    read from the sample, well within Triton's error targets at that size."""

    MAX_AGE = 60.0
    BUCKETS = 5
    KEEP = 2048

    def __init__(self) -> None:
        self.count = 0
        self.sum = 0
        # [start, observations, how many it has seen]
        self._buckets: collections.deque[list[Any]] = collections.deque()

    def observe(self, us: int, now: float) -> None:
        self.count += 1
        self.sum += us
        buckets = self._buckets
        if not buckets or now - buckets[-1][0] >= self.MAX_AGE / self.BUCKETS:
            buckets.append([now, [], 0])
            while len(buckets) > self.BUCKETS:
                buckets.popleft()
        bucket = buckets[-1]
        seen = bucket[2]
        bucket[2] = seen + 1
        kept = bucket[1]
        if seen < self.KEEP:
            kept.append(us)
        else:
            slot = random.randrange(seen + 1)
            if slot < self.KEEP:
                kept[slot] = us

    def window(self, now: float) -> list[int]:
        """The durations kept for the last minute, unsorted."""
        oldest = now - self.MAX_AGE
        span = self.MAX_AGE / self.BUCKETS
        return [v for start, kept, _ in self._buckets if start + span > oldest for v in kept]


def quantiles_of(values: list[int], wanted: Sequence[float]) -> list[float]:
    """Each wanted quantile of ``values`` (nearest rank; NaN when there are none)."""
    n = len(values)
    if not n:
        return [math.nan] * len(wanted)
    values = sorted(values)
    return [float(values[min(n - 1, max(0, math.ceil(q * n) - 1))]) for q in wanted]


class ModelStats:
    """Accumulators updated by the scheduler; ``as_dict`` renders Triton's JSON form.

    With ``summaries`` (``--metrics-config summary_latencies=true``) each successful request's
    durations are also observed for Triton's summary families.
    """

    def __init__(self, name: str, version: int, summaries: bool = False) -> None:
        self.name = name
        self.version = version
        self.summaries = {k: LatencySummary() for k in SUMMARY_KEYS} if summaries else None
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
            if self.summaries is not None:  # Triton's request and queue summaries count hits
                now = time.monotonic()
                self.summaries["request"].observe(total_ns // 1000, now)
                self.summaries["queue"].observe(0, now)

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
            summaries = self.summaries
            for rows, total_ns, queue_ns in succeeded:
                n += 1
                self.inference_count += rows
                ok[1] += total_ns
                q[1] += queue_ns
                if summaries is not None:
                    now = time.monotonic()
                    summaries["request"].observe(total_ns // 1000, now)
                    summaries["queue"].observe(queue_ns // 1000, now)
                    summaries["compute_input"].observe(input_ns // 1000, now)
                    summaries["compute_infer"].observe(infer_ns // 1000, now)
                    summaries["compute_output"].observe(output_ns // 1000, now)
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

    def summary_values(self, quantiles: Sequence[float]) -> dict[str, tuple[int, int, list[float]]]:
        """Per summary key: its count, its sum (µs) and the ``quantiles`` now ({} without
        summaries)."""
        if self.summaries is None:
            return {}
        now = time.monotonic()
        with self._lock:  # copied here, sorted outside: executes do not wait for a scrape
            taken = {k: (s.count, s.sum, s.window(now)) for k, s in self.summaries.items()}
        return {k: (count, total, quantiles_of(values, quantiles))
                for k, (count, total, values) in taken.items()}

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
