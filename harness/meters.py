"""What the benchmarks measure besides requests: CPU per process and of the whole machine, the other
load on a shared machine, resident memory, the load average (Linux ``/proc``).

:class:`CpuMeter` is the one CPU meter: the CPU seconds of named processes and the cores the whole
machine kept busy between :meth:`~CpuMeter.start` and :meth:`~CpuMeter.stop`; the difference is
the load of every other process ("external" load: other people's work on a shared machine).
"""

from __future__ import annotations

import math
import os
import pathlib
import statistics
import subprocess
import threading
import time


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (NaN once it is gone)."""
    try:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat (idle and iowait are not busy)."""
    parts = [int(x) for x in pathlib.Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = parts[3] + parts[4]
    return float(sum(parts) - idle), float(sum(parts))


def _cores(before: tuple[float, float], after: tuple[float, float]) -> float:
    return (after[0] - before[0]) / max(after[1] - before[1], 1) * (os.cpu_count() or 1)


class CpuMeter:
    """CPU seconds of named processes (and of the whole machine) between start() and stop()."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids

    def start(self) -> "CpuMeter":
        self.t0 = time.monotonic()
        self.c0 = {n: cpu_seconds(p) for n, p in self.pids.items()}
        self.m0 = machine_busy()
        return self

    def stop(self) -> dict:
        """``wall_s``; ``cpu_s`` by name; ``machine_busy_cores``, the cores the machine kept busy; and
        ``external_cores``, those of every process not named."""
        wall = time.monotonic() - self.t0
        cpu = {n: cpu_seconds(p) - self.c0[n] for n, p in self.pids.items()}
        busy = _cores(self.m0, machine_busy())
        return {"wall_s": wall, "cpu_s": cpu, "machine_busy_cores": busy,
                "external_cores": busy - sum(cpu.values()) / max(wall, 1e-9)}


def busy_cores(window_s: float = 2.0, exclude: dict[str, int] | None = None) -> float:
    """Cores busy on the whole machine over ``window_s``, less those of the processes ``exclude``."""
    meter = CpuMeter(exclude or {}).start()
    time.sleep(window_s)
    return meter.stop()["external_cores"]


def wait_quiet(timeout_s: float, threshold_cores: float = 0.4, window_s: float = 2.0) -> dict:
    """Wait (up to ``timeout_s``) until the load of processes other than this one is below
    ``threshold_cores``, sampled over ``window_s``.

    Other people's tests share the machine; starting a measurement in a quiet moment makes it
    less noisy, it does not make it noise-free. Returns what was seen.
    """
    t0 = time.monotonic()
    me = {"self": os.getpid()}
    busy = busy_cores(window_s, me)
    while busy > threshold_cores and time.monotonic() - t0 < timeout_s:
        busy = busy_cores(window_s, me)
    return {"busy_cores": round(busy, 2), "waited_s": round(time.monotonic() - t0, 1)}


def loadavg() -> float:
    """The 1-minute load average."""
    return float(pathlib.Path("/proc/loadavg").read_text().split()[0])


def uptime() -> str:
    """``uptime``'s line (the load averages), for a benchmark's log."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except Exception:
        return pathlib.Path("/proc/loadavg").read_text().strip()


class Periodic:
    """Calls ``sample()`` at once and then every ``period_s`` seconds, on a thread of its own, from
    :meth:`start` until :meth:`stop`: the loop of every sampler here."""

    def __init__(self, period_s: float, sample) -> None:
        self.period_s, self.sample = period_s, sample
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.period_s):
                return

    def start(self) -> "Periodic":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class LoadSampler:
    """Samples the 1-minute load average every ``period_s`` in a thread."""

    def __init__(self, period_s: float = 5.0) -> None:
        self.samples: list[tuple[float, float]] = []
        self._t0 = time.monotonic()
        self._periodic = Periodic(period_s, lambda: self.samples.append((round(time.monotonic() - self._t0, 1),
                                                                          loadavg())))

    def start(self) -> "LoadSampler":
        self._t0 = time.monotonic()
        self._periodic.start()
        return self

    def stop(self) -> dict:
        self._periodic.stop()
        values = [v for _, v in self.samples]
        return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


class CpuTimeline:
    """:class:`CpuMeter` second by second (every ``period_s``): ``seconds`` holds (start on the
    monotonic clock, cores of the named processes, cores of every other process) per period."""

    def __init__(self, pids: dict[str, int], period_s: float = 1.0) -> None:
        self.pids = pids
        self.seconds: list[tuple[float, float, float]] = []
        self._meter: CpuMeter | None = None
        self._periodic = Periodic(period_s, self._tick)

    def _tick(self) -> None:
        if self._meter is not None:
            m = self._meter.stop()
            ours = sum(v for v in m["cpu_s"].values() if not math.isnan(v)) / max(m["wall_s"], 1e-9)
            self.seconds.append((self._meter.t0, ours, m["external_cores"]))
        self._meter = CpuMeter(self.pids).start()

    def start(self) -> "CpuTimeline":
        self._periodic.start()
        return self

    def stop(self) -> None:
        self._periodic.stop()


def rss_mb(pid: int) -> float:
    """Resident memory of a process in MiB (0.0 once it is gone)."""
    try:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class RssSampler:
    """The peak resident memory of named processes while the ``with`` block runs (sampled)."""

    def __init__(self, pids: dict[str, int], every_s: float = 0.1) -> None:
        self.pids, self.every_s = pids, every_s
        self.peak = {name: 0.0 for name in pids}
        self._periodic = Periodic(every_s, self._sample)

    def _sample(self) -> None:
        for name, pid in self.pids.items():
            self.peak[name] = max(self.peak[name], rss_mb(pid))

    def __enter__(self) -> "RssSampler":
        self._periodic.start()
        return self

    def __exit__(self, *exc) -> None:
        self._periodic.stop()


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, their children, ...), from /proc."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in pathlib.Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def favour(pid: int, nice: int) -> None:
    """Niceness ``nice`` for a process and for its scheduler autogroup (its session; with autogroups on,
    a process's niceness only counts against others of its session, and sessions share the CPU
    evenly unless their own niceness says otherwise)."""
    if not nice:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, pid, nice)
    except OSError:
        pass
    try:
        pathlib.Path(f"/proc/{pid}/autogroup").write_text(str(nice))
    except OSError:
        pass


def favour_tree(pid: int, nice: int) -> None:
    """:func:`favour` for a process, all its threads and all its descendants (their threads too)."""
    for p in [pid, *descendants(pid)]:
        favour(p, nice)
        for task in pathlib.Path(f"/proc/{p}/task").glob("*"):
            try:
                os.setpriority(os.PRIO_PROCESS, int(task.name), nice)
            except (OSError, ValueError):
                pass
