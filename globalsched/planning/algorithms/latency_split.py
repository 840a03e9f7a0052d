"""Latency split for multi-model queries (Nexus section 6.2): per-stage budgets that minimise GPUs.

A query is a DAG of stages; stage u receives rate_u requests/s (the roots the query's rate, each
child gamma * its parent's). Given budget t (its session's SLO), stage u costs

    gpus_u(t) = floor(rate_u / T_u(t)) + l_u(b)/d

squishy's own account: the saturated GPUs at throughput T_u(t) plus the occupancy of the residual
load at its best batch b and duty cycle d (d + l_u(b) <= t - margins, d <= b/rate). Unlike the lower
bound's rate * min l(b)/b, this charges a tight budget for the small batches and short duty cycles
it forces on a low-rate stage. Budgets must add up to at most the query's SLO along every
root-to-leaf path.

* Trees (every stage has at most one parent): exact dynamic programming over a time axis cut into
  ``steps`` equal slices, f(u, k) = min over j of gpus_u(j) + sum over children v of f(v, k - j),
  evaluated as numpy min-plus products. ``steps`` is a multiple of every path length (when that
  stays below 1000) so that the even split lies on the grid.
* DAGs (a stage with several parents), a sound method: unroll the DAG into a tree with one copy of
  a shared stage per path (each copy carries the rate its path brings), solve that tree exactly,
  then give each real stage the *smallest* budget of its copies. Every path of the DAG is a path
  of the tree whose budgets were only lowered, so every path still fits the SLO; the cost can only
  be higher than the tree's optimum, i.e. this is feasible but not always optimal.
* Then slack is handed out (both cases): a stage's budget is raised as far as its tightest path
  allows, stages that gain most first, so no path keeps unused time that could lower a cost.
* The result is never worse than the even or proportional split: if the grid made the DP's answer
  worse than either reference, that reference is returned (``method`` says which).
"""

from __future__ import annotations

import math
from functools import reduce
from typing import Sequence

import numpy as np

from globalsched.planning.plan import EPS_MS, GpuSpec, LatencySplit, PlanningError, QuerySpec, SessionSpec, SplitMethod

from .batch_sizing import prepare, residual_config
from .config import PlannerConfig
from .squishy import saturated_split

MAX_STEPS = 1000
MIN_STEPS = 240
MAX_UNROLLED = 4000


def stage_cost_gpus(query: QuerySpec, stage: str, budget_ms: float, config: PlannerConfig,
                    gpu: GpuSpec | None = None, rate_rps: float | None = None) -> float:
    """gpus_u(budget) of the module docstring; math.inf when even batch 1 misses the budget."""
    st = query.stage(stage)
    rate = query.stage_rates_rps()[stage] if rate_rps is None else rate_rps
    if budget_ms - config.margins_ms < 2 * st.profile.latency_ms(1) - EPS_MS:
        return math.inf
    spec = SessionSpec(stage, st.model, budget_ms, rate, st.profile)
    try:
        sm = prepare(spec, gpu, config)
        n, _, residual = saturated_split(sm)
        if residual <= 0:
            return float(n)
        batch, duty = residual_config(sm, residual)
    except PlanningError:
        return math.inf
    return n + sm.lat(batch) / duty  # a residual's burst headroom is pooled on its GPU: not counted


def total_cost(query: QuerySpec, budgets: dict[str, float], config: PlannerConfig, gpu: GpuSpec | None) -> float:
    rates = query.stage_rates_rps()
    return sum(stage_cost_gpus(query, s.name, budgets[s.name], config, gpu, rates[s.name]) for s in query.stages)


def _fits(query: QuerySpec, budgets: dict[str, float]) -> bool:
    return all(sum(budgets[u] for u in path) <= query.slo_ms + EPS_MS for path in query.graph.paths())


def default_steps(query: QuerySpec) -> int:
    """A grid on which every path's even split lies (multiple of each path length), at least 240."""
    lcm = reduce(math.lcm, {len(p) for p in query.graph.paths()}, 1)
    if lcm > MAX_STEPS:
        return MAX_STEPS
    return lcm * max(1, math.ceil(MIN_STEPS / lcm))


# ---- the tree DP ----------------------------------------------------------------------------------


def _tree_dp(nodes: Sequence[tuple[str, float, tuple[int, ...]]], roots: Sequence[int], steps: int,
             cost_of: "callable") -> tuple[float, list[int]]:
    """Exact DP on a forest. ``nodes[i] = (stage, rate, children)``; returns (cost, grid budget per node).

    ``cost_of(stage, rate)`` gives an array c[k], k = 0..steps, the cost at budget k slices (inf when
    infeasible). The forest's roots share the whole axis independently (each root path from 0).
    """
    n = len(nodes)
    f: list[np.ndarray | None] = [None] * n
    choice: list[np.ndarray | None] = [None] * n
    k_idx = np.arange(steps + 1)
    j_idx = np.arange(steps + 1)
    # rem[k, j] = k - j, valid when 1 <= j <= k
    rem = k_idx[:, None] - j_idx[None, :]
    valid = (j_idx[None, :] >= 1) & (rem >= 0)
    order = _postorder(nodes, roots)
    for i in order:
        stage, rate, kids = nodes[i]
        c = cost_of(stage, rate)
        h = np.zeros(steps + 1)
        for v in kids:
            h = h + f[v]  # type: ignore[operator]
        with np.errstate(invalid="ignore"):
            table = np.where(valid, c[None, :] + h[np.clip(rem, 0, steps)], np.inf)
        choice[i] = np.argmin(table, axis=1)
        f[i] = table[k_idx, choice[i]]
        f[i][0] = np.inf
    budgets = [0] * n

    def trace(i: int, k: int) -> None:
        j = int(choice[i][k])  # type: ignore[index]
        budgets[i] = j
        for v in nodes[i][2]:
            trace(v, k - j)

    total = 0.0
    for r in roots:
        total += float(f[r][steps])  # type: ignore[index]
        if math.isfinite(total):
            trace(r, steps)
    return total, budgets


def _postorder(nodes: Sequence[tuple[str, float, tuple[int, ...]]], roots: Sequence[int]) -> list[int]:
    out: list[int] = []
    stack = [(r, False) for r in roots]
    while stack:
        i, done = stack.pop()
        if done:
            out.append(i)
            continue
        stack.append((i, True))
        stack.extend((v, False) for v in nodes[i][2])
    return out


def _unrolled(query: QuerySpec) -> tuple[list[tuple[str, float, tuple[int, ...]]], list[int]]:
    """The query as a forest: one node per path prefix; each carries the rate its path brings."""
    nodes: list[tuple[str, float, tuple[int, ...]]] = []

    def build(stage: str, rate: float) -> int:
        if len(nodes) > MAX_UNROLLED:
            raise PlanningError(f"query {query.name!r}: too many paths to split")
        idx = len(nodes)
        nodes.append((stage, rate, ()))
        kids = tuple(build(e.child, rate * e.gamma) for e in query.children(stage))
        nodes[idx] = (stage, rate, kids)
        return idx

    roots = [build(r, query.rate_rps) for r in query.graph.roots()]
    return nodes, roots


# ---- slack ------------------------------------------------------------------------------------------


def _room_ms(query: QuerySpec, budgets: dict[str, float], stage: str) -> float:
    """How far ``stage``'s budget can grow before some path through it exceeds the SLO."""
    worst = 0.0
    for path in query.graph.paths():
        if stage in path:
            worst = max(worst, sum(budgets[u] for u in path))
    return max(0.0, query.slo_ms - worst)


def stretch(query: QuerySpec, budgets: dict[str, float]) -> dict[str, float]:
    """Scale each budget by SLO / (sum of its fullest path): every path still fits, none keeps slack
    that all its stages could share."""
    paths = query.graph.paths()
    out = {}
    for s in query.stages:
        factor = min(query.slo_ms / sum(budgets[u] for u in p) for p in paths if s.name in p)
        out[s.name] = budgets[s.name] * max(1.0, factor)
    return out


def fill_slack(query: QuerySpec, budgets: dict[str, float], config: PlannerConfig,
               gpu: GpuSpec | None) -> dict[str, float]:
    """Raise budgets into unused path time: first where a cost drops (most first), then the rest
    spread in proportion to the budgets (:func:`stretch`), so no stage keeps a needlessly tight one."""
    out = dict(budgets)
    rates = query.stage_rates_rps()
    while True:
        best: tuple[float, str, float] | None = None
        for s in query.stages:
            room = _room_ms(query, out, s.name)
            if room <= EPS_MS:
                continue
            now = stage_cost_gpus(query, s.name, out[s.name], config, gpu, rates[s.name])
            after = stage_cost_gpus(query, s.name, out[s.name] + room, config, gpu, rates[s.name])
            gain = now - after
            if gain > 1e-12 and (best is None or gain > best[0]):
                best = (gain, s.name, room)
        if best is None:
            break
        # Give the stage just what reaches its lower cost, keeping the rest for the others.
        name, room = best[1], best[2]
        target = stage_cost_gpus(query, name, out[name] + room, config, gpu, rates[name])
        lo, hi = 0.0, room
        for _ in range(40):
            mid = (lo + hi) / 2
            if stage_cost_gpus(query, name, out[name] + mid, config, gpu, rates[name]) <= target + 1e-12:
                hi = mid
            else:
                lo = mid
        out[name] += hi

    def cost(name: str, budget: float) -> float:
        return stage_cost_gpus(query, name, budget, config, gpu, rates[name])

    spread = stretch(query, out)
    for s in query.stages:  # each stage separately: any subset of stretched budgets still fits
        if cost(s.name, spread[s.name]) <= cost(s.name, out[s.name]) + 1e-12:
            out[s.name] = spread[s.name]
    for s in query.stages:  # what stretching left (paths limited elsewhere), where it costs nothing
        room = _room_ms(query, out, s.name)
        if room > EPS_MS and cost(s.name, out[s.name] + room) <= cost(s.name, out[s.name]) + 1e-12:
            out[s.name] += room
    return out


# ---- reference splits -------------------------------------------------------------------------------


def even_split(query: QuerySpec, config: PlannerConfig = PlannerConfig(), gpu: GpuSpec | None = None) -> LatencySplit:
    """Each stage gets SLO / (length of the longest path through it)."""
    paths = query.graph.paths()
    budgets = {s.name: min(query.slo_ms / len(p) for p in paths if s.name in p) for s in query.stages}
    return _result(query, SplitMethod.EVEN, budgets, config, gpu)


def proportional_split(query: QuerySpec, config: PlannerConfig = PlannerConfig(),
                       gpu: GpuSpec | None = None) -> LatencySplit:
    """Each stage gets SLO * l(1) / (sum of l(1) along its heaviest path): time in proportion to work."""
    paths = query.graph.paths()
    w = {s.name: s.profile.latency_ms(1) for s in query.stages}
    budgets = {s.name: min(query.slo_ms * w[s.name] / sum(w[u] for u in p) for p in paths if s.name in p)
               for s in query.stages}
    return _result(query, SplitMethod.PROPORTIONAL, budgets, config, gpu)


def _result(query: QuerySpec, method: SplitMethod, budgets: dict[str, float], config: PlannerConfig,
            gpu: GpuSpec | None) -> LatencySplit:
    return LatencySplit(query.name, method, tuple((s.name, budgets[s.name]) for s in query.stages),
                        total_cost(query, budgets, config, gpu))


# ---- entry point ------------------------------------------------------------------------------------


def split_latency(query: QuerySpec, config: PlannerConfig = PlannerConfig(), gpu: GpuSpec | None = None,
                  steps: int | None = None, slack: bool = True) -> LatencySplit:
    """Budgets per stage minimising total (fractional) GPUs; every path fits the SLO.

    Raises PlanningError naming the query and a path when even the smallest feasible budgets
    (2*l(1) + margins per stage) exceed the SLO along it. ``slack=False`` returns the grid optimum
    as is (used to compare with brute force).
    """
    for path in query.graph.paths():
        need = sum(2 * query.stage(u).profile.latency_ms(1) + config.margins_ms for u in path)
        if need > query.slo_ms + EPS_MS:
            raise PlanningError(f"query {query.name!r}: path {'->'.join(path)} needs at least {need:g} ms "
                                f"(2*l(1) + margins per stage), more than the SLO {query.slo_ms:g} ms")
    steps = steps or default_steps(query)
    step_ms = query.slo_ms / steps
    tree = query.graph.is_tree()
    nodes, roots = _unrolled(query)
    cache: dict[tuple[str, float], np.ndarray] = {}

    def cost_of(stage: str, rate: float) -> np.ndarray:
        key = (stage, rate)
        if key not in cache:
            cache[key] = np.array([math.inf] + [stage_cost_gpus(query, stage, k * step_ms, config, gpu, rate)
                                                for k in range(1, steps + 1)])
        return cache[key]

    value, grid = _tree_dp(nodes, roots, steps, cost_of)
    method = SplitMethod.TREE_DP if tree else SplitMethod.DAG_DP
    if math.isfinite(value):
        budgets: dict[str, float] = {}
        for (stage, _, _), k in zip(nodes, grid):
            budgets[stage] = min(budgets.get(stage, math.inf), k * step_ms)
    else:  # the grid is too coarse for the tightest paths: start from the minimum budgets instead
        budgets = {s.name: 2 * s.profile.latency_ms(1) + config.margins_ms for s in query.stages}
    if slack:
        budgets = fill_slack(query, budgets, config, gpu)
    assert _fits(query, budgets), "latency split broke a path's SLO"
    best = _result(query, method, budgets, config, gpu)
    if not slack:
        return best
    for ref in (even_split(query, config, gpu), proportional_split(query, config, gpu)):
        if ref.est_gpus < best.est_gpus - 1e-12:
            best = ref
    return best
