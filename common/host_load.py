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
* ``load_avg``: the 1-minute load average of ``/proc/loadavg`` (the whole host; reported, not judged);
* ``busiest``: with ``processes=True``, the other processes that used the most CPU meanwhile
  (``/proc/<pid>/stat``), by name, for a report.

Contended (:meth:`HostLoad.contended`): other work took cores that ``threads`` threads of ours
need: ``steal_cores >= 0.1``, or ``other_cores + steal_cores`` beyond the cores left over once our
threads have theirs (``cores - threads``) by more than half a core. Half a core of slack keeps a
frontend or a shell that wakes now and then from flagging every batch.
"""

from __future__ import annotations

import os
import pathlib
import time
from dataclasses import dataclass
from typing import Callable

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

    def contended(self, threads: int) -> bool:
        """Whether other work took cores that ``threads`` threads of this process need."""
        spare = max(self.cores - max(threads, 1), 0)
        return self.steal_cores >= STEAL_CORES or self.other_cores + self.steal_cores > spare + SLACK_CORES

    def describe(self) -> str:
        parts = [f"other processes {self.other_cores:.2f} cores", f"steal {self.steal_cores:.2f} cores"]
        if self.load_avg is not None:
            parts.append(f"load average {self.load_avg:.2f} on {self.cores} cores")
        if self.busiest:
            parts.append("busiest: " + ", ".join(f"{n} {c:.2f}" for n, c in self.busiest))
        return ", ".join(parts)

    def to_json_obj(self, threads: int) -> dict:
        return {"interval_s": round(self.interval_s, 3), "cores": self.cores,
                "other_cores": round(self.other_cores, 3), "steal_cores": round(self.steal_cores, 3),
                "load_avg": self.load_avg, "busiest": [[n, round(c, 3)] for n, c in self.busiest],
                "contended": self.contended(threads)}


def _read(path: str) -> str:
    return pathlib.Path(path).read_text()


def _process_cpu(read: Callable[[str], str], ticks_per_s: float) -> dict[int, tuple[str, float]]:
    """pid -> (name, CPU seconds) of every process readable in /proc."""
    out = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            text = read(f"/proc/{entry.name}/stat")
        except OSError:
            continue
        name = text[text.find("(") + 1:text.rfind(")")]
        fields = text[text.rfind(")") + 2:].split()
        try:
            out[int(entry.name)] = (name, (int(fields[11]) + int(fields[12])) / ticks_per_s)
        except (IndexError, ValueError):
            continue
    return out


class HostLoadMeter:
    """Successive :class:`HostLoad` readings: each :meth:`sample` covers the time since the last one.

    ``read`` (a path -> text function), ``clock`` and ``own_cpu`` (this process's CPU seconds) are
    injectable for tests. ``processes=True`` also scans every process for the busiest ones (a few
    milliseconds: for reports, not for every batch)."""

    def __init__(self, *, processes: bool = False, read: Callable[[str], str] = _read,
                 clock: Callable[[], float] = time.monotonic, own_cpu: Callable[[], float] = time.process_time,
                 cpus: frozenset[int] | None = None) -> None:
        self.read = read
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
        return self.clock(), times, self.own_cpu(), procs

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
        other = max(busy - own, 0.0) / elapsed
        busiest = []
        if self.processes:
            me = os.getpid()
            for pid, (name, cpu) in now[3].items():
                before = last[3].get(pid)
                if pid == me or before is None or before[0] != name:
                    continue
                used = (cpu - before[1]) / elapsed
                if used >= 0.05:
                    busiest.append((name, used))
            busiest.sort(key=lambda nc: -nc[1])
        try:
            load_avg = float(self.read("/proc/loadavg").split()[0])
        except (OSError, ValueError, IndexError):
            load_avg = None
        return HostLoad(elapsed, self.cores, max(steal, 0.0) / elapsed, other, load_avg, tuple(busiest[:BUSIEST]))


class ContentionMonitor:
    """A thread that samples a :class:`HostLoadMeter` every ``interval_s``; :meth:`contended` is the
    verdict of the last full window for ``threads`` threads (False until one was read)."""

    def __init__(self, threads: int, interval_s: float = 0.5, meter: HostLoadMeter | None = None) -> None:
        import threading

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
