"""An idle scheduler costs next to nothing (issue 29): ``nexus serve`` on its defaults with emulated
backends, its sample models and queries placed, no traffic; the scheduler's CPU seconds from /proc
over 20 s stay under a generous bound.

Before the fix it used 65-69% of a core (80% with 10 backends) re-computing the queries' latency
split at every evaluation; after, about 1% (benchmarks/idle_scheduler.md). The bound leaves room for a
busy 2-core CI machine, and catches any loop whose cost grows with time rather than with events.
"""

from __future__ import annotations

import time

import pytest

from harness.meters import CpuMeter, loadavg
from tests.conftest import start_serve

BACKENDS = 3
SETTLE_S = 10.0            # after the ready line: the first plans and profiles land
WINDOW_S = 20.0
BOUND_CORE_FRACTION = 0.15


@pytest.mark.slow
def test_an_idle_scheduler_uses_almost_no_cpu(tmp_path):
    cluster = start_serve(tmp_path / "data", "--backends", str(BACKENDS), "--device", "emulated:t4")
    try:
        pids = cluster.components()
        time.sleep(SETTLE_S)
        meter = CpuMeter({"scheduler": pids["scheduler"]}).start()
        time.sleep(WINDOW_S)
        m = meter.stop()
        assert cluster.proc.poll() is None, cluster.logs()[-3000:]
    finally:
        cluster.stop()
    used = m["cpu_s"]["scheduler"] / m["wall_s"]
    print(f"idle scheduler: {used:.1%} of a core over {m['wall_s']:.0f} s ({BACKENDS} emulated backends; "
          f"load average {loadavg():.2f})")
    assert used < BOUND_CORE_FRACTION, f"the idle scheduler used {used:.0%} of a core over {m['wall_s']:.0f} s"
