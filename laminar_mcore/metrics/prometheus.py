"""``/metrics`` in Prometheus' text format, read from a server's live books at scrape time.

The controller and every relay serve ``GET /metrics`` unauthenticated and read-only, as SGLang's
engines do: it reveals counts and timings, never weights, tokens or commands. Nothing is
instrumented twice: each server keeps its own books (the rollout manager's stats, the
experience buffer, the relay's store) and a ``Scrape`` turns a snapshot of them into metric
families when Prometheus asks, in a registry of the server's own (two servers in one process,
as in the tests, never collide). The names are documented in docs/metrics.md.
"""

from __future__ import annotations

import threading
from typing import Callable, Iterable, Mapping, Optional, Sequence

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily, Metric)

# staleness at consumption, in versions behind the trainer
STALENESS_BUCKETS = (0, 1, 2, 4, 8, 16, 32)
# seconds of one publish or pull
SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300)


def _family(kind, name: str, doc: str, value: Optional[float],
            labels: Optional[Mapping[str, float]], label: str) -> Metric:
    if labels is None:
        return kind(name, doc, value=float(value or 0))
    family = kind(name, doc, labels=[label])
    for key, v in sorted(labels.items()):
        family.add_metric([str(key)], v)
    return family


def counter(name: str, doc: str, value: Optional[float] = None,
            labels: Optional[Mapping[str, float]] = None, label: str = "") -> Metric:
    """A counter; with ``labels`` ({label value: count}) one sample per value of ``label``.
    ``name`` has no ``_total``: the exposition adds it."""
    return _family(CounterMetricFamily, name, doc, value, labels, label)


def gauge(name: str, doc: str, value: Optional[float] = None,
          labels: Optional[Mapping[str, float]] = None, label: str = "") -> Metric:
    """A gauge; ``labels`` as for ``counter``."""
    return _family(GaugeMetricFamily, name, doc, value, labels, label)


class Histogram:
    """Running bucket counts (O(buckets) memory whatever the run's length), thread-safe;
    ``family`` renders them at scrape time."""

    def __init__(self, buckets: Sequence[float]):
        self.buckets = tuple(sorted(buckets))
        self._counts = [0] * len(self.buckets)
        self.count = 0
        self.sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            for i, bound in enumerate(self.buckets):
                if value <= bound:
                    self._counts[i] += 1
            self.count += 1
            self.sum += float(value)

    def family(self, name: str, doc: str) -> Metric:
        with self._lock:
            cumulative = [(_le(b), float(c)) for b, c in zip(self.buckets, self._counts)]
            cumulative.append(("+Inf", float(self.count)))
            return HistogramMetricFamily(name, doc, buckets=cumulative, sum_value=self.sum)


def _le(bound: float) -> str:
    return str(float(bound))


class _Callback:
    def __init__(self, collect: Callable[[], Iterable[Metric]]):
        self._collect = collect

    def collect(self) -> Iterable[Metric]:
        return list(self._collect())


class Scrape:
    """A registry of one server's metrics; ``collect()`` is called at every scrape."""

    def __init__(self, collect: Callable[[], Iterable[Metric]]):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Callback(collect))

    def text(self) -> bytes:
        return generate_latest(self.registry)

    async def handle(self, request: web.Request) -> web.Response:
        return web.Response(body=self.text(), headers={"Content-Type": CONTENT_TYPE_LATEST})
