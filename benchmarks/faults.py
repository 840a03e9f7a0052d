"""Faults and overload on real processes with emulated GPUs (issue 11); figures in faults.md.

Scenarios, each on a fresh cluster of separately started processes (scheduler, one frontend,
emulated backends; ``harness.cluster.Cluster``), with a steady open-loop load
(``nexus.bench.BackgroundLoad``, evenly spaced arrivals, a 10 s client deadline):

* ``kill``: a model at a steady open-loop rate (default 300 rps), then ``kill -9`` of the backend
  serving it, once with the scheduler's default of one replica and once with ``--min-replicas 2``
  (then the backend killed is one of the two). Reported: requests failed (any status but OK) and
  late (OK after the SLO) among those sent in the 2 s from the kill, against the 2 s before it (the
  machine's own noise); requests that got no response at all; the requests in flight at the kill;
  and the time from the kill until goodput is back: the first 250 ms bin from which every bin of the
  next second answers on time at least 0.95 of the share the 2 s before the kill did.
* ``hang``: the same with ``kill -STOP`` instead: the process stays, its sockets stay open, and
  only gRPC keepalive (pings unanswered for 2 s) tells the frontend and the scheduler. Counted the
  same way; the stopped backend is continued and stopped at the end.
* ``overload``: one backend whose capacity is known from the profile (the saturated batch over its
  latency), offered 1x, 2x and 5x that rate. Reported: goodput (OK within the SLO per second) over
  capacity, statuses, and the frontend's and backend's peak resident memory during each phase.

Usage: python -m benchmarks.faults [--rate 300] [--out benchmarks/out/faults.json]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import time

from common.profile import Profile
from common.sample_models import mlp_small, model_bytes
from harness.background_load import BackgroundLoad
from harness.cluster import Cluster, Upload
from harness.meters import RssSampler
from harness.smoke import add_smoke, parse_args
from nexus.bench.report import write_json

DEVICE_TYPE = "gtx1080ti"
FAST = Profile.linear(1.0, 5.0, 32, device_type=DEVICE_TYPE)          # l(b) = 5 + b ms
FAST_SLO_MS = 100.0
SATURATED_BATCH = 20


def heavy(capacity_rps: float) -> tuple[Profile, float]:
    """A profile and SLO whose saturated batch is 20 and whose capacity is ``capacity_rps``:
    l(20) = 20 / capacity, l(b) = l(20) / 5 + b * (l(20) * 4/5) / 20, SLO = 2 l(20). (At 40 rps:
    l(b) = 100 + 20b ms, SLO 1 s.) A low capacity keeps 5x overload within what the Python processes
    of a shared 2-core machine serve, so that the figure measures admission rather than the CPU."""
    full_ms = SATURATED_BATCH / capacity_rps * 1000
    return (Profile.linear(full_ms * 0.8 / SATURATED_BATCH, full_ms * 0.2, 32, device_type=DEVICE_TYPE),
            2 * full_ms)
WINDOW_S = 2.0       # failures of the kill: those sent in this window from the kill, against the one before
BIN_S = 0.25


def start_cluster(workdir: pathlib.Path, backends: int) -> Cluster:
    return Cluster(workdir, backends=backends, device=f"emulated:{DEVICE_TYPE}",
                   frontend={"report_interval_s": 0.5}).start()


def _upload(cluster: Cluster, tmp: pathlib.Path, name: str, profile: Profile, slo_ms: float,
            min_replicas: int = 0) -> None:
    model, prof = tmp / f"{name}.onnx", tmp / f"{name}.json"
    model.write_bytes(model_bytes(mlp_small()))
    prof.write_text(profile.to_json())
    cluster.upload(Upload(model, name, str(prof), slo_ms, min_replicas))


def steady_load(cluster: Cluster, model: str, rate: float, slo_ms: float) -> BackgroundLoad:
    return BackgroundLoad(cluster.frontend.address, model, rate, slo_ms=slo_ms, cv=0.0).start()


def _serving_except(cluster: Cluster, model: str, stopped) -> int:
    """Backends other than ``stopped`` that have ``model`` loaded (a stopped one cannot answer Stats)."""
    import grpc

    from common.pb import control, control_grpc
    n = 0
    for b in cluster.backends:
        if b is stopped or b.proc.poll() is not None:
            continue
        with grpc.insecure_channel(b.address) as ch:
            stats = control_grpc.BackendStub(ch).Stats(control.BackendStatsRequest(), timeout=5)
        n += any(s.model == model for s in stats.sessions)
    return n


def kill_scenario(tmp: pathlib.Path, rate: float, replicas: int, steady_s: float, after_s: float,
                  fault: str = "kill") -> dict:
    """``fault``: ``kill`` (SIGKILL) or ``hang`` (SIGSTOP, continued after the measurement)."""
    cluster = start_cluster(tmp / f"{fault}{replicas}", 3)
    stopped = None
    try:
        _upload(cluster, tmp, "victim", FAST, FAST_SLO_MS, replicas)
        deadline = time.monotonic() + 30
        while len(cluster.serving("victim")) < replicas and time.monotonic() < deadline:
            time.sleep(0.2)
        serving = cluster.serving("victim")
        load = steady_load(cluster, "victim", rate, FAST_SLO_MS)
        time.sleep(steady_s)
        in_flight = load.in_flight()
        kill_t = time.monotonic()
        if fault == "hang":
            stopped = serving[0]
            stopped.pause()
        else:
            serving[0].kill()
        time.sleep(after_s)
        result = load.stop().samples
        replicas_after = _serving_except(cluster, "victim", stopped)
    finally:
        if stopped is not None:
            stopped.resume()
        cluster.stop()
    slo_s = FAST_SLO_MS / 1000
    codes = result.status_counts()
    rows = list(zip(result.statuses(), result.sent_at.tolist(), result.done_at.tolist()))

    def window(lo: float, hi: float) -> tuple[int, int, int]:
        """(requests, failed, late) among those sent in [kill + lo, kill + hi)."""
        sel = [(st, t, d) for st, t, d in rows if kill_t + lo <= t < kill_t + hi]
        return (len(sel), sum(1 for st, _, _ in sel if st != "OK"),
                sum(1 for st, t, d in sel if st == "OK" and d - t > slo_s))

    n_before, failed_before, late_before = window(-WINDOW_S - slo_s, -slo_s)
    n_after, failed_after, late_after = window(-slo_s, WINDOW_S - slo_s)
    good_before = (n_before - failed_before - late_before) / max(n_before, 1)
    bins = []
    for i in range(int(-1.0 / BIN_S), int(after_s / BIN_S) - 1):
        n, failed, late = window(i * BIN_S, (i + 1) * BIN_S)
        bins.append((round(i * BIN_S, 2), (n - failed - late) / max(n, 1)))
    # Back at the offered rate: from the first bin after the kill where this bin and those of the next
    # second all answer on time at least 0.95 of what the same length before the kill did.
    need = 0.95 * good_before
    after_bins = [(t, g) for t, g in bins if t >= 0]
    recovery = next((t for k, (t, _) in enumerate(after_bins)
                     if all(g >= need for _, g in after_bins[k:k + int(1.0 / BIN_S)])), None)
    return {
        "fault": fault, "min_replicas": replicas, "rate_rps": rate, "load_average": round(os.getloadavg()[0], 1),
        "sent": len(rows), "codes": codes, "no_response": codes.get("NO_RESPONSE", 0),
        "in_flight_at_kill": in_flight, "good_fraction_before_kill": round(good_before, 3),
        "failed": len(rows) - codes.get("OK", 0), "backends_serving_before": len(serving),
        "backends_serving_after": replicas_after,
        "window_s": WINDOW_S, "failed_in_window_after": failed_after, "late_in_window_after": late_after,
        "failed_in_window_before": failed_before, "late_in_window_before": late_before,
        "recovery_s": recovery, "good_fraction_by_bin": {f"{t:+.2f}": round(g, 3) for t, g in bins},
    }


def overload_scenario(tmp: pathlib.Path, factors: list[float], phase_s: float, capacity_rps: float) -> list[dict]:
    cluster = start_cluster(tmp / f"overload{capacity_rps:g}", 1)
    out = []
    profile, slo_ms = heavy(capacity_rps)
    try:
        _upload(cluster, tmp, "heavy", profile, slo_ms)
        pids = {"frontend": cluster.frontend.pid, "backend": cluster.backends[0].pid}
        slo_s = slo_ms / 1000
        for factor in factors:
            rate = factor * capacity_rps
            with RssSampler(pids) as rss:
                load = steady_load(cluster, "heavy", rate, slo_ms)
                time.sleep(phase_s)
                result = load.stop().samples
            sent, done = result.sent_at.tolist(), result.done_at.tolist()
            codes = result.status_counts()
            warm = sent[0] + 1.0          # the first second fills the queues
            end = sent[-1]
            good = sum(1 for s, t, d in zip(result.statuses(), sent, done)
                       if s == "OK" and d - t <= slo_s and warm <= t <= end)
            goodput = good / (end - warm)
            out.append({"factor": factor, "offered_rps": rate, "sent": len(sent), "codes": codes,
                        "load_average": round(os.getloadavg()[0], 1),
                        "goodput_rps": round(goodput, 1), "goodput_over_capacity": round(goodput / capacity_rps, 3),
                        "capacity_rps": capacity_rps, "slo_ms": slo_ms,
                        "no_response": codes.get("NO_RESPONSE", 0),
                        "peak_rss_mb": {k: round(v, 1) for k, v in rss.peak.items()}})
            time.sleep(1.0)      # let the queues drain before the next phase
    finally:
        cluster.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=300.0, help="offered rate of the kill scenario")
    parser.add_argument("--steady-s", type=float, default=4.0)
    parser.add_argument("--after-s", type=float, default=5.0)
    parser.add_argument("--phase-s", type=float, default=8.0, help="length of each overload phase")
    parser.add_argument("--factors", default="1,2,5", help="overload factors (offered / capacity)")
    parser.add_argument("--capacities", default="20,40", help="capacities (rps) of the overloaded device")
    parser.add_argument("--skip", default="", help="comma-separated scenarios to skip: kill, hang, overload")
    parser.add_argument("--out", default="benchmarks/out/faults.json")
    add_smoke(parser, skip="hang", rate=20.0, steady_s=1.0, after_s=1.0, phase_s=2.0, factors="2", capacities="20")
    args = parse_args(parser, argv)
    skip = set(filter(None, args.skip.split(",")))
    report: dict = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = pathlib.Path(d)
        for fault in ("kill", "hang"):
            if fault in skip:
                continue
            report[fault] = [kill_scenario(tmp, args.rate, r, args.steady_s, args.after_s, fault) for r in (1, 2)]
            for k in report[fault]:
                print(f"{'kill -9' if fault == 'kill' else 'kill -STOP'}, min_replicas {k['min_replicas']}: sent {k['sent']}, failed {k['failed']}; "
                      f"in the {k['window_s']} s from the kill failed {k['failed_in_window_after']} late "
                      f"{k['late_in_window_after']} (before it: failed {k['failed_in_window_before']} late "
                      f"{k['late_in_window_before']}); no response {k['no_response']}, in flight at the kill "
                      f"{k['in_flight_at_kill']}, goodput back after {k['recovery_s']} s (good before the kill: "
                      f"{k['good_fraction_before_kill']}, load {k['load_average']}); {k['codes']}", flush=True)
        if "overload" not in skip:
            report["overload"] = [o for c in args.capacities.split(",") for o in overload_scenario(
                tmp, [float(f) for f in args.factors.split(",")], args.phase_s, float(c))]
            for o in report["overload"]:
                print(f"capacity {o['capacity_rps']:g} rps, overload {o['factor']:g}x ({o['offered_rps']:.0f} rps): goodput {o['goodput_rps']} rps = "
                      f"{o['goodput_over_capacity']} of capacity; peak RSS {o['peak_rss_mb']}; {o['codes']}", flush=True)
    print(f"wrote {write_json(args.out, report, indent=2)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
