"""Latency split benchmark: the DP against the even and the proportional split.

Random queries (trees, and DAGs where a stage may have two parents) of 2-6 stages whose models come
from the GPU-like classes of plan_quality.py; end-to-end SLOs uniform in [150, 600] ms, root rates
log-uniform in [5, 500] requests/s, fan-outs gamma in [0.5, 4]. For each split we report the
estimated GPUs (the DP's objective) and the GPUs squishy actually uses once every query of a
workload is split that way and all stage sessions are packed together.

    python -m benchmarks.latency_split
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time

from benchmarks.plan_quality import CLASSES, MAX_BATCH, V100
from globalsched.planning.plan import QueryEdge, QuerySpec, QueryStage, validate_plan
from common.profile import Profile
from globalsched.planning.algorithms import even_split, proportional_split, solve, split_latency
from harness.smoke import add_smoke, parse_args


def random_query(rng: random.Random, name: str, dag: bool) -> QuerySpec:
    while True:
        n = rng.randint(2, 6)
        stages = []
        for i in range(n):
            cls = rng.choice(list(CLASSES))
            (a_lo, a_hi), (b_lo, b_hi), (w_lo, w_hi), (x_lo, x_hi) = CLASSES[cls]
            p = Profile.linear(rng.uniform(a_lo, a_hi), rng.uniform(b_lo, b_hi), MAX_BATCH,
                               300 + rng.uniform(w_lo, w_hi), rng.uniform(x_lo, x_hi))
            stages.append(QueryStage(f"{cls}{i}", cls, p))
        edges = []
        for i in range(1, n):
            parents = {rng.randrange(i)}
            if dag and i >= 2 and rng.random() < 0.5:
                parents.add(rng.randrange(i))
            edges += [QueryEdge(stages[p].name, stages[i].name, rng.uniform(0.5, 4.0)) for p in sorted(parents)]
        q = QuerySpec(name, rng.uniform(150, 600), math.exp(rng.uniform(math.log(5), math.log(500))),
                      tuple(stages), tuple(edges))
        if all(sum(2 * q.stage(u).profile.latency_ms(1) for u in path) <= q.slo_ms for path in q.graph.paths()):
            return q


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", type=int, default=10)
    ap.add_argument("--queries", type=int, default=20, help="queries per workload")
    add_smoke(ap, workloads=1, queries=3)
    args = parse_args(ap, argv)
    methods = {"dp": split_latency, "even": even_split, "proportional": proportional_split}
    print("| shape | queries | est. GPUs: DP / even / proportional | DP worse than even | "
          "packed GPUs: DP / even / proportional | DP split time ms (mean / max) |")
    print("|---|---|---|---|---|---|")
    for shape in ("tree", "dag"):
        est = {m: 0.0 for m in methods}
        packed = {m: 0 for m in methods}
        worse = 0
        count = 0
        times = []
        for w in range(args.workloads):
            rng = random.Random(w * 31 + (shape == "dag"))
            queries = [random_query(rng, f"q{i}", shape == "dag") for i in range(args.queries)]
            sessions: dict[str, list] = {m: [] for m in methods}
            for q in queries:
                splits = {}
                for m, fn in methods.items():
                    t0 = time.perf_counter()
                    splits[m] = fn(q, gpu=V100)
                    if m == "dp":
                        times.append((time.perf_counter() - t0) * 1000)
                    est[m] += splits[m].est_gpus
                    sessions[m] += splits[m].sessions(q)
                worse += splits["dp"].est_gpus > splits["even"].est_gpus + 1e-9
                count += 1
            for m in methods:
                plan = solve(sessions[m], V100)
                assert validate_plan(plan, sessions[m], V100) == []
                packed[m] += plan.num_gpus
        print(f"| {shape} | {count} | {est['dp']:.1f} / {est['even']:.1f} / {est['proportional']:.1f} | {worse} | "
              f"{packed['dp']} / {packed['even']} / {packed['proportional']} | "
              f"{statistics.mean(times):.0f} / {max(times):.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
