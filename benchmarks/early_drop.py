"""Early drop vs no drop under overload: goodput of one simulated device (pure simulation, seconds to run).

For each profile l(b) = alpha*b + beta and SLO, the device runs Nexus's saturated batch B (largest b
with 2*l(b) <= SLO), whose capacity is B/l(B). Poisson arrivals at 0.5x, 1x, 1.5x and 2x capacity
are served by each policy with :func:`backend.simulate.simulate`; the table reports goodput
(on-time responses per second) as a fraction of capacity, the bad rate (late + dropped), the mean
batch and the p99 latency of served requests, averaged over seeds. Target: early drop keeps
>= 0.9 of capacity at 2x overload.

Run from the repository root:  python -m benchmarks.early_drop  [--seconds 60 --seeds 3 --out benchmarks/early_drop.md]
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from common.batch_decision import EarliestFirst, SlidingWindowEarlyDrop
from backend.simulate import capacity_rps, saturated_batch, simulate
from common.arrivals import arrival_times
from harness.smoke import add_smoke, parse_args

POLICIES = {
    "early_drop": SlidingWindowEarlyDrop,
    "earliest_first (drop expired)": EarliestFirst,
    "no_drop (FIFO)": lambda: EarliestFirst(drop_expired=False),
}
LOADS = (0.5, 1.0, 1.5, 2.0)


@dataclass(frozen=True)
class Case:
    name: str
    alpha_ms: float
    beta_ms: float
    slo_ms: float

    def latency_ms(self, batch: int) -> float:
        return self.alpha_ms * batch + self.beta_ms


CASES = (
    Case("gpu-like (l(b) = 1.0*b + 5 ms, SLO 100 ms)", 1.0, 5.0, 100.0),
    Case("batching-hungry (l(b) = 0.25*b + 10 ms, SLO 50 ms)", 0.25, 10.0, 50.0),
)


def run_case(case: Case, seconds: float, seeds: int) -> list[dict]:
    batch = saturated_batch(case.latency_ms, case.slo_ms, 4096)
    capacity = capacity_rps(case.latency_ms, batch)
    rows = []
    for load in LOADS:
        for name, factory in POLICIES.items():
            results = [simulate(factory(), arrival_times(load * capacity, seconds, seed), case.slo_ms,
                                case.latency_ms, batch) for seed in range(seeds)]
            rows.append({
                "case": case.name, "batch": batch, "capacity_rps": capacity, "load": load, "policy": name,
                "goodput_rps": statistics.mean(r.goodput_rps for r in results),
                "goodput_of_capacity": statistics.mean(r.goodput_rps for r in results) / capacity,
                "bad_rate": statistics.mean(r.bad_rate for r in results),
                "mean_batch": statistics.mean(r.mean_batch for r in results),
                "p99_ms": statistics.mean(r.latency_p99_ms for r in results),
            })
    return rows


def markdown(rows: list[dict], command: str, seconds: float, seeds: int, elapsed_s: float) -> str:
    lines = [
        "# Early drop vs no drop under overload",
        "",
        "Single device, one session, simulated with `backend.simulate.simulate` (discrete events, no sleeping).",
        f"Poisson arrivals for {seconds:g} simulated seconds, mean over {seeds} seed(s); the device runs the",
        "saturated batch B (largest b with 2*l(b) <= SLO) back to back when loaded; capacity = B / l(B).",
        "Goodput = responses within the SLO per second over the arrival window.",
        "",
        f"Command: `{command}` ({elapsed_s:.1f} s wall)",
        "",
    ]
    for case in dict.fromkeys(r["case"] for r in rows):
        case_rows = [r for r in rows if r["case"] == case]
        first = case_rows[0]
        lines += [f"## {case}", "", f"B = {first['batch']}, capacity = {first['capacity_rps']:.0f} req/s", "",
                  "| load | policy | goodput req/s | goodput / capacity | bad rate | mean batch | p99 latency ms |",
                  "| ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
        for r in case_rows:
            lines.append(f"| {r['load']:.1f}x | {r['policy']} | {r['goodput_rps']:.0f} | {r['goodput_of_capacity']:.3f} "
                         f"| {r['bad_rate']:.3f} | {r['mean_batch']:.1f} | {r['p99_ms']:.1f} |")
        lines.append("")
    lines += ["## Goodput ratio, early drop vs no drop", "",
              "| case | load | early drop / capacity | no drop / capacity | early drop / no drop |",
              "| --- | ---: | ---: | ---: | ---: |"]
    for case in dict.fromkeys(r["case"] for r in rows):
        for load in (1.5, 2.0):
            early = next(r for r in rows if r["case"] == case and r["load"] == load and r["policy"] == "early_drop")
            fifo = next(r for r in rows if r["case"] == case and r["load"] == load and r["policy"] == "no_drop (FIFO)")
            ratio = early["goodput_rps"] / fifo["goodput_rps"] if fifo["goodput_rps"] else float("inf")
            lines.append(f"| {case} | {load:.1f}x | {early['goodput_of_capacity']:.3f} | "
                         f"{fifo['goodput_of_capacity']:.3f} | {ratio:.0f}x |")
    lines.append("")
    worst = min(r["goodput_of_capacity"] for r in rows if r["policy"] == "early_drop" and r["load"] == 2.0)
    verdict = "met" if worst >= 0.9 else "NOT met"
    lines += [f"Target (early drop keeps >= 0.9 of capacity at 2x overload): {verdict} "
              f"(worst case {worst:.3f}).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="simulated seconds of arrivals per run")
    parser.add_argument("--seeds", type=int, default=3, help="arrival seeds averaged per cell")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_suffix(".md"), help="markdown report")
    add_smoke(parser, seconds=1.0, seeds=1)
    args = parse_args(parser, argv)
    if args.seconds <= 0 or args.seeds < 1:
        parser.error("--seconds must be positive and --seeds at least 1")
    command = "python -m benchmarks.early_drop " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    start = time.perf_counter()
    rows = [row for case in CASES for row in run_case(case, args.seconds, args.seeds)]
    report = markdown(rows, command.strip(), args.seconds, args.seeds, time.perf_counter() - start)
    print(report)
    args.out.write_text(report)
    worst = min(r["goodput_of_capacity"] for r in rows if r["policy"] == "early_drop" and r["load"] == 2.0)
    return 0 if worst >= 0.9 or args.smoke else 1


if __name__ == "__main__":
    sys.exit(main())
