"""Exact and improving planners with OR-Tools CP-SAT.

The exact model (small instances). Given G GPUs (squishy's count: the optimum is at most that),
choose for every session i, GPU g and batch b a boolean y[i,g,b] (at most one b per (i,g)). Without
loss of generality a GPU's duty cycle equals its execution time E_g (a shorter cycle only raises
throughputs and loosens SLOs), so:

* E_g = sum of l_i(b) over its sessions, a shared prefix counted once on the combined batch
  (table lookups with AddElement);
* SLO: E_g + (execution seen by i) <= budget_i whenever i runs on g;
* memory: sum of m_i(b) (shared prefix once) <= the GPU's memory;
* throughput: t[i,g] * E_g <= b * 10^9 (t in milli-requests/s, E in microseconds; one
  AddMultiplicationEquality per pair), t[i,g] = 0 unless i runs on g, sum_g t[i,g] >= rate_i;
* minimise the number of GPUs used (used[g] >= used[g+1] breaks symmetry; the sum >= lower bound).

Burst headroom (``burst_sigma`` = z > 0) is modelled per allocation, not pooled: an allocation at
batch b may carry at most the n*(b) arrivals per cycle that a lone session may
(:func:`globalsched.planning.headroom.own_burst_load_items`), i.e. t * E <= n*(b) * 10^9, and
its load t is reported. Each allocation then covers its own burst quantile, and the pooled quantile
of a GPU never exceeds the sum of its sessions' own (sqrt(sum c^2 n) <= sum c sqrt(n), the skew term
is at most c_max and the continuity term c_max/2 at most sum c/2), so H = 0 and the plan keeps the
pooled rule. The exact model thus solves a stricter problem than squishy's pooled packing: with
headroom its optimum is not reported as proven (``optimal`` stays None unless the count meets the
lower bound), and squishy's plan is kept whenever it is at least as good.

Latencies are rounded *up* to whole microseconds, budgets and memory *down*, rates *up* to
milli-requests/s: every model solution is a valid plan, and "optimal" means optimal for those
rounded figures (a plan within one microsecond of an SLO could be missed). Reported as proven only
when CP-SAT's status is OPTIMAL (or the count meets the lower bound).

The improvement step (large instances), a large-neighbourhood search: start from the squishy plan;
repeatedly take k GPUs that run shared (residual) loads, compute what their sessions still need
beyond the GPUs outside the neighbourhood, and ask the exact model to serve that with k-1 GPUs; on
success the k GPUs are replaced. The time limit is spread over the rounds; the CP-SAT solver's own
wall time is what is counted, so this module reads no clock.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from ortools.sat.python import cp_model

from globalsched.planning.headroom import own_burst_load_items
from globalsched.planning.plan import (GpuPlan, GpuSpec, Plan, PrefixGroup, SessionAlloc, SessionSpec, gpu_exec_breakdown,
                         validate_plan)

from .batch_sizing import SessionModel
from .config import PlannerConfig
from .prefix import PrefixModel
from .squishy import prepare_all, squishy

_US = 1000.0          # microseconds per millisecond
_THR_SCALE = 10 ** 9  # milli-req/s * microseconds per (batch item): b items per E us = b*1e9/E milli-req/s
_MEM_SCALE = 1000.0   # kilobytes per megabyte


@dataclass(frozen=True)
class ExactResult:
    status: str                                   # "OPTIMAL", "FEASIBLE", "INFEASIBLE", "UNKNOWN", ...
    gpus: tuple[tuple[tuple[str, int], ...], ...]  # per used GPU: (session, batch) pairs
    wall_s: float
    loads: tuple[Mapping[str, float], ...] = ()    # per used GPU: session -> load (req/s), with headroom


def _up(x: float, scale: float) -> int:
    return math.ceil(x * scale - 1e-6)


def _down(x: float, scale: float) -> int:
    return math.floor(x * scale + 1e-6)


def solve_exact(models: Sequence[SessionModel], prefixes: Mapping[str, PrefixModel], capacity_mb: float,
                num_gpus: int, lower_bound: int, time_limit_s: float, workers: int, seed: int,
                hint: Sequence[Sequence[tuple[str, int]]] = (), minimise: bool = True) -> ExactResult:
    """Run the exact model for at most ``num_gpus`` GPUs (see the module docstring)."""
    m = cp_model.CpModel()
    G = num_gpus
    cap = _down(capacity_mb, _MEM_SCALE) if math.isfinite(capacity_mb) else None
    max_budget = max(_down(s.budget_ms, _US) for s in models)
    batches: dict[str, list[int]] = {}
    for s in models:
        usable = [b for b in range(1, s.max_batch + 1) if 2 * _up(s.lat(b), _US) <= _down(s.budget_ms, _US)]
        batches[s.name] = usable
    y: dict[tuple[str, int, int], cp_model.IntVar] = {}
    x: dict[tuple[str, int], cp_model.IntVar] = {}
    used = [m.NewBoolVar(f"used{g}") for g in range(G)]
    exec_g = [m.NewIntVar(0, max_budget, f"E{g}") for g in range(G)]
    for g in range(G):
        lat_terms = []
        mem_terms = []
        groups_here: dict[str, list[SessionModel]] = {}
        for s in models:
            ys = {b: m.NewBoolVar(f"y_{s.name}_{g}_{b}") for b in batches[s.name]}
            for b, v in ys.items():
                y[s.name, g, b] = v
            xv = m.NewBoolVar(f"x_{s.name}_{g}")
            x[s.name, g] = xv
            m.Add(sum(ys.values()) == xv)
            m.AddImplication(xv, used[g])
            if s.group is not None and s.group in prefixes:
                groups_here.setdefault(s.group, []).append(s)
                continue
            lat_terms += [_up(s.lat(b), _US) * v for b, v in ys.items()]
            mem_terms += [_up(s.mem(b), _MEM_SCALE) * v for b, v in ys.items()]
            for b, v in ys.items():  # SLO: E_g + l_i(b) <= budget_i
                m.Add(exec_g[g] <= _down(s.budget_ms, _US) - _up(s.lat(b), _US)).OnlyEnforceIf(v)
        for gname, members in groups_here.items():
            p = prefixes[gname]
            combined = m.NewIntVar(0, p.max_batch, f"B_{gname}_{g}")
            m.Add(combined == sum(b * y[s.name, g, b] for s in members for b in batches[s.name]))
            p_lat = m.NewIntVar(0, _up(p.lat(p.max_batch), _US), f"pl_{gname}_{g}")
            m.AddElement(combined, [0] + [_up(p.lat(b), _US) for b in range(1, p.max_batch + 1)], p_lat)
            suffix = sum(_up(p.suffix_lat(s, b), _US) * y[s.name, g, b] for s in members for b in batches[s.name])
            group_exec = m.NewIntVar(0, max_budget, f"ge_{gname}_{g}")
            m.Add(group_exec == p_lat + suffix)
            lat_terms.append(group_exec)
            for s in members:
                m.Add(exec_g[g] + group_exec <= _down(s.budget_ms, _US)).OnlyEnforceIf(x[s.name, g])
            if cap is not None:
                p_mem = m.NewIntVar(0, max(_up(v, _MEM_SCALE) for v in p.memory_mb), f"pm_{gname}_{g}")
                m.AddElement(combined, [0] + [_up(p.mem(b), _MEM_SCALE) for b in range(1, p.max_batch + 1)], p_mem)
                mem_terms.append(p_mem)
                mem_terms += [_up(p.suffix_mem(s, b), _MEM_SCALE) * y[s.name, g, b]
                              for s in members for b in batches[s.name]]
        m.Add(exec_g[g] == sum(lat_terms))
        if cap is not None:
            m.Add(sum(mem_terms) <= cap)
        if g + 1 < G:  # GPUs are interchangeable: used ones first, longest execution first
            m.Add(used[g] >= used[g + 1])
            m.Add(exec_g[g] >= exec_g[g + 1])
    # Cut (valid, linear; it gives the relaxation the strength of the lower bound on every GPU): a
    # request of session i takes at least c_i = min_b l_i(b)/b of a GPU's cycle (prefix members:
    # their suffix's best per-item time plus the prefix's), so on each GPU sum_i t[i,g]*c_i <= 1.
    share_terms: list[list] = [[] for _ in range(G)]
    t_vars: dict[tuple[str, int], cp_model.IntVar] = {}
    headroom = any(s.burst_sigma > 0 for s in models)
    for s in models:
        if s.group is not None and s.group in prefixes:
            p = prefixes[s.group]
            c_ms = (min((p.suffix_lat(s, b) / b for b in batches[s.name]), default=0.0)
                    + min(p.lat(b) / b for b in range(1, p.max_batch + 1)))
        else:
            c_ms = min((s.lat(b) / b for b in batches[s.name]), default=0.0)
        c = math.floor(c_ms * 1e6)  # ns per request: t (milli-req/s) * c is in 1e-12 of a GPU
        need = _up(s.rate_rps, 1000.0)
        # items per cycle an allocation at batch b may carry, in thousandths (b without headroom)
        carry = {b: (_down(own_burst_load_items(b, s.burst_sigma), 1000.0)
                     if s.burst_sigma > 0 and s.marginal(b) > 0 else 1000 * b) for b in batches[s.name]}
        ts = []
        for g in range(G):
            t = m.NewIntVar(0, need, f"t_{s.name}_{g}")
            t_vars[s.name, g] = t
            m.Add(t <= need * x[s.name, g])
            prod = m.NewIntVar(0, need * max_budget, f"p_{s.name}_{g}")
            m.AddMultiplicationEquality(prod, [t, exec_g[g]])
            m.Add(prod <= (_THR_SCALE // 1000) * sum(carry[b] * y[s.name, g, b] for b in batches[s.name]))
            share_terms[g].append(c * t)
            ts.append(t)
        m.Add(sum(ts) >= need)
    for g in range(G):
        m.Add(sum(share_terms[g]) <= _THR_SCALE * 1000 * used[g])
    m.Add(sum(used) >= min(lower_bound, G))
    if minimise:
        m.Minimize(sum(used))
    for g, allocs in enumerate(hint[:G]):
        m.AddHint(used[g], 1)
        here = dict(allocs)
        for s in models:
            for b in batches[s.name]:
                m.AddHint(y[s.name, g, b], 1 if here.get(s.name) == b else 0)
    for g in range(len(hint), G):
        m.AddHint(used[g], 0)

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.01, time_limit_s)
    solver.parameters.num_workers = max(1, workers)
    solver.parameters.random_seed = seed
    status = solver.Solve(m)
    name = solver.StatusName(status)
    gpus: list[tuple[tuple[str, int], ...]] = []
    loads: list[dict[str, float]] = []
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        for g in range(G):
            allocs = tuple((s.name, b) for s in models for b in batches[s.name] if solver.Value(y[s.name, g, b]))
            if allocs:
                gpus.append(allocs)
                loads.append({n: solver.Value(t_vars[n, g]) / 1000.0 for n, _ in allocs})
    return ExactResult(name, tuple(gpus), solver.WallTime(), tuple(loads) if headroom else ())


def gpu_plans_from(assignments: Iterable[Sequence[tuple[str, int]]], specs: Mapping[str, SessionSpec],
                   groups: Mapping[str, PrefixGroup], first_id: int = 0,
                   loads: Sequence[Mapping[str, float]] = ()) -> list[GpuPlan]:
    """GpuPlans whose duty cycle is exactly their execution time (shared prefixes where >= 2 members);
    ``loads[k]`` gives the k-th GPU's sessions' loads (headroom), else they carry none."""
    out = []
    for k, allocs in enumerate(assignments):
        here = loads[k] if k < len(loads) else {}
        counts: dict[str, int] = {}
        for name, _ in allocs:
            gname = specs[name].prefix_group
            if gname is not None and gname in groups:
                counts[gname] = counts.get(gname, 0) + 1
        shared = tuple(sorted(gn for gn, c in counts.items() if c >= 2))
        probe = GpuPlan(first_id + k, 1.0, tuple(SessionAlloc(n, b, 0.0) for n, b in allocs), shared)
        duty, _, _ = gpu_exec_breakdown(probe, specs, groups)
        out.append(GpuPlan(first_id + k, duty, tuple(SessionAlloc(n, b, b * 1000.0 / duty, here.get(n))
                                                     for n, b in allocs), shared))
    return out


def _renumber(gpus: Sequence[GpuPlan]) -> list[GpuPlan]:
    return [GpuPlan(i, g.duty_cycle_ms, g.sessions, g.shared_prefixes) for i, g in enumerate(gpus)]


def improve_lns(base: Sequence[GpuPlan], sessions: Sequence[SessionSpec], gpu: GpuSpec, config: PlannerConfig,
                groups: Sequence[PrefixGroup], lower_bound: int) -> tuple[list[GpuPlan], int, float]:
    """(improved GPUs, GPUs saved, CP-SAT seconds spent); see the module docstring."""
    specs = {s.name: s for s in sessions}
    group_map = {g.name: g for g in groups}
    current = list(base)
    rng = random.Random(config.seed)
    budget_s = config.cpsat_time_limit_s
    spent = 0.0
    saved = 0
    k = max(2, config.lns_neighbourhood_gpus)
    failures = 0
    for _ in range(config.lns_max_rounds):
        if spent >= budget_s or len(current) <= lower_bound:
            break
        shared = [i for i, g in enumerate(current)
                  if len(g.sessions) > 1 or g.duty_cycle_ms > 1.0001 * gpu_exec_breakdown(g, specs, group_map)[0]]
        if len(shared) < 2:
            break
        # Neighbours by duty cycle: GPUs with similar cycles merge best. Seed: emptiest first, then random.
        by_duty = sorted(shared, key=lambda i: current[i].duty_cycle_ms)
        if failures == 0:
            seed_i = min(shared, key=lambda i: gpu_exec_breakdown(current[i], specs, group_map)[0]
                         / current[i].duty_cycle_ms)
        else:
            seed_i = rng.choice(shared)
        pos = by_duty.index(seed_i)
        lo = max(0, min(pos - k // 2, len(by_duty) - k))
        hood = set(by_duty[lo:lo + k])
        outside: dict[str, float] = {}
        for i, g in enumerate(current):
            if i not in hood:
                for a in g.sessions:
                    outside[a.session] = outside.get(a.session, 0.0) + a.planned_load_rps
        sub: list[SessionSpec] = []
        for name in sorted({a.session for i in hood for a in current[i].sessions}):
            need = specs[name].rate_rps - outside.get(name, 0.0)
            if need > 1e-9:
                sub.append(specs[name].with_rate(need))
        if not sub:  # the neighbourhood serves nothing anyone needs
            current = [g for i, g in enumerate(current) if i not in hood]
            saved += len(hood)
            continue
        models, prefixes = prepare_all(sub, gpu, config, groups)
        limit = min(1.0, budget_s - spent)
        res = solve_exact(models, prefixes, gpu.memory_mb, len(hood) - 1, 0, limit, 1, config.seed, minimise=True)
        spent += res.wall_s
        if res.gpus and len(res.gpus) < len(hood):
            new = gpu_plans_from(res.gpus, specs, group_map, loads=res.loads)
            candidate = [g for i, g in enumerate(current) if i not in hood] + new
            if validate_plan_quick(candidate, sessions, gpu, config, groups):
                saved += len(hood) - len(new)
                current = candidate
                failures = 0
                continue
        failures += 1
        if failures > 3 * max(1, len(shared) // k):
            break
    return _renumber(current), saved, spent


def validate_plan_quick(gpus: Sequence[GpuPlan], sessions: Sequence[SessionSpec], gpu: GpuSpec,
                        config: PlannerConfig, groups: Sequence[PrefixGroup]) -> bool:
    return not validate_plan(Plan("check", tuple(gpus), 0, 0.0), sessions, gpu, config.margins_ms, groups,
                             config.burst_sigma)


def cpsat_solve(sessions: Sequence[SessionSpec], gpu: GpuSpec, config: PlannerConfig,
                groups: Sequence[PrefixGroup], lower_bound: int,
                force_lns: bool = False) -> tuple[list[GpuPlan], bool | None, tuple[str, ...]]:
    """(GPUs, proven optimal?, notes). Small instances: exact; others (or ``force_lns``): LNS from squishy."""
    base = squishy(sessions, gpu, config, groups)
    if len(base) <= lower_bound:
        return base, True, ("squishy's plan meets the lower bound",)
    small = len(sessions) <= config.exact_max_sessions and len(base) <= config.exact_max_gpus
    if small and not force_lns:
        specs = {s.name: s for s in sessions}
        group_map = {g.name: g for g in groups}
        models, prefixes = prepare_all(sessions, gpu, config, groups)
        order = sorted(base, key=lambda g: -gpu_exec_breakdown(g, specs, group_map)[0])
        hint = [[(a.session, a.batch) for a in g.sessions] for g in order]
        res = solve_exact(models, prefixes, gpu.memory_mb, len(base), lower_bound, config.cpsat_time_limit_s,
                          config.cpsat_workers, config.seed, hint)
        if res.gpus and len(res.gpus) <= len(base):
            plans = gpu_plans_from(res.gpus, specs, group_map, loads=res.loads)
            if validate_plan_quick(plans, sessions, gpu, config, groups):
                optimal = res.status == "OPTIMAL" if config.burst_sigma <= 0 else None
                note = f"cp-sat {res.status.lower()} in {res.wall_s:.2f} s" + (
                    " (burst headroom per allocation, not pooled: optimum not proven)" if config.burst_sigma > 0 else "")
                return plans, optimal, (note,)
        if res.status == "INFEASIBLE":
            # Only possible through rounding to whole microseconds: nothing proven.
            return base, None, ("cp-sat found squishy's plan infeasible after rounding; kept squishy's plan",)
        return base, False, (f"cp-sat {res.status.lower()} after {res.wall_s:.2f} s; kept squishy's plan",)
    improved, saved, spent = improve_lns(base, sessions, gpu, config, groups, lower_bound)
    return improved, None, (f"cp-sat lns saved {saved} GPU(s) in {spent:.2f} s of solver time",)
