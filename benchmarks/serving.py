"""Serving efficiency on one CPU backend (issue 2): the system against the model's own limit.

    python -m benchmarks.serving [--threads 1] [--repeats 3] [--step-s 5] [--warmup-s 4] [--slo-ms 100]

Per repeat, in one run and on one machine:

(a) LIMIT: ResNet-18-64 called through ONNX Runtime directly, with the backend's session options
    and thread count: l(b) is the median of timed runs of each batch size b; the limit is the
    Nexus saturated throughput b*/l(b*) at the largest b* with 2*l(b*) <= SLO. l(b*) is measured
    again next to every step of the rate search (same background load) and the limit uses the
    median of those measurements.
(b) SERVED: a real local cluster (scheduler, frontend, one CPU backend as separate processes,
    started here without ``nexus serve`` so that flags and wrappers can be set per process),
    resnet18_64 uploaded alone and profiled by the backend as ``nexus serve`` does;
    the largest Poisson rate at which 99% of the requests finish within the SLO, by a ramp of
    ``nexus.bench.find_max_rate`` steps (5 s measured after a 4 s lead-in each) that only goes up,
    by 7%, from 0.3x the limit to the first failing rate (``--search bisect``: find_max_rate's own
    doubling and bisection; see ``harness.experiments.ramp_rate`` for why it is not the default). The ratio
    served / limit is the result. For reference it also reports the BATCHING BOUND: the same search on
    ``backend.simulate`` (an ideal work-conserving server executing exactly the ORT-direct l(b)
    with the backend's early-drop policy, no RPC, no CPU sharing), i.e. what Poisson arrivals and
    batching allow before any implementation cost.
(c) ADDED LATENCY: p50 of the full path (client -> frontend -> backend -> ORT) at a low rate,
    batch 1, minus ORT's own batch-1 p50; served and ORT-direct phases alternate so both see the
    same background. Where the time goes: the frontend's own per-request time (ModelStatistics
    inference_stats.success), the backend's queue and compute times (queue, compute_input + _infer + _output), the
    CPU each process spent per request (/proc/PID/stat), and the p50 of one bare gRPC hop with the
    same client (``harness.fake_kserve`` answering at once).

Client, frontend, backend and ORT share the machine's cores; other engineers' tests share it
too: every step records the CPU used by processes outside this benchmark ("other load"), and each
repeat first waits (up to ``--quiet-wait-s``) for a quiet moment. JSON goes to
benchmarks/out/serving.json. The cluster is ``harness.experiments.SampleCluster``, as in
benchmarks/frontend_path.py, hotpath.py and profile_vs_serving.py.

Experiment switches (``harness.experiments``): ``--cprofile frontend,backend`` runs those components
under ``python -m cProfile`` (main thread: the event loop) into benchmarks/out/<tag>.<name>.prof;
``--pin`` (with ``--threads 1``) puts the backend's executor thread, where ORT runs, alone on the last
CPU (the backend's ``--executor-cpus``) and every other thread of the cluster (``taskset``) and the
client on the others. ``--batch-start duty-cycle`` passes the backend's own flag, for an A/B against
eager batch starts on the same code.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import statistics
import sys

import numpy as np

from harness.experiments import (PIN_OTHER, SampleCluster, exit_on_sigterm, max_rate, on_exec_cpus, ramp_rate,
                                 require_answers)
from harness.meters import CpuMeter, uptime, wait_quiet
from harness.smoke import add_smoke, parse_args
from harness.ort_direct import ort_limit as direct_limit
from harness.ort_direct import ort_session, paced_latencies, time_batch
from nexus.bench.report import write_json
from harness.stats import model_stats, stats_delta

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out"

# ---- ONNX Runtime directly -----------------------------------------------------------------------

def ort_limit(model: str, threads: int, slo_ms: float, repeats: int = 15, no_spin: bool = True) -> dict:
    """ORT direct on the sample ``model``: median l(b) for b = 1, 2, ... until 2*l(b) exceeds the SLO
    twice in a row; the saturated b (``harness.ort_direct.ort_limit``)."""
    from common.sample_models import build_sample_model, model_bytes, sample_input

    m = build_sample_model(model)
    session = ort_session(model_bytes(m), threads, spin=not no_spin)
    return direct_limit(session, slo_ms, lambda b: sample_input(m, b, seed=b), repeats)


# ---- load ---------------------------------------------------------------------------------------

def low_load(cluster: SampleCluster, model: str, rate: float, duration_s: float, slo_ms: float, threads: int,
             no_spin: bool = True, rounds: int = 5, pin: bool = False) -> dict:
    """p50 at a low rate against ORT's own batch-1 p50, with where the time and the CPU go.

    The served phases and ORT-direct phases alternate (``rounds`` of each, ``duration_s`` in all
    for each side), and ORT direct idles between runs at the same mean gap as the arrivals, so that
    both sides sample the same background load and the same cold caches.
    """
    from common.sample_models import build_sample_model, model_bytes, sample_input
    from nexus.bench import LoadClient

    m = build_sample_model(model)
    session = ort_session(model_bytes(m), threads, spin=not no_spin)
    x = sample_input(m, 1)
    time_batch(session, x, 0, warmup=5)
    rng = np.random.default_rng(1)
    pids = cluster.pids()
    phase_s = duration_s / rounds

    async def served() -> tuple[list, list, list, dict, dict]:
        lat, ort, reports = [], [], []
        cpu_total: dict[str, float] = {}
        busy = []
        before = model_stats(cluster.frontend.address, model)
        async with LoadClient(cluster.frontend.address, model) as client:
            await client.run(rate, 1.0, slo_ms)  # warm up
            for i in range(rounds):
                meter = CpuMeter(pids).start()
                r = await client.run(rate, phase_s, slo_ms, seed=100 + i)
                cpu = meter.stop()
                for k, v in cpu["cpu_s"].items():
                    cpu_total[k] = cpu_total.get(k, 0.0) + v
                busy.append(cpu["external_cores"])
                reports.append(r)
                s = r.samples
                ok = s.measured & np.isfinite(s.latency_ms)
                lat.extend(s.latency_ms[ok].tolist())
                with on_exec_cpus(pin):
                    ort.extend(paced_latencies(session, x, rate, phase_s, rng))
        after = model_stats(cluster.frontend.address, model)
        return lat, ort, reports, cpu_total, {"stats": stats_delta(after, before), "external_cores": busy}

    lat, ort, reports, cpu_total, extra = asyncio.run(served())
    require_answers(lat, reports, f"serving: the low-load phase ({rate:g} rps for {duration_s:g} s)")
    d = extra["stats"]
    sent = sum(r.sent for r in reports)
    n = max(d["success_count"], 1)
    nb = max(d["execution_count"], 1)
    e2e_p50 = float(np.percentile(lat, 50))
    ort_p50 = float(np.percentile(ort, 50))
    frontend_ms = d["success_ns"] / n / 1e6
    queue_ms = d["queue_ns"] / max(d["queue_count"], 1) / 1e6
    compute_ms = d["compute_ns"] / max(d["compute_count"], 1) / 1e6
    e2e_mean = float(np.mean(lat))
    ort_mean = float(np.mean(ort))
    return {
        "rate": rate, "requests": len(lat), "sent": sent,
        "bad": sum(r.sent - r.within_slo for r in reports),
        "e2e_p50_ms": e2e_p50, "e2e_p99_ms": float(np.percentile(lat, 99)), "e2e_mean_ms": e2e_mean,
        "ort_b1_p50_ms": ort_p50, "ort_b1_mean_ms": ort_mean, "ort_runs": len(ort),
        "added_p50_ms": e2e_p50 - ort_p50,
        "frontend_mean_ms": frontend_ms, "backend_queue_mean_ms": queue_ms, "backend_compute_mean_ms": compute_ms,
        "mean_batch": d["inference_count"] / nb,
        # Where the added mean latency goes (means; they add up to e2e_mean - ort_mean):
        "split_mean_ms": {
            "client<->frontend (gRPC unary, both ways)": e2e_mean - frontend_ms,
            "frontend<->backend (Execute stream, both ways, frontend work)": frontend_ms - queue_ms - compute_ms,
            "backend queue (arrival to batch start)": queue_ms,
            "backend compute over ORT direct": compute_ms - ort_mean,
        },
        "cpu_ms_per_request": {k: v * 1000 / max(sent, 1) for k, v in cpu_total.items()},
        "external_cores": extra["external_cores"],
    }


def batching_bound(latency_ms: dict[int, float], max_batch: int, slo_ms: float) -> float:
    """The largest Poisson rate at which an ideal server (no RPC, no CPU contention: exactly the
    ORT-direct l(b), the backend's early-drop policy, work-conserving) keeps 99% within the SLO,
    from ``backend.simulate`` (bisection, 3 seeds x 40 s). What batching itself allows."""
    from common.batch_decision import SlidingWindowEarlyDrop
    from backend.simulate import simulate
    from common.arrivals import arrival_times
    from common.rate_search import max_passing_rate

    sizes = sorted(latency_ms)

    def l_of(b: int) -> float:
        if b in latency_ms:
            return latency_ms[b]
        return float(np.interp(b, sizes, [latency_ms[x] for x in sizes]))

    running = 0.0
    mono = {}
    for b in range(1, max_batch + 1):       # the policy needs l(b) non-decreasing
        running = max(running, l_of(b))
        mono[b] = running

    def passes(rate: float) -> bool:
        for seed in range(3):
            r = simulate(SlidingWindowEarlyDrop(), arrival_times(rate, 40.0, seed), slo_ms, mono.__getitem__,
                         max_batch)
            if r.on_time < 0.99 * r.offered:
                return False
        return True

    # 14 bisections between 1 rps (taken to pass) and 1.2x the saturated throughput (taken to fail).
    return max_passing_rate(passes, 1.0, bracket=(1.0, 1.2 * max_batch * 1000.0 / mono[max_batch]), refine=14)


def hop_floor(rate: float, duration_s: float, slo_ms: float) -> dict:
    """p50 of one bare gRPC hop with the same client: ``harness.fake_kserve`` answering a
    resnet18_64-shaped ModelInfer at once (no frontend logic, no backend, no model)."""
    from nexus.bench import run_bench
    from harness.fake_kserve import spawn

    cfg = {"models": {"resnet18_64": {"inputs": [["input", "FP32", [-1, 3, 64, 64]]],
                                      "outputs": [["logits", "FP32", [-1, 1000]]], "latency_ms": 0}}}
    proc, address = spawn(cfg)
    try:
        run_bench(address, "resnet18_64", rate, 1.0, slo_ms)
        r = run_bench(address, "resnet18_64", rate, duration_s, slo_ms, warmup_s=0.5)
    finally:
        proc.terminate()
        proc.wait(5)
    return {"p50_ms": r.p50_ms, "p90_ms": r.p90_ms, "mean_ms": r.mean_ms}


# ---- main -----------------------------------------------------------------------------------------

def one_repeat(args, i: int) -> dict:
    model = "resnet18_64"
    from common.sample_models import build_sample_model, model_bytes, sample_input

    res: dict = {"quiet": wait_quiet(args.quiet_wait_s), "uptime_before": uptime()}
    cprofile = tuple(x for x in args.cprofile.split(",") if x)
    with SampleCluster([model], threads=args.threads, cprofile=cprofile, cprofile_dir=OUT, pin=args.pin, batch_start=args.batch_start,
                       tag=f"serving{i}") as c:
        threads = args.threads or (os.cpu_count() or 1)
        with on_exec_cpus(args.pin):
            lim = ort_limit(model, args.threads, args.slo_ms, args.ort_repeats)
        res["limit_scan"] = lim
        b_star = lim["batch"]
        print(f"[{i}] ORT direct ({threads} threads): saturated batch {b_star} l={lim['l_ms']:.1f} ms "
              f"-> {lim['throughput_rps']:.1f} rps", flush=True)
        ll = low_load(c, model, args.low_rate, args.low_s, args.slo_ms, args.threads, pin=args.pin)
        ll["hop_floor"] = hop_floor(args.low_rate, min(args.low_s, 10.0), args.slo_ms)
        res["low_load"] = ll
        split = ", ".join(f"{k} {v:.2f}" for k, v in ll["split_mean_ms"].items())
        print(f"[{i}] low load {args.low_rate:g} rps: e2e p50 {ll['e2e_p50_ms']:.2f} ms, ORT b1 p50 "
              f"{ll['ort_b1_p50_ms']:.2f} ms -> added {ll['added_p50_ms']:.2f} ms; mean split: {split}; one bare "
              f"gRPC hop (fake_kserve) p50 {ll['hop_floor']['p50_ms']:.2f} ms", flush=True)

        # l(b*) again next to every step of the search: the limit under the same background load.
        m = build_sample_model(model)
        session = ort_session(model_bytes(m), args.threads)
        xb = sample_input(m, b_star, seed=b_star)
        l_samples = [lim["l_ms"]]

        def next_to_step(_r) -> dict:
            with on_exec_cpus(args.pin):
                l_b = statistics.median(time_batch(session, xb, 8, warmup=1))
            l_samples.append(l_b)
            return {"ort_l_bstar_ms": l_b}

        lo = max(10.0, 0.3 * lim["throughput_rps"])
        hi = 1.1 * lim["throughput_rps"]
        pids = c.pids()
        meter = CpuMeter({k: pids[k] for k in ("frontend", "backend", "client")}).start()
        frontend = c.frontend.address
        before = model_stats(frontend, model)
        if args.search == "ramp":
            rate, steps = ramp_rate(frontend, model, args.slo_ms, args.ramp_start * lim["throughput_rps"], hi,
                                    args.ramp_factor, args.step_s, on_step=next_to_step, pids=pids,
                                    warmup_s=args.warmup_s)
        else:
            rate, steps = max_rate(frontend, model, args.slo_ms, lo, hi, args.step_s, on_step=next_to_step,
                                   pids=pids, warmup_s=args.warmup_s)
            if rate == 0.0:      # even the lowest rate failed (a burst of other load, or a slow config): go lower
                rate, more = max_rate(frontend, model, args.slo_ms, lo / 3, lo, args.step_s, on_step=next_to_step,
                                      pids=pids, max_steps=6, warmup_s=args.warmup_s)
                steps += more
        d = stats_delta(model_stats(frontend, model), before)
        cpu = meter.stop()
        l_med = statistics.median(l_samples)
        limit = b_star * 1000 / l_med
        res.update({"b_star": b_star, "l_bstar_samples_ms": l_samples, "l_bstar_ms": l_med, "limit_rps": limit,
                    "served_rps": rate, "ratio": rate / limit, "steps": steps,
                    "search_batches": {str(k): [v[0], v[1] / v[0] / 1e6] for k, v in sorted(d["batches"].items())},
                    "search_cpu": cpu})
        for s in steps:
            print(f"[{i}]   {s['offered_rps']:6.1f} rps: within SLO {s['within_slo'] / max(s['sent'], 1):.4f} "
                  f"p50 {s['p50_ms'] or 0:.1f} p99 {s['p99_ms'] or 0:.1f} late {s['late']} dropped {s['dropped']} "
                  f"lag {s['client_lag_ms']:.1f} ms | other load {s['external_cores']:.2f} cores | "
                  f"ORT l({b_star}) {s['ort_l_bstar_ms']:.1f} ms", flush=True)
        print(f"[{i}] served {rate:.1f} rps / limit {limit:.1f} rps (b*={b_star}, l={l_med:.1f} ms, "
              f"range {min(l_samples):.1f}-{max(l_samples):.1f}) = {res['ratio']:.3f}", flush=True)
        c.stop()
        prof = c.profiles(c.models)[model].get("cpu")
        if prof is not None:
            from backend.sessions import session_max_batch
            res["scheduler_profile_ms"] = {r.batch: r.latency_ms for r in prof.rows}
            res["backend_max_batch"] = session_max_batch(prof, args.slo_ms)
    lat = {int(k): v for k, v in res["limit_scan"]["latency_ms"].items()}
    res["batching_bound_rps"] = batching_bound(lat, res["b_star"], args.slo_ms)
    res["batching_bound_ratio"] = res["batching_bound_rps"] / (res["b_star"] * 1000 / lat[res["b_star"]])
    print(f"[{i}] batching bound (simulated ideal server, ORT-direct l(b)): {res['batching_bound_rps']:.1f} rps "
          f"= {res['batching_bound_ratio']:.3f} of that scan's limit", flush=True)
    res["uptime_after"] = uptime()
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1, help="ORT intra-op threads, backend and direct (0: ORT default)")
    p.add_argument("--repeats", type=int, default=3, help="independent clusters (whole measurement each)")
    p.add_argument("--slo-ms", type=float, default=100.0)
    p.add_argument("--step-s", type=float, default=5.0, help="measured duration of each find_max_rate step")
    p.add_argument("--warmup-s", type=float, default=4.0, help="unmeasured lead-in of each step (re-planning)")
    p.add_argument("--search", choices=("ramp", "bisect"), default="ramp",
                   help="ramp: rates only go up (start, *factor, ...) until one fails; bisect: find_max_rate's "
                        "doubling + bisection (steps down are served with a plan made for a higher rate)")
    p.add_argument("--ramp-start", type=float, default=0.3, help="first ramp rate, as a fraction of the limit")
    p.add_argument("--ramp-factor", type=float, default=1.07)
    p.add_argument("--ort-repeats", type=int, default=15)
    p.add_argument("--low-rate", type=float, default=15.0)
    p.add_argument("--low-s", type=float, default=15.0)
    p.add_argument("--cprofile", default="", help="components to run under cProfile: frontend,backend")
    p.add_argument("--pin", action="store_true",
                   help="experiment: the backend's executor thread (ORT, use with --threads 1) on the last CPU, "
                        "every other thread of the cluster and the client on the others")
    p.add_argument("--batch-start", default="eager", choices=["eager", "duty-cycle"],
                   help="the backend's --batch-start (duty-cycle: wait for the planned batch, at most a duty cycle)")
    p.add_argument("--quiet-wait-s", type=float, default=60.0,
                   help="wait up to this long before each repeat for the machine's other load to drop")
    p.add_argument("--out", default=str(OUT / "serving.json"))
    add_smoke(p, repeats=1, threads=1, pin=True, slo_ms=100.0, step_s=1.0, warmup_s=0.5, ramp_start=0.1, ramp_factor=20.0, ort_repeats=3,
              low_rate=10.0, low_s=3.0, quiet_wait_s=0.0)
    args = parse_args(p, argv)
    exit_on_sigterm()
    if args.pin:
        os.sched_setaffinity(0, set(PIN_OTHER))   # the load client (threads made later inherit it)
    print(uptime(), flush=True)
    runs = []
    for i in range(args.repeats):
        runs.append(one_repeat(args, i))
    ratios = [r["ratio"] for r in runs]
    added = [r["low_load"]["added_p50_ms"] for r in runs]
    print()
    print("| repeat | load avg before | external load (cores) | b* | l(b*) ms | limit rps | served rps | ratio | "
          "backend max batch | e2e p50 ms | ORT b1 p50 ms | added p50 ms | bare gRPC hop p50 ms |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for i, r in enumerate(runs):
        ll = r["low_load"]
        ext = statistics.median(ll["external_cores"])
        print(f"| {i} | {r['uptime_before'].split('load average:')[-1].strip()} | {ext:.2f} | {r['b_star']} | "
              f"{r['l_bstar_ms']:.1f} | {r['limit_rps']:.1f} | {r['served_rps']:.1f} | {r['ratio']:.3f} | "
              f"{r.get('backend_max_batch', '?')} | {ll['e2e_p50_ms']:.2f} | {ll['ort_b1_p50_ms']:.2f} | "
              f"{ll['added_p50_ms']:.2f} | {ll['hop_floor']['p50_ms']:.2f} |")
    print()
    names = list(runs[0]["low_load"]["split_mean_ms"])
    print("| repeat | " + " | ".join(names) + " | CPU ms/req frontend | backend | client |")
    print("| ---: |" + " ---: |" * (len(names) + 3))
    for i, r in enumerate(runs):
        ll = r["low_load"]
        cpu = ll["cpu_ms_per_request"]
        print(f"| {i} | " + " | ".join(f"{v:.2f}" for v in ll["split_mean_ms"].values()) +
              f" | {cpu['frontend']:.2f} | {cpu['backend']:.2f} | {cpu['client']:.2f} |")
    summary = {
        "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
        "added_p50_median_ms": statistics.median(added), "added_p50_min_ms": min(added),
        "added_p50_max_ms": max(added),
    }
    print(f"\nratio median {summary['ratio_median']:.3f} (range {summary['ratio_min']:.3f}-{summary['ratio_max']:.3f}); "
          f"added p50 median {summary['added_p50_median_ms']:.2f} ms "
          f"(range {summary['added_p50_min_ms']:.2f}-{summary['added_p50_max_ms']:.2f})")
    print(uptime())
    print(f"wrote {write_json(args.out, {'args': vars(args), 'runs': runs, 'summary': summary})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
