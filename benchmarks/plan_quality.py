"""Plan quality benchmark: GPUs used by every planner against the lower bounds and each other, and
pooled against per-session burst headroom.

Workloads are generated from GPU-like profiles l(b) = alpha*b + beta (ms) in three model classes
whose ranges follow published V100 / 1080 Ti measurements (a MobileNet-class model costs a few
tenths of a ms per image on top of ~2 ms, ResNet-50 ~1.3 ms per image on top of ~5 ms, VGG/SSD-class
several ms per image on top of ~10 ms), memory = weights + activations per image. SLOs are uniform
in [50, 400] ms, rates log-uniform in [5, 2000] requests/s. The ``memory`` suite uses large models
on an 8 GB GPU, where memory binds and the published algorithm's plans overcommit it.

    python -m benchmarks.plan_quality                 # the numbers in benchmarks/plan_quality.md
    python -m benchmarks.plan_quality --sizes 10 100 --seeds 3 --json out.json
    python -m benchmarks.plan_quality --bounds-only   # tight vs throughput-only bound against CP-SAT
    python -m benchmarks.plan_quality --headroom-only # pooled vs per-session headroom, long tails

``lb`` is the tight bound (throughput and each session's fixed cost per duty cycle), ``lb_old`` the
throughput-only bound of earlier releases.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from harness.smoke import add_smoke, parse_args
from globalsched.planning.headroom import overflow_probability_target, simulated_overflow_share
from globalsched.planning.plan import GpuSpec, Plan, SessionSpec, validate_plan
from common.profile import Profile
from globalsched.planning.algorithms import (PlannerConfig, ReplanState, Solver, lower_bound_gpus, replan,
                                   solve)
from globalsched.planning.algorithms.baselines import per_session_headroom
from globalsched.planning.algorithms.lower_bound import bounds_gpus
from harness.workloads import long_tail

# (alpha ms/image, beta ms, weights MB, activations MB/image): ranges per model class
CLASSES = {
    "small": ((0.2, 0.5), (1.0, 3.0), (20, 100), (5, 15)),      # MobileNet / SqueezeNet
    "medium": ((1.0, 1.6), (4.0, 6.0), (100, 300), (15, 40)),   # ResNet-50 / Inception
    "large": ((2.5, 4.5), (6.0, 12.0), (500, 1200), (30, 60)),  # VGG-16 / SSD
}
V100 = GpuSpec("v100-16gb", 16000)
SMALL_GPU = GpuSpec("8gb", 8000)
MAX_BATCH = 64


def generate(n: int, seed: int, classes: tuple[str, ...] = ("small", "medium", "large")) -> list[SessionSpec]:
    rng = random.Random(seed * 7919 + n)
    sessions = []
    for i in range(n):
        cls = rng.choice(classes)
        (a_lo, a_hi), (b_lo, b_hi), (w_lo, w_hi), (x_lo, x_hi) = CLASSES[cls]
        alpha, beta = rng.uniform(a_lo, a_hi), rng.uniform(b_lo, b_hi)
        profile = Profile.linear(alpha, beta, MAX_BATCH, 300.0 + rng.uniform(w_lo, w_hi), rng.uniform(x_lo, x_hi))
        slo = rng.uniform(50.0, 400.0)
        rate = math.exp(rng.uniform(math.log(5.0), math.log(2000.0)))
        sessions.append(SessionSpec(f"{cls}{i}", cls, round(slo, 1), round(rate, 2), profile))
    return sessions


def run_one(sessions: list[SessionSpec], gpu: GpuSpec, solvers: list[Solver], config: PlannerConfig) -> dict[str, Any]:
    row: dict[str, Any] = {"n": len(sessions), "lb_frac": lower_bound_gpus(sessions, gpu)}
    for solver in solvers:
        cpu0 = time.process_time()
        plan = solve(sessions, gpu, solver, config)
        cpu_s = time.process_time() - cpu0
        violations = validate_plan(plan, sessions, gpu)
        row["lb"] = plan.lower_bound
        row["lb_old"] = plan.lower_bound_throughput_only
        row[solver.value] = {"gpus": plan.num_gpus, "wall_ms": plan.solve_ms, "cpu_ms": cpu_s * 1000.0,
                             "valid": not violations, "optimal": plan.optimal,
                             "violations": sorted({v.kind.value for v in violations})}
    return row


def summarise(rows: list[dict[str, Any]], solvers: list[Solver]) -> list[str]:
    lines = ["| sessions | workloads | LB (mean) | old LB (mean) | " + " | ".join(f"{s.value} GPUs/LB" for s in solvers)
             + " | squishy GPUs/old LB | squishy vs nexus (GPUs) | squishy time ms (mean / max, wall) |",
             "|" + "---|" * (7 + len(solvers))]
    for n in sorted({r["n"] for r in rows}):
        rs = [r for r in rows if r["n"] == n]
        cells = []
        for s in solvers:
            have = [r for r in rs if s.value in r]
            if not have:
                cells.append("-")
                continue
            ratios = [r[s.value]["gpus"] / r["lb"] for r in have]
            invalid = sum(not r[s.value]["valid"] for r in have)
            cells.append(f"{statistics.mean(ratios):.3f} (max {max(ratios):.3f})"
                         + (f", {invalid} invalid" if invalid else ""))
        diffs = [r["squishy"]["gpus"] - r["nexus"]["gpus"] for r in rs if "nexus" in r]
        times = [r["squishy"]["wall_ms"] for r in rs]
        old = [r["squishy"]["gpus"] / r["lb_old"] for r in rs]
        lines.append(f"| {n} | {len(rs)} | {statistics.mean(r['lb'] for r in rs):.1f} | "
                     f"{statistics.mean(r['lb_old'] for r in rs):.1f} | " + " | ".join(cells)
                     + f" | {statistics.mean(old):.3f} (max {max(old):.3f}) | {sum(diffs):+d} total, worst "
                       f"{max(diffs):+d} | {statistics.mean(times):.1f} / {max(times):.1f} |")
    return lines


def replan_table(n: int, seeds: int) -> list[str]:
    """Sessions moved and GPUs used by an epoch re-plan after typical rate changes."""
    scenarios = {
        "noise +-5% on every session": lambda rng, i: rng.uniform(0.95, 1.05),
        "10% of sessions +15%": lambda rng, i: 1.15 if i % 10 == 0 else 1.0,
        "10% of sessions -30%": lambda rng, i: 0.7 if i % 10 == 0 else 1.0,
        "one session x3": lambda rng, i: 3.0 if i == 0 else 1.0,
        "every session x0.5": lambda rng, i: 0.5,
    }
    from globalsched.planning.algorithms.replan import _placements, match_ids

    lines = [f"| change ({n} sessions, {seeds} workloads) | moved sessions (mean / max) | moved by a fresh squishy "
             "plan (ids matched) | GPUs re-plan / fresh squishy | re-plan wall ms (mean) |", "|---|---|---|---|---|"]
    for label, factor in scenarios.items():
        moved, fresh_moved, ours, fresh, times = [], [], 0, 0, []
        for seed in range(seeds):
            sessions = generate(n, 500 + seed)
            plan, state = replan(None, sessions, V100, 0.0, ReplanState())
            rng = random.Random(seed)
            changed = [s.with_rate(s.rate_rps * factor(rng, i)) for i, s in enumerate(sessions)]
            new, _ = replan(plan, changed, V100, 30.0, state)
            assert not validate_plan(new, changed, V100)
            moved.append(new.moved or 0)
            ours += new.num_gpus
            fresh_gpus = solve(changed, V100).gpus
            fresh += len(fresh_gpus)
            before, after = _placements(plan.gpus), _placements(match_ids(fresh_gpus, plan))
            fresh_moved.append(sum(1 for k in before if after.get(k, set()) - before[k]))
            times.append(new.solve_ms)
        lines.append(f"| {label} | {statistics.mean(moved):.1f} / {max(moved)} | {statistics.mean(fresh_moved):.1f} | "
                     f"{ours} / {fresh} | {statistics.mean(times):.0f} |")
    return lines


def slow(n: int, seed: int) -> list[SessionSpec]:
    """``n`` slow sessions, 1-20 req/s, SLOs of 20-60 ms, l(b) = 3-8 ms + 1-3 ms per item: every one
    pays its fixed cost l(b)/(budget - l(b)) per cycle."""
    rng = random.Random(seed)
    return [SessionSpec(f"s{i}", f"s{i}", rng.uniform(20.0, 60.0), math.exp(rng.uniform(0.0, math.log(20.0))),
                        Profile.linear(rng.uniform(1, 3), rng.uniform(3, 8), 16, 300.0, 10.0)) for i in range(n)]


def bounds_table(seeds: int, time_limit_s: float) -> list[str]:
    """Tight and throughput-only bounds against the CP-SAT optimum on small instances, where the
    exact model proves it: mixed rates (the small-exact suite), slow sessions, a slice of a tail."""
    lines = ["| instances | proven optimal | optimum / tight LB (mean, max) | optimum / old LB (mean, max) | "
             "tight LB = optimum | old LB = optimum | fractional tight / old bound, share of the optimum |",
             "|---|---|---|---|---|---|---|"]
    config = PlannerConfig(cpsat_time_limit_s=time_limit_s, exact_max_sessions=10, exact_max_gpus=12)
    suites = {
        "4-6 sessions, mixed rates / 4": lambda seed: [
            x.with_rate(x.rate_rps / 4) for x in generate(random.Random(seed).choice([4, 5, 6]), 1000 + seed)],
        "8 slow sessions (1-20 req/s, SLO 20-60 ms)": lambda seed: slow(8, seed),
        "10 models of an issue-18 tail (ranks 10-19 of 100, 150 req/s in all)": lambda seed: long_tail(
            100, 150.0, (50.0, 200.0), seed)[10:20],
    }
    for label, make in suites.items():
        tight, old, frac_tight, frac_old = [], [], [], []
        for seed in range(seeds):
            sessions = make(seed)
            plan = solve(sessions, V100, Solver.CPSAT, config)
            assert not validate_plan(plan, sessions, V100) and plan.lower_bound <= plan.num_gpus
            if plan.optimal:
                tight.append(plan.num_gpus / plan.lower_bound)
                old.append(plan.num_gpus / plan.lower_bound_throughput_only)
                f_tight, f_old = bounds_gpus(sessions, V100)
                frac_tight.append(f_tight / plan.num_gpus)
                frac_old.append(f_old / plan.num_gpus)
        if tight:
            lines.append(f"| {label} | {len(tight)}/{seeds} | {statistics.mean(tight):.3f}, {max(tight):.3f} | "
                         f"{statistics.mean(old):.3f}, {max(old):.3f} | {sum(t == 1 for t in tight)} | "
                         f"{sum(o == 1 for o in old)} | {statistics.mean(frac_tight):.2f} / "
                         f"{statistics.mean(frac_old):.2f} |")
    return lines


def modelled_overflow(plan: Plan, sessions: list[SessionSpec], cycles: int = 20000) -> list[float]:
    """Per GPU: the share of simulated duty cycles (Poisson arrivals at the routed loads) that
    overflow. Plans without loads route each session's rate in proportion to throughput."""
    specs = {x.name: x for x in sessions}
    served = plan.throughput_by_session()
    out = []
    for g in plan.gpus:
        loads = [a.load_rps if a.load_rps is not None else specs[a.session].rate_rps * a.throughput
                 / served[a.session] for a in g.sessions]
        out.append(simulated_overflow_share([specs[a.session].profile.latency_ms for a in g.sessions],
                                            [specs[a.session].profile.max_batch for a in g.sessions],
                                            loads, g.duty_cycle_ms, cycles, seed=g.id))
    return out


def headroom_table(seeds: int, z: float = 1.5) -> list[str]:
    """GPUs and modelled overflow with pooled headroom, per-session headroom and none."""
    workloads = {
        "100 models, 150 req/s Zipf, SLO 50-200 ms": lambda seed: long_tail(100, 150.0, (50.0, 200.0), seed),
        "100 models, 300 req/s Zipf, SLO 500-800 ms": lambda seed: long_tail(100, 300.0, (500.0, 800.0), seed),
        "100 models, 600 req/s Zipf, SLO 50-200 ms": lambda seed: long_tail(100, 600.0, (50.0, 200.0), seed),
        "100 models, 1500 req/s Zipf, SLO 50-200 ms": lambda seed: long_tail(100, 1500.0, (50.0, 200.0), seed),
        "200 models, 3000 req/s Zipf, SLO 30-100 ms": lambda seed: long_tail(200, 3000.0, (30.0, 100.0), seed),
        "500 models, 2000 req/s Zipf, SLO 50-200 ms": lambda seed: long_tail(500, 2000.0, (50.0, 200.0), seed),
        "mixed, 100 sessions (rates 5-2000 req/s)": lambda seed: generate(100, seed),
    }
    p = overflow_probability_target(z)
    lines = [f"Target: a duty cycle overflows with probability at most {p:.4f} (z = {z}).\n",
             "| workload | seeds | tight LB | old LB | GPUs: no headroom | per-session | pooled | pooled / "
             "per-session | overflow per GPU, per-session (mean / max) | pooled (mean / max) | pooled / tight LB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, make in workloads.items():
        lb = lb_old = none = per = pooled = 0
        over_per: list[float] = []
        over_pooled: list[float] = []
        for seed in range(seeds):
            sessions = make(seed)
            plain = solve(sessions, V100)
            per_plan = solve(per_session_headroom(sessions, V100, PlannerConfig(), z), V100)
            pooled_plan = solve(sessions, V100, Solver.SQUISHY, PlannerConfig(burst_sigma=z))
            assert not validate_plan(pooled_plan, sessions, V100, burst_sigma=z)
            lb, lb_old = lb + plain.lower_bound, lb_old + plain.lower_bound_throughput_only
            none, per, pooled = none + plain.num_gpus, per + per_plan.num_gpus, pooled + pooled_plan.num_gpus
            over_per += modelled_overflow(per_plan, sessions)
            over_pooled += modelled_overflow(pooled_plan, sessions)
        lines.append(f"| {label} | {seeds} | {lb} | {lb_old} | {none} | {per} | {pooled} | {pooled / per:.3f} | "
                     f"{statistics.mean(over_per):.4f} / {max(over_per):.4f} | "
                     f"{statistics.mean(over_pooled):.4f} / {max(over_pooled):.4f} | {pooled / lb:.3f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[10, 30, 100, 300, 1000])
    ap.add_argument("--seeds", type=int, default=10, help="workloads per size (halved above 100 sessions)")
    ap.add_argument("--cpsat-time-limit-s", type=float, default=10.0)
    ap.add_argument("--cpsat-max-sessions", type=int, default=100, help="run cpsat only up to this size")
    ap.add_argument("--json", type=Path, help="write every row here")
    ap.add_argument("--replan-only", action="store_true", help="only the re-planning table")
    ap.add_argument("--bounds-only", action="store_true", help="only the bounds against the CP-SAT optimum")
    ap.add_argument("--headroom-only", action="store_true", help="only pooled vs per-session headroom")
    ap.add_argument("--replan-sizes", type=int, nargs="+", default=[100, 1000], help="sizes of the re-planning table")
    add_smoke(ap, sizes=[10], seeds=1, cpsat_time_limit_s=1.0, cpsat_max_sessions=10, replan_sizes=[10])
    args = parse_args(ap, argv)
    if args.replan_only or args.smoke:
        for n in args.replan_sizes:
            print("\n".join(replan_table(n, 3 if not args.smoke else 1)) + "\n")
        if not args.smoke:
            return 0
    if args.bounds_only or args.smoke:
        print("\n".join(bounds_table(args.seeds * 2, args.cpsat_time_limit_s)))
        if not args.smoke:
            return 0
    if args.headroom_only or args.smoke:
        print("\n".join(headroom_table(max(1, args.seeds // 2))))
        if not args.smoke:
            return 0

    base = [Solver.SQUISHY, Solver.NEXUS, Solver.BATCH_OBLIVIOUS, Solver.ONE_PER_GPU]
    # The exact model for up to 10 sessions / 12 GPUs, the LNS above that.
    config = PlannerConfig(cpsat_time_limit_s=args.cpsat_time_limit_s, exact_max_sessions=10, exact_max_gpus=12)
    suites: dict[str, list[dict[str, Any]]] = {"mixed": [], "memory": [], "small-exact": []}
    for n in args.sizes:
        seeds = args.seeds if n <= 100 else max(2, args.seeds // 2)
        for seed in range(seeds):
            solvers = base + ([Solver.CPSAT] if n <= args.cpsat_max_sessions else [])
            suites["mixed"].append(run_one(generate(n, seed), V100, solvers, config))
            print(f"mixed n={n} seed={seed}: " + ", ".join(
                f"{s.value}={suites['mixed'][-1][s.value]['gpus']}" for s in solvers)
                + f" lb={suites['mixed'][-1]['lb']}", file=sys.stderr)
    for n in (10, 50, 200):
        for seed in range(max(2, args.seeds // 2)):
            suites["memory"].append(run_one(generate(n, 100 + seed, ("large",)), SMALL_GPU, base, config))
    for seed in range(args.seeds * 2):  # where the exact model applies: 4-6 sessions, lower rates
        sessions = [s.with_rate(s.rate_rps / 4) for s in generate(random.Random(seed).choice([4, 5, 6]), 1000 + seed)]
        suites["small-exact"].append(run_one(sessions, V100, [Solver.SQUISHY, Solver.NEXUS, Solver.CPSAT], config))

    print(f"## mixed workloads on {V100.name}\n")
    print("\n".join(summarise(suites["mixed"], base + [Solver.CPSAT])))
    print(f"\n## memory-bound workloads (large models only) on {SMALL_GPU.name}\n")
    print("\n".join(summarise(suites["memory"], base)))
    print("\n## small instances (4-6 sessions, rates / 4): CP-SAT exact\n")
    print("\n".join(summarise(suites["small-exact"], [Solver.SQUISHY, Solver.NEXUS, Solver.CPSAT])))
    exact = suites["small-exact"]
    proven = sum(r["cpsat"]["optimal"] is True for r in exact)
    better = sum(r["cpsat"]["gpus"] < r["squishy"]["gpus"] for r in exact)
    print(f"\nCP-SAT proved optimality on {proven}/{len(exact)} small instances and beat squishy on {better}; "
          f"mean CP-SAT wall time {statistics.mean(r['cpsat']['wall_ms'] for r in exact):.0f} ms.")
    mixed = suites["mixed"]
    for n in sorted({r["n"] for r in mixed}):
        rs = [r for r in mixed if r["n"] == n and "cpsat" in r]
        proven = [r for r in rs if r["cpsat"]["optimal"] is True]
        if proven:
            print(f"n={n}: CP-SAT proved the optimum on {len(proven)}/{len(rs)} workloads; there optimum/LB = "
                  f"{statistics.mean(r['cpsat']['gpus'] / r['lb'] for r in proven):.3f}, squishy/optimum = "
                  f"{statistics.mean(r['squishy']['gpus'] / r['cpsat']['gpus'] for r in proven):.3f}")
    for name, rows in suites.items():
        total = sum(r["squishy"]["gpus"] for r in rows) / sum(r["lb"] for r in rows)
        print(f"{name}: total squishy GPUs / total LB = {total:.3f}")
    ratio = statistics.mean(r["squishy"]["gpus"] / r["lb"] for r in mixed)
    worse = sum(r["squishy"]["gpus"] > r["nexus"]["gpus"] for s in suites.values() for r in s
                if "nexus" in r and r["nexus"]["valid"])
    big = [r["squishy"]["wall_ms"] for r in mixed if r["n"] >= 1000]
    print(f"\nTargets: mean squishy GPUs/LB over mixed workloads = {ratio:.3f} (target <= 1.10); "
          f"workloads where squishy used more GPUs than a valid published-squishy plan: {worse} (target 0); "
          + (f"1,000-session squishy wall time max {max(big):.0f} ms (target < 1000 ms)." if big else ""))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(suites, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
