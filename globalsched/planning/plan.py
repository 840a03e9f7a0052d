"""Plan value types: the contract between the planning algorithms, the scheduler and ``nexus plan``.

Everything here is a frozen dataclass (or an enum) so that the planning algorithms stay pure
functions ``plan = solve(sessions, gpu, ...)``. Units are in the names: ``*_ms`` milliseconds,
``*_rps`` requests per second, ``*_mb`` megabytes.

The validity rules (docs/planning.md, "The plan"): for every session the throughputs assigned to it add
up to at least its rate; on every GPU the sessions' execution times add up to at most
``duty_cycle_ms``, ``duty_cycle_ms + exec <= slo_ms`` (less the configured margins) for each of them,
``throughput == batch * 1000 / duty_cycle_ms``, and their memory fits. :func:`validate_plan` checks
exactly these and returns every violation found.

Loads and burst headroom (issue 18). An allocation may carry ``load_rps``: the arrival rate the plan
routes to it (the frontends' weight), at most its throughput; without it the load is the
throughput. A session's loads add up to at least its rate. With burst headroom at ``z > 0``
(``--burst-sigma``), every GPU also keeps ``H`` ms free for the pooled burst of its sessions'
arrivals (:mod:`globalsched.planning.headroom`: a cycle overflows with probability at most 1 - Phi(z)): the
executions plus ``H`` fit the duty cycle, and ``duty_cycle_ms + exec + H <= slo_ms`` (less the
margins) for each session. ``H`` is computed from each allocation's batch, load and marginal cost
per item c(batch) of its profile, c taken up to the session's saturated batch (2*l(b) within its
budget). With ``z = 0`` (the default of ``nexus plan``) ``H = 0`` and the rules are those of docs/planning.md.

Prefix sharing (shared layers, issue 3): sessions may belong to a :class:`PrefixGroup` whose profile
gives the latency and memory of the shared prefix alone. A session's own profile is always the
*whole* model run alone. On a GPU that lists the group in ``GpuPlan.shared_prefixes``, the members
present run the prefix once on their combined batch ``B = sum b_i`` and then their suffixes:
``exec = l_p(B) + sum (l_i(b_i) - l_p(b_i))`` and ``memory = m_p(B) + sum (m_i(b_i) - m_p(b_i))``;
every member's request sees that whole group execution time.

Spare GPUs (issue 24, globalsched/planning/replicas.py): a GPU that holds only spare replicas may be
given ``spare_overbook`` times its duty cycle for its executions (the other rules are unchanged).
The frontends split each session's arrivals over all its replicas, so a spare runs a fraction of its
batch but for its own session's burst, and the bursts of the sessions sharing a spare GPU rarely
coincide: the spare GPU's room is pooled over them, not reserved for each at its full batch.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace as _replace
from typing import AbstractSet, Any, Callable, Iterable, Mapping, Sequence

from common.batch_decision import saturated_batch
from globalsched.planning.headroom import BurstTerm, burst_excess_ms, marginal_ms_per_item
from common.profile import Profile
from common.query_graph import QueryError, QueryGraph

# Floating-point slack for comparisons of times (ms) and rates (relative).
EPS_MS = 1e-6
EPS_REL = 1e-9


class PlanningError(ValueError):
    """A workload that no plan can serve; the message names the session and the reason."""


# ---- inputs ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuSpec:
    """The kind of device every GPU of the plan is: a name and its memory."""

    name: str
    memory_mb: float


@dataclass(frozen=True)
class PrefixGroup:
    """Sessions sharing a model prefix; ``profile`` is the prefix's own l_p(b) and m_p(b).

    Contract (checked by the workload parser): for each member and every batch b of the member's
    profile, ``l_p(b) <= l_i(b)`` and ``m_p(b) <= m_i(b)``, and the prefix profile reaches at least
    the member's largest batch.
    """

    name: str
    profile: Profile


@dataclass(frozen=True)
class SessionSpec:
    """A session: a model served under one latency SLO at an offered rate."""

    name: str
    model: str
    slo_ms: float
    rate_rps: float
    profile: Profile
    prefix_group: str | None = None

    def with_rate(self, rate_rps: float) -> "SessionSpec":
        return SessionSpec(self.name, self.model, self.slo_ms, rate_rps, self.profile, self.prefix_group)


# ---- queries (multi-model DAGs) ---------------------------------------------------------------------


@dataclass(frozen=True)
class QueryStage:
    """One model of a query; it becomes the session ``<query>/<stage>`` once given a budget."""

    name: str
    model: str
    profile: Profile
    prefix_group: str | None = None


@dataclass(frozen=True)
class QueryEdge:
    """``parent`` sends ``gamma`` requests to ``child`` per request it receives (fan-out)."""

    parent: str
    child: str
    gamma: float


@dataclass(frozen=True)
class QuerySpec:
    """The planning view of a query: its graph (:class:`common.query_graph.QueryGraph`, shared with
    the served :class:`common.query_def.QueryDef`), a profile per stage, a gamma per edge and an
    end-to-end SLO; each root receives ``rate_rps``.

    Invariants (:meth:`validate`): those of the graph (unique stage names, edges between known
    stages, no duplicate edge, no cycle), positive gammas, SLO and rate positive.
    """

    name: str
    slo_ms: float
    rate_rps: float
    stages: tuple[QueryStage, ...]
    edges: tuple[QueryEdge, ...] = ()
    graph: QueryGraph = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        where = f"query {self.name!r}"
        if not (self.slo_ms > 0 and math.isfinite(self.slo_ms)):
            raise QueryError(f"{where}: slo_ms must be positive")
        if not (self.rate_rps > 0 and math.isfinite(self.rate_rps)):
            raise QueryError(f"{where}: rate must be positive")
        for e in self.edges:
            if not (e.gamma > 0 and math.isfinite(e.gamma)):
                raise QueryError(f"{where}: edge {e.parent}->{e.child} gamma must be positive")
        graph = QueryGraph(self.name, tuple(s.name for s in self.stages), tuple((e.parent, e.child) for e in self.edges))
        object.__setattr__(self, "graph", graph)

    def stage(self, name: str) -> QueryStage:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(name)

    def children(self, name: str) -> list[QueryEdge]:
        """The edges out of stage ``name``, with their gammas."""
        return [e for e in self.edges if e.parent == name]

    def stage_rates_rps(self) -> dict[str, float]:
        """Requests per second reaching each stage: roots get the query rate, children sum gamma*parent."""
        rates = {s.name: 0.0 for s in self.stages}
        for name in self.graph.topological_order():
            if not self.graph.parents(name):
                rates[name] = self.rate_rps
            for e in self.children(name):
                rates[e.child] += rates[name] * e.gamma
        return rates


class SplitMethod(str, enum.Enum):
    """How a query's latency budgets were chosen."""

    TREE_DP = "tree-dp"        # exact DP over the discretised time axis
    DAG_DP = "dag-dp"          # DP on the unrolled tree, shared stages take their tightest copy
    EVEN = "even"              # SLO / path length, tightest path through each stage
    PROPORTIONAL = "proportional"  # SLO * l(1) / (sum of l(1) along the heaviest path)


@dataclass(frozen=True)
class LatencySplit:
    """Per-stage latency budgets of one query; every root-to-leaf path sums to at most its SLO."""

    query: str
    method: SplitMethod
    budgets_ms: tuple[tuple[str, float], ...]
    est_gpus: float  # sum over stages of rate * min l(b)/b at the budget (fractional GPUs)

    def budget_ms(self, stage: str) -> float:
        return dict(self.budgets_ms)[stage]

    def sessions(self, query: QuerySpec) -> tuple[SessionSpec, ...]:
        """The sessions this split turns the query into: SLO = budget, rate = stage rate."""
        rates = query.stage_rates_rps()
        budgets = dict(self.budgets_ms)
        return tuple(
            SessionSpec(query.graph.session_name(s.name), s.model, budgets[s.name], rates[s.name], s.profile,
                        s.prefix_group)
            for s in query.stages)

    def to_json_obj(self) -> dict[str, Any]:
        return {"name": self.query, "method": self.method.value, "est_gpus": round(self.est_gpus, 6),
                "budgets_ms": {k: round(v, 6) for k, v in self.budgets_ms}}


# ---- plan ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SessionAlloc:
    """One session on one GPU: a batch per duty cycle, i.e. ``batch * 1000 / duty_cycle_ms`` req/s;
    ``load_rps`` the arrivals routed here (None: the throughput; see the module docstring)."""

    session: str
    batch: int
    throughput: float
    load_rps: float | None = None

    @property
    def planned_load_rps(self) -> float:
        return self.throughput if self.load_rps is None else self.load_rps


@dataclass(frozen=True)
class GpuPlan:
    """One GPU: its duty cycle and the sessions it runs, one batch each per cycle.

    ``shared_prefixes`` names the prefix groups whose members on this GPU batch their prefix together
    (see the module docstring); empty for plans made without prefix sharing.
    """

    id: int
    duty_cycle_ms: float
    sessions: tuple[SessionAlloc, ...]
    shared_prefixes: tuple[str, ...] = ()

    def session_names(self) -> frozenset[str]:
        """The sessions it runs (kept once computed: the re-planner asks every GPU for every session)."""
        names = self.__dict__.get("_session_names")
        if names is None:
            names = frozenset(a.session for a in self.sessions)
            object.__setattr__(self, "_session_names", names)
        return names


@dataclass(frozen=True)
class Plan:
    """A placement of sessions on GPUs, with what the solver knows about its quality.

    ``optimal``: True when the GPU count is proven minimal (CP-SAT status OPTIMAL, or the count equals
    the lower bound), False when a proving solver stopped early, None when the solver does not prove.
    ``moved``: for a re-plan, how many sessions present before and after changed their set of GPUs.
    ``lower_bound`` is the tight bound (throughput and every session's fixed cost per duty cycle);
    ``lower_bound_throughput_only`` the bound of earlier releases (throughput alone), kept for
    comparison; both are certified (globalsched/planning/algorithms/lower_bound.py), None when not computed.
    ``bound_gpus``: the two bounds before rounding up, (tight, throughput-only), from which the device
    scaler tells how the plan grows with its rates (globalsched/planning/scaling_policy.py); in memory
    only, not in the plan's JSON.
    """

    solver: str
    gpus: tuple[GpuPlan, ...]
    lower_bound: int
    solve_ms: float
    optimal: bool | None = None
    moved: int | None = None
    notes: tuple[str, ...] = ()
    lower_bound_throughput_only: int | None = None
    bound_gpus: tuple[float, float] | None = None

    @property
    def num_gpus(self) -> int:
        return len(self.gpus)

    def throughput_by_session(self) -> dict[str, float]:
        return self._sum_by_session(lambda a: a.throughput)

    def load_by_session(self) -> dict[str, float]:
        """The arrival rate routed to each session (loads, or throughputs where none is given)."""
        return self._sum_by_session(lambda a: a.planned_load_rps)

    def _sum_by_session(self, value: "Callable[[SessionAlloc], float]") -> dict[str, float]:
        out: dict[str, float] = {}
        for g in self.gpus:
            for a in g.sessions:
                out[a.session] = out.get(a.session, 0.0) + value(a)
        return out

    def gpus_of(self, session: str) -> frozenset[int]:
        return frozenset(g.id for g in self.gpus if session in g.session_names())

    def replace(self, **changes: Any) -> "Plan":
        return _replace(self, **changes)

    # ---- JSON (docs/planning.md, "The plan") ----------------------------------------

    def to_json_obj(self) -> dict[str, Any]:
        """The contract's keys in order; ``lower_bound_throughput_only``, ``optimal``/``moved``/``notes``
        and per-GPU ``prefix_groups`` only when they carry information."""
        gpus = []
        for g in self.gpus:
            obj: dict[str, Any] = {
                "id": g.id, "duty_cycle_ms": g.duty_cycle_ms,
                "sessions": [{"session": a.session, "batch": a.batch, "throughput": a.throughput}
                             | ({"load_rps": a.load_rps} if a.load_rps is not None else {})
                             for a in g.sessions]}
            if g.shared_prefixes:
                obj["prefix_groups"] = list(g.shared_prefixes)
            gpus.append(obj)
        out: dict[str, Any] = {"solver": self.solver, "num_gpus": self.num_gpus, "lower_bound": self.lower_bound,
                               "solve_ms": round(self.solve_ms, 3), "gpus": gpus}
        if self.lower_bound_throughput_only is not None:
            out["lower_bound_throughput_only"] = self.lower_bound_throughput_only
        if self.optimal is not None:
            out["optimal"] = self.optimal
        if self.moved is not None:
            out["moved"] = self.moved
        if self.notes:
            out["notes"] = list(self.notes)
        return out

    @staticmethod
    def from_json_obj(obj: Mapping[str, Any]) -> "Plan":
        """Inverse of :meth:`to_json_obj`; raises ValueError naming the field on malformed input."""
        def need(o: Mapping[str, Any], key: str, where: str) -> Any:
            if not isinstance(o, Mapping) or key not in o:
                raise ValueError(f"{where}: missing field '{key}'")
            return o[key]

        gpus = []
        for i, g in enumerate(need(obj, "gpus", "plan")):
            where = f"gpus[{i}]"
            allocs = tuple(
                SessionAlloc(str(need(a, "session", f"{where}.sessions[{j}]")),
                             int(need(a, "batch", f"{where}.sessions[{j}]")),
                             float(need(a, "throughput", f"{where}.sessions[{j}]")),
                             float(a["load_rps"]) if a.get("load_rps") is not None else None)
                for j, a in enumerate(need(g, "sessions", where)))
            gpus.append(GpuPlan(int(need(g, "id", where)), float(need(g, "duty_cycle_ms", where)), allocs,
                                tuple(g.get("prefix_groups", ()))))
        plan = Plan(str(need(obj, "solver", "plan")), tuple(gpus), int(need(obj, "lower_bound", "plan")),
                    float(need(obj, "solve_ms", "plan")), obj.get("optimal"), obj.get("moved"),
                    tuple(obj.get("notes", ())), obj.get("lower_bound_throughput_only"))
        if "num_gpus" in obj and obj["num_gpus"] != plan.num_gpus:
            raise ValueError(f"num_gpus: says {obj['num_gpus']} but gpus lists {plan.num_gpus}")
        return plan


# ---- the cost model: what one GPU's allocations cost ---------------------------------------------------


def slo_budget_ms(slo_ms: float, margins_ms: float = 0.0) -> float:
    """The part of an SLO left for queueing plus execution once network/pre/post margins are taken."""
    return slo_ms - margins_ms


def gpu_exec_breakdown(gpu: GpuPlan, specs: Mapping[str, SessionSpec],
                       groups: Mapping[str, PrefixGroup]) -> tuple[float, float, dict[str, float]]:
    """(execution time of one cycle, memory, execution time each session's request sees).

    Sessions must all be known and batches in range (validate_plan checks that first). A group in
    ``gpu.shared_prefixes`` is batched once across its members present; everyone else runs alone.
    """
    shared = set(gpu.shared_prefixes)
    total_ms = 0.0
    memory = 0.0
    seen_ms: dict[str, float] = {}
    per_group: dict[str, list[tuple[SessionSpec, int]]] = {}
    for a in gpu.sessions:
        spec = specs[a.session]
        if spec.prefix_group is not None and spec.prefix_group in shared:
            per_group.setdefault(spec.prefix_group, []).append((spec, a.batch))
            continue
        lat = spec.profile.latency_ms(a.batch)
        total_ms += lat
        memory += spec.profile.memory_mb(a.batch)
        seen_ms[a.session] = lat
    for gname, members in per_group.items():
        prefix = groups[gname].profile
        combined = sum(b for _, b in members)
        exec_ms = prefix.latency_ms(combined)
        mem = prefix.memory_mb(combined)
        for spec, b in members:
            exec_ms += max(0.0, spec.profile.latency_ms(b) - prefix.latency_ms(b))
            mem += max(0.0, spec.profile.memory_mb(b) - prefix.memory_mb(b))
        total_ms += exec_ms
        memory += mem
        for spec, _ in members:
            seen_ms[spec.name] = exec_ms
    return total_ms, memory, seen_ms


# ---- validation ----------------------------------------------------------------------------------------


class ViolationKind(str, enum.Enum):
    UNKNOWN_SESSION = "unknown-session"
    DUPLICATE_SESSION = "duplicate-session"      # the same session twice on one GPU
    DUPLICATE_GPU_ID = "duplicate-gpu-id"
    EMPTY_GPU = "empty-gpu"
    BAD_DUTY_CYCLE = "bad-duty-cycle"            # not a positive finite number
    BAD_BATCH = "bad-batch"                      # outside 1..the profile's largest batch
    THROUGHPUT = "throughput"                    # throughput != batch * 1000 / duty_cycle_ms
    DUTY_CYCLE = "duty-cycle"                    # executions exceed the duty cycle
    SLO = "slo"                                  # duty cycle + execution exceeds the SLO budget
    MEMORY = "memory"
    UNDER_SERVED = "under-served"                # loads (throughputs) add up to less than the rate
    LOAD = "load"                                # a load above its throughput, or negative
    PREFIX = "prefix"                            # unknown shared prefix or combined batch beyond its profile


@dataclass(frozen=True)
class Violation:
    kind: ViolationKind
    message: str
    gpu_id: int | None = None
    session: str | None = None


def gpu_burst_excess_ms(gpu: GpuPlan, specs: Mapping[str, SessionSpec], margins_ms: float,
                        burst_sigma: float) -> float:
    """H of :mod:`globalsched.planning.headroom` for one GPU of a plan (0 when ``burst_sigma <= 0``); sessions must
    be known and batches in range."""
    if burst_sigma <= 0:
        return 0.0
    return burst_excess_ms([burst_term(a, specs[a.session], margins_ms) for a in gpu.sessions], gpu.duty_cycle_ms,
                           burst_sigma)


def burst_term(alloc: SessionAlloc, spec: SessionSpec, margins_ms: float) -> BurstTerm:
    """``alloc``'s part in its GPU's burst headroom (globalsched/planning/headroom.py): its batch, its load and
    the cost of an item beyond the batch, up to the saturated batch of its SLO budget."""
    p = spec.profile
    largest = saturated_batch(p.latency_ms, slo_budget_ms(spec.slo_ms, margins_ms), p.max_batch, EPS_MS)
    return BurstTerm(alloc.batch, alloc.planned_load_rps, marginal_ms_per_item(p.latency_ms, alloc.batch, largest))


def validate_plan(plan: Plan, sessions: Sequence[SessionSpec], gpu: GpuSpec, margins_ms: float = 0.0,
                  prefix_groups: Iterable[PrefixGroup] = (), burst_sigma: float = 0.0,
                  spare_gpus: AbstractSet[int] = frozenset(), spare_overbook: float = 1.0) -> list[Violation]:
    """Every way ``plan`` breaks the validity rules (docs/planning.md) for ``sessions`` on ``gpu``; [] if valid.

    ``margins_ms`` is the network + pre + post processing time taken from every SLO before checking;
    ``burst_sigma`` > 0 adds the burst headroom rule of the module docstring; the GPUs of
    ``spare_gpus`` may take ``spare_overbook`` times their duty cycle for their executions (the
    module docstring's spare GPUs).
    """
    specs = {s.name: s for s in sessions}
    groups = {g.name: g for g in prefix_groups}
    out: list[Violation] = []
    ids: set[int] = set()
    for g in plan.gpus:
        if g.id in ids:
            out.append(Violation(ViolationKind.DUPLICATE_GPU_ID, f"gpu id {g.id} appears twice", g.id))
        ids.add(g.id)
        if not g.sessions:
            out.append(Violation(ViolationKind.EMPTY_GPU, f"gpu {g.id} runs no session", g.id))
            continue
        d = g.duty_cycle_ms
        if not (isinstance(d, (int, float)) and math.isfinite(d) and d > 0):
            out.append(Violation(ViolationKind.BAD_DUTY_CYCLE, f"gpu {g.id}: duty cycle {d!r} ms", g.id))
            continue
        ok = True
        names: set[str] = set()
        for a in g.sessions:
            if a.session not in specs:
                out.append(Violation(ViolationKind.UNKNOWN_SESSION, f"gpu {g.id}: unknown session {a.session!r}",
                                     g.id, a.session))
                ok = False
                continue
            if a.session in names:
                out.append(Violation(ViolationKind.DUPLICATE_SESSION, f"gpu {g.id}: session {a.session!r} twice",
                                     g.id, a.session))
                ok = False
            names.add(a.session)
            if not (isinstance(a.batch, int) and 1 <= a.batch <= specs[a.session].profile.max_batch):
                out.append(Violation(ViolationKind.BAD_BATCH,
                                     f"gpu {g.id}: session {a.session!r} batch {a.batch} outside 1.."
                                     f"{specs[a.session].profile.max_batch}", g.id, a.session))
                ok = False
                continue
            expected = a.batch * 1000.0 / d
            if not math.isclose(a.throughput, expected, rel_tol=EPS_REL, abs_tol=EPS_REL):
                out.append(Violation(ViolationKind.THROUGHPUT,
                                     f"gpu {g.id}: session {a.session!r} throughput {a.throughput} != "
                                     f"batch*1000/duty_cycle = {expected}", g.id, a.session))
            if a.load_rps is not None and not (0 <= a.load_rps <= a.throughput * (1 + EPS_REL) + EPS_REL):
                out.append(Violation(ViolationKind.LOAD,
                                     f"gpu {g.id}: session {a.session!r} load {a.load_rps} req/s outside 0.."
                                     f"its throughput {a.throughput}", g.id, a.session))
        for gname in g.shared_prefixes:
            if gname not in groups:
                out.append(Violation(ViolationKind.PREFIX, f"gpu {g.id}: unknown prefix group {gname!r}", g.id))
                ok = False
                continue
            combined = sum(a.batch for a in g.sessions
                           if a.session in specs and specs[a.session].prefix_group == gname)
            if combined > groups[gname].profile.max_batch:
                out.append(Violation(ViolationKind.PREFIX,
                                     f"gpu {g.id}: prefix {gname!r} combined batch {combined} beyond its "
                                     f"profile ({groups[gname].profile.max_batch})", g.id))
                ok = False
        if not ok:
            continue
        total_ms, memory, seen_ms = gpu_exec_breakdown(g, specs, groups)
        burst_ms = gpu_burst_excess_ms(g, specs, margins_ms, burst_sigma)
        plus = f" + burst headroom {burst_ms:.6g} ms" if burst_ms > 0 else ""
        spare = g.id in spare_gpus
        room_ms, pooled = (d * spare_overbook, f" x {spare_overbook:g} (a spare GPU)") if spare else (d, "")
        if total_ms + burst_ms > room_ms + EPS_MS:
            out.append(Violation(ViolationKind.DUTY_CYCLE,
                                 f"gpu {g.id}: executions take {total_ms:.6g} ms{plus} > duty cycle {d:.6g} ms{pooled}",
                                 g.id))
        for name, exec_ms in seen_ms.items():
            budget = slo_budget_ms(specs[name].slo_ms, margins_ms)
            if d + exec_ms + burst_ms > budget + EPS_MS:
                out.append(Violation(ViolationKind.SLO,
                                     f"gpu {g.id}: session {name!r} duty cycle {d:.6g} + execution {exec_ms:.6g} ms"
                                     f"{plus} > SLO budget {budget:.6g} ms", g.id, name))
        if memory > gpu.memory_mb + EPS_MS:
            out.append(Violation(ViolationKind.MEMORY,
                                 f"gpu {g.id}: needs {memory:.6g} MB > {gpu.memory_mb:.6g} MB", g.id))
    served = plan.load_by_session()
    with_loads = {a.session for g in plan.gpus for a in g.sessions if a.load_rps is not None}
    for s in sessions:
        got = served.get(s.name, 0.0)
        if got < s.rate_rps * (1 - EPS_REL) - EPS_REL:
            what = "load" if s.name in with_loads else "throughput"
            out.append(Violation(ViolationKind.UNDER_SERVED,
                                 f"session {s.name!r}: {what} {got:.6g} req/s < rate {s.rate_rps:.6g}",
                                 session=s.name))
    return out


def sessions_by_name(sessions: Iterable[SessionSpec]) -> dict[str, SessionSpec]:
    return {s.name: s for s in sessions}


__all__ = [
    "EPS_MS", "EPS_REL", "GpuPlan", "GpuSpec", "LatencySplit", "Plan", "PlanningError", "PrefixGroup",
    "QueryEdge", "QuerySpec", "QueryStage", "SessionAlloc", "SessionSpec", "SplitMethod", "Violation",
    "ViolationKind", "burst_term", "gpu_burst_excess_ms", "gpu_exec_breakdown", "sessions_by_name", "slo_budget_ms", "validate_plan",
]
