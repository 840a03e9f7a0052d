"""Prometheus metrics of a frontend, served at ``/metrics`` on ``--metrics-listen`` (default 127.0.0.1:8002).

:class:`FrontendMetrics` owns a per-process ``prometheus_client.CollectorRegistry``. The KServe
service calls :meth:`FrontendMetrics.success` and :meth:`FrontendMetrics.failure` once per inference
request of a model or query it knows, by session (a version key, common/version_policy.py, or a query's
name); the plan's figures are read from the routing table at each scrape. Labels: ``model`` (a
model, a query, or a query's stage session ``<query>/<stage>``) and ``version`` (the model's version
that served the request; ``"1"`` for queries), as Triton labels its per-model metrics. The plan's
gauges are per session, labelled ``model`` with the session's name.

Triton's per-model metrics, with Triton's series names and meaning:

- ``nv_inference_request_success``, ``nv_inference_request_failure{reason}``: requests (a request of
  many rows counts once). ``reason`` is Triton's: ``REJECTED`` (dropped at its deadline, shed under
  overload, or no backend), ``CANCELED``, ``BACKEND`` (the model failed), ``OTHER`` (invalid input).
- ``nv_inference_count``: rows of successful requests.
- ``nv_inference_exec_count``: batch executions of the model, each counted by the frontend whose
  request the backend marked first of the model in that batch, so summed over the frontends it is
  the number of batches run (of successful requests).
- ``nv_inference_request_duration_us``: cumulative end-to-end time of successful requests at the
  frontend; ``nv_inference_queue_duration_us`` and ``nv_inference_compute_infer_duration_us``:
  cumulative time they waited in a backend's queue and the time of the batch they ran in (models;
  a query's stages are counted under their stage sessions' names only in the plan gauges).

Every one of these is a whole number, as Triton's are: counts are counted, and times are summed in
nanoseconds and written in whole microseconds.

Triton declares these as counters without the ``_total`` suffix; ``prometheus_client`` writes a
counter only with that suffix, so they are exposed untyped under Triton's exact names, which is what
dashboards built for Triton query. ``rate()`` and ``increase()`` work on them as on counters.

This system's own:

- ``nexus_request_latency_seconds{model,version}`` histogram of end-to-end latency of successful
  requests, buckets around typical SLOs; ``nexus_request_latency_slo_ratio`` histogram of latency / SLO
  (the bucket ``le="1.0"`` counts requests within their SLO, whatever the model's SLO).
- ``nexus_request_queue_seconds{model,version}`` and ``nexus_request_compute_seconds{model,version}``:
  histograms, with the latency's buckets (1 ms to 10 s), of the time each successful request waited in
  a backend's queue and of its batch's run. Histograms, unlike Triton's summaries, add up across
  frontends: ``histogram_quantile(0.99, sum by (le, model) (rate(nexus_request_latency_seconds_bucket[1m])))``
  is the p99 over every frontend.
- ``nexus_requests_late_total{model,version}``: successful requests answered after their SLO (their own
  ``timeout`` parameter, or the model's SLO, capped by the gRPC deadline).
- ``nexus_cold_starts_total{model,version}``: requests that found their model cold (resident on no
  device, globalsched/planning/residency.py) and asked for it to be paged in; ``nexus_cold_start_wait_seconds``
  histogram of how long such a request waited for its model to be routed (the load included).
- ``nexus_requests_in_flight``: requests this frontend is serving now, over every transport (those
  held for its first routing table included); a drain on SIGTERM waits for them.
- ``nexus_requests_dropped_total{model,version,reason}``: requests dropped or shed, by gRPC status:
  ``DEADLINE_EXCEEDED`` (could not meet its deadline), ``RESOURCE_EXHAUSTED`` (a backend's queue was
  full), ``UNAVAILABLE`` (no backend serves the model now).
- From the routing table the scheduler pushed: ``nexus_routing_epoch``, ``nexus_planned_devices``,
  ``nexus_lower_bound_devices`` (and ``nexus_lower_bound_throughput_only_devices``, the looser bound of
  earlier releases); per session ``nexus_session_planned_rate_rps``,
  ``nexus_session_measured_rate_rps``, ``nexus_session_slo_seconds``, ``nexus_session_backends``; per
  session and backend (label ``backend`` = node id) ``nexus_session_planned_batch``,
  ``nexus_session_planned_throughput_rps`` and ``nexus_session_duty_cycle_seconds``.
"""

from __future__ import annotations

import bisect
import itertools
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import grpc
import prometheus_client
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, UnknownMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from common.version_policy import split_key


# ``*_created`` series (creation timestamps) only mean something to OpenMetrics scrapers and double
# the size of every scrape; this process's registries leave them out.
prometheus_client.disable_created_metrics()

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                     1.0, 2.0, 5.0, 10.0)
SLO_RATIO_BUCKETS = (0.25, 0.5, 0.75, 0.9, 1.0, 1.25, 1.5, 2.0, 4.0)

# Triton's failure reasons (``nv_inference_request_failure{reason}``) for the gRPC statuses a request can end with.
_FAILURE_REASON = {
    grpc.StatusCode.DEADLINE_EXCEEDED: "REJECTED",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "REJECTED",
    grpc.StatusCode.UNAVAILABLE: "REJECTED",
    grpc.StatusCode.CANCELLED: "CANCELED",
    grpc.StatusCode.INTERNAL: "BACKEND",
    grpc.StatusCode.UNKNOWN: "BACKEND",
}
DROP_STATUSES = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)


def _labels(session: str) -> list[str]:
    """The ``model`` and ``version`` labels of a session's requests."""
    name, version = split_key(session)
    return [name, str(version)]


def failure_reason(code: grpc.StatusCode) -> str:
    return _FAILURE_REASON.get(code, "OTHER")


@dataclass(slots=True)
class _ModelCounts:
    """Everything recorded of one model: plain numbers, added to per request and turned into metric
    families only at a scrape (``prometheus_client``'s labelled children take a lock and a dict
    lookup per call, and its histogram walks its buckets in Python: several calls per request)."""

    success: int = 0
    failure: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    inferences: int = 0
    executions: int = 0
    request_ns: int = 0
    queue_ns: int = 0
    compute_ns: int = 0
    # Histograms as per-bucket counts (the last one is +Inf) and sums; made cumulative at a scrape.
    latency_buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))
    latency_sum_s: float = 0.0
    slo_ratio_buckets: list[int] = field(default_factory=lambda: [0] * (len(SLO_RATIO_BUCKETS) + 1))
    slo_ratio_sum: float = 0.0
    queue_buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))
    compute_buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))
    late: int = 0
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys((c.name for c in DROP_STATUSES), 0))
    cold_starts: int = 0
    page_in_buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))
    page_in_sum_s: float = 0.0

    @property
    def request_us(self) -> int:
        return self.request_ns // 1000

    @property
    def queue_us(self) -> int:
        return self.queue_ns // 1000

    @property
    def compute_us(self) -> int:
        return self.compute_ns // 1000


def _histogram(name: str, doc: str, bounds: tuple[float, ...], per_model) -> HistogramMetricFamily:
    """A histogram family from per-bucket counts: ``per_model`` yields (model, counts, sum)."""
    family = HistogramMetricFamily(name, doc, labels=["model", "version"])
    edges = [floatToGoString(b) for b in bounds] + ["+Inf"]
    for model, counts, total in per_model:
        if not any(counts):        # as a labelled histogram: a series from its first observation on
            continue
        family.add_metric(_labels(model), list(zip(edges, itertools.accumulate(counts))), total)
    return family


class _RequestCollector(Collector):
    """This system's own per-request metrics (module doc): latency and SLO-ratio histograms, late and
    dropped counters, from the recorder's plain counts."""

    def __init__(self, counts: dict[str, _ModelCounts]) -> None:
        self.counts = counts

    def collect(self):
        models = sorted(self.counts.items())
        yield _histogram("nexus_request_latency_seconds", "End-to-end latency of successful requests",
                         LATENCY_BUCKETS_S, ((m, c.latency_buckets, c.latency_sum_s) for m, c in models))
        yield _histogram("nexus_request_queue_seconds",
                         "Time successful requests waited in a backend's queue before their batch ran",
                         LATENCY_BUCKETS_S, ((m, c.queue_buckets, c.queue_ns / 1e9) for m, c in models))
        yield _histogram("nexus_request_compute_seconds", "Time the batch of each successful request took to run",
                         LATENCY_BUCKETS_S, ((m, c.compute_buckets, c.compute_ns / 1e9) for m, c in models))
        yield _histogram("nexus_request_latency_slo_ratio",
                         "Latency of successful requests divided by their SLO (le=1.0: within SLO)",
                         SLO_RATIO_BUCKETS, ((m, c.slo_ratio_buckets, c.slo_ratio_sum) for m, c in models))
        yield _histogram("nexus_cold_start_wait_seconds",
                         "Time a request for a cold model waited for it to be paged in (its load included)",
                         LATENCY_BUCKETS_S, ((m, c.page_in_buckets, c.page_in_sum_s) for m, c in models))
        cold = CounterMetricFamily("nexus_cold_starts", "Requests that found their model cold and asked for it "
                                                        "to be paged in", labels=["model", "version"])
        for model, c in models:
            cold.add_metric(_labels(model), c.cold_starts)
        yield cold
        late = CounterMetricFamily("nexus_requests_late", "Successful requests answered after their SLO",
                                   labels=["model", "version"])
        dropped = CounterMetricFamily("nexus_requests_dropped", "Requests dropped or shed, by gRPC status",
                                      labels=["model", "version", "reason"])
        for model, c in models:
            late.add_metric(_labels(model), c.late)
            for reason, n in c.dropped.items():
                dropped.add_metric([*_labels(model), reason], n)
        yield late
        yield dropped


class _TritonCollector(Collector):
    """Triton's per-model counters, untyped under Triton's exact series names (see the module doc)."""

    _SERIES = (
        ("nv_inference_count", "Number of inferences performed (rows of successful requests)", "inferences"),
        ("nv_inference_exec_count", "Number of model executions performed (this frontend's share of batches)",
         "executions"),
        ("nv_inference_request_duration_us", "Cumulative inference request duration in microseconds", "request_us"),
        ("nv_inference_queue_duration_us", "Cumulative inference queuing duration in microseconds", "queue_us"),
        ("nv_inference_compute_infer_duration_us", "Cumulative compute inference duration in microseconds",
         "compute_us"),
    )

    def __init__(self, counts: dict[str, _ModelCounts]) -> None:
        self.counts = counts

    def collect(self):
        labels = ["model", "version"]
        success = UnknownMetricFamily("nv_inference_request_success",
                                      "Number of successful inference requests, all batch sizes", labels=labels)
        failure = UnknownMetricFamily("nv_inference_request_failure",
                                      "Number of failed inference requests, all batch sizes",
                                      labels=[*labels, "reason"])
        series = [(UnknownMetricFamily(name, doc, labels=labels), attr) for name, doc, attr in self._SERIES]
        for model, c in sorted(self.counts.items()):
            success.add_metric(_labels(model), c.success)
            for reason, n in sorted(c.failure.items()):
                failure.add_metric([*_labels(model), reason], n)
            for family, attr in series:
                family.add_metric(_labels(model), getattr(c, attr))
        yield success
        yield failure
        for family, _ in series:
            yield family


class _PlanCollector(Collector):
    """Gauges from the routing table the scheduler pushed last."""

    def __init__(self, table: Callable[[], object]) -> None:
        self.table = table

    def collect(self):
        table = self.table()
        epoch = GaugeMetricFamily("nexus_routing_epoch", "Plan epoch of the routing table this frontend holds")
        epoch.add_metric([], table.epoch)
        devices = GaugeMetricFamily("nexus_planned_devices", "Devices the scheduler's plan uses")
        devices.add_metric([], table.planned_devices)
        bound = GaugeMetricFamily("nexus_lower_bound_devices",
                                  "Lower bound on the devices any plan needs for the planned rates (throughput "
                                  "and each session's fixed cost per duty cycle)")
        bound.add_metric([], table.lower_bound)
        old_bound = GaugeMetricFamily("nexus_lower_bound_throughput_only_devices",
                                      "The throughput-only lower bound of earlier releases, for comparison")
        old_bound.add_metric([], table.lower_bound_throughput_only)
        yield from (epoch, devices, bound, old_bound)
        per_session = {
            "planned": GaugeMetricFamily("nexus_session_planned_rate_rps",
                                         "Request rate the plan serves for the session", labels=["model"]),
            "measured": GaugeMetricFamily("nexus_session_measured_rate_rps",
                                          "Request rate the frontends reported for the session, summed",
                                          labels=["model"]),
            "slo": GaugeMetricFamily("nexus_session_slo_seconds", "Latency SLO of the session", labels=["model"]),
            "backends": GaugeMetricFamily("nexus_session_backends", "Backends the session is routed to",
                                          labels=["model"]),
        }
        per_route = {
            "batch": GaugeMetricFamily("nexus_session_planned_batch", "Planned batch of the session on a backend",
                                       labels=["model", "backend"]),
            "throughput": GaugeMetricFamily("nexus_session_planned_throughput_rps",
                                            "Throughput the plan gives the session on a backend",
                                            labels=["model", "backend"]),
            "duty": GaugeMetricFamily("nexus_session_duty_cycle_seconds",
                                      "Planned duty cycle of the backend the session runs on",
                                      labels=["model", "backend"]),
        }
        for name, entry in sorted(table.models.items()):
            if not entry.served:
                continue
            per_session["planned"].add_metric([name], entry.planned_rate_rps)
            per_session["measured"].add_metric([name], entry.measured_rate_rps)
            per_session["slo"].add_metric([name], entry.slo_ms / 1000)
            per_session["backends"].add_metric([name], len(entry.backends))
            for route in entry.backends:
                per_route["batch"].add_metric([name, route.node_id], route.batch)
                per_route["throughput"].add_metric([name, route.node_id], route.weight)
                per_route["duty"].add_metric([name, route.node_id], route.duty_cycle_ms / 1000)
        yield from per_session.values()
        yield from per_route.values()


class FrontendMetrics:
    """The frontend's recorder and its registry; see the module doc for the metrics."""

    def __init__(self, table: Callable[[], object], in_flight: Callable[[], int] = lambda: 0) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._counts: dict[str, _ModelCounts] = {}
        self.registry.register(_TritonCollector(self._counts))
        self.registry.register(_RequestCollector(self._counts))
        self.registry.register(_PlanCollector(table))
        Gauge("nexus_requests_in_flight", "Requests being served now, over every transport",
              registry=self.registry).set_function(in_flight)

    def _model(self, model: str) -> _ModelCounts:
        """A model's counts, created (every counter shown at 0: ratios need them) on first sight."""
        c = self._counts.get(model)
        if c is None:
            c = self._counts[model] = _ModelCounts()
        return c

    def success(self, model: str, rows: int, latency_s: float, slo_s: float,
                result=None) -> None:
        """A successful request of ``rows`` rows that took ``latency_s`` against a budget of ``slo_s``;
        ``result`` is the backend's answer, a ``frontend.backend_pool.Reply`` (None for a query, whose stages ran on several backends)."""
        c = self._model(model)
        c.success += 1
        c.inferences += rows
        c.request_ns += round(latency_s * 1e9)
        if result is not None:
            c.executions += bool(result.first_in_batch)
            c.queue_ns += result.queue_ns
            c.compute_ns += result.compute_ns
            c.queue_buckets[bisect.bisect_left(LATENCY_BUCKETS_S, result.queue_ns / 1e9)] += 1
            c.compute_buckets[bisect.bisect_left(LATENCY_BUCKETS_S, result.compute_ns / 1e9)] += 1
        c.latency_buckets[bisect.bisect_left(LATENCY_BUCKETS_S, latency_s)] += 1
        c.latency_sum_s += latency_s
        if slo_s > 0:
            ratio = latency_s / slo_s
            c.slo_ratio_buckets[bisect.bisect_left(SLO_RATIO_BUCKETS, ratio)] += 1
            c.slo_ratio_sum += ratio
            if latency_s > slo_s:
                c.late += 1

    def failure(self, model: str, code: grpc.StatusCode) -> None:
        """A request of a known model that ended with ``code``."""
        c = self._model(model)
        c.failure[failure_reason(code)] += 1
        if code in DROP_STATUSES:
            c.dropped[code.name] += 1

    def cold_start(self, model: str) -> None:
        """A request found ``model`` cold and asked for it to be paged in."""
        self._model(model).cold_starts += 1

    def paged_in(self, model: str, waited_s: float) -> None:
        """A request waited ``waited_s`` for cold ``model`` to be routed."""
        c = self._model(model)
        c.page_in_buckets[bisect.bisect_left(LATENCY_BUCKETS_S, waited_s)] += 1
        c.page_in_sum_s += waited_s

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric (what ``/metrics`` serves)."""
        return prometheus_client.generate_latest(self.registry)
