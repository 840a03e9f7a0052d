"""The CPU the serving path takes on the cores ``nexus serve``'s backends use: what
:func:`nexus.cpu_layout.decide` leaves off each layout's devices (a :class:`~nexus.cpu_layout.ServingPath`).

The path is everything on those cores but the backends: the frontend, the scheduler, ``nexus serve``
itself, the clients on this machine and any other work. :meth:`ServingPathMeter.sample` gives it in
cores over the last ``window_s``: the busy time of the CPUs this process may run on (``/proc/stat``)
less the CPU of the backend processes named (``/proc/PID/stat``), both counted between the oldest
reading within the window and now. Of it, the CPU of the frontend processes named and their
descendants (a frontend's workers) is the part that grows with the rates (``rate_cores``); the rest
(``fixed_cores``) is taken as it is. A process first seen in the window counts from its first
reading (a backend's CPU before it is the path's: at most one poll's worth, once per switch).

The backends' own work outside their models (their event loops, the hop's frames) is left out: it
runs between their batches more than beside them, and the figure is a lower bound of the path.
``read`` and ``clock`` are injectable for tests; off Linux (no ``/proc/stat``) it gives none.
"""

from __future__ import annotations

import collections
import os
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from common.host_load import parse_proc_stat, stat_cpu
from nexus.cpu_layout import ServingPath

WINDOW_S = 10.0             # the span a figure covers, once readings reach back that far


@dataclass(frozen=True)
class _Reading:
    at_s: float
    busy_s: float                       # busy CPU seconds of the CPUs measured
    backends_s: Mapping[int, float]     # pid -> its CPU seconds
    frontends_s: Mapping[int, float]


class ServingPathMeter:
    """Successive readings; :meth:`sample` reads once more and gives the path (module docstring)."""

    def __init__(self, window_s: float = WINDOW_S, *, read: Callable[[str], str] | None = None,
                 clock: Callable[[], float] = time.monotonic, cpus: frozenset[int] | None = None) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be positive, got {window_s}")
        self.window_s = window_s
        self.read = read or (lambda path: open(path).read())
        self.clock = clock
        self.cpus = cpus if cpus is not None else frozenset(os.sched_getaffinity(0))
        try:
            self.ticks_per_s = float(os.sysconf("SC_CLK_TCK"))
        except (ValueError, OSError, AttributeError):
            self.ticks_per_s = 100.0
        self._readings: collections.deque[_Reading] = collections.deque()

    def reset(self) -> None:
        """Forget the readings: the backends changed, and the old ones' last CPU is no one's path."""
        self._readings.clear()

    def _cpu(self, pids: Iterable[int]) -> dict[int, float]:
        out = {}
        for pid in pids:
            cpu = stat_cpu(self.read, pid, self.ticks_per_s)
            if cpu is not None:
                out[pid] = cpu[1]
        return out

    def _with_descendants(self, pids: Iterable[int]) -> set[int]:
        seen, todo = set(), list(pids)
        while todo:
            pid = todo.pop()
            if pid in seen:
                continue
            seen.add(pid)
            try:
                todo += [int(c) for c in self.read(f"/proc/{pid}/task/{pid}/children").split()]
            except (OSError, ValueError):
                pass
        return seen

    def _reading(self, backend_pids: Iterable[int], frontend_pids: Iterable[int]) -> _Reading | None:
        try:
            busy = parse_proc_stat(self.read("/proc/stat"), self.cpus, self.ticks_per_s).busy_s
        except (OSError, ValueError):
            return None
        return _Reading(self.clock(), busy, self._cpu(backend_pids), self._cpu(self._with_descendants(frontend_pids)))

    def _since_first(self, now: Mapping[int, float], which: str) -> float:
        """CPU seconds of the processes in ``now`` since each one's first reading within the window."""
        return sum(cpu - next(getattr(r, which)[pid] for r in self._readings if pid in getattr(r, which))
                   for pid, cpu in now.items())

    def sample(self, backend_pids: Iterable[int], frontend_pids: Iterable[int] = ()) -> ServingPath:
        """The path over the window up to now (none before two readings, or without ``/proc``)."""
        now = self._reading(backend_pids, frontend_pids)
        if now is None:
            return ServingPath()
        while len(self._readings) > 1 and now.at_s - self._readings[1].at_s >= self.window_s:
            self._readings.popleft()        # the oldest that still reaches back a whole window stays
        self._readings.append(now)
        span = now.at_s - self._readings[0].at_s
        if span <= 0:
            return ServingPath()
        path = max(0.0, now.busy_s - self._readings[0].busy_s - self._since_first(now.backends_s, "backends_s"))
        frontends = min(path, self._since_first(now.frontends_s, "frontends_s"))
        return ServingPath((path - frontends) / span, frontends / span)
