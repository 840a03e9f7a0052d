"""What else runs on the cores a process uses: CPU steal, other processes' CPU, load average.

A batch timed while other work shares its cores measures the machine, not the model (issue 18:
``nexus profile`` run beside a busy ``nexus serve`` recorded l(16) = 64 ms where 39 ms was the
model's). The profiler reports the load it saw and plans such batch sizes at a robust statistic;
a CPU backend flags the batches it serves meanwhile as contended, so they never enter a measured
profile (common/measured_profile.py).

Figures, between two readings of ``/proc`` (Linux; elsewhere :meth:`HostLoadMeter.sample` returns
None and nothing counts as contended):

* ``steal_cores``: CPU time the hypervisor gave to other guests (``steal`` of ``/proc/stat``), in
  cores, over the CPUs this process may run on (its affinity set);
* ``other_cores``: CPU time every other process used on those CPUs: their busy time less this
  process's own (``time.process_time``, all its threads), in cores;
* ``cluster_cores``: CPU time the cluster's own other processes used, in cores: where this process
  was started by ``nexus serve`` (``$NEXUS_CLUSTER_PID`` names it), that supervisor and its other
  children (the scheduler, the frontend, other backends). It is taken out of ``other_cores`` and never
  counts as contention: those processes run beside a model whenever it serves, so a profile measured
  beside them is the profile of service, and a first start that profiles its models while the rest
  of the cluster starts is not "other work" (issue 26);
* ``load_avg``: the 1-minute load average of ``/proc/loadavg`` (the whole host; reported, not judged);
* ``busiest``: with ``processes=True``, the other processes that used the most CPU meanwhile
  (``/proc/<pid>/stat``), by name, for a report.

Contended (:meth:`HostLoad.contended`): other work took cores that ``threads`` threads of ours
need: ``steal_cores >= 0.1``, or ``other_cores + steal_cores`` beyond the cores left over once our
threads have theirs (``cores - threads``) by more than half a core. Half a core of slack keeps a
frontend or a shell that wakes now and then from flagging every batch. Both figures must pass their
limit by more than the readings' resolution (``resolution_cores``): ``/proc`` counts in clock ticks
(10 ms), so over the 20 ms that a small model's batch size takes to measure, one tick of a shell
reads as half a core; such a window is judged by what it can tell, and is not contended by rounding.
"""

from __future__ import annotations

import os
import pathlib
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping

STEAL_CORES = 0.1          # steal at least this much (in cores) is contention whatever else runs
SLACK_CORES = 0.5          # other work beyond the spare cores by more than this is contention
BUSIEST = 8                # other processes named in a reading


@dataclass(frozen=True)
class CpuTimes:
    """CPU seconds of the CPUs this process may use, summed over them, from ``/proc/stat``."""

    busy_s: float          # user, nice, system, irq, softirq
    steal_s: float
    total_s: float         # every column up to steal


def parse_proc_stat(text: str, cpus: frozenset[int] | None = None, ticks_per_s: float = 100.0) -> CpuTimes:
    """The ``cpuN`` lines of ``/proc/stat`` for ``cpus`` (None: the aggregate ``cpu`` line).

    ValueError when a CPU asked for is not there."""
    busy = steal = total = 0.0
    seen: set[int] = set()
    for line in text.splitlines():
        fields = line.split()
        if not fields or not fields[0].startswith("cpu"):
            continue
        name = fields[0]
        if cpus is None:
            if name != "cpu":
                continue
        else:
            if name == "cpu" or int(name[3:]) not in cpus:
                continue
            seen.add(int(name[3:]))
        v = [int(x) for x in fields[1:9]] + [0] * max(0, 8 - len(fields[1:9]))
        user, nice, system, idle, iowait, irq, softirq, st = v
        busy += user + nice + system + irq + softirq
        steal += st
        total += user + nice + system + idle + iowait + irq + softirq + st
    if cpus is not None and seen != set(cpus):
        raise ValueError(f"/proc/stat lacks CPU(s) {sorted(set(cpus) - seen)}")
    if cpus is None and total == 0:
        raise ValueError("/proc/stat has no aggregate cpu line")
    return CpuTimes(busy / ticks_per_s, steal / ticks_per_s, total / ticks_per_s)


@dataclass(frozen=True)
class HostLoad:
    """What shared this process's cores between two readings (module docstring)."""

    interval_s: float
    cores: int
    steal_cores: float
    other_cores: float
    load_avg: float | None
    busiest: tuple[tuple[str, float], ...] = ()     # (process name, cores), busiest first
    cluster_cores: float = 0.0                      # the cluster's own other processes (module doc)
    resolution_cores: float = 0.0                   # what the readings' clock ticks can be off by

    def contended(self, threads: int) -> bool:
        """Whether other work took cores that ``threads`` threads of this process need."""
        spare = max(self.cores - max(threads, 1), 0)
        doubt = self.resolution_cores
        return (self.steal_cores - doubt >= STEAL_CORES
                or self.other_cores + self.steal_cores - doubt > spare + SLACK_CORES)

    def describe(self) -> str:
        parts = [f"other processes {self.other_cores:.2f} cores", f"steal {self.steal_cores:.2f} cores"]
        if self.load_avg is not None:
            parts.append(f"load average {self.load_avg:.2f} on {self.cores} cores")
        if self.busiest:
            parts.append("busiest: " + ", ".join(f"{n} {c:.2f}" for n, c in self.busiest))
        if self.cluster_cores:
            parts.append(f"this cluster's other processes {self.cluster_cores:.2f} cores (not counted)")
        return ", ".join(parts)

    def to_json_obj(self, threads: int) -> dict:
        return {"interval_s": round(self.interval_s, 3), "cores": self.cores,
                "other_cores": round(self.other_cores, 3), "steal_cores": round(self.steal_cores, 3),
                "load_avg": self.load_avg, "busiest": [[n, round(c, 3)] for n, c in self.busiest],
                "cluster_cores": round(self.cluster_cores, 3), "contended": self.contended(threads)}


def _read(path: str) -> str:
    return pathlib.Path(path).read_text()


CLUSTER_PID_ENV = "NEXUS_CLUSTER_PID"       # set by `nexus serve` for its children: its own pid


def stat_cpu(read: Callable[[str], str], pid: int, ticks_per_s: float) -> tuple[str, float] | None:
    """(name, CPU seconds) of process ``pid`` from ``/proc/<pid>/stat``; None when it cannot be read."""
    try:
        text = read(f"/proc/{pid}/stat")
    except OSError:
        return None
    name = text[text.find("(") + 1:text.rfind(")")]
    fields = text[text.rfind(")") + 2:].split()
    try:
        return name, (int(fields[11]) + int(fields[12])) / ticks_per_s
    except (IndexError, ValueError):
        return None


def _process_cpu(read: Callable[[str], str], ticks_per_s: float) -> dict[int, tuple[str, float]]:
    """pid -> (name, CPU seconds) of every process readable in /proc."""
    out = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (cpu := stat_cpu(read, int(entry.name), ticks_per_s)) is not None:
            out[int(entry.name)] = cpu
    return out


def cluster_family(read: Callable[[str], str] = _read, environ: Mapping[str, str] = os.environ,
                   me: int | None = None) -> frozenset[int]:
    """The cluster's own other processes (module doc): the supervisor named by ``$NEXUS_CLUSTER_PID``
    and its children, less this process; empty when not started by one, or when it is gone."""
    text = environ.get(CLUSTER_PID_ENV, "")
    if not text.isdigit():
        return frozenset()
    supervisor = int(text)
    try:
        children = read(f"/proc/{supervisor}/task/{supervisor}/children").split()
    except OSError:
        return frozenset()
    me = os.getpid() if me is None else me
    return frozenset({supervisor, *(int(c) for c in children if c.isdigit())} - {me})


class HostLoadMeter:
    """Successive :class:`HostLoad` readings: each :meth:`sample` covers the time since the last one.

    ``read`` (a path -> text function), ``clock`` and ``own_cpu`` (this process's CPU seconds) are
    injectable for tests. ``processes=True`` also scans every process for the busiest ones (a few
    milliseconds: for reports, not for every batch)."""

    def __init__(self, *, processes: bool = False, read: Callable[[str], str] = _read,
                 clock: Callable[[], float] = time.monotonic, own_cpu: Callable[[], float] = time.process_time,
                 cpus: frozenset[int] | None = None,
                 family: Callable[[], frozenset[int]] = cluster_family) -> None:
        self.read = read
        self.family = family
        self.clock = clock
        self.own_cpu = own_cpu
        self.processes = processes
        try:
            self.ticks_per_s = float(os.sysconf("SC_CLK_TCK"))
        except (ValueError, OSError, AttributeError):
            self.ticks_per_s = 100.0
        if cpus is None:
            try:
                cpus = frozenset(os.sched_getaffinity(0))
            except AttributeError:
                cpus = None
        self.cpus = cpus
        self.cores = len(cpus) if cpus else (os.cpu_count() or 1)
        self._last = self._reading()

    def _reading(self):
        try:
            times = parse_proc_stat(self.read("/proc/stat"), self.cpus, self.ticks_per_s)
        except (OSError, ValueError):
            return None
        procs = _process_cpu(self.read, self.ticks_per_s) if self.processes else {}
        family = {}
        for pid in self.family():
            cpu = procs.get(pid) or stat_cpu(self.read, pid, self.ticks_per_s)
            if cpu is not None:
                family[pid] = cpu
        return self.clock(), times, self.own_cpu(), procs, family

    def sample(self) -> HostLoad | None:
        """The load since the previous sample (or the meter's creation); None where /proc cannot tell."""
        now = self._reading()
        last, self._last = self._last, now
        if now is None or last is None:
            return None
        elapsed = now[0] - last[0]
        if elapsed <= 0:
            return None
        busy = now[1].busy_s - last[1].busy_s
        steal = now[1].steal_s - last[1].steal_s
        own = now[2] - last[2]
        # a family member seen in both readings (one that started or ended between them is not)
        cluster = sum(max(cpu - last[4][pid][1], 0.0) for pid, (name, cpu) in now[4].items()
                      if pid in last[4] and last[4][pid][0] == name)
        other = max(busy - own - cluster, 0.0) / elapsed
        busiest = []
        if self.processes:
            me = os.getpid()
            for pid, (name, cpu) in now[3].items():
                before = last[3].get(pid)
                if pid == me or pid in now[4] or before is None or before[0] != name:
                    continue
                used = (cpu - before[1]) / elapsed
                if used >= 0.05:
                    busiest.append((name, used))
            busiest.sort(key=lambda nc: -nc[1])
        try:
            load_avg = float(self.read("/proc/loadavg").split()[0])
        except (OSError, ValueError, IndexError):
            load_avg = None
        # every tick counter read twice (the CPUs' and each family member's) may be off by a tick
        resolution = 2 * (len(self.cpus or ()) or self.cores) + 2 * len(now[4])
        return HostLoad(elapsed, self.cores, max(steal, 0.0) / elapsed, other, load_avg, tuple(busiest[:BUSIEST]),
                        cluster / elapsed, resolution / self.ticks_per_s / elapsed)


class ContentionMonitor:
    """A thread that samples a :class:`HostLoadMeter` every ``interval_s``; :meth:`contended` is the
    verdict of the last full window for ``threads`` threads (False until one was read)."""

    def __init__(self, threads: int, interval_s: float = 0.5, meter: HostLoadMeter | None = None) -> None:
        self.threads = threads
        self.interval_s = interval_s
        self.meter = meter or HostLoadMeter()
        self.last: HostLoad | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="host-load", daemon=True)

    def start(self) -> "ContentionMonitor":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.last = self.meter.sample()

    def contended(self) -> bool:
        last = self.last
        return last is not None and last.contended(self.threads)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
