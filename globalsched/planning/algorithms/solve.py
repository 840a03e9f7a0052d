"""``solve``: the one entry point that runs a named solver and wraps its GPUs into a :class:`Plan`."""

from __future__ import annotations

import time
from typing import Iterable, Sequence

from globalsched.planning.plan import GpuPlan, GpuSpec, Plan, PlanningError, PrefixGroup, SessionSpec

from .baselines import batch_oblivious, nexus_published, one_per_gpu
from .config import PlannerConfig, Solver
from .lower_bound import bounds_gpus, certified
from .squishy import squishy


def solve(sessions: Sequence[SessionSpec], gpu: GpuSpec, solver: Solver | str = Solver.SQUISHY,
          config: PlannerConfig = PlannerConfig(), prefix_groups: Iterable[PrefixGroup] = ()) -> Plan:
    """Plan ``sessions`` on GPUs of kind ``gpu`` with ``solver``.

    Raises PlanningError naming the session when a session can never be served (SLO below 2*l(1)
    after margins, batch 1 beyond memory) and ValueError for an unknown solver name. ``solve_ms``
    is wall time of the whole call; ``optimal`` is True when the count is proven minimal (CP-SAT
    proof, or it equals the lower bound).
    """
    try:
        solver = Solver(solver)
    except ValueError:
        raise ValueError(f"unknown solver {solver!r}; choose from {[s.value for s in Solver]}") from None
    names = [s.name for s in sessions]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise PlanningError(f"session {dup!r}: listed twice")
    groups = tuple(prefix_groups)
    start = time.perf_counter()
    fractional = bounds_gpus(sessions, gpu, config, groups)
    lb, lb_old = certified(fractional)
    optimal: bool | None = None
    notes: tuple[str, ...] = ()
    gpus: list[GpuPlan]
    if solver is Solver.SQUISHY:
        gpus = squishy(sessions, gpu, config, groups)
    elif solver is Solver.NEXUS:
        gpus = nexus_published(sessions, gpu, config, groups)
    elif solver is Solver.BATCH_OBLIVIOUS:
        gpus = batch_oblivious(sessions, gpu, config, groups)
    elif solver is Solver.ONE_PER_GPU:
        gpus = one_per_gpu(sessions, gpu, config, groups)
    else:
        from .cpsat import cpsat_solve  # lazy: it imports ortools (~250 ms at start-up), only this solver needs it
        gpus, optimal, notes = cpsat_solve(sessions, gpu, config, groups, lb,
                                           force_lns=solver is Solver.CPSAT_LNS)
    if len(gpus) == lb:
        optimal = True
    solve_ms = (time.perf_counter() - start) * 1000.0
    return Plan(solver.value, tuple(gpus), lb, solve_ms, optimal, None, notes, lb_old, fractional)
