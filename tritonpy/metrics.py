"""Prometheus metrics in Triton's names, served as text on the metrics port (``/metrics``).

On every scrape a collector reads the server's counters (its statistics' counts and
cumulative durations, carried across reloads as Triton's), its failures, its pending requests,
the CPU's utilization and memory, and its live shared-memory usage per pool, and the models' own
metrics (``pb_utils.MetricFamily``) are read from ``server.metrics_registry``.

The text is written in the style of Triton's exporter (prometheus-cpp): a counter's samples are
named exactly as the family (``nv_inference_count{...}``), without the ``_total`` suffix and the
``_created`` samples that ``prometheus_client`` adds, so dashboards built for Triton keep working.
"""
from __future__ import annotations

import asyncio
import logging
import math
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping

import psutil
from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ._errors import listen_error
from ._stats import FAILURE_REASONS

if TYPE_CHECKING:
    from .server import Server

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; charset=utf-8"  # Triton 2.51's (measured; Prometheus takes it)

# (family, help, statistics path): counts are plain, "ns" durations are exported in whole µs.
# Triton's names and help texts, in its exporter's order; the failures (by reason) come after
# the successes.
_COUNT_FAMILIES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("nv_inference_request_success", "Number of successful inference requests, all batch sizes",
     ("inference_stats", "success", "count")),
    ("nv_inference_count", "Number of inferences performed (does not include cached requests)",
     ("inference_count",)),
    ("nv_inference_exec_count",
     "Number of model executions performed (does not include cached requests)",
     ("execution_count",)),
)
# The duration counters, unless --metrics-config counter_latencies=false.
_DURATION_FAMILIES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("nv_inference_request_duration_us",
     "Cumulative inference request duration in microseconds (includes cached requests)",
     ("inference_stats", "success", "ns")),
    ("nv_inference_queue_duration_us",
     "Cumulative inference queuing duration in microseconds (includes cached requests)",
     ("inference_stats", "queue", "ns")),
    ("nv_inference_compute_input_duration_us",
     "Cumulative compute input duration in microseconds (does not include cached requests)",
     ("inference_stats", "compute_input", "ns")),
    ("nv_inference_compute_infer_duration_us",
     "Cumulative compute inference duration in microseconds (does not include cached requests)",
     ("inference_stats", "compute_infer", "ns")),
    ("nv_inference_compute_output_duration_us",
     "Cumulative inference compute output duration in microseconds (does not include cached "
     "requests)",
     ("inference_stats", "compute_output", "ns")),
)
# Per model whose config enables the response cache, with the duration counters.
_CACHE_MODEL_FAMILIES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("nv_cache_num_hits_per_model", "Number of cache hits per model",
     ("inference_stats", "cache_hit", "count")),
    ("nv_cache_hit_duration_per_model", "Total cache hit duration per model, in microseconds",
     ("inference_stats", "cache_hit", "ns")),
    ("nv_cache_num_misses_per_model", "Number of cache misses per model",
     ("inference_stats", "cache_miss", "count")),
    ("nv_cache_miss_duration_per_model",
     "Total cache miss (insert+lookup) duration per model, in microseconds",
     ("inference_stats", "cache_miss", "ns")),
)
# The duration summaries, with --metrics-config summary_latencies=true: (family, help, key).
_SUMMARY_FAMILIES = (
    ("nv_inference_request_summary_us",
     "Summary of inference request duration in microseconds (includes cached requests)",
     "request"),
    ("nv_inference_queue_summary_us",
     "Summary of inference queuing duration in microseconds (includes cached requests)",
     "queue"),
    ("nv_inference_compute_input_summary_us", _DURATION_FAMILIES[2][1], "compute_input"),
    ("nv_inference_compute_infer_summary_us", _DURATION_FAMILIES[3][1], "compute_infer"),
    ("nv_inference_compute_output_summary_us", _DURATION_FAMILIES[4][1], "compute_output"),
    ("nv_cache_hit_summary_per_model",
     "Summary of cache hit counts/durations per model, in microseconds.", "cache_hit"),
    ("nv_cache_miss_summary_per_model",
     "Summary of cache miss counts/durations per model, in microseconds.", "cache_miss"),
)
#: The summaries of only the models whose config enables the response cache.
_CACHE_SUMMARY_KEYS = ("cache_hit", "cache_miss")
# Triton's server-wide response-cache families (gauges, as Triton's), from ResponseCache.metrics.
_CACHE_FAMILIES = (
    ("nv_cache_util", "Cache utilization [0.0 - 1.0]", "util"),
    ("nv_cache_num_entries", "Number of responses stored in response cache", "entries"),
    ("nv_cache_num_lookups", "Number of cache lookups in response cache", "lookups"),
    ("nv_cache_num_hits", "Number of cache hits in response cache", "hits"),
    ("nv_cache_num_misses", "Number of cache misses in response cache", "misses"),
    ("nv_cache_num_evictions", "Number of cache evictions in response cache", "evictions"),
    ("nv_cache_lookup_duration",
     "Total cache lookup duration (hit and miss), in microseconds", "lookup_us"),
    ("nv_cache_insertion_duration", "Total cache insertion duration, in microseconds",
     "insertion_us"),
)
_SHM_FAMILIES = (
    ("tritonpy_shm_pool_mapped_bytes", "Bytes of shared memory mapped by the pool", "mapped_bytes"),
    ("tritonpy_shm_pool_used_bytes", "Bytes of shared memory in use by live tensors in the pool", "used_bytes"),
    ("tritonpy_shm_pool_segments", "Shared-memory segments held by the pool", "segments"),
    ("tritonpy_shm_pool_peak_bytes", "Most bytes of shared memory the pool has mapped at once",
     "peak_bytes"),
)


def _lookup(entry: dict[str, Any], path: tuple[str, ...]) -> float:
    value: Any = entry
    for key in path:
        if not isinstance(value, dict):
            return 0.0
        value = value.get(key, 0)
    try:
        number = float(value)  # proto JSON writes uint64 as strings
    except (TypeError, ValueError):
        return 0.0
    return float(int(number) // 1000) if path[-1] == "ns" else number


class TritonStatsCollector:
    """A ``prometheus_client`` collector of Triton's per-model metrics and tritonpy's shm usage.

    Args:
        server: the :class:`tritonpy.Server` whose ``statistics()`` and ``shm_usage()`` are read
            on each scrape.
    """

    def __init__(self, server: Server) -> None:
        self.server = server

    def collect(self) -> Iterator[Metric]:
        """Yield the metric families (called on every scrape). As Triton's exporter, a family
        with no series is left out."""
        for family in self._families():
            if family.samples:
                yield family

    def _families(self) -> Iterator[Metric]:
        try:  # the loaded versions only: as Triton, an unloaded version's series go with it
            stats = self.server.counters()
        except Exception:  # a failing scrape must not fail the metrics endpoint
            log.exception("reading counters for metrics failed")
            stats = []
        config = getattr(self.server, "metrics_config", None)
        counters = config is None or config.counter_latencies
        runtimes = self._runtimes()
        # With --model-namespacing, as Triton's: a namespace label (the model's repository)
        # between the model and its version.
        spaced = bool(getattr(self.server, "model_namespacing", False))
        names = ["model", "namespace", "version"] if spaced else ["model", "version"]

        def ident(entry: Mapping[str, Any]) -> tuple[str, ...]:
            return tuple(str(entry.get(k, "")) for k in ("name", "namespace", "version")
                         if spaced or k != "namespace")

        cached = {ident({"name": rt.name, "namespace": rt.namespace, "version": rt.version})
                  for rt in runtimes or () if rt.config.response_cache.enable}

        def counter_family(name: str, doc: str, path: tuple[str, ...],
                           only: set[tuple[str, ...]] | None = None) -> Metric:
            family = CounterMetricFamily(name, doc, labels=names)
            for entry in stats:
                model = ident(entry)
                if only is None or model in only:
                    family.add_metric(list(model), _lookup(entry, path))
            return family

        yield counter_family(*_COUNT_FAMILIES[0])
        # Failures by Triton's reason label; every reason of every model, zeros included, and
        # as Triton's, those of unloaded versions too.
        failures = CounterMetricFamily(
            "nv_inference_request_failure", "Number of failed inference requests, all batch sizes",
            labels=names[:-1] + ["reason", "version"])
        try:
            for entry in self.server.failures():
                model = ident(entry)
                for reason in reversed(FAILURE_REASONS):  # as Triton's exporter lists them
                    failures.add_metric([*model[:-1], reason, model[-1]],
                                        float(entry["reasons"].get(reason, 0)))
        except Exception:
            log.exception("reading failures for metrics failed")
        yield failures
        for name, doc, path in _COUNT_FAMILIES[1:]:
            yield counter_family(name, doc, path)
        if counters:
            for name, doc, path in _DURATION_FAMILIES:
                yield counter_family(name, doc, path)
            # As Triton: only for the models whose config enables the cache.
            for name, doc, path in _CACHE_MODEL_FAMILIES:
                yield counter_family(name, doc, path, only=cached)
        cache = getattr(self.server, "response_cache", None)
        if cache is not None:  # Triton's server-wide families, with --cache-config
            values = cache.metrics()
            for name, doc, key in _CACHE_FAMILIES:
                gauge = GaugeMetricFamily(name, doc)
                gauge.add_metric([], values[key])
                yield gauge
        pending = GaugeMetricFamily(
            "nv_inference_pending_request_count",
            "Instantaneous number of pending requests awaiting execution per-model.",
            labels=names)
        try:
            for entry in self.server.pending_requests():
                pending.add_metric(list(ident(entry)), float(entry["count"]))
        except Exception:
            log.exception("reading pending requests for metrics failed")
        yield pending
        if config is not None and config.summary_latencies:
            yield from self._summaries(runtimes or [], config.summary_quantiles, cached, spaced)
        try:
            pools = self.server.shm_usage()
        except Exception:
            log.exception("reading shared-memory usage for metrics failed")
            pools = []
        for name, doc, key in _SHM_FAMILIES:
            gauge = GaugeMetricFamily(name, doc, labels=["pool"])
            for pool in pools:
                if key in pool:  # a stub that did not answer has no used_bytes
                    gauge.add_metric([str(pool.get("pool", ""))], float(pool[key]))
            yield gauge

    @staticmethod
    def _summaries(runtimes: list[Any], quantiles: tuple[tuple[float, float], ...],
                   cached: set[tuple[str, ...]], spaced: bool) -> Iterator[Metric]:
        """Triton's duration summaries: per model version its count, sum and quantiles (of
        about the last minute), in Triton's line order. As Triton's, the request summary
        leaves out the models that enable the response cache, and the cache's hit and miss
        summaries have only those."""
        wanted = [q for q, _ in quantiles]
        values = [({"model": rt.name, **({"namespace": rt.namespace} if spaced else {}),
                    "version": str(rt.version)}, rt.stats.summary_values(wanted))
                  for rt in runtimes]
        for name, doc, key in _SUMMARY_FAMILIES:
            family = Metric(name, doc, "summary")
            for labels, by_key in values:
                model = tuple(labels.values())
                if key not in by_key or (key == "request" and model in cached) or (
                        key in _CACHE_SUMMARY_KEYS and model not in cached):
                    continue
                count, total, estimates = by_key[key]
                family.add_sample(name + "_count", labels, float(count))
                family.add_sample(name + "_sum", labels, float(total))
                for q, value in zip(wanted, estimates):
                    family.add_sample(name, {**labels, "quantile": _number(q)}, value)
            yield family

    def _runtimes(self) -> list[Any] | None:
        """The loaded model versions (None: not known)."""
        try:
            return list(self.server.repo.runtimes())
        except Exception:
            return None


class CpuMetrics:
    """Triton's CPU families: ``nv_cpu_utilization`` (the share of non-idle CPU time over the
    last interval, from ``/proc/stat``; 0 until one interval has passed, as with Triton) and the
    machine's RAM, total and used (total less available).

    Args:
        interval_s: how long a utilization sample lasts (Triton's ``--metrics-interval-ms``);
            a scrape after it takes a new one, covering the time since the last.
    """

    def __init__(self, interval_s: float = 2.0) -> None:
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._times = psutil.cpu_times()
        self._at = time.monotonic()
        self._utilization = 0.0

    def utilization(self) -> float:
        with self._lock:
            now = time.monotonic()
            if now - self._at >= self.interval_s:
                times = psutil.cpu_times()
                idle = _idle(times) - _idle(self._times)
                total = sum(times) - sum(self._times) - _guest(times) + _guest(self._times)
                self._utilization = min(1.0, max(0.0, 1.0 - idle / total)) if total > 0 else 0.0
                self._times, self._at = times, now
            return self._utilization

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("nv_cpu_utilization", "CPU utilization rate [0.0 - 1.0]",
                                value=self.utilization())
        memory = psutil.virtual_memory()
        yield GaugeMetricFamily("nv_cpu_memory_total_bytes", "CPU total memory (RAM), in bytes",
                                value=float(memory.total))
        yield GaugeMetricFamily("nv_cpu_memory_used_bytes", "CPU used memory (RAM), in bytes",
                                value=float(memory.total - memory.available))


def _idle(times: Any) -> float:
    return float(times.idle + getattr(times, "iowait", 0.0))


def _guest(times: Any) -> float:
    # Linux counts guest time inside user and nice as well: count it once.
    return float(getattr(times, "guest", 0.0) + getattr(times, "guest_nice", 0.0))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == int(value) and abs(value) < 2**63:
        return str(int(value))
    return repr(value)


def render(families: Iterable[Metric]) -> str:
    """Prometheus text exposition (format 0.0.4) of ``families``, in Triton's naming style."""
    lines: list[str] = []
    for family in families:
        kind = family.type if family.type in ("counter", "gauge", "histogram", "summary") else "untyped"
        # A model's counter keeps the name it was registered with ("x_total" included).
        shown = getattr(family, "registered_name", family.name)
        lines.append(f"# HELP {shown} {family.documentation.replace(chr(10), ' ')}")
        lines.append(f"# TYPE {shown} {kind}")
        created = family.name + "_created"  # what prometheus_client adds, not a model's own
        for sample in family.samples:
            name = sample.name
            if name == created:
                continue
            if kind == "counter" and name == family.name + "_total":
                name = shown
            labels = ",".join(f'{k}="{_escape(str(v))}"' for k, v in sample.labels.items())
            lines.append(f"{name}{{{labels}}} {_number(sample.value)}" if labels
                         else f"{name} {_number(sample.value)}")
    return "\n".join(lines) + "\n" if lines else ""


def metrics_text(server: Server, cpu: CpuMetrics | None = None) -> str:
    """The full metrics page: Triton's families (the CPU's too, given ``cpu``), shm usage,
    then the models' custom metrics."""
    families: list[Metric] = list(TritonStatsCollector(server).collect())
    if cpu is not None:
        try:
            families.extend(cpu.collect())
        except Exception:
            log.exception("reading CPU metrics failed")
    registry = getattr(server, "metrics_registry", None)
    if registry is not None:
        try:
            families.extend(registry.collect())
        except Exception:
            log.exception("collecting custom metrics failed")
    return render(families)


class MetricsFrontend:
    """Serves :func:`metrics_text` at ``/metrics`` over HTTP (Triton's ``--metrics-port``).

    Args:
        server: the server to report on.
        host: address to listen on.
        port: port to listen on (0 picks a free one; see :attr:`port` after :meth:`start`).
        cpu_metrics: serve Triton's CPU families (``--allow-cpu-metrics``).
        interval_ms: how long a CPU utilization sample lasts (``--metrics-interval-ms``).
    """

    def __init__(self, server: Server, host: str = "0.0.0.0", port: int = 8002,
                 cpu_metrics: bool = True, interval_ms: int = 2000) -> None:
        self.server = server
        self.host = host
        self.port = port
        # As Triton, which samples the CPU every half interval.
        self.cpu = CpuMetrics(interval_ms / 2000) if cpu_metrics else None
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        """Bind and start serving."""
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as exc:
            sock.close()
            await self._runner.cleanup()
            raise listen_error("Metrics", f"{self.host}:{self.port}", exc) from None
        self.port = sock.getsockname()[1]
        await web.SockSite(self._runner, sock).start()
        log.info("Started Metrics Service at %s:%d", self.host, self.port)

    async def stop(self, timeout: float = 5.0) -> None:
        """Stop serving."""
        if self._runner is not None:
            self._runner._shutdown_timeout = timeout
            await self._runner.cleanup()
            self._runner = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if request.method != "GET":
            # Triton 2.51's answer, to the byte (measured).
            return web.Response(status=405, body=b'{"error":"Method Not Allowed"}',
                                headers={"Content-Type": "text/plain"})
        if request.path not in ("/metrics", "/metrics/"):
            # As Triton 2.51 (measured): any other path is 200 with an empty body, which is
            # what an HTTP probe of the metrics port (Kubernetes' httpGet on "/") expects.
            return web.Response(status=200, content_type="text/plain", charset="utf-8")
        # statistics() takes the server's locks: keep it off the event loop.
        text = await asyncio.to_thread(metrics_text, self.server, self.cpu)
        return web.Response(body=text.encode(), headers={"Content-Type": CONTENT_TYPE})
