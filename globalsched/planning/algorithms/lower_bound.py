"""The certified lower bound on GPUs (docs/planning.md, "The lower bound"), reported with every plan.

Two bounds, both valid for every plan that :func:`globalsched.planning.plan.validate_plan` accepts:

* :func:`lower_bound` (the one plans report as ``lower_bound``): each session needs at least
  ``f_i = min over usable b of max(rate * l(b)/b, l(b) / (budget - l(b)))`` GPUs (rate in requests
  per ms): the throughput a batch gives, or the fixed cost of running one batch per duty cycle,
  which every session pays however small its rate.
* :func:`lower_bound_throughput_only` (reported as ``lower_bound_throughput_only``, the bound of
  earlier releases): the first term alone, ``rate * min l(b)/b``. A long tail of small sessions
  makes it meaningless; it is kept for comparison with earlier numbers.

"Usable" b: ``2*l(b) <= budget`` (budget = SLO less the margins) and, for a session outside prefix
groups, ``m(b)`` within the GPU's memory. Rates are the sessions' own rates: burst headroom
(:mod:`globalsched.planning.algorithms.headroom`) only adds constraints to a plan, so a bound valid for every
plan under the base rules holds for the planner's headroom plans too; it does not count the
headroom itself, so plan/bound ratios include what the headroom costs.

Proof (sessions outside prefix groups). Take a valid plan. On GPU g with duty cycle d_g, session i
runs batch b = b_ig and gets throughput t_ig = b/d_g; its *share* of the GPU is s_ig = l_i(b)/d_g.
The rules give, on every GPU: sum_i l_i(b_ig) <= d_g, so sum_i s_ig <= 1; and
d_g + l_i(b) <= budget_i, so (i) d_g <= budget_i - l_i(b) and (ii) 2*l_i(b) <= budget_i (as
l_i(b) <= d_g), and (iii) m_i(b) fits the memory. Hence every allocation's b is usable, and
s_ig >= F_i(b) := l_i(b)/(budget_i - l_i(b)) by (i), and s_ig = t_ig * c_i(b) with c_i(b) = l_i(b)/b.
So s_ig >= phi_i(b, t_ig) := max(F_i(b), t_ig * c_i(b)).

A session may run on several GPUs (saturated GPUs plus a residual, replicas, a repaired plan that
split it) with sum_g t_ig >= rate_i. For lambda in [0, 1], max(F, lambda*x) >= lambda*max(F, x), so
with lambda_g = t_ig/rate_i: phi_i(b, t_ig) >= min(1, lambda_g) * phi_i(b, rate_i) (for lambda_g > 1
because phi grows with t). If some lambda_g >= 1 that allocation alone gives S_i := sum_g s_ig >=
phi_i(b_ig, rate_i) >= f_i; otherwise S_i >= (sum_g lambda_g) * min_b phi_i(b, rate_i) >= f_i since
sum_g lambda_g >= 1. Summing over sessions, #GPUs >= sum_g sum_i s_ig = sum_i S_i >= sum_i f_i, and
the GPU count is an integer, so it is at least the ceiling. Replicas only add shares. (validate_plan
allows EPS_MS of slack on times: the bound uses budget + EPS_MS, so it stays sound at that slack.)

Memory. Every session outside prefix groups holds at least ``min over usable b of m_i(b)`` on some
GPU, and a GPU holds at most its memory: #GPUs >= sum_i min_b m_i(b) / memory. The tight bound is
the larger of that and the sum above (both hold for every valid plan). A fleet whose memory, not
its time, sets the device count (issue 26: 200 models of 630 MB resident on 8 T4s) would otherwise
get a bound the re-planner's waste check could never meet, and a fresh plan at every re-plan.

Prefix groups (the group's members on a GPU that shares its prefix run l_p(B) + sum of suffixes,
which every member's requests see; globalsched/planning/plan.py). Let S_G be the share of the group's executions
on all GPUs. (a) Per request: every request costs at least the prefix's best per-item time plus its
suffix's (:func:`prefix.group_lower_bound_gpus`), so S_G >= sum_i rate_i * (pc + sc_i). (b) Per
member j: on a GPU hosting j the group's execution E satisfies E >= l_p(b_j) + suffix_j(b_j) =
l_j(b_j) (l_p never decreases with the batch, and l_p <= l_j is checked), and d + E <= budget_j, so
the argument above applies to j with E in place of l_j(b): S_G >= f_j. Memory is not used for
members (the prefix's memory on a shared GPU need not grow with the batch). The group contributes
max((a), max_j f_j), never less than the throughput-only bound's (a).
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

from common.batch_decision import saturated_batch
from globalsched.planning.plan import EPS_MS, GpuSpec, PrefixGroup, SessionSpec

from .batch_sizing import SessionModel, prepare
from .config import PlannerConfig
from .prefix import check_prefix_groups, group_lower_bound_gpus, prefix_models


def _usable(sm: SessionModel) -> range:
    """Batches 1.. the largest with 2*l(b) within the budget, over the whole profile: a plan may use
    a batch beyond the planner's memory-capped ``max_batch`` where memory dips (checked per b)."""
    return range(1, saturated_batch(sm.lat, sm.budget_ms, len(sm.latency_ms), EPS_MS) + 1)


def session_memory_mb(sm: SessionModel, memory_mb: float | None) -> float:
    """The least memory the session holds on a GPU of ``memory_mb`` (None: unbounded), over usable b
    that fit it; 0 when none does (the session is then refused elsewhere)."""
    fits = [sm.mem(b) for b in _usable(sm) if memory_mb is None or sm.mem(b) <= memory_mb + EPS_MS]
    return min(fits, default=0.0)


def session_bounds_gpus(sm: SessionModel, memory_mb: float | None) -> tuple[float, float]:
    """(f_i of the module docstring, rate * min l(b)/b) over usable b, memory checked when
    ``memory_mb`` is given: the session's tight and throughput-only bounds."""
    floor = per_item = math.inf
    rate = sm.rate_rps / 1000.0
    top = sm.budget_ms + EPS_MS
    for b in _usable(sm):
        if memory_mb is not None and sm.mem(b) > memory_mb + EPS_MS:
            continue  # memory need not grow monotonically with the batch
        lat = sm.lat(b)
        cost = lat / b
        per_item = min(per_item, cost)
        floor = min(floor, max(rate * cost, lat / (top - lat)))
    return floor, rate * per_item


def bounds_gpus(sessions: Sequence[SessionSpec], gpu: GpuSpec | None = None,
                config: PlannerConfig = PlannerConfig(),
                prefix_groups: Iterable[PrefixGroup] = (), memory_term: bool = True) -> tuple[float, float]:
    """(tight, throughput-only) fractional bounds in one pass; raises PlanningError naming a session
    no plan can serve. ``memory_term`` False: the tight bound of time shares alone."""
    prefixes = prefix_models(prefix_groups)
    memory = gpu.memory_mb if gpu is not None else None
    tight = old = held_mb = 0.0
    grouped: dict[str, list[SessionModel]] = {}
    for spec in sessions:
        sm = prepare(spec, gpu, config, with_headroom=False)
        if spec.prefix_group is not None:
            grouped.setdefault(spec.prefix_group, []).append(sm)
        else:
            floor, per_item = session_bounds_gpus(sm, memory)
            tight, old = tight + floor, old + per_item
            held_mb += session_memory_mb(sm, memory)
    check_prefix_groups(grouped, prefixes)
    for gname, members in grouped.items():
        group = group_lower_bound_gpus(members, prefixes[gname], memory)
        old += group
        tight += max(group, max(session_bounds_gpus(m, None)[0] for m in members))
    if memory and memory_term:      # the memory the sessions hold, on GPUs of ``memory`` MB (module docstring)
        tight = max(tight, held_mb / memory)
    return tight, old


def lower_bound_gpus(sessions: Sequence[SessionSpec], gpu: GpuSpec | None = None,
                     config: PlannerConfig = PlannerConfig(),
                     prefix_groups: Iterable[PrefixGroup] = (), memory_term: bool = True) -> float:
    """The fractional tight bound (throughput and per-session fixed cost, or the memory held, the
    larger); raises PlanningError naming a session no plan can serve."""
    return bounds_gpus(sessions, gpu, config, prefix_groups, memory_term)[0]


def lower_bound_throughput_only_gpus(sessions: Sequence[SessionSpec], gpu: GpuSpec | None = None,
                                     config: PlannerConfig = PlannerConfig(),
                                     prefix_groups: Iterable[PrefixGroup] = ()) -> float:
    """The fractional bound of earlier releases: ``sum rate * min l(b)/b`` (no fixed cost)."""
    return bounds_gpus(sessions, gpu, config, prefix_groups)[1]


def _ceil(x: float) -> int:
    """ceil with a hair of float slack, so 3.0000000001 stays 3."""
    return max(0, math.ceil(x - 1e-9))


def lower_bounds(sessions: Sequence[SessionSpec], gpu: GpuSpec | None = None,
                 config: PlannerConfig = PlannerConfig(), prefix_groups: Iterable[PrefixGroup] = ()) -> tuple[int, int]:
    """(:func:`lower_bound`, :func:`lower_bound_throughput_only`) in one pass."""
    return certified(bounds_gpus(sessions, gpu, config, prefix_groups))


def certified(bounds: tuple[float, float]) -> tuple[int, int]:
    """The GPU counts of fractional bounds (:func:`bounds_gpus`): no valid plan uses fewer."""
    return _ceil(bounds[0]), _ceil(bounds[1])


def lower_bound(sessions: Sequence[SessionSpec], gpu: GpuSpec | None = None,
                config: PlannerConfig = PlannerConfig(), prefix_groups: Iterable[PrefixGroup] = (),
                memory_term: bool = True) -> int:
    """ceil of :func:`lower_bound_gpus`: no valid plan uses fewer GPUs."""
    return _ceil(lower_bound_gpus(sessions, gpu, config, prefix_groups, memory_term))


def lower_bound_throughput_only(sessions: Sequence[SessionSpec], gpu: GpuSpec | None = None,
                                config: PlannerConfig = PlannerConfig(),
                                prefix_groups: Iterable[PrefixGroup] = ()) -> int:
    """ceil of :func:`lower_bound_throughput_only_gpus` (for comparison with earlier numbers)."""
    return _ceil(lower_bound_throughput_only_gpus(sessions, gpu, config, prefix_groups))
