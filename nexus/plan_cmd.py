"""``nexus plan WORKLOAD.json [--solver NAME] [--json]``: plan a workload offline.

Exit status: 0 with a valid plan; 1 when the chosen solver's plan breaks a validity rule (only the
``nexus`` baseline can: it does not check memory), the violations going to stderr and, with
``--json``, to a ``violations`` key; 2 for bad input (malformed file, infeasible session), with one
line ``nexus plan: error: <message naming the session or field>`` on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from globalsched.planning.algorithms import PlannerConfig, Solver, solve, split_latency
from globalsched.planning.plan import Plan, PlanningError, SessionSpec, gpu_exec_breakdown, validate_plan
from nexus.plan_files import Workload, WorkloadError, load_workload


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("plan", help="plan a workload offline (squishy bin packing and friends)",
                              description="Plan the sessions (and queries) of WORKLOAD.json on as few GPUs "
                                          "as possible and print the plan.")
    p.add_argument("workload", metavar="WORKLOAD.json")
    p.add_argument("--solver", default=Solver.SQUISHY.value, choices=[s.value for s in Solver],
                   help="planner to run (default: squishy)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (docs/planning.md)")
    p.add_argument("--time-limit-s", type=float, default=10.0, help="CP-SAT time limit (default: 10)")
    p.add_argument("--network-ms", type=float, default=0.0, help="network margin taken from every SLO")
    p.add_argument("--preprocess-ms", type=float, default=0.0, help="preprocessing margin")
    p.add_argument("--postprocess-ms", type=float, default=0.0, help="postprocessing margin")
    p.add_argument("--burst-sigma", type=float, default=0.0,
                   help="burst headroom: every GPU keeps room for its sessions' pooled Poisson burst, a duty "
                        "cycle overflowing with probability at most 1 - Phi(Z); allocations then carry "
                        "load_rps (default: 0, none)")
    p.set_defaults(func=run)


def _error(message: str) -> int:
    print(f"nexus plan: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    try:
        config = PlannerConfig(network_ms=args.network_ms, preprocess_ms=args.preprocess_ms,
                               postprocess_ms=args.postprocess_ms, cpsat_time_limit_s=args.time_limit_s,
                               burst_sigma=args.burst_sigma)
    except ValueError as exc:
        return _error(str(exc))
    try:
        workload = load_workload(args.workload)
        splits = [split_latency(q, config, workload.gpu) for q in workload.queries]
        sessions = list(workload.sessions)
        for q, split in zip(workload.queries, splits):
            sessions += split.sessions(q)
        plan = solve(sessions, workload.gpu, args.solver, config, workload.prefix_groups)
    except (WorkloadError, PlanningError) as exc:
        return _error(str(exc))
    violations = validate_plan(plan, sessions, workload.gpu, config.margins_ms, workload.prefix_groups,
                               config.burst_sigma)
    if args.json:
        obj = plan.to_json_obj()
        if splits:
            obj["queries"] = [s.to_json_obj() for s in splits]
        if violations:
            obj["violations"] = [v.message for v in violations]
        print(json.dumps(obj, indent=2))
    else:
        print(render_table(plan, sessions, workload, splits))
    for v in violations:
        print(f"nexus plan: invalid plan: {v.message}", file=sys.stderr)
    return 1 if violations else 0


def render_table(plan: Plan, sessions: list[SessionSpec], workload: Workload, splits: list[Any]) -> str:
    """The human-readable form: a summary line, one row per GPU, then query budgets."""
    specs = {s.name: s for s in sessions}
    groups = {g.name: g for g in workload.prefix_groups}
    proof = {True: ", optimal", False: ", not proven optimal", None: ""}[plan.optimal]
    lines = [f"solver {plan.solver}: {plan.num_gpus} GPU(s) of {workload.gpu.name} "
             f"(lower bound {plan.lower_bound}{proof}; throughput alone: {plan.lower_bound_throughput_only}), "
             f"solved in {plan.solve_ms:.1f} ms"]
    lines += [f"  note: {n}" for n in plan.notes]
    rows = [("GPU", "duty ms", "busy", "memory MB", "sessions (batch, req/s)")]
    for g in plan.gpus:
        exec_ms, mem, _ = gpu_exec_breakdown(g, specs, groups)
        names = ", ".join(f"{a.session} ({a.batch}, {a.throughput:.1f})" for a in g.sessions)
        if g.shared_prefixes:
            names += f"  [shared prefix: {', '.join(g.shared_prefixes)}]"
        rows.append((str(g.id), f"{g.duty_cycle_ms:.2f}", f"{100 * exec_ms / g.duty_cycle_ms:.0f}%",
                     f"{mem:.0f}", names))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4])
    for split in splits:
        budgets = ", ".join(f"{k} {v:.1f} ms" for k, v in split.budgets_ms)
        lines.append(f"query {split.query}: {split.method.value} split: {budgets} (~{split.est_gpus:.2f} GPUs)")
    return "\n".join(lines)
