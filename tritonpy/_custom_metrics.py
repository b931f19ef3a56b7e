"""Custom metrics created by models (pb_utils.MetricFamily), exported through prometheus_client.

A collector of our own rather than prometheus_client's Counter/Gauge classes: Triton lets each
metric of a family carry its own label set and histogram buckets, which those classes do not.
"""
from __future__ import annotations

import threading
from typing import Any, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector

COUNTER, GAUGE, HISTOGRAM = 0, 1, 2
_KIND_NAMES = {COUNTER: "counter", GAUGE: "gauge", HISTOGRAM: "histogram"}


def _bound(b: float) -> str:
    """A bucket bound as Triton (prometheus-cpp) writes it: 1 not 1.0, 0.5, +Inf."""
    if b == float("inf"):
        return "+Inf"
    return str(int(b)) if b.is_integer() and abs(b) < 1e15 else repr(b)


class CustomMetrics(Collector):
    """Families and their labelled values, updated from METRIC_* frames."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._families: dict[str, tuple[str, int]] = {}
        # family -> labels tuple -> [value] or [buckets, counts, sum, count]
        self._values: dict[str, dict[tuple, list]] = {}

    def family(self, name: str, description: str, kind: int) -> str | None:
        """Register a family; None, or why not (the name is taken by another kind). A family
        registered again with the same kind is the same family (its first description stays),
        as with Triton."""
        with self._lock:
            known = self._families.get(name)
            if known is None:
                self._families[name] = (description, kind)
                self._values[name] = {}
            elif known[1] != kind:
                return (f"metric family '{name}' already exists as a {_KIND_NAMES[known[1]]}; "
                        f"it cannot also be a {_KIND_NAMES.get(kind, kind)}")
        return None

    def op(self, family: str, labels: dict[str, str], op: str, value: float,
           buckets: list[float] | None) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            if family not in self._families:
                return
            kind = self._families[family][1]
            vals = self._values[family]
            slot = vals.get(key)
            if slot is None:
                slot = ([list(buckets or []), [0] * (len(buckets or []) + 1), 0.0, 0]
                        if kind == HISTOGRAM else [0.0])
                vals[key] = slot
            if op == "increment":
                slot[0] += value
            elif op == "set":
                slot[0] = value
            elif op == "observe" and kind == HISTOGRAM:
                bounds, counts = slot[0], slot[1]
                i = next((j for j, b in enumerate(bounds) if value <= b), len(bounds))
                counts[i] += 1
                slot[2] += value
                slot[3] += 1

    def value(self, family: str, labels: dict[str, str]) -> float:
        key = tuple(sorted(labels.items()))
        with self._lock:
            slot = self._values.get(family, {}).get(key)
            if slot is None:
                return 0.0
            return float(slot[2] if len(slot) == 4 else slot[0])

    def collect(self) -> Iterator[Any]:
        with self._lock:
            snapshot = {f: (self._families[f], {k: list(v) for k, v in vals.items()})
                        for f, vals in self._values.items()}
        for name, ((desc, kind), vals) in snapshot.items():
            label_names = sorted({k for key in vals for k, _ in key})
            if kind == HISTOGRAM:
                fam: Any = HistogramMetricFamily(name, desc, labels=label_names)
                for key, (bounds, counts, total, _n) in vals.items():
                    d = dict(key)
                    cum, acc = [], 0
                    for b, c in zip(bounds + [float("inf")], counts):
                        acc += c
                        cum.append((_bound(b), acc))
                    fam.add_metric([d.get(n, "") for n in label_names], cum, total)
            else:
                cls = CounterMetricFamily if kind == COUNTER else GaugeMetricFamily
                fam = cls(name, desc, labels=label_names)
                # As registered: prometheus_client strips a counter's "_total" from the family
                # name; the metrics page (metrics.render) prints this one, as Triton does.
                fam.registered_name = name
                for key, (v,) in vals.items():
                    d = dict(key)
                    fam.add_metric([d.get(n, "") for n in label_names], v)
            yield fam
