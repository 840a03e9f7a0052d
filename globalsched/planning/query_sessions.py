"""Turning registered queries into stage sessions with latency budgets: a pure function.

For each query the latency split (``globalsched.planning.algorithms.split_latency``: DP by default, or the
even / proportional baselines) is computed on the profiles of one device type, with the query's
reported rate and the fan-out gamma measured per edge. Each stage becomes the session
``<query>/<stage>`` whose SLO is its budget and whose rate is the query rate times the gammas along
the way. A query the split cannot serve within its SLO (2*l(1) per stage does not fit) keeps an
even split, is served best effort, and carries the reason.

The DP minimises *fractional* GPUs (rate * l(b)/b per stage); whole GPUs after bin packing can
disagree by one either way. So ``method="dp"`` also packs the even and proportional splits of the
query's stages (squishy, a millisecond) and keeps whichever needs the fewest whole GPUs, DP on
ties: the scheduler's split is never worse than the even split it is compared against.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Mapping

from globalsched.planning.algorithms import PlannerConfig, even_split, proportional_split, solve, split_latency
from globalsched.planning.plan import GpuSpec, PlanningError, QueryEdge, QuerySpec, QueryStage
from common.profile import Profile
from common.query_def import QueryDef, even_budgets_ms, latest_finish_ms
from globalsched.planning.cluster_values import MIN_PLANNED_RATE_RPS, UNBOUNDED_MEMORY_MB, QueryPlan, SessionInput

SPLIT_METHODS = ("dp", "even", "proportional")
DEFAULT_GAMMA = 1.0
SPLIT_CACHE_SIZE = 256      # splits remembered (query x rate x gammas x profiles x device type)


def plan_query_sessions(queries: Mapping[str, QueryDef], rates_rps: Mapping[str, float],
                        gammas: Mapping[tuple[str, str, str], float],
                        profiles: Mapping[str, Mapping[str, Profile]], device_types: list[str],
                        method: str = "dp", default_rate_rps: float = 1.0,
                        config: PlannerConfig | None = None, burst_sigmas: Mapping[str, float] = {},
                        ) -> tuple[list[SessionInput], dict[str, QueryPlan]]:
    """Stage sessions of every query and how their budgets were chosen.

    ``profiles[model][device_type]``; ``device_types`` in order of preference (most backends first).
    ``config.margins_ms`` (the path allowance) is spent outside the device by every stage: each
    stage's budget covers it, and the packing keeps duty cycle + batch latency within budget less it.
    ``burst_sigmas``: the burst room Z the plan of each device type keeps (``config.burst_sigma``
    where absent), which a split made for that type prices.
    """
    config = config or PlannerConfig()

    if method not in SPLIT_METHODS:
        raise ValueError(f"unknown latency split {method!r}; expected one of {', '.join(SPLIT_METHODS)}")
    sessions: list[SessionInput] = []
    plans: dict[str, QueryPlan] = {}
    for name, q in queries.items():
        edges = q.graph.edges
        used = {f"{p}->{c}": gammas.get((name, p, c), DEFAULT_GAMMA) for p, c in edges}
        device_type = next((t for t in device_types
                            if all(t in profiles.get(s.model, {}) for s in q.stages)), None)
        rate = max(rates_rps.get(name, default_rate_rps), MIN_PLANNED_RATE_RPS)
        if device_type is None:
            missing = sorted({s.model for s in q.stages if not any(t in profiles.get(s.model, {})
                                                                  for t in device_types)})
            plans[name] = QueryPlan(name, even_budgets_ms(q), used, "even",
                                    f"no profile on a registered device type for {', '.join(missing) or 'a stage'}")
            continue
        spec = QuerySpec(name, q.slo_ms, rate,
                         tuple(QueryStage(s.name, s.model, profiles[s.model][device_type]) for s in q.stages),
                         tuple(QueryEdge(p, c, max(used[f"{p}->{c}"], 1e-3)) for p, c in edges))
        typed = replace(config, burst_sigma=burst_sigmas.get(device_type, config.burst_sigma))
        split_ms, chosen, reason = query_split(spec, method, device_type, typed)
        budgets = dict(split_ms) if split_ms is not None else even_budgets_ms(q)
        stage_rates = spec.stage_rates_rps()
        for s in q.stages:
            sessions.append(SessionInput(q.graph.session_name(s.name), budgets[s.name],
                                         max(stage_rates[s.name], MIN_PLANNED_RATE_RPS), profiles[s.model]))
        minimal = {s.name: 2 * profiles[s.model][device_type].latency_ms(1) + config.margins_ms for s in q.stages}
        plans[name] = QueryPlan(name, budgets, used, chosen, reason, stage_rates, latest_finish_ms(q, minimal))
    return sessions, plans


@functools.lru_cache(maxsize=SPLIT_CACHE_SIZE)
def query_split(spec: QuerySpec, method: str, device_type: str, config: PlannerConfig
                ) -> tuple[tuple[tuple[str, float], ...] | None, str, str]:
    """The latency split of ``spec`` on ``device_type`` by ``method``: (budgets as (stage, ms) pairs,
    the method chosen, ""), or (None, "even", why) when no split serves the query within its SLO.

    Pure in its (hashable, frozen) arguments, so it is memoised: the split (a DP and, for "dp", the
    packing of three splits) costs hundreds of milliseconds, and the planner asks for it at every
    evaluation (each workload report, the epoch timer) with the same rates, gammas and profiles
    unless something changed; an idle scheduler spent most of a core here."""
    try:
        split = {"dp": split_latency, "even": even_split, "proportional": proportional_split}[method](spec, config)
        if method == "dp":
            split = min([split, even_split(spec, config), proportional_split(spec, config)],
                        key=lambda s: _packed_gpus(spec, s, device_type, config))
    except PlanningError as exc:
        return None, "even", f"{exc}; served best effort"
    return split.budgets_ms, split.method.value, ""


def _packed_gpus(spec, split, device_type: str, config: PlannerConfig) -> int:
    """Whole GPUs the query's stage sessions need under ``split`` (squishy, unbounded memory)."""
    try:
        return len(solve(split.sessions(spec), GpuSpec(device_type, UNBOUNDED_MEMORY_MB), config=config).gpus)
    except PlanningError:
        return 1 << 30
