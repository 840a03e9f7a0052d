"""A simulation beside a real run of the same trace: the scaling decisions read from both sides'
logs, their pairing in time, and the series a comparison is made of (benchmarks/sim_fidelity.py
runs the comparison; benchmarks/sim_fidelity.md holds its results). Pure functions: no processes,
no clock.

Real lines are ``(seen_s, line)``: the monotonic time the line was read, and its text; a line that
carries its own ``asctime`` is dated by it (``wall_minus_mono_s`` converts). Simulated decisions
come from the simulation's events (nexus/simulate/run.py, ``Simulation.events``).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import re
from typing import Iterable, Sequence

import numpy as np

UNMATCHED_COST_S = 6.0          # match_decisions pairs two decisions at most 2x this apart
KINDS = ("add", "remove", "plan", "desired")
EXIT = "exit"                   # not a decision: a drained backend's process ended (device-seconds stop)


@dataclasses.dataclass(frozen=True)
class Decision:
    """One control-plane decision at ``time_s`` (seconds from the trace's start): ``kind`` one of
    KINDS, ``value`` the new desired count for "desired" (else 0), ``text`` what the log said."""

    time_s: float
    kind: str
    value: int = 0
    text: str = ""


@dataclasses.dataclass(frozen=True)
class Match:
    kind: str
    real: Decision | None
    sim: Decision | None

    @property
    def dt_s(self) -> float | None:
        """Simulated minus real time; None when one side has no such decision."""
        return None if self.real is None or self.sim is None else self.sim.time_s - self.real.time_s

    def within(self, tolerance_s: float) -> bool:
        return self.dt_s is not None and abs(self.dt_s) <= tolerance_s


def match_decisions(real: Sequence[Decision], sim: Sequence[Decision], *,
                    unmatched_cost_s: float = UNMATCHED_COST_S) -> list[Match]:
    """Pair the decisions of each kind in time order, as an alignment (no pair crosses another):
    the pairing that minimises the sum of |time differences| plus ``unmatched_cost_s`` for each
    decision left without a partner (so two decisions more than twice that apart are never paired,
    and a decision one side made and the other did not shows as unmatched rather than shifting every
    later pair). "desired" decisions pair only with the same new count. Returned sorted by time."""
    out: list[Match] = []
    for kind in sorted({d.kind for d in (*real, *sim)}):
        r = sorted((d for d in real if d.kind == kind), key=lambda d: d.time_s)
        s = sorted((d for d in sim if d.kind == kind), key=lambda d: d.time_s)
        n, m = len(r), len(s)
        inf = math.inf
        cost = [[inf] * (m + 1) for _ in range(n + 1)]
        back = [[""] * (m + 1) for _ in range(n + 1)]
        cost[0][0] = 0.0
        for i in range(n + 1):
            for j in range(m + 1):
                if i and cost[i - 1][j] + unmatched_cost_s < cost[i][j]:
                    cost[i][j], back[i][j] = cost[i - 1][j] + unmatched_cost_s, "r"
                if j and cost[i][j - 1] + unmatched_cost_s < cost[i][j]:
                    cost[i][j], back[i][j] = cost[i][j - 1] + unmatched_cost_s, "s"
                if i and j and (kind != "desired" or r[i - 1].value == s[j - 1].value):
                    c = cost[i - 1][j - 1] + abs(r[i - 1].time_s - s[j - 1].time_s)
                    if c < cost[i][j]:
                        cost[i][j], back[i][j] = c, "m"
        i, j, pairs = n, m, []
        while i or j:
            step = back[i][j]
            if step == "m":
                pairs.append(Match(kind, r[i - 1], s[j - 1]))
                i, j = i - 1, j - 1
            elif step == "r":
                pairs.append(Match(kind, r[i - 1], None))
                i -= 1
            else:
                pairs.append(Match(kind, None, s[j - 1]))
                j -= 1
        out += reversed(pairs)
    return sorted(out, key=lambda p: (min(d.time_s for d in (p.real, p.sim) if d is not None), p.kind))


ASCTIME_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
ADDING_LINE = re.compile(r"nexus serve: adding (backend-\d+)")
REMOVING_LINE = re.compile(r"nexus serve: removing (backend-\d+)")
STARTED_LINE = re.compile(r"nexus serve: (backend-\d+) started \(pid \d+\) at (\S+)")
STOPPED_LINE = re.compile(r"nexus serve: (backend-\d+) \(pid \d+\) stopped")
REPLANNED_LINE = re.compile(r"epoch \d+: re-planned")
DESIRED_LINE = re.compile(r"devices (\w+): (\d+) desired, (\d+) registered")
REGISTERED_LINE = re.compile(r"re-plan requested: (\S+) registered at (\S+)")
WARMED_LINE = re.compile(r"\((\d+) batches, (\d+) ms\)")
EPOCH_PLANNED_LINE = re.compile(r"epoch (\d+): re-planned")
EPOCH_ROUTED_LINE = re.compile(r"routing epoch (\d+):")
DUTY_LINE = re.compile(r"epoch (\d+): (\S+) duty cycle [\d.]+ ms: (.*)$")


def fit_distribution(samples: Sequence[tuple[int, float]]) -> tuple[float, float] | None:
    """Least squares of delay = intercept + slope * n over ``(n, delay)``: n the most sessions new to
    one backend in a plan (the simulator loads a backend's new models one after another, the backends
    in parallel, then pushes the routing tables), so ``slope`` is the simulator's ``model_load_s`` and
    ``intercept`` its fixed part (``planning_ms`` plus three control hops). None without two
    different n."""
    if len({n for n, _ in samples}) < 2:
        return None
    x = np.array([n for n, _ in samples], float)
    y = np.array([d for _, d in samples], float)
    slope, intercept = np.polyfit(x, y, 1)
    return float(intercept), float(slope)


def new_sessions_per_plan(lines: Iterable[tuple[float, str]], wall_minus_mono_s: float | None
                          ) -> list[tuple[int, float]]:
    """(most sessions new to one backend, delay to the frontends) of each real plan, from the
    scheduler's per-backend plan lines ('epoch E: NODE duty cycle D ms: m01 b=3 ..., ...'; a plan
    names only the backends whose assignment changed, the others hold what they held)."""
    lines = list(lines)
    plans: dict[int, dict[str, set[str]]] = {}
    for _, line in lines:
        if m := DUTY_LINE.search(line):
            models = set() if m.group(3).strip() == "idle" else {x.split(" b=")[0] for x in m.group(3).split(", ")}
            plans.setdefault(int(m.group(1)), {})[m.group(2)] = models
    delays = dict((e, d) for (t, e), d in zip(*_planned_routed(lines, wall_minus_mono_s)))
    out: list[tuple[int, float]] = []
    held: dict[str, set[str]] = {}
    for e in sorted(plans):
        if held and e in delays:
            n = max((len(plans[e][node] - held.get(node, set())) for node in plans[e]), default=0)
            out.append((n, delays[e]))
        held.update(plans[e])
    return out


def _planned_routed(lines, wall_minus_mono_s):
    planned, routed = [], []
    for seen, line in lines:
        if m := EPOCH_PLANNED_LINE.search(line):
            planned.append((line_time(seen, line, wall_minus_mono_s), int(m.group(1))))
        elif m := EPOCH_ROUTED_LINE.search(line):
            routed.append((line_time(seen, line, wall_minus_mono_s), int(m.group(1))))
    epochs = {e for _, e in routed}
    kept = [p for p in planned if p[1] in epochs]
    return kept, distribution_delays(kept, routed)


def distribution_delays(planned: Iterable[tuple[float, int]], routed: Iterable[tuple[float, int]]) -> list[float]:
    """Seconds from each plan (time, epoch) to the first routing table of that epoch at a frontend
    (time, epoch): how long a plan takes to reach the requests (model tables, loads and warm-ups, then
    the routing tables). Plans no frontend got (superseded, or after the end) are left out."""
    first: dict[int, float] = {}
    for t, e in routed:
        first[e] = min(t, first.get(e, math.inf))
    return [first[e] - t for t, e in planned if e in first]


def real_distribution(lines: Iterable[tuple[float, str]], wall_minus_mono_s: float | None) -> list[tuple[float, float]]:
    """(plan time, delay) of each plan in the real logs (:func:`distribution_delays`)."""
    kept, delays = _planned_routed(list(lines), wall_minus_mono_s)
    return [(t, d) for (t, _), d in zip(kept, delays)]


def line_time(seen_s: float, line: str, wall_minus_mono_s: float | None) -> float:
    """When a line was written, on the monotonic clock: its own ``asctime`` (local time, ms) where it
    has one and the offset between the clocks is known, else when it was seen."""
    m = ASCTIME_LINE.match(line)
    if m is None or wall_minus_mono_s is None:
        return seen_s
    wall = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return wall - wall_minus_mono_s


def real_decisions(lines: Iterable[tuple[float, str]], t0: float, wall_minus_mono_s: float | None,
                   device_type: str = "t4") -> list[Decision]:
    """The decisions in ``nexus serve --log-level info``'s lines (``(monotonic time seen, line)``), in
    seconds from ``t0``. "desired" only where the count changes (the scheduler also logs a change of
    the registered count or the drain choice)."""
    out, desired = [], None
    for seen, line in lines:
        t = line_time(seen, line, wall_minus_mono_s) - t0
        if ADDING_LINE.search(line):
            out.append(Decision(t, "add", 0, line.split("nexus serve: ", 1)[1]))
        elif REMOVING_LINE.search(line):
            out.append(Decision(t, "remove", 0, line.split("nexus serve: ", 1)[1]))
        elif STOPPED_LINE.search(line):
            out.append(Decision(t, EXIT, 0, line.split("nexus serve: ", 1)[1]))
        elif REPLANNED_LINE.search(line):
            out.append(Decision(t, "plan", 0, line[line.find("epoch"):]))
        elif (m := DESIRED_LINE.search(line)) and m.group(1) == device_type:
            if int(m.group(2)) != desired:
                desired = int(m.group(2))
                out.append(Decision(t, "desired", desired, line[m.start():]))
    return out


def sim_decisions(events: Iterable[dict], lead_s: float) -> list[Decision]:
    """The same decisions from a simulation's events (``Simulation.events``), in seconds from the
    trace's start (the simulated trace began ``lead_s`` in)."""
    out, desired = [], None
    for e in events:
        t, kind, text = e["time_s"] - lead_s, e["kind"], e["text"]
        if kind == "actuator" and text.startswith("adding"):
            out.append(Decision(t, "add", 0, text))
        elif kind == "actuator" and text.startswith("removing"):
            out.append(Decision(t, "remove", 0, text))
        elif kind == "membership" and text.endswith("drained and exited"):
            out.append(Decision(t, EXIT, 0, text))
        elif kind == "plan":
            out.append(Decision(t, "plan", 0, text))
        elif kind == "scaling" and e.get("desired") != desired:
            desired = e["desired"]
            out.append(Decision(t, "desired", int(desired), text))
    return out


def within_window(decisions: Iterable[Decision], start_s: float, end_s: float) -> list[Decision]:
    return [d for d in decisions if start_s <= d.time_s < end_s]


def per_second(times_s: np.ndarray, good: np.ndarray, seconds: int) -> list[float | None]:
    """The share of ``good`` among the requests sent in each second [k, k+1), k < ``seconds``
    (None for a second without requests); times outside are clipped into the first or last second."""
    idx = np.clip(np.floor(np.asarray(times_s, float)).astype(np.int64), 0, seconds - 1)
    n = np.bincount(idx, minlength=seconds)
    g = np.bincount(idx[np.asarray(good, bool)], minlength=seconds)
    return [float(a / b) if b else None for a, b in zip(g.tolist(), n.tolist())]


def intervals_overlap_s(intervals: Iterable[tuple[float, float | None]], start_s: float, end_s: float) -> float:
    """Sum over ``(begin, end)`` (end None: still running) of their overlap with [start_s, end_s]."""
    total = 0.0
    for a, b in intervals:
        b = end_s if b is None else b
        total += max(0.0, min(b, end_s) - max(a, start_s))
    return total
