"""Custom metrics created by models (pb_utils.MetricFamily), exported through prometheus_client.

A collector of our own rather than prometheus_client's Counter/Gauge classes: Triton lets each
metric of a family carry its own label set and histogram buckets, which those classes do not.

Lifetimes, as Triton 2.51 has them (measured): a family's name, kind and first description stay
registered for the life of the server (prometheus-cpp's registry never forgets a family), but
its series live only as long as the MetricFamily objects they were made through. Deleting such
an object in the model (``del``, garbage collection, ``finalize``) drops every series made
through it at once, the ones whose Metric objects are already gone included; a family left
with no series is not shown at all (HELP and TYPE neither), and the same name made again starts
from 0. Deleting a Metric object alone keeps its series. A stub that ends without deleting its
families (an unload whose ``finalize`` deletes nothing, or a crash) drops nothing: the series
stay, and a reload's metrics of the same labels go on counting from them.

Triton counts the series per MetricFamily object; one series made through objects of two live
stubs (two instances, two models) would be dropped by the first deletion, under the other's
metric. Here a series goes only once no MetricFamily object of a live stub that made it is left.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
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
    """Families and their labelled values, updated from METRIC_* frames.

    Args:
        is_live: whether the owner of a hold (a stub) still runs; a dead one's holds keep no
            series (the stub can no longer delete them: they are dropped by :meth:`forget`).
    """

    def __init__(self, is_live: Callable[[Any], bool] = lambda owner: True) -> None:
        self._lock = threading.Lock()
        self._is_live = is_live
        self._families: dict[str, tuple[str, int]] = {}
        # family -> labels tuple -> [value] or [buckets, counts, sum, count]
        self._values: dict[str, dict[tuple, list]] = {}
        # The MetricFamily objects of the stubs, (owner, id) -> (family, the series they made),
        # and the other way round, (family, labels) -> those objects.
        self._made: dict[tuple[Hashable, int], tuple[str, set[tuple]]] = {}
        self._makers: dict[tuple[str, tuple], set[tuple[Hashable, int]]] = {}

    def family(self, name: str, description: str, kind: int, owner: Hashable = None,
               family_id: int | None = None) -> str | None:
        """Register a family; None, or why not (the name is taken by another kind). A family
        registered again with the same kind is the same family (its first description stays),
        as with Triton. ``owner`` and ``family_id`` name the MetricFamily object of a stub
        that asked: the series its metrics make go when :meth:`delete_family` names it."""
        with self._lock:
            known = self._families.get(name)
            if known is None:
                self._families[name] = (description, kind)
                self._values[name] = {}
            elif known[1] != kind:
                return (f"metric family '{name}' already exists as a {_KIND_NAMES[known[1]]}; "
                        f"it cannot also be a {_KIND_NAMES.get(kind, kind)}")
            if family_id is not None:
                self._made[(owner, family_id)] = (name, set())
        return None

    def op(self, family: str, labels: dict[str, str], op: str, value: float,
           buckets: list[float] | None, owner: Hashable = None,
           family_id: int | None = None) -> None:
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
            if op == "create" and family_id is not None:
                made = self._made.get((owner, family_id))
                if made is not None and made[0] == family:
                    made[1].add(key)
                    self._makers.setdefault((family, key), set()).add((owner, family_id))
            elif op == "increment":
                slot[0] += value
            elif op == "set":
                slot[0] = value
            elif op == "observe" and kind == HISTOGRAM:
                bounds, counts = slot[0], slot[1]
                i = next((j for j, b in enumerate(bounds) if value <= b), len(bounds))
                counts[i] += 1
                slot[2] += value
                slot[3] += 1

    def delete_family(self, owner: Hashable, family_id: int) -> None:
        """The model deleted a MetricFamily object: drop the series made through it that no
        MetricFamily object of a live stub made too."""
        with self._lock:
            made = self._made.pop((owner, family_id), None)
            if made is None:
                return
            family, keys = made
            vals = self._values.get(family, {})
            for key in keys:
                makers = self._makers.get((family, key))
                if makers is None:
                    continue
                makers.discard((owner, family_id))
                if not any(self._is_live(o) for o, _ in makers):
                    del self._makers[(family, key)]
                    vals.pop(key, None)

    def forget(self, owner: Hashable) -> None:
        """A stub ended (unloaded, or died): its MetricFamily objects no longer count, and the
        series they made stay (only a deletion by the model drops series)."""
        with self._lock:
            for hold in [h for h in self._made if h[0] == owner]:
                family, keys = self._made.pop(hold)
                for key in keys:
                    makers = self._makers.get((family, key))
                    if makers is not None:
                        makers.discard(hold)
                        if not makers:
                            del self._makers[(family, key)]

    def value(self, family: str, labels: dict[str, str]) -> float:
        key = tuple(sorted(labels.items()))
        with self._lock:
            slot = self._values.get(family, {}).get(key)
            if slot is None:
                return 0.0
            return float(slot[2] if len(slot) == 4 else slot[0])

    def collect(self) -> Iterator[Any]:
        # As prometheus-cpp: a family with no series is not exported (no HELP or TYPE line).
        with self._lock:
            snapshot = {f: (self._families[f], {k: list(v) for k, v in vals.items()})
                        for f, vals in self._values.items() if vals}
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
