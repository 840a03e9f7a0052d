"""The elastic benchmark's analysis (harness/elastic.py) on made-up samples: integrals of step
functions, recovery after a step, drain windows from nexus serve's lines and the failures in them,
the Zipf trace's models."""

from __future__ import annotations

import math

import numpy as np
import pytest

from harness.elastic import (ClusterSample, DrainWindow, LogTail, Requests, drain_windows, errors_within, failures_in,
                                 integral, recovery_s, served_before, share_within, write_elastic_plot, zipf_models)


def test_integral_of_a_step_function_within_the_window():
    assert integral([0.0, 10.0, 20.0], [2, 4, 1], 0.0, 30.0) == 2 * 10 + 4 * 10 + 1 * 10
    assert integral([5.0, 10.0], [2, 4], 0.0, 12.0) == 2 * 10 + 4 * 2          # the first value holds before it
    assert integral([0.0, 10.0], [2, 4], 8.0, 9.0) == 2.0
    assert integral([], [], 0.0, 10.0) == 0.0


def _requests(good_until: float, bad_from: float, bad_to: float, rate: float = 100.0) -> Requests:
    t = np.arange(0.0, good_until, 1 / rate)
    good = ~((t >= bad_from) & (t < bad_to))
    return Requests(t, good, ["OK" if g else "DEADLINE_EXCEEDED" for g in good])


def test_recovery_is_when_the_share_within_slo_comes_back_and_stays():
    req = _requests(60.0, 20.0, 23.5)                      # a step at 20 s; 3.5 s of misses
    assert recovery_s(req, 20.0, 60.0) == pytest.approx(4.0)
    assert share_within(req, 0.0, 20.0) == (1.0, 2000)
    assert recovery_s(_requests(60.0, 0.0, 0.0), 20.0, 60.0) == 0.0
    assert recovery_s(_requests(60.0, 20.0, 60.0), 20.0, 60.0) is None
    flapping = _requests(60.0, 20.0, 21.0)
    flapping.good[(flapping.sent_at >= 24.0) & (flapping.sent_at < 24.5)] = False   # missed again within the hold
    assert recovery_s(flapping, 20.0, 60.0) == pytest.approx(5.0)


def test_drain_windows_and_the_requests_that_failed_in_them():
    lines = [(10.0, "nexus serve: removing backend-3 (be-1 at 127.0.0.1:1): surplus; draining it (SIGTERM)"),
             (11.0, "nexus serve: something else"),
             (12.5, "nexus serve: backend-3 (pid 42) stopped, exit status 0"),
             (20.0, "nexus serve: removing backend-4 (be-2 at 127.0.0.1:2): surplus; draining it (SIGTERM)")]
    windows = drain_windows(lines)
    assert windows == [DrainWindow("backend-3", "be-1", 10.0, 12.5), DrainWindow("backend-4", "be-2", 20.0, math.inf)]
    req = Requests(np.array([8.0, 9.5, 11.0, 14.0, 21.0]), np.array([True, False, False, False, False]),
                   ["OK", "UNAVAILABLE", "CANCELLED", "UNAVAILABLE", "DEADLINE_EXCEEDED"],
                   np.array(["a", "a", "b", "a", "c"], dtype=object))
    assert failures_in(req, windows, before_s=1.0) == {"CANCELLED": 1, "DEADLINE_EXCEEDED": 1, "UNAVAILABLE": 1}
    assert errors_within(req, 0.0, 12.0) == {"CANCELLED": 1, "UNAVAILABLE": 1}
    assert errors_within(req, 0.0, 12.0, {"b"}) == {"CANCELLED": 1}
    assert errors_within(req, 0.0, 9.0) == {}
    # Only the drained backend's models count: be-1 served a (b had moved off it before the drain),
    # be-2 was idle when it was told to drain.
    samples = [_sample(9.0, (("be-1", ("a", "b")), ("be-2", ("c",)))),
               _sample(9.8, (("be-1", ("a",)), ("be-2", ()), ("be-3", ("b", "c")))),
               _sample(10.5, (("be-3", ("a", "b", "c")),))]
    assert served_before(samples, "be-1", 10.0) == {"a"} and served_before(samples, "be-2", 20.0) == set()
    assert served_before(samples, "be-1", 5.0) == set()
    assert failures_in(req, windows, before_s=1.0, samples=samples) == {"UNAVAILABLE": 1}


def _sample(t: float, placement=()) -> ClusterSample:
    return ClusterSample(t, 1, 1, 1, 1, 1, 0.0, 0.0, placement)


def test_log_tail_reads_only_what_is_appended_after_it_starts(tmp_path):
    log = tmp_path / "serve.log"
    log.write_text("nexus serve: before\n")
    tail = LogTail(log).start()
    with log.open("a") as f:
        f.write("nexus serve: removing backend-2 (be-9 at x): surplus\nnexus serve: half a li")
    lines = tail.stop()
    assert [line for _, line in lines] == ["nexus serve: removing backend-2 (be-9 at x): surplus"]
    assert drain_windows(lines) == [DrainWindow("backend-2", "be-9", lines[0][0], math.inf)]


def test_the_plot_is_a_png(tmp_path):
    samples = [ClusterSample(float(t), 1 + (t > 5), 1 + (t > 6), 2, 2, 1, 40.0, 0.1 * t) for t in range(12)]
    req = _requests(12.0, 5.0, 6.0)
    path = tmp_path / "elastic.png"
    write_elastic_plot(path, samples, req, 0.0, 12.0, "made up", steps_at=(5.0,))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_zipf_models_split_the_rate_and_cycle_cvs_and_slos():
    models = zipf_models(24, zipf_s=1.0, seed=3)
    shares = [m.share for m in models]
    assert sum(shares) == pytest.approx(1.0) and shares == sorted(shares, reverse=True)
    assert shares[0] / shares[1] == pytest.approx(2.0) and shares[0] / shares[23] == pytest.approx(24.0)
    assert {m.cv for m in models} == {1.0, 2.0, 3.0, 4.0} and {m.slo_ms for m in models} == {200.0, 300.0, 400.0}
    assert all(m.profile.device_type == "t4" and m.profile.latency_ms(2) > m.profile.latency_ms(1) for m in models)
