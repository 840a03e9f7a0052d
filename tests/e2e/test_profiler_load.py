"""The profiler on a busy machine (issue 18): a batch size measured while other work takes the cores
the runtime needs is reported with the load seen and planned at a median-based figure, not at a p99
that the other work inflated."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

import pytest

from common.host_load import HostLoad
from common.profile import LATENCY_MARGIN, conservative_latency_ms
from common.sample_models import write_sample_models
from profiler.fill import fill_rows
from profiler.measure import BatchMeasurement

BUSY = HostLoad(2.0, 2, 0.0, 1.1, 3.0, (("nexus-hog", 1.0),))
SPIN = ("import ctypes, time\nctypes.CDLL(None).prctl(15, b'nexus-hog', 0, 0, 0)\n"
        "end = time.time() + 120\nwhile time.time() < end: pass")


def runs(median: float, outliers: int) -> tuple[float, ...]:
    """20 runs near ``median`` and ``outliers`` runs 5x slower (another process took the core)."""
    return tuple([median * (1 + 0.01 * (i % 5 - 2)) for i in range(20)] + [5 * median] * outliers)


def test_a_contended_size_plans_at_the_median_based_figure():
    clean = BatchMeasurement(4, runs(10.0, 3), 10.0)
    busy = BatchMeasurement(4, runs(10.0, 3), 10.0, BUSY, contended=True)
    assert clean.latency_ms == pytest.approx(conservative_latency_ms(clean.mean_ms, clean.std_ms, clean.p99_ms))
    assert clean.latency_ms > 40                       # the p99 of the slow runs
    median = statistics.median(busy.samples_ms)
    assert busy.latency_ms == pytest.approx((median + busy.mad_std_ms) * LATENCY_MARGIN)
    assert busy.latency_ms < 13
    merged = clean.merged(busy)
    assert merged.contended and merged.load is BUSY and len(merged.samples_ms) == 46


def test_a_size_between_a_clean_and_a_contended_one_has_no_p99_floor():
    rows = fill_rows([BatchMeasurement(1, runs(2.0, 0), 5.0), BatchMeasurement(3, runs(6.0, 3), 5.0, BUSY, True)])
    assert rows[1].latency_ms < 6.0 * 1.3                # no floor at the interpolated (inflated) p99
    assert rows[2].latency_ms < 6.0 * 1.3


def test_nexus_profile_on_a_busy_machine_reports_the_load_and_plans_robustly(tmp_path):
    # resnet18_64: its batch sizes take long enough to measure (0.3-0.5 s here) for /proc's 10 ms
    # ticks to tell contention (a window of a few ms, as a tiny model's, is judged by what it can tell)
    model = write_sample_models(tmp_path, ["resnet18_64"])["resnet18_64"]
    out = tmp_path / "busy.json"
    hogs = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(2)]
    try:
        time.sleep(0.5)
        # two runtime threads on a machine whose cores the hogs keep busy
        r = subprocess.run([sys.executable, "-m", "nexus", "profile", str(model), "--threads", "2",
                            "--batch-sizes", "1,4", "--iters", "20", "--min-iters", "5", "--time-budget-s", "0.5",
                            "--no-plot", "-q", "-o", str(out)], capture_output=True, text=True, timeout=120)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    assert r.returncode == 0, r.stderr
    meta = json.loads(out.read_text())["meta"]
    assert meta["contended_batches"], meta["host_load"]
    load = meta["host_load"][str(meta["contended_batches"][0])]
    assert load["contended"] and load["other_cores"] >= 0.5
    assert load["busiest"], load                          # by name: the hogs, or whatever else is busier
    assert "nexus profile: warning: other work shared the cores while batch sizes" in r.stderr
    assert "busiest: " in r.stderr and "median-based figure, not the p99" in r.stderr
    assert "(contended: median-based l(b))" in r.stdout
