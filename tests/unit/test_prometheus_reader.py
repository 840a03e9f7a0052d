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
