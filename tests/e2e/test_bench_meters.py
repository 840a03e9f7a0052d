"""The benchmark library's meters (harness/meters.py): CPU per process and of the machine, RSS."""

from __future__ import annotations

import math
import pathlib
import os
import subprocess
import sys
import time

from harness.meters import (CpuMeter, CpuTimeline, LoadSampler, RssSampler, cpu_seconds, loadavg, rss_mb,
                                wait_quiet)


def _burn(cpu_s: float) -> None:
    end = time.process_time() + cpu_s
    while time.process_time() < end:
        pass


def test_cpu_meter_counts_the_cpu_a_process_spent_and_the_machine_saw():
    meter = CpuMeter({"me": os.getpid()}).start()
    _burn(0.3)
    cpu = meter.stop()
    assert cpu["cpu_s"]["me"] >= 0.25            # /proc/PID/stat counts in 10 ms ticks
    assert cpu["machine_busy_cores"] > 0
    assert cpu["external_cores"] == cpu["machine_busy_cores"] - cpu["cpu_s"]["me"] / cpu["wall_s"]


def test_a_process_that_is_gone_reads_as_nan_cpu_and_no_memory():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert math.isnan(cpu_seconds(child.pid)) and rss_mb(child.pid) == 0.0


def test_rss_sampler_keeps_the_peak_and_the_quiet_wait_gives_up_at_its_timeout():
    with RssSampler({"me": os.getpid()}, every_s=0.01) as rss:
        time.sleep(0.05)
    assert rss.peak["me"] > 10 and rss_mb(os.getpid()) > 10
    seen = wait_quiet(0.0, threshold_cores=-1.0, window_s=0.05)   # nothing is ever that quiet
    assert seen["busy_cores"] > -1.0 and seen["waited_s"] >= 0
    assert loadavg() == float(pathlib.Path("/proc/loadavg").read_text().split()[0])    # the 1-minute figure


def test_the_timeline_and_the_load_sampler_sample_every_period_until_stopped():
    timeline = CpuTimeline({"me": os.getpid()}, period_s=0.1).start()
    load = LoadSampler(period_s=0.05).start()
    _burn(0.35)
    deadline = time.monotonic() + 30.0      # a loaded machine may starve the sampling threads: burn on
    while len(timeline.seconds) < 2 and time.monotonic() < deadline:
        _burn(0.05)
    timeline.stop()
    seen = load.stop()
    assert len(timeline.seconds) >= 2 and seen["n"] >= 2 and seen["min"] <= seen["median"] <= seen["max"]
    starts = [t for t, _, _ in timeline.seconds]
    assert starts == sorted(starts) and max(ours for _, ours, _ in timeline.seconds) > 0.2   # this process burnt CPU
    n = len(timeline.seconds)
    time.sleep(0.25)
    assert len(timeline.seconds) == n                   # stopped: no more samples

