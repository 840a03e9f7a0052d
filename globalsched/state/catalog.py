"""What the tables say about models beside the placement, read once when a plan is made: with it, a
plan is a complete value, and distribution (globalsched/actuators/distribution.py) only sends it.

Model administration (globalsched/state/model_admin.py) makes a :class:`Catalog` for each new plan
(``ModelAdmin.catalog``); the control loop attaches it to the plan (``ClusterPlan.catalog``) before any
actuator sees the plan. The descriptions are the protobuf messages every table carries: built once,
at model administration's edge, and sent as they are.

:class:`DistributionEvents` is the other direction: what distribution learns while sending (a model
a backend could not load; which versions a routing table routed) goes back as events, and model
administration decides what they change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Protocol

from common.pb import control
from common.profile import Profile


@dataclass(frozen=True)
class UnplannedRoute:
    """A served version the plan has no session for, routed UNAVAILABLE with why (its loads failed on
    every device type, or its version policy selects none of the stored versions)."""

    key: str
    slo_ms: float
    reason: str


@dataclass(frozen=True)
class Catalog:
    descs: Mapping[str, control.ModelDesc] = field(default_factory=dict)        # every stored version by key
    profiles: Mapping[tuple[str, str], Profile] = field(default_factory=dict)   # (key, device type): what plans
    emulated: Mapping[tuple[str, str], Profile] = field(default_factory=dict)   # (key, device type): what an
    #                                                                             emulated device executes
    unavailable: Mapping[str, str] = field(default_factory=dict)   # key -> why no backend can serve it
    profiling: frozenset[str] = frozenset()                         # models being profiled now
    unplanned: tuple[UnplannedRoute, ...] = ()
    queries: Mapping[str, str] = field(default_factory=dict)        # registered queries' definitions by name


class DistributionEvents(Protocol):
    def load_failed(self, model: str, session: str, node_id: str, device_type: str, reason: str) -> None:
        """A backend's model table reply says it could not load ``model`` (for ``session``)."""

    def loaded(self, models: Iterable[str]) -> None:
        """Backends answered model tables that loaded these models (version keys)."""

    def routed(self, keys: list[str]) -> None:
        """A routing table that routes these version keys to backends reached the frontends."""
