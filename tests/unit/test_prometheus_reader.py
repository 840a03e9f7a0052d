"""harness/prometheus.py reads exposition text by name and labels, and refuses a broken one."""

from __future__ import annotations

import pytest

from harness.prometheus import labels, parse

TEXT = """# HELP nexus_requests_total Requests.
# TYPE nexus_requests_total counter
nexus_requests_total{model="a",code="ok"} 3
nexus_requests_total{model="a",code="late"} 1
nexus_requests_total{model="b",code="ok"} 5
# HELP nexus_routing_epoch Epoch.
# TYPE nexus_routing_epoch gauge
nexus_routing_epoch 7
"""


def test_values_by_name_and_labels():
    s = parse(TEXT)
    assert s.value("nexus_routing_epoch") == 7
    assert s.value("nexus_requests_total", model="a", code="ok") == 3
    assert s.value("nexus_requests_total", model="a") is None          # exactly these labels
    assert s.value("nexus_missing", default=-1) == -1
    assert s.matching("nexus_requests_total", model="a") == {labels(model="a", code="ok"): 3,
                                                             labels(model="a", code="late"): 1}
    assert s.total("nexus_requests_total", code="ok") == 8
    assert s.types == {"nexus_requests": "counter", "nexus_routing_epoch": "gauge"}


def test_a_duplicate_sample_is_an_error():
    with pytest.raises(ValueError, match="duplicate sample nexus_routing_epoch"):
        parse(TEXT + "nexus_routing_epoch 8\n")


def _histogram(counts: dict[str, int]) -> str:
    lines = ["# HELP lag_seconds Lag.", "# TYPE lag_seconds histogram"]
    lines += [f'lag_seconds_bucket{{le="{le}"}} {n}' for le, n in counts.items()]
    total = list(counts.values())[-1]
    return "\n".join([*lines, f"lag_seconds_count {total}", "lag_seconds_sum 1.0", ""])


def test_a_histograms_quantile_between_two_readings_is_its_bucket_bound():
    from harness.prometheus import bucket_quantile, buckets

    before = buckets(parse(_histogram({"0.01": 50, "0.05": 50, "1.0": 50, "+Inf": 50})), "lag_seconds")
    assert before == {0.01: 50, 0.05: 50, 1.0: 50, float("inf"): 50}
    # 100 new observations: 97 under 10 ms, 2 more under 50 ms, 1 beyond 1 s
    after = buckets(parse(_histogram({"0.01": 147, "0.05": 149, "1.0": 149, "+Inf": 150})), "lag_seconds")
    assert bucket_quantile(before, after, 0.5) == (0.01, 100)
    assert bucket_quantile(before, after, 0.99) == (0.05, 100)
    assert bucket_quantile(before, after, 1.0) == (float("inf"), 100)
    assert bucket_quantile(after, after, 0.99) == (0.0, 0)                # nothing observed between them
    assert bucket_quantile({}, before, 0.99) == (0.01, 50)               # from the start
