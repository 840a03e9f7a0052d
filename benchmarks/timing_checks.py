"""Timing checks that used to be assertions in unit tests, reported instead (issue 12).

Unit tests assert outcomes only; wall-clock figures depend on the machine and on whatever else runs
on it, so they are measured here and reported with the bound each one is expected to meet:

1. ``emulated``: an emulated GPU served end to end (``nexus serve --device emulated:gtx1080ti``):
   per batch size, the backend's measured compute time over the profile's l(b), expected within
   [0.98, 1.10] (from tests/e2e/test_emulated_cluster.py);
2. ``bench``: ``nexus bench`` against its fake KServe server (from tests/e2e/test_bench.py): the longest
   latency of the scripted late answers (expected in [350, SLO + grace) ms), p50 of 300 ms answers
   (>= 300 ms), the client lag of an open-loop run (< 200 ms) and of a run whose loop is blocked for
   200 ms (>= 150 ms);
3. ``planner``: CPU seconds squishy bin packing takes for 1000 sessions (``plan_quality.py``'s
   workload), expected < 2 s (from tests/unit/test_algorithms_squishy.py);
4. ``multitenant``: the profiler's harness serving two emulated models at light load on the wall
   clock: p99 per model, expected <= 60 ms (the SLO) in at least one of three steps, bad rate <= 1%
   (from tests/e2e/test_profiler_multitenant.py, which checks the same step on a virtual clock);
5. ``bench-search``: ``find_max_rate`` against the fake server's single-worker model (capacity
   100 rps) with 0.7 s steps: 20 rps passes, 400 rps fails, the rate found is in [20, 400)
   (from tests/e2e/test_bench.py, which checks the search's wiring with no timing claim).

How long a killed or hung backend takes to be repaired is ``benchmarks/faults.py``'s figure (the
time from the kill until goodput is back); tests/e2e/test_failover.py waits for the repair instead.

Run: ``python -m benchmarks.timing_checks [--only emulated|bench|planner|multitenant|bench-search]
[--rounds 5]``; prints a table and
writes ``benchmarks/out/timing_checks.json``. Exit status 0 whatever the figures (it reports; the
figures are read, not gated).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import time

from common.profile import Profile
from common.sample_models import mlp_small, model_bytes
from harness.cluster import ServeCluster, Upload
from harness.scratch import scratch_dir
from harness.smoke import add_smoke, parse_args

ROOT = pathlib.Path(__file__).resolve().parent.parent

DEVICE_TYPE = "gtx1080ti"
PROFILE = Profile.linear(2.0, 20.0, 24, memory_base_mb=400, memory_per_item_mb=8, device_type=DEVICE_TYPE)
EMU_SLO_MS = 200.0
MIN_BATCHES = 8


def emulated_ratios(rounds: int, step_s: float = 3.0) -> list[dict[int, float]]:
    """Measured compute time / profile l(b) per batch size, per round of four load levels."""
    import tritonclient.grpc as grpcclient

    from nexus.bench import run_bench

    with scratch_dir("timing-checks-") as scratch:
        tmp = scratch.path
        cluster = ServeCluster(tmp / "cluster", "--no-samples", "--device", f"emulated:{DEVICE_TYPE}")
        try:
            (tmp / "mlp.onnx").write_bytes(model_bytes(mlp_small()))
            (tmp / "profile.json").write_text(PROFILE.to_json())
            cluster.upload(Upload(tmp / "mlp.onnx", "emu_mlp", str(tmp / "profile.json"), EMU_SLO_MS), timeout_s=60)
            client = grpcclient.InferenceServerClient(cluster.frontend)

            def batch_stats() -> dict[int, tuple[int, int]]:
                stats = client.get_inference_statistics("emu_mlp").model_stats[0]
                return {b.batch_size: (b.compute_infer.count, b.compute_infer.ns) for b in stats.batch_stats}

            out = []
            for attempt in range(rounds):
                before = batch_stats()
                for rate in (20, 60, 120, 240):
                    run_bench(cluster.frontend, "emu_mlp", rate, step_s, EMU_SLO_MS, warmup_s=0.5,
                              seed=attempt * 1000 + rate)
                after = batch_stats()
                ratios = {}
                for size, (count, ns) in after.items():
                    count -= before.get(size, (0, 0))[0]
                    ns -= before.get(size, (0, 0))[1]
                    if count >= MIN_BATCHES:
                        ratios[size] = (ns / count / 1e6) / PROFILE.latency_ms(size)
                out.append(ratios)
            client.close()
            return out
        finally:
            cluster.stop()


def bench_figures() -> dict[str, float]:
    from nexus.bench import run_bench, run_bench_async
    from harness.fake_kserve import GRACE_MS, SCRIPTED_CONFIG, SLO_MS, spawn

    proc, server = spawn(SCRIPTED_CONFIG)
    try:
        mixed = run_bench(server, "mixed", 100.0, 2.0, SLO_MS, grace_ms=GRACE_MS, seed=5)
        slow = run_bench(server, "slow", 50.0, 1.0, 1000.0, seed=2)

        async def stalled():
            async def stall() -> None:
                await asyncio.sleep(0.3)
                time.sleep(0.2)
            staller = asyncio.ensure_future(stall())
            r = await run_bench_async(server, "fast", 100.0, 1.0, SLO_MS, seed=4)
            await staller
            return r

        lagged = asyncio.run(stalled())
    finally:
        proc.terminate()
        proc.wait(10)
    return {"mixed_max_ms": mixed.max_ms, "slow_p50_ms": slow.p50_ms, "slow_client_lag_ms": slow.client_lag_ms,
            "stalled_client_lag_ms": lagged.client_lag_ms, "slo_plus_grace_ms": SLO_MS + GRACE_MS}


def planner_cpu_s() -> float:
    """CPU seconds of one squishy plan of 1000 generated sessions on a V100."""
    from benchmarks.plan_quality import V100, generate
    from globalsched.planning.algorithms import solve

    sessions = generate(1000, 1)
    start = time.process_time()
    solve(sessions, V100)
    return time.process_time() - start


def multitenant_light_load(attempts: int = 3) -> list[dict[str, float]]:
    """The harness at light load on the wall clock, up to ``attempts`` steps until one is within SLO:
    per step, each model's p99 (ms) and bad rate."""
    from common.runtimes import load_runtime
    from profiler.harness import Harness, TenantModel

    data = model_bytes(mlp_small())
    profiles = {"a": Profile.linear(0.25, 2.0, 32, 500, 10, device_type="gtx"),
                "b": Profile.linear(0.5, 3.0, 32, 800, 20, device_type="gtx")}
    runtimes = {name: load_runtime("emulated", data, "emulated:gtx", profile=p) for name, p in profiles.items()}
    try:
        harness = Harness([TenantModel(name, runtimes[name], p, 60.0) for name, p in profiles.items()])
        harness.run_step({"a": 100.0, "b": 50.0}, 0.2, seed=0)      # warm-up
        steps = []
        for attempt in range(attempts):
            stats = harness.run_step({"a": 200.0, "b": 100.0}, 0.5, seed=1 + attempt)
            steps.append({f"{name}_{key}": getattr(s, key) for name, s in stats.items() for key in ("p99_ms", "bad_rate")})
            if all(s.ok for s in stats.values()):
                break
        return steps
    finally:
        for rt in runtimes.values():
            rt.close()


def bench_search() -> dict[str, float]:
    """find_max_rate against the fake server's single-worker model (100 rps), with 0.7 s steps."""
    from nexus.bench import find_max_rate
    from harness.fake_kserve import spawn

    proc, server = spawn({"models": {"single": {"inputs": [["input", "FP32", [-1, 8]]],
                                                "outputs": [["output", "FP32", [-1, 4]]],
                                                "latency_ms": 10, "workers": 1}}})
    try:
        rate, reports = find_max_rate(server, "single", 200.0, 0.99, lo=20.0, hi=400.0, step_duration_s=0.7,
                                      warmup_s=0.1, cooldown_s=0.0, rel_tol=0.5, max_steps=4)
    finally:
        proc.terminate()
        proc.wait(10)
    return {"rate_rps": rate, "lo_good_fraction": reports[0].good_fraction,
            "hi_good_fraction": reports[1].good_fraction if len(reports) > 1 else float("nan")}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["emulated", "bench", "planner", "multitenant", "bench-search"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--step-s", type=float, default=3.0, help="emulated: seconds of load per rate")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "timing_checks.json"))
    add_smoke(ap, rounds=1, step_s=0.5)
    args = parse_args(ap, argv)
    result: dict = {}
    rows = []
    if args.only in (None, "bench"):
        f = bench_figures()
        result["bench"] = f
        rows += [("bench: late answers' max latency (ms)", f["mixed_max_ms"], f"[350, {f['slo_plus_grace_ms']:g})",
                  350 <= f["mixed_max_ms"] < f["slo_plus_grace_ms"]),
                 ("bench: p50 of 300 ms answers (ms)", f["slow_p50_ms"], ">= 300", f["slow_p50_ms"] >= 300),
                 ("bench: client lag, open loop (ms)", f["slow_client_lag_ms"], "< 200", f["slow_client_lag_ms"] < 200),
                 ("bench: client lag, loop blocked 200 ms (ms)", f["stalled_client_lag_ms"], ">= 150",
                  f["stalled_client_lag_ms"] >= 150)]
    if args.only in (None, "emulated"):
        rounds = emulated_ratios(args.rounds, args.step_s)
        result["emulated_ratios"] = [{str(k): v for k, v in sorted(r.items())} for r in rounds]
        for i, r in enumerate(rounds):
            for size, ratio in sorted(r.items()):
                rows.append((f"emulated round {i}: compute / l({size})", ratio, "[0.98, 1.10]", 0.98 <= ratio <= 1.10))
    if args.only in (None, "planner"):
        cpu_s = result["planner_cpu_s"] = planner_cpu_s()
        rows.append(("planner: CPU s, squishy, 1000 sessions", cpu_s, "< 2", cpu_s < 2.0))
    if args.only in (None, "multitenant"):
        steps = result["multitenant_light_load"] = multitenant_light_load()
        for i, step in enumerate(steps):
            for key, value in step.items():
                bound, ok = ("<= 60", value <= 60.0) if key.endswith("p99_ms") else ("<= 0.01", value <= 0.01)
                rows.append((f"multitenant step {i}: {key}", value, bound, ok))
    if args.only in (None, "bench-search"):
        f = result["bench_search"] = bench_search()
        rows += [("bench-search: rate found (rps)", f["rate_rps"], "[20, 400)", 20 <= f["rate_rps"] < 400),
                 ("bench-search: good fraction at 20 rps", f["lo_good_fraction"], ">= 0.99",
                  f["lo_good_fraction"] >= 0.99),
                 ("bench-search: good fraction at 400 rps", f["hi_good_fraction"], "< 0.99",
                  f["hi_good_fraction"] < 0.99)]
    width = max(len(r[0]) for r in rows)
    for name, value, bound, ok in rows:
        print(f"{name:<{width}}  {value:9.3f}  expected {bound:<14} {'ok' if ok else 'MISSED'}")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
