"""The global scheduler's planning algorithms: pure functions over frozen dataclasses.

Entry points (stable; the scheduler service and ``nexus plan`` call these):

* ``solve(sessions, gpu, solver="squishy", config=PlannerConfig(), prefix_groups=()) -> Plan``
* ``lower_bound(sessions, gpu=None, config=PlannerConfig(), prefix_groups=()) -> int`` (tight) and
  ``lower_bound_throughput_only(...) -> int`` (the earlier, throughput-only bound); ``lower_bounds``
  gives both in one pass
* ``replan(current, sessions, gpu, now_s, state, config=ReplanConfig(), prefix_groups=()) -> (Plan, ReplanState)``
* ``split_latency(query, config=PlannerConfig(), gpu=None, steps=None) -> LatencySplit``

With ``PlannerConfig.burst_sigma > 0`` every plan keeps pooled burst headroom (globalsched/planning/headroom.py)
and its allocations carry ``load_rps``. Value types live in :mod:`globalsched.planning.plan`; nothing here reads a
clock except to measure ``solve_ms``.
"""

from .config import PlannerConfig, Solver
from .latency_split import even_split, proportional_split, split_latency
from .lower_bound import (lower_bound, lower_bound_gpus, lower_bound_throughput_only,
                          lower_bound_throughput_only_gpus, lower_bounds)
from .replan import ReplanConfig, ReplanReason, ReplanState, replan
from .solve import solve

__all__ = [
    "PlannerConfig", "ReplanConfig", "ReplanReason", "ReplanState", "Solver", "even_split", "lower_bound",
    "lower_bound_gpus", "lower_bound_throughput_only", "lower_bound_throughput_only_gpus", "lower_bounds",
    "proportional_split", "replan", "solve", "split_latency",
]
