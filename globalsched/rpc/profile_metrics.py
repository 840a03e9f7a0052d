"""The profiles in service on the scheduler's metrics port, read at scrape time from the model
administration (globalsched/state/profile_book.py says what each figure is):

- ``nexus_profile_latency_seconds{model, device_type, source, batch}``: l(b) of the table, the
  measured profile and the prediction (``source``), at batches 1, 2, 4, ... and the largest;
- ``nexus_profile_in_use{model, device_type, source}``: 1 for the profile the plan uses;
- ``nexus_profile_samples{model, device_type, kind}``: serving samples held (``clean``), left out as
  ``contended``, and ``lost`` on the way (more than a report holds);
- ``nexus_profile_drift_ratio{model, device_type}``: the last update's drift from the profile in use;
- ``nexus_profile_prediction_error_ratio{model, device_type, stat}``: once a measurement replaced a
  prediction, its ``mean`` and ``max`` relative error of l(b) and its ``bias`` (positive: pessimistic);
- ``nexus_profile_invalid_samples_total``: samples backends sent that were no measurement.
"""

from __future__ import annotations

import functools
from typing import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from globalsched.rpc.convert import profile_curve
from globalsched.state.model_admin import ModelAdmin
from globalsched.state.profile_book import ProfileReport


class ProfileCollector(Collector):
    """The profiles' families. Their samples are made when first read: the metrics endpoint writes the
    text in a worker thread (common/metrics_http.py), so the 26,000 samples of 2,400 models, which
    held the scheduler's loop 55-97 ms at every scrape, are made there. What they say is taken on the
    loop: the reports, frozen, of profiles that are not changed once made (8 ms at 2,400 models)."""

    def __init__(self, admin: ModelAdmin) -> None:
        self.admin = admin

    def collect(self):
        reports = self.admin.in_service.profile_reports()
        invalid = self.admin.in_service.invalid_samples
        made = functools.cache(lambda: _families(reports, invalid))
        for i, family in enumerate(_families((), invalid)):       # the families' names and types
            family.samples = SamplesOnRead(lambda i=i: made()[i].samples)
            yield family


class SamplesOnRead:
    """A family's samples, made by ``make()`` when first read (in the thread that reads them)."""

    def __init__(self, make: Callable[[], list]) -> None:
        self._make = make

    def __iter__(self) -> Iterator:
        return iter(self._make())


def _families(reports: Iterable[ProfileReport], invalid: int) -> list[Metric]:
    latency = GaugeMetricFamily("nexus_profile_latency_seconds", "l(b) of a profile of the model on the device "
                                "type: its table, measured profile or prediction",
                                labels=["model", "device_type", "source", "batch"])
    in_use = GaugeMetricFamily("nexus_profile_in_use", "1 for the profile the plan uses",
                               labels=["model", "device_type", "source"])
    samples = GaugeMetricFamily("nexus_profile_samples", "serving samples held (clean), left out (contended) "
                                "and lost on the way", labels=["model", "device_type", "kind"])
    drift = GaugeMetricFamily("nexus_profile_drift_ratio", "the measurement's relative drift from the profile "
                              "in use at its last update", labels=["model", "device_type"])
    error = GaugeMetricFamily("nexus_profile_prediction_error_ratio", "relative error of l(b) of the prediction "
                              "a measurement replaced", labels=["model", "device_type", "stat"])
    for r in reports:
        key = [r.model, r.device_type]
        for source, profile in (("table", r.table), ("measured", r.measured), ("predicted", r.predicted)):
            if profile is None:
                continue
            curve = profile_curve(profile)
            for b, ms in zip(curve.batch, curve.latency_ms):
                latency.add_metric([*key, source, str(b)], ms / 1000.0)
        in_use.add_metric([*key, r.in_use], 1.0)
        for kind, n in (("clean", r.samples), ("contended", r.contended_samples), ("lost", r.lost_samples)):
            samples.add_metric([*key, kind], n)
        drift.add_metric(key, r.drift)
        if r.replaced is not None:
            for stat, v in (("mean", r.replaced.error.mean_rel), ("max", r.replaced.error.max_rel),
                            ("bias", r.replaced.error.bias)):
                error.add_metric([*key, stat], v)
    invalid_family = CounterMetricFamily("nexus_profile_invalid_samples", "latency samples backends sent that were "
                                         "no measurement (ignored)")
    invalid_family.add_metric([], invalid)
    return [latency, in_use, samples, drift, error, invalid_family]
