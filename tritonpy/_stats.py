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

The Prometheus counters are these statistics summed over a version's runtimes
(:class:`CounterCarry`): a reload restarts the statistics, not the counters.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import math
import random
import re
import threading
import time
from typing import Any, Iterable, Mapping, Sequence

from ._errors import public

log = logging.getLogger(__name__)

_KEYS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output",
         "cache_hit", "cache_miss")
#: Triton's failure reasons (its exporter lists them the other way round, newest first).
FAILURE_REASONS = ("REJECTED", "CANCELED", "BACKEND", "OTHER")


#: Triton's summary quantiles, each with the error its estimate may have.
DEFAULT_QUANTILES = ((0.5, 0.05), (0.9, 0.01), (0.95, 0.001), (0.99, 0.001), (0.999, 0.001))
#: The durations a model's summaries observe (Triton's ``nv_inference_<key>_summary_us``, and
#: ``nv_cache_<hit|miss>_summary_per_model`` for a model that enables the response cache).
SUMMARY_KEYS = ("request", "queue", "compute_input", "compute_infer", "compute_output",
                "cache_hit", "cache_miss")


@public
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
        """Read ``setting=value`` items as Triton 2.51 does (measured): an item without ``=``
        or without a value raises ValueError; unknown settings are ignored; only the exact
        values ``false`` and ``true`` turn the counters off and the summaries on, and once
        turned they stay so; a quantile's numbers are read as C++'s ``stod`` reads them (the
        number at the start: ``0.0.1`` is 0.0), one with none is logged and skipped (none
        left: the defaults)."""
        values: dict[str, Any] = {}
        for item in settings:
            key, eq, value = item.partition("=")
            if not eq or not value:
                raise ValueError(f"--metrics-config option format is <setting>=<value>. "
                                 f"Got {item}")
            group, comma, name = key.rpartition(",")
            if comma:
                if group:  # a named group's settings are not the models' (Triton's global)
                    continue
                key = name
            if key == "counter_latencies":
                if value == "false":
                    values["counter_latencies"] = False
            elif key == "summary_latencies":
                if value == "true":
                    values["summary_latencies"] = True
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
            pair = (_stod(q), _stod(e))
        except ValueError as exc:
            log.error("Invalid option: [%s]. Error: %s", item, exc)
            continue
        if not (0.0 <= pair[0] <= 1.0 and 0.0 <= pair[1] <= 1.0):  # NaN too
            log.error("Invalid option: [%s]. A quantile and its error are between 0 and 1",
                      item)
            continue
        pairs.append(pair)
    return tuple(pairs)


_NUMBER_AT_START = re.compile(
    r"\s*[+-]?(?:(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|inf(?:inity)?|nan)", re.IGNORECASE)


def _stod(text: str) -> float:
    """The number at the start of ``text``, the rest ignored, as C++'s ``std::stod`` reads it;
    ValueError("stod"), its words, when there is none."""
    m = _NUMBER_AT_START.match(text)
    if m is None:
        raise ValueError("stod")
    return float(m.group(0))


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
        # Its own: a reload's new runtime observes into the summary its draining predecessor
        # still observes into (Triton's summaries, like its counters, go on over a reload).
        self._lock = threading.Lock()

    def observe(self, us: int, now: float) -> None:
        with self._lock:
            self._observe(us, now)

    def _observe(self, us: int, now: float) -> None:
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
        with self._lock:
            return [v for start, kept, _ in self._buckets if start + span > oldest
                    for v in kept]

    def totals(self) -> tuple[int, int]:
        with self._lock:
            return self.count, self.sum


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
        self.namespace = ""  # its model's, with --model-namespacing (see RuntimeBase)
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
                self.summaries["cache_hit"].observe(lookup_ns // 1000, now)

    def cache_miss(self, lookup_ns: int, insert_ns: int) -> None:
        """A request the response cache missed has run, its answer kept in ``insert_ns`` (0:
        not kept): a miss timed by both, as Triton's count and summary."""
        with self._lock:
            s = self.stats["cache_miss"]
            s[0] += 1
            s[1] += lookup_ns + insert_ns
            if self.summaries is not None:
                self.summaries["cache_miss"].observe((lookup_ns + insert_ns) // 1000,
                                                     time.monotonic())

    def failures_by_reason(self) -> dict[str, int]:
        with self._lock:
            return dict(self.failures)

    def counters(self) -> dict[str, Any]:
        """The cumulative part, what the Prometheus counters show: ``inference_count``,
        ``execution_count`` and ``inference_stats`` (as in :meth:`as_dict`), and ``failures``
        by reason."""
        with self._lock:
            return {
                "inference_count": self.inference_count,
                "execution_count": self.execution_count,
                "inference_stats": {k: {"count": v[0], "ns": v[1]} for k, v in self.stats.items()},
                "failures": dict(self.failures),
            }

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
            now = time.monotonic() if summaries is not None else 0.0
            for rows, total_ns, queue_ns in succeeded:
                n += 1
                self.inference_count += rows
                ok[1] += total_ns
                q[1] += queue_ns
                if summaries is not None:
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
            b = self.batch.get(batch_size)
            if b is None:
                b = self.batch[batch_size] = {k: [0, 0] for k in (
                    "compute_input", "compute_infer", "compute_output")}
            for key, ns in (("compute_input", input_ns), ("compute_infer", infer_ns),
                            ("compute_output", output_ns)):
                every, this_batch = stats[key], b[key]
                every[0] += n
                every[1] += ns * n
                this_batch[0] += 1
                this_batch[1] += ns

    def add_compute(self, batch_size: int, input_ns: int, infer_ns: int, output_ns: int) -> None:
        """Compute times that came after the request they belong to was counted (by
        :meth:`execution`, with ``batch_size`` rows): added to the totals, with no count."""
        with self._lock:
            b = self.batch.get(batch_size)
            for key, ns in (("compute_input", input_ns), ("compute_infer", infer_ns),
                            ("compute_output", output_ns)):
                self.stats[key][1] += ns
                if b is not None:
                    b[key][1] += ns

    def summary_values(self, quantiles: Sequence[float]) -> dict[str, tuple[int, int, list[float]]]:
        """Per summary key: its count, its sum (µs) and the ``quantiles`` now ({} without
        summaries)."""
        if self.summaries is None:
            return {}
        now = time.monotonic()
        out = {}
        for key, summary in self.summaries.items():
            values = summary.window(now)  # copied, then sorted outside its lock
            count, total = summary.totals()
            out[key] = (count, total, quantiles_of(values, quantiles))
        return out

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


class _Carried:
    """The runtimes of one model version, as its counters see them."""

    __slots__ = ("serving", "runs", "totals", "gone", "failures")

    def __init__(self) -> None:
        self.serving = False
        self.runs: list[ModelStats] = []  # since its last load: they count in every counter
        self.totals: dict[str, Any] = {}  # the counters of the runs that finished
        self.gone: list[ModelStats] = []  # from before its last unload: failures only
        self.failures: dict[str, int] = {}  # the failures of the gone that finished


class CounterCarry:
    """Each model version's Prometheus counters, carried across the runtimes that serve it.

    As Triton 2.51's (measured): a reload that replaces a version's runtime restarts its
    statistics, not its counters (success, counts, durations, cache and failures go on from
    their values). An unload takes the version's series off the metrics page and its next load
    starts them at 0, except ``nv_inference_request_failure``: it stays on the page with its
    values and goes on from them. So a version's counters sum the runtimes that served it since
    it was loaded, and its failures every runtime that ever served it.

    The statistics of a runtime that still finishes its requests are read on each scrape; once
    it is unloaded they are final and folded into a total, so that however many reloads a
    version sees, it keeps one total and the runtimes still draining.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._versions: dict[tuple[str, str, int], _Carried] = {}  # (namespace, name, version)

    def serving(self, stats: ModelStats) -> None:
        """The runtime of ``stats`` serves its version from now on (loaded, or a reload's
        replacement)."""
        with self._lock:
            c = self._versions.setdefault((stats.namespace, stats.name, stats.version),
                                          _Carried())
            c.serving = True
            c.runs.append(stats)

    def unloaded(self, namespace: str, name: str, version: int) -> None:
        """The version is out of service: its counters start again at its next load, its
        failures go on."""
        with self._lock:
            c = self._versions.get((namespace, name, version))
            if c is None:
                return
            c.serving = False
            c.gone.extend(c.runs)
            c.runs = []
            _add(c.failures, c.totals.get("failures", {}))
            c.totals = {}

    def finished(self, stats: ModelStats) -> None:
        """The runtime of ``stats`` is unloaded: it counts no more, and is folded."""
        with self._lock:
            c = self._versions.get((stats.namespace, stats.name, stats.version))
            if c is None:
                return
            if any(s is stats for s in c.runs):
                c.runs = [s for s in c.runs if s is not stats]
                _add(c.totals, stats.counters())
            elif any(s is stats for s in c.gone):
                c.gone = [s for s in c.gone if s is not stats]
                _add(c.failures, stats.counters()["failures"])

    def counters(self, namespace: str, name: str, version: int) -> dict[str, Any] | None:
        """The version's counters, in the shape of :meth:`ModelStats.counters` less its
        failures (see :meth:`failures`); None while it is not serving."""
        with self._lock:
            c = self._versions.get((namespace, name, version))
            if c is None or not c.serving:
                return None
            out: dict[str, Any] = {}
            _add(out, c.totals)
            runs = list(c.runs)
        for stats in runs:
            _add(out, stats.counters())
        out.pop("failures", None)
        return out

    def failures(self) -> list[tuple[str, str, int, dict[str, int]]]:
        """``(namespace, name, version, failures by reason)`` of every version that served,
        unloaded ones too."""
        with self._lock:
            held = []
            for (namespace, name, version), c in self._versions.items():
                failures = dict.fromkeys(FAILURE_REASONS, 0)
                _add(failures, c.failures)
                _add(failures, c.totals.get("failures", {}))
                held.append((namespace, name, version, failures, c.runs + c.gone))
        out = []
        for namespace, name, version, failures, runs in held:
            for stats in runs:
                _add(failures, stats.failures_by_reason())
            out.append((namespace, name, version, failures))
        return out


def _add(into: dict[str, Any], more: Mapping[str, Any]) -> None:
    """Add the numbers of ``more`` into ``into``, nested dicts as nested dicts."""
    for key, value in more.items():
        if isinstance(value, Mapping):
            _add(into.setdefault(key, {}), value)
        else:
            into[key] = into.get(key, 0) + value
