"""Placement values: the backends that exist and what each of them runs.

A plan (``globalsched.planning.plan.Plan``) says what each abstract device runs; the cluster has concrete
backends of a device type. globalsched/planning/plan_device_type.py maps plan devices onto backends, keeping a
device on the backend that ran it (so re-planning moves few sessions), and, when the plan needs
more devices than exist, folds the extra plan devices onto the least-loaded backends
(``overcommitted``: reported, still served) rather than leaving sessions unserved.
"""

from __future__ import annotations

from dataclasses import dataclass


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
    throughput_rps: float       # batch per duty cycle: what the backend can serve of it
    load_rps: float = 0.0       # the arrivals planned here (at most the throughput: burst headroom); routed by it


@dataclass(frozen=True)
class BackendAssignment:
    node_id: str
    duty_cycle_ms: float
    sessions: tuple[PlacedSession, ...]
    exec_ms: float = 0.0        # the batches' execution per duty cycle, a shared prefix counted once
    spare: bool = False         # holds only spare replicas (globalsched/planning/replicas.py, add_spares)


@dataclass(frozen=True)
class Placement:
    backends: tuple[BackendAssignment, ...]
    overcommitted: int          # plan devices folded onto a backend that already had one
    moved: int                  # sessions that left a backend they were on before
