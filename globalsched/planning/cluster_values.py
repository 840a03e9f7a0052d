"""The planner's input and output values: what the scheduler knows (:class:`ClusterView`) and what it
decided (:class:`ClusterPlan`). All frozen.

The pure planner (globalsched/planning/planner.py) maps a view and its own state to a plan; the planning task
(globalsched/planning/control_loop.py) reads the view and hands the plan to the actuators that apply it:
tables to backends and frontends (globalsched/actuators/distribution.py), profiling of models the plan needs
profiled, and the number of devices per device type the plan wants (``devices_needed``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

from common.profile import Profile
from globalsched.planning.algorithms.replan import ReplanReason
from globalsched.state.catalog import Catalog
from globalsched.planning.placement import BackendSlot, Placement

if TYPE_CHECKING:
    from common.query_def import QueryDef

MIN_PLANNED_RATE_RPS = 1.0
UNBOUNDED_MEMORY_MB = 1e12  # a backend that reports no memory limit


# ---- input -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SessionInput:
    """A session as the placement sees it: its SLO, planned rate and profiles by device type."""

    model: str
    slo_ms: float
    rate_rps: float
    profiles: Mapping[str, Profile]      # by device type
    prefix_group: str = ""
    prefix_share: float | None = None     # fraction of the model's weights in its group's prefix


@dataclass(frozen=True)
class ModelView:
    """A model served under its own name (a row of the session table) with what planning needs of it."""

    name: str
    slo_ms: float
    profiles: Mapping[str, Profile]       # by device type, co-location slowdown applied
    prefix_group: str = ""
    prefix_share: float | None = None
    min_replicas: int = 0                 # 0: the scheduler's default
    unloadable_on: frozenset[str] = frozenset()   # device types where its load attempts are spent
    # the least rate planned for until its traffic has been measured over a whole rate window (0: none;
    # a model without one and no measured rate is planned for the scheduler's default)
    expected_rate_rps: float = 0.0


@dataclass(frozen=True)
class ClusterView:
    """Everything the planner reads, at ``now_s`` (monotonic seconds).

    ``rates_rps`` are measured (window means, before headroom; a surge's latest rate) per session
    name, a query's under the query's name, over ``rate_windows_s`` seconds of counted requests (0
    or absent: unknown); ``surges_rps`` the sessions whose latest reports jumped
    beyond noise (globalsched/state/rate_reports.py); ``gammas`` the measured fan-out per (query, parent, child). ``stage_models`` has the
    profiles and unloadable device types of every model a query stage runs. ``force`` is set when
    something the plan depends on changed (``why`` says what); otherwise the planner judges the rates
    by its bands and epoch.
    """

    now_s: float
    backends: tuple[BackendSlot, ...] = ()
    models: tuple[ModelView, ...] = ()
    queries: Mapping[str, QueryDef] = field(default_factory=dict)
    stage_models: Mapping[str, ModelView] = field(default_factory=dict)
    rates_rps: Mapping[str, float] = field(default_factory=dict)
    surges_rps: Mapping[str, float] = field(default_factory=dict)   # sessions whose demand just jumped
    rate_windows_s: Mapping[str, float] = field(default_factory=dict)
    surge_windows_s: Mapping[str, float] = field(default_factory=dict)   # seconds of each surging report
    # the latest reports per session: (rate summed over frontends, the shortest window's seconds)
    latest_reports: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    # per session, the index of dispersion of its reports' counts (common/surge.py, the largest of its
    # frontends'); one not known is taken as Poisson's, 1
    rate_dispersions: Mapping[str, float] = field(default_factory=dict)
    gammas: Mapping[tuple[str, str, str], float] = field(default_factory=dict)
    last_requested_s: Mapping[str, float] = field(default_factory=dict)   # session -> its last reported request
    force: ReplanReason | None = None
    why: tuple[str, ...] = ()

    def device_types(self) -> list[str]:
        """Device types present, the type of the most backends first (ties by name)."""
        counts: dict[str, int] = {}
        for b in self.backends:
            counts[b.device_type] = counts.get(b.device_type, 0) + 1
        return sorted(counts, key=lambda t: (-counts[t], t))


# ---- output ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QueryPlan:
    """How a query's SLO was split over its stages (globalsched/planning/query_sessions.py)."""

    name: str
    budgets_ms: Mapping[str, float]
    gammas: Mapping[str, float]            # "parent->child" -> gamma used
    method: str
    reason: str = ""
    stage_rates_rps: Mapping[str, float] = field(default_factory=dict)
    latest_finish_ms: Mapping[str, float] = field(default_factory=dict)   # common.query_def.latest_finish_ms


@dataclass(frozen=True)
class PlannedSession:
    """A session of the plan: the model it runs (a query stage's differs from its name), its SLO (a
    stage's latency budget) and the rate it is planned for, headroom included."""

    name: str
    model: str
    slo_ms: float
    rate_rps: float


@dataclass(frozen=True)
class ClusterPlan:
    placements: Mapping[str, Placement]               # by device type
    unplaced: Mapping[str, str]                       # session -> reason
    need_profile: Mapping[str, str]                   # model -> device type to profile it on
    best_effort: Mapping[str, str] = field(default_factory=dict)  # session -> why it cannot meet its SLO
    cold: frozenset[str] = frozenset()                # sessions not resident (in ``unplaced``): paged in on demand
    num_devices_planned: int = 0
    lower_bound: int = 0                              # the certified bound: throughput and fixed costs
    lower_bound_throughput_only: int = 0              # the bound of earlier releases, for comparison
    solver: str = ""
    notes: tuple[str, ...] = ()
    sessions: Mapping[str, PlannedSession] = field(default_factory=dict)
    query_plans: Mapping[str, QueryPlan] = field(default_factory=dict)
    planned_query_rates: Mapping[str, float] = field(default_factory=dict)   # query -> rate with headroom
    planned_gammas: Mapping[tuple[str, str, str], float] = field(default_factory=dict)
    devices_needed: Mapping[str, int] = field(default_factory=dict)   # device type -> devices the plan uses
    lower_bounds: Mapping[str, int] = field(default_factory=dict)     # device type -> its lower bound
    # device type -> its (tight, throughput-only) bounds before rounding up, at the rates planned
    bound_gpus: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    reasons: Mapping[str, ReplanReason] = field(default_factory=dict)  # device type -> why it was re-planned
    why: tuple[str, ...] = ()                                          # what forced this plan, if anything
    # The models' descriptions and profiles the tables carry, read when the plan was made (the control
    # loop attaches it: the planner never reads it); None on the planner's own value.
    catalog: Catalog | None = field(default=None, compare=False)

    def backends_of(self, session: str) -> list[tuple[str, float]]:
        """(node id, throughput share) of every backend serving ``session``."""
        out = []
        for placement in self.placements.values():
            for b in placement.backends:
                for s in b.sessions:
                    if s.model == session:
                        out.append((b.node_id, s.throughput_rps))
        return out

    def routes(self) -> dict[str, list[tuple[str, float, int, float]]]:
        """Per session, where frontends send it: (node id, share of its arrivals in requests/s, planned
        batch, the backend's duty cycle). A share is the load the plan puts there (the throughput
        where it gave none): frontends route by it, so a replica planned for the whole rate but
        carrying part of it is not sent more than its part."""
        out: dict[str, list[tuple[str, float, int, float]]] = {}
        for placement in self.placements.values():
            for b in placement.backends:
                for s in b.sessions:
                    out.setdefault(s.model, []).append((b.node_id, s.load_rps or s.throughput_rps, s.batch,
                                                        b.duty_cycle_ms))
        return out

    def routed_load_rps(self) -> dict[str, float]:
        """Per backend, the arrivals per second the frontends send it at the planned rates: each
        session's planned load (on its backends that are not spare) split by the shares of
        :meth:`routes`. A spare replica is planned for the whole load of its session but carries its
        share of it."""
        spare = {b.node_id for p in self.placements.values() for b in p.backends if b.spare}
        out: dict[str, float] = {}
        for routes in self.routes().values():
            total = sum(share for _, share, _, _ in routes)
            rate = sum(share for node, share, _, _ in routes if node not in spare)
            for node, share, _, _ in routes:
                out[node] = out.get(node, 0.0) + (rate * share / total if total > 0 else 0.0)
        return out

    def sessions_on(self, node_id: str) -> int:
        """Sessions the plan runs on a backend."""
        return sum(len(b.sessions) for p in self.placements.values() for b in p.backends if b.node_id == node_id)

    def model_of(self, session: str) -> str:
        planned = self.sessions.get(session)
        return planned.model if planned is not None else session
