"""The host-load meter (common/host_load.py): /proc/stat parsing, the contention rule on fake readings,
and a real busy process seen by a real meter."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from common.host_load import CLUSTER_PID_ENV, HostLoad, HostLoadMeter, cluster_family, parse_proc_stat

STAT = """cpu  1000 0 500 8000 100 0 0 0 0 0
cpu0 600 0 300 3900 50 0 0 0 0 0
cpu1 400 0 200 4100 50 0 0 0 0 0
intr 12345
"""


def test_proc_stat_aggregate_and_per_cpu():
    agg = parse_proc_stat(STAT, None, ticks_per_s=100)
    assert (agg.busy_s, agg.steal_s, agg.total_s) == (15.0, 0.0, 96.0)
    one = parse_proc_stat(STAT, frozenset({1}), ticks_per_s=100)
    assert (one.busy_s, one.total_s) == (6.0, 47.5)


def test_proc_stat_errors_name_what_is_missing():
    with pytest.raises(ValueError, match=r"lacks CPU\(s\) \[3\]"):
        parse_proc_stat(STAT, frozenset({0, 3}))
    with pytest.raises(ValueError, match="no aggregate cpu line"):
        parse_proc_stat("intr 1\n", None)


class FakeProc:
    """/proc/stat of two CPUs whose busy and steal jiffies the test advances."""

    def __init__(self) -> None:
        self.busy = [0, 0]
        self.steal = [0, 0]
        self.t = 0.0
        self.own = 0.0
        self.procs: dict[int, tuple[str, float]] = {}     # pid -> (name, CPU ticks)
        self.children: list[int] = []

    def read(self, path: str) -> str:
        if path == "/proc/loadavg":
            return "1.50 1.00 0.50 2/300 1234\n"
        if path.startswith("/proc/") and path.endswith("/stat") and path != "/proc/stat":
            pid = int(path.split("/")[2])
            if pid not in self.procs:
                raise FileNotFoundError(path)
            name, ticks = self.procs[pid]
            return f"{pid} ({name}) S 1 " + " ".join(["0"] * 9) + f" {round(ticks)} 0 0 0\n"
        if path.endswith("/children"):
            return " ".join(map(str, self.children))
        lines = [f"cpu {round(sum(self.busy))} 0 0 0 0 0 0 {round(sum(self.steal))}"]
        lines += [f"cpu{i} {round(b)} 0 0 100 0 0 0 {round(s)}" for i, (b, s) in enumerate(zip(self.busy, self.steal))]
        return "\n".join(lines) + "\n"

    def advance(self, seconds: float, busy_cores: float, own_cores: float, steal_cores: float = 0.0) -> None:
        self.t += seconds
        per_cpu = busy_cores * seconds * 100 / 2
        self.busy = [b + per_cpu for b in self.busy]
        self.steal = [s + steal_cores * seconds * 100 / 2 for s in self.steal]
        self.own += own_cores * seconds


def meter(proc: FakeProc, family=frozenset) -> HostLoadMeter:
    m = HostLoadMeter(read=proc.read, clock=lambda: proc.t, own_cpu=lambda: proc.own, cpus=frozenset({0, 1}),
                      family=family)
    m.ticks_per_s = 100.0
    m._last = m._reading()
    return m


def test_an_idle_host_is_not_contended():
    proc = FakeProc()
    m = meter(proc)
    proc.advance(1.0, busy_cores=2.0, own_cores=1.9)     # the busy time is ours
    load = m.sample()
    assert load.other_cores == pytest.approx(0.1) and load.steal_cores == 0
    assert load.load_avg == 1.5 and load.cores == 2
    assert not load.contended(threads=2)


def test_other_processes_on_the_cores_our_threads_need_are_contention():
    proc = FakeProc()
    m = meter(proc)
    proc.advance(2.0, busy_cores=1.8, own_cores=1.0)
    load = m.sample()
    assert load.other_cores == pytest.approx(0.8)
    assert load.contended(threads=2)          # both cores are ours: 0.8 of a core taken
    assert not load.contended(threads=1)      # one spare core absorbs it
    assert "other processes 0.80 cores" in load.describe()


def test_steal_is_contention_on_its_own():
    proc = FakeProc()
    m = meter(proc)
    proc.advance(1.0, busy_cores=0.5, own_cores=0.5, steal_cores=0.2)
    load = m.sample()
    assert load.steal_cores == pytest.approx(0.2) and load.contended(threads=1)


def test_no_reading_and_no_time_give_none():
    proc = FakeProc()
    m = meter(proc)
    assert m.sample() is None                     # no time passed
    broken = HostLoadMeter(read=lambda path: (_ for _ in ()).throw(OSError("no /proc")))
    assert broken.sample() is None


def _spinner(name: str) -> subprocess.Popen:
    """A child process named ``name`` (PR_SET_NAME) that spins on a core for 30 s."""
    spin = (f"import ctypes, time\nctypes.CDLL(None).prctl(15, b'{name}', 0, 0, 0)\n"
            "end = time.time() + 30\nwhile time.time() < end: pass")
    return subprocess.Popen([sys.executable, "-c", spin])


def _load_beside(name: str):
    """A real meter's reading over 2 s while a spinning child named ``name`` runs (started 1 s before)."""
    child = _spinner(name)
    try:
        time.sleep(1.0)
        m = HostLoadMeter(processes=True)         # the window starts now: the child is running
        time.sleep(2.0)
        return m.sample()
    finally:
        child.kill()
        child.wait()


def test_a_real_busy_process_shows_up_by_name():
    load = _load_beside("nexus-hog")
    # a busy loop gets a share of a core even on a busy machine (load averages of 20 were seen here)
    assert load is not None and load.other_cores >= 0.2, load
    assert any(name == "nexus-hog" and cores >= 0.05 for name, cores in load.busiest), load.busiest


def test_host_load_json_carries_the_verdict():
    load = HostLoad(1.0, 2, 0.0, 1.2, 2.5, (("stress", 1.0),))
    obj = load.to_json_obj(threads=2)
    assert obj["contended"] is True and obj["busiest"] == [["stress", 1.0]]


def test_the_clusters_own_processes_are_not_other_work():
    # nexus serve (pid 10) runs the scheduler (11) and this backend's siblings; 900 is a stranger
    proc = FakeProc()
    proc.procs = {10: ("nexus", 0), 11: ("nexus", 0)}
    m = meter(proc, family=lambda: frozenset({10, 11}))
    proc.advance(1.0, busy_cores=2.0, own_cores=1.0)
    proc.procs[11] = ("nexus", 90)                    # the scheduler took 0.9 of a core meanwhile
    load = m.sample()
    assert load.cluster_cores == pytest.approx(0.9)
    assert load.other_cores == pytest.approx(0.1)
    assert not load.contended(threads=2)
    assert "this cluster's other processes 0.90 cores (not counted)" in load.describe()
    # a family member that is gone, or whose pid was reused by another program, counts for nothing
    proc.procs = {10: ("nexus", 0), 11: ("other", 500)}
    proc.advance(1.0, busy_cores=2.0, own_cores=1.0)
    load = m.sample()
    assert load.cluster_cores == 0 and load.other_cores == pytest.approx(1.0) and load.contended(threads=2)


def test_the_cluster_family_is_the_supervisor_and_its_other_children():
    proc = FakeProc()
    proc.children = [11, 12, 13]
    env = {CLUSTER_PID_ENV: "10"}
    assert cluster_family(proc.read, env, me=12) == frozenset({10, 11, 13})
    assert cluster_family(proc.read, {}, me=12) == frozenset()                     # not under nexus serve
    assert cluster_family(proc.read, {CLUSTER_PID_ENV: "x"}, me=12) == frozenset()   # not a pid

    def gone(path: str) -> str:
        raise FileNotFoundError(path)
    assert cluster_family(gone, env, me=12) == frozenset()                         # the supervisor exited


def test_a_real_sibling_counts_as_the_clusters_own(monkeypatch):
    # this test's process plays the supervisor: a busy child of it is a sibling of the meter's
    monkeypatch.setenv(CLUSTER_PID_ENV, str(os.getpid()))
    load = _load_beside("nexus-sib")
    assert load is not None and load.cluster_cores >= 0.2, load
    assert not any(name == "nexus-sib" for name, _ in load.busiest), load.busiest


def test_a_window_too_short_for_the_clock_ticks_is_not_contended_by_rounding():
    proc = FakeProc()
    m = meter(proc)
    proc.advance(0.02, busy_cores=1.8, own_cores=1.0)      # a small model's batch size: 20 ms
    load = m.sample()
    assert load.resolution_cores == pytest.approx(2.0)     # 4 tick counters read twice, over 20 ms
    assert not load.contended(threads=2)
    proc.advance(2.0, busy_cores=1.8, own_cores=1.0)       # the same load over 2 s is contention
    load = m.sample()
    assert load.resolution_cores == pytest.approx(0.02) and load.contended(threads=2)
