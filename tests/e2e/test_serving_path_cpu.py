"""The serving path's CPU (nexus/serving_path_cpu.py): the CPUs' busy time less the backends', over a
window, the frontends' part apart, on fake /proc readings; and on real processes, a busy one counted
as the path until it is named a backend, and as the frontends' part with its children."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from common.host_load import stat_cpu
from nexus.cpu_layout import ServingPath
from nexus.serving_path_cpu import ServingPathMeter


class _Proc:
    """A fake /proc: CPU 0 and 1 busy ticks, and processes' ticks (100 a second)."""

    def __init__(self) -> None:
        self.busy = [0, 0]
        self.procs: dict[int, int] = {}
        self.children: dict[int, list[int]] = {}
        self.now = 0.0

    def read(self, path: str) -> str:
        if path == "/proc/stat":
            lines = [f"cpu{i} {b} 0 0 {10_000 - b} 0 0 0 0 0 0" for i, b in enumerate(self.busy)]
            return "\n".join(["cpu  0 0 0 0 0 0 0 0 0 0", *lines]) + "\n"
        pid = int(path.split("/")[2])
        if pid not in self.procs:
            raise FileNotFoundError(path)
        if path.endswith("/children"):
            return " ".join(str(c) for c in self.children.get(pid, ()))
        return f"{pid} (nexus) S 1 1 1 0 -1 0 0 0 0 0 {self.procs[pid]} 0 0 0 20 0 1 0 0 0 0\n"

    def run(self, seconds: float, busy_ticks: tuple[int, int], **procs: int) -> None:
        self.now += seconds
        self.busy = [self.busy[0] + busy_ticks[0], self.busy[1] + busy_ticks[1]]
        for name, ticks in procs.items():
            pid = int(name[1:])
            self.procs[pid] = self.procs.get(pid, 0) + ticks


def _meter(proc: _Proc, window_s: float = 10.0) -> ServingPathMeter:
    meter = ServingPathMeter(window_s, read=proc.read, clock=lambda: proc.now, cpus=frozenset({0, 1}))
    meter.ticks_per_s = 100.0
    return meter


def test_the_path_is_the_busy_time_less_the_backends_over_the_window():
    proc = _Proc()
    proc.procs = {7: 0, 8: 0}
    meter = _meter(proc)
    assert meter.sample([7, 8]).cores() == 0.0               # one reading: nothing to count yet
    proc.run(2.0, (150, 130), p7=120, p8=100)                # 2.8 s busy, the backends 2.2 s of it
    assert meter.sample([7, 8]).cores() == pytest.approx(0.3)
    proc.run(2.0, (100, 100), p7=90, p8=90, p9=5)            # backend 9 appears: counted from its first reading
    assert meter.sample([7, 8, 9]).cores() == pytest.approx((4.8 - 4.0) / 4.0)
    proc.run(2.0, (100, 100), p7=90, p8=90, p9=10)
    assert meter.sample([7, 8, 9]).cores() == pytest.approx((6.8 - 5.8 - 0.1) / 6.0)
    # readings older than the window go, as long as one still reaches back a whole window
    for _ in range(5):
        proc.run(2.0, (50, 50), p7=40, p8=40, p9=10)
        meter.sample([7, 8, 9])
    assert meter.sample([7, 8, 9]).cores() == pytest.approx(0.05)    # the last 10 s: 0.1 s of path every 2 s
    # a backend that is gone counts for nothing: the 0.4 s it used in the window are the path's until a reset
    del proc.procs[9]
    proc.run(2.0, (50, 50), p7=40, p8=40)
    assert meter.sample([7, 8, 9]).cores() == pytest.approx((5.0 - 4.0) / 10.0)
    meter.reset()
    assert meter.sample([7, 8]).cores() == 0.0
    proc.run(1.0, (50, 50), p7=40, p8=40)
    assert meter.sample([7, 8]) == ServingPath(pytest.approx(0.2), 0.0)


def test_the_frontends_and_their_workers_are_the_part_that_grows_with_the_rates():
    proc = _Proc()
    proc.procs = {7: 0, 20: 0, 21: 0, 22: 0}
    proc.children = {20: [21, 22]}                            # a frontend and its two workers
    meter = _meter(proc)
    meter.sample([7], [20])
    proc.run(2.0, (150, 110), p7=160, p20=2, p21=30, p22=28)  # 2.6 s busy: backend 1.6, frontends 0.6
    path = meter.sample([7], [20])
    assert path == ServingPath(pytest.approx(0.2), pytest.approx(0.3))
    assert path.cores() == pytest.approx(0.5) and path.cores(2.0) == pytest.approx(0.8)
    # frontends never count for more than the path itself (ticks read at slightly different moments)
    proc.run(2.0, (100, 100), p7=160, p20=0, p21=60, p22=60)
    path = meter.sample([7], [20])
    assert path.fixed_cores == pytest.approx(0.0) and path.rate_cores == pytest.approx((4.6 - 3.2) / 4.0)


def test_without_proc_stat_it_counts_nothing():
    def read(path: str) -> str:
        raise FileNotFoundError(path)

    meter = ServingPathMeter(read=read, cpus=frozenset({0}))
    assert meter.sample([1]) == ServingPath() and meter.sample([1], [2]) == ServingPath()
    with pytest.raises(ValueError, match="window_s must be positive"):
        ServingPathMeter(0.0)


def test_a_busy_process_is_the_path_until_it_is_named_a_backend():
    # a parent that waits, whose child spins: as a frontend, the child is its worker
    busy = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; "
                             "subprocess.run([sys.executable, '-c', 'while True: pass'])"])
    try:
        ticks = float(os.sysconf("SC_CLK_TCK"))
        deadline = time.monotonic() + 10
        while not (children := open(f"/proc/{busy.pid}/task/{busy.pid}/children").read().split()):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        spinner = int(children[0])
        meters = other, backend, frontend = ServingPathMeter(), ServingPathMeter(), ServingPathMeter()
        start = stat_cpu(lambda p: open(p).read(), spinner, ticks)[1]
        began = time.monotonic()
        other.sample([]), backend.sample([spinner]), frontend.sample([], [busy.pid])
        time.sleep(1.5)
        as_other, as_backend, as_frontend = other.sample([]), backend.sample([spinner]), frontend.sample([], [busy.pid])
        spun = (stat_cpu(lambda p: open(p).read(), spinner, ticks)[1] - start) / (time.monotonic() - began)
        assert len(meters) == 3 and spun > 0.4                  # it had much of a core
        assert as_other.cores() >= spun * 0.8 and as_other.rate_cores == 0.0    # the path holds it...
        # ...a backend's CPU is no one's path: the figures differ by its share...
        assert as_other.cores() - as_backend.cores() == pytest.approx(spun, abs=0.15)
        # ...and a frontend's worker is the path's part that grows with the rates
        assert as_frontend.rate_cores == pytest.approx(spun, abs=0.15)
    finally:
        busy.kill()
        busy.wait()
        subprocess.run(["pkill", "-f", "while True: pass"], check=False)
