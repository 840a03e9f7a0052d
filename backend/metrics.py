"""Prometheus text endpoint of a backend: ``GET /metrics`` (``nexus backend --metrics-port P``).

Served by ``common.metrics_http`` (aiohttp, on the backend's event loop) from a per-process
``prometheus_client.CollectorRegistry`` whose collector renders, at each scrape, a
:class:`control.BackendStats` snapshot (the same one the ``Stats`` RPC returns). Metric names
(labels ``model`` = the session, ``group`` = a prefix group id):

- ``nexus_backend_queue_length{model}`` gauge, requests waiting
- ``nexus_backend_inference_count_total{model}`` rows executed; ``nexus_backend_execution_count_total{model}``
  batches; ``nexus_backend_success_total``, ``nexus_backend_failure_total``, ``nexus_backend_dropped_total``
- ``nexus_backend_queue_seconds_total{model}``, ``nexus_backend_compute_seconds_total{model}``
- ``nexus_backend_batch_size{model}`` histogram of executed batch sizes (``_bucket{le}``, ``_sum``, ``_count``)
- ``nexus_backend_warmup_batches_total{model}``, ``nexus_backend_warmup_seconds_total{model}``: warm-up
  before the session took traffic here (in none of the figures above); ``nexus_backend_warming_sessions``
  gauge, sessions of a model table being applied whose warm-up runs now
- ``nexus_backend_memory_bytes{model}`` gauge (a prefix group's prefix counted on one member only),
  ``nexus_backend_memory_bytes_total`` gauge for the whole backend
- ``nexus_backend_utilization`` gauge, busy fraction over the last 10 s; ``nexus_backend_busy_fraction_total``
  since start
- ``nexus_backend_prefix_group_*{group}``: merged batches, rows, prefix seconds, memory of each shared prefix
- ``nexus_backend_info{node_id,device}`` 1
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from common.pb import control

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

_PER_SESSION = (
    ("nexus_backend_queue_length", GaugeMetricFamily, "Requests waiting in the session's queue.", "queue_length", 1),
    ("nexus_backend_inference_count_total", CounterMetricFamily, "Rows (inferences) executed.", "inference_count", 1),
    ("nexus_backend_execution_count_total", CounterMetricFamily, "Batches executed.", "execution_count", 1),
    ("nexus_backend_success_total", CounterMetricFamily, "Requests answered successfully.", "success_count", 1),
    ("nexus_backend_failure_total", CounterMetricFamily, "Requests failed (dropped included).", "fail_count", 1),
    ("nexus_backend_dropped_total", CounterMetricFamily, "Requests dropped: deadline unreachable or queue full.",
     "dropped", 1),
    ("nexus_backend_queue_seconds_total", CounterMetricFamily, "Time requests spent queued.", "queue_ns", 1e-9),
    ("nexus_backend_compute_seconds_total", CounterMetricFamily, "Time of the batches the session ran in.",
     "compute_ns", 1e-9),
    ("nexus_backend_warmup_batches_total", CounterMetricFamily, "Warm-up batches run before the session took "
     "traffic (not counted as executions).", "warmup_count", 1),
    ("nexus_backend_warmup_seconds_total", CounterMetricFamily, "Time of the session's warm-up batches.",
     "warmup_ns", 1e-9),
    ("nexus_backend_memory_bytes", GaugeMetricFamily,
     "Memory of the session's runtime (a shared prefix on one member).", "memory_bytes", 1),
)
_PER_GROUP = (
    ("nexus_backend_prefix_group_executions_total", CounterMetricFamily,
     "Merged batches run through the shared prefix.", "execution_count", 1),
    ("nexus_backend_prefix_group_inferences_total", CounterMetricFamily, "Rows run through the shared prefix.",
     "inference_count", 1),
    ("nexus_backend_prefix_group_prefix_seconds_total", CounterMetricFamily, "Time spent in the shared prefix.",
     "prefix_compute_ns", 1e-9),
    ("nexus_backend_prefix_group_memory_bytes", GaugeMetricFamily, "Memory of the shared prefix (held once).",
     "memory_bytes", 1),
    ("nexus_backend_prefix_group_sessions", GaugeMetricFamily, "Sessions batched through the shared prefix.", None, 1),
)


class BackendCollector(Collector):
    """Every metric of one ``snapshot()`` (a :class:`control.BackendStats`), taken at each scrape."""

    def __init__(self, snapshot: Callable[[], control.BackendStats], device: str = "") -> None:
        self.snapshot = snapshot
        self.device = device

    def collect(self):
        stats = self.snapshot()
        info = GaugeMetricFamily("nexus_backend_info", "Backend identity.", labels=["node_id", "device"])
        info.add_metric([stats.node_id, self.device], 1)
        yield info
        for name, help_text, value in (
                ("nexus_backend_utilization", "Busy fraction of the device over the last 10 seconds.",
                 stats.utilization),
                ("nexus_backend_busy_fraction_total", "Busy fraction of the device since the backend started.",
                 stats.utilization_total),
                ("nexus_backend_memory_bytes_total", "Memory of every runtime, each shared prefix once.",
                 stats.memory_bytes),
                ("nexus_backend_sessions", "Sessions loaded on this backend.", len(stats.sessions)),
                ("nexus_backend_warming_sessions", "Sessions of a model table being applied whose warm-up runs now.",
                 len(stats.warming))):
            yield GaugeMetricFamily(name, help_text, value=value)
        for name, family, help_text, attr, scale in _PER_SESSION:
            metric = family(name, help_text, labels=["model"])
            for s in stats.sessions:
                metric.add_metric([s.model], getattr(s, attr) * scale)
            yield metric
        sizes = HistogramMetricFamily("nexus_backend_batch_size",
                                      "Sizes of the batches executed (merged size in a prefix group).",
                                      labels=["model"])
        for s in stats.sessions:
            hist = dict(s.batch_histogram)
            buckets = [(str(bound), sum(c for size, c in hist.items() if size <= bound)) for bound in BATCH_BUCKETS]
            buckets.append(("+Inf", sum(hist.values())))
            sizes.add_metric([s.model], buckets, sum_value=sum(size * c for size, c in hist.items()))
        yield sizes
        session_info = GaugeMetricFamily("nexus_backend_session_info",
                                         "Session metadata: its prefix group on this backend.",
                                         labels=["model", "prefix_group"])
        for s in stats.sessions:
            session_info.add_metric([s.model, s.prefix_group], 1)
        yield session_info
        for name, family, help_text, attr, scale in _PER_GROUP:
            metric = family(name, help_text, labels=["group"])
            for g in stats.prefix_groups:
                metric.add_metric([g.group], len(g.sessions) if attr is None else getattr(g, attr) * scale)
            yield metric


def registry(snapshot: Callable[[], control.BackendStats], device: str = "") -> CollectorRegistry:
    """A registry of its own (not the global one) holding the backend's collector."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(BackendCollector(snapshot, device))
    return reg

