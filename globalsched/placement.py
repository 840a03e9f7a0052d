"""From a plan of abstract GPUs to the backends that exist: a pure function.

A plan (``common.plan.Plan``) says what each abstract device runs. The cluster has concrete backends
of a device type. :func:`assign_backends` maps plan devices to backends, keeping a device on the backend
that ran most of the same sessions before (so re-planning moves few sessions), and, when the plan needs
more devices than exist, folds the extra plan devices onto the least-loaded backends (overcommitted:
reported, still served) rather than leaving sessions unserved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence


@dataclass(frozen=True)
class BackendSlot:
    """A registered backend as placement sees it."""

    node_id: str
    device_type: str
    memory_mb: float


@dataclass(frozen=True)
class PlacedSession:
    model: str
    batch: int
    throughput_rps: float


@dataclass(frozen=True)
class BackendAssignment:
    node_id: str
    duty_cycle_ms: float
    sessions: tuple[PlacedSession, ...]


@dataclass(frozen=True)
class Placement:
    backends: tuple[BackendAssignment, ...]
    overcommitted: int          # plan devices folded onto a backend that already had one
    moved: int                  # sessions that left a backend they were on before

    def models_on(self, node_id: str) -> tuple[PlacedSession, ...]:
        for b in self.backends:
            if b.node_id == node_id:
                return b.sessions
        return ()


def assign_backends(device_plans: Sequence[tuple[float, Sequence[PlacedSession]]],
                    backends: Sequence[BackendSlot],
                    previous: Mapping[str, frozenset[str]]) -> Placement:
    """Map plan devices ``(duty_cycle_ms, sessions)`` onto ``backends``.

    ``previous`` maps a node id to the models it served before. Plan devices are matched greedily,
    largest overlap with a backend's previous models first; ties go to the backend listed first.
    """
    if not backends:
        return Placement((), 0, 0)
    order = sorted(range(len(device_plans)), key=lambda i: -len(device_plans[i][1]))
    free = [b.node_id for b in backends]
    chosen: dict[int, str] = {}
    for i in order:
        models = {s.model for s in device_plans[i][1]}
        if not free:
            break
        best = max(free, key=lambda n: (len(models & previous.get(n, frozenset())), -free.index(n)))
        chosen[i] = best
        free.remove(best)
    merged: dict[str, list[tuple[float, Sequence[PlacedSession]]]] = {b.node_id: [] for b in backends}
    for i, node in chosen.items():
        merged[node].append(device_plans[i])
    overcommitted = 0
    load = {n: sum(len(p[1]) for p in plans) for n, plans in merged.items()}
    for i in order:
        if i in chosen:
            continue
        node = min(load, key=lambda n: (load[n], list(load).index(n)))
        merged[node].append(device_plans[i])
        load[node] += len(device_plans[i][1])
        overcommitted += 1
    result = []
    moved = 0
    for b in backends:
        plans = merged[b.node_id]
        sessions: dict[str, PlacedSession] = {}
        for _, placed in plans:
            for s in placed:
                if s.model in sessions:  # the same session on two folded devices: add their shares
                    old = sessions[s.model]
                    s = PlacedSession(s.model, max(s.batch, old.batch), s.throughput_rps + old.throughput_rps)
                sessions[s.model] = s
        duty = max((p[0] for p in plans), default=0.0)
        moved += len(previous.get(b.node_id, frozenset()) - set(sessions))
        result.append(BackendAssignment(b.node_id, duty, tuple(sorted(sessions.values(), key=lambda s: s.model))))
    return Placement(tuple(result), overcommitted, moved)
