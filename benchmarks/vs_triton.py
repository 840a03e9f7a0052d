"""Nexus against a tuned Triton, measured by Triton's own perf_analyzer (issue 18 item 5).

    python -m benchmarks.vs_triton [--scenarios single,mix] [--servers triton,nexus]
                                   [--nexus-config NAME[=FLAGS] ...] [--late-requests drop,serve]
                                   [--triton-python PY] [--ladders 2]
                                   [--start-rps R --factor 1.1] [--quick] [--nice -15]

Each server on the same model files, measured by the same tool, on this machine. Per scenario, two
paired ladders (harness/ladder.py): every server of a ladder is started once and left running,
and at each rate of the ladder every server still in the race is measured, one right after the
other, before the ladder goes up to the next rate; a server leaves after two failed levels in a row,
and its goodput is the highest rate it passed. On this shared machine, the other load drifts and
spikes for minutes at a time: servers measured one after the other would be compared under
different load. Ladder 1 holds Triton's first-stage candidates and every Nexus configuration;
ladder 2 the best Triton candidate of ladder 1 at three queue delays and the Nexus configurations
again. Ratios are taken within a ladder, against its best Triton candidate. Scenarios:

- ``single``: a ResNet-18-class CNN at 3x64x64 (``resnet18_64(seed=1018)``, another file than the
  sample) at a 100 ms SLO.
- ``mix``: four models of different sizes and SLOs behind one machine, equal shares of the total
  rate, Poisson arrivals per model: that ResNet-18 at 100 ms, the small CNN (the sample
  ``vehicle_cls``: a compact ResNet at 64x64) at 50 ms, a tiny CNN at 3x16x16 at 30 ms and the sample
  MLP at 20 ms.
- ``tiny``: the sample MLP alone at 20 ms (its concurrency sweep is benchmarks/tiny_sweep.py).

THE TOOL. perf_analyzer 2.50 (the tritonclient wheel's binary, :mod:`harness.perf_analyzer`) in
request-rate mode: Poisson arrivals, asynchronous requests, measurement windows of ``--window-ms``
that must agree within ``--stability-pct`` (p99 and throughput) in ``--max-trials`` windows. A mix
level runs one perf_analyzer per model at once, each at its share of the rate. A level passes when
every perf_analyzer completed it (no failed request: perf_analyzer stops at the first one; stable
windows), every model's p99 is within its SLO, and every model was served its offered rate: at least
97% of it, or within the Poisson noise of the windows' count (three standard deviations; see
``harness.perf_analyzer.Level.passes``). The ladder starts at ``--start-rps`` (total) and steps
by ``--factor``.

CPU. Every level meters the CPU seconds of the server's processes (/proc; Triton: tritonserver, its
Python backend stubs and the PyTriton process; Nexus: every component) and of the perf_analyzer
processes (they are this process's children: ``getrusage``), and the cores the whole machine kept
busy; the report gives them in cores beside every throughput.

TRITON, configured as its users would, tuned as Triton's Model Analyzer does (every candidate's
goodput is reported): Triton 2.51, the ``tritonserver`` bundled in ``nvidia-pytriton`` 0.7 (its own
virtualenv, ``--triton-python``; benchmarks/triton_model.py), ONNX Runtime in the model function with
the direct-ORT baseline's session options, one ORT session per model instance, dynamic batching with
``preferred_batch_size`` [max/2, max]. First stage (ladder 1): max batch size and instances x ORT
threads (single: 8, 16 or 32, and 1 x 2 or 2 x 1, at a 5 ms queue delay; mix: the models side by side,
one ORT thread each, at a 0.5 ms delay or a tenth of the SLO, or ORT's default threads); second stage
(ladder 2): the best of them at its own, a quarter and four times its queue delay
(harness/triton_compare.py).

NEXUS: ``nexus serve --no-samples`` with the flags of each ``--nexus-config`` (default: ``default``,
nothing added, what a user gets, and ``two-devices`` = ``--backends 2 --threads 1``, one device per
core), free ports, the models uploaded with ``nexus models upload --slo-ms`` and profiled by a
backend, as ``nexus serve`` does its samples; with ``--late-requests serve`` (or ``drop,serve``:
every configuration twice) uploaded to serve their late requests as Triton does
(common/late_requests.py) rather than drop them, which perf_analyzer counts as failures.

ORT called directly (``harness.ort_direct``: ORT's default threads, spinning off) gives each
model's own limit b*/l(b*), before and after the servers' measurements (in the mix, b* within 8..64
is Triton's max batch size). ``--nice N`` (as root) favours the whole benchmark (servers,
perf_analyzer and ORT direct alike) over other load on a shared machine. Output: tables on stdout,
benchmarks/out/vs_triton.json and a plot (worst p99/SLO against the offered rate, per server, of
each scenario's last ladder) at ``--plot``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from common.late_requests import LateRequests
from harness import perf_analyzer as pa
from harness.background_load import BackgroundLoad
from harness.cluster import ServeCluster, Upload, descendants, live_profiles
from harness.ladder import paired_ladder
from harness.meters import CpuMeter, LoadSampler, favour, favour_tree, loadavg
from harness.ort_direct import ort_limit as direct_limit
from harness.ort_direct import ort_session
from harness.smoke import add_smoke, parse_args
from nexus.bench.report import write_json
from harness.triton_compare import MAX_TRITON_BATCH, MODELS, NEXUS_CONFIGS, SCENARIOS, SERVED_FRACTION, START_RPS, \
    ModelSpec, build_models, delay_candidates, level_passes, parse_late_requests, parse_nexus_configs, shares, triton_candidates

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out"
PLOT = ROOT / "benchmarks" / "vs_triton.png"
SMOKE_HELP = ("--smoke runs the Nexus side only (Triton is skipped: it needs nvidia-pytriton's own virtualenv): "
              "scenario single, nexus serve on its defaults, ORT direct, one ladder of one 30 rps level measured "
              "by perf_analyzer; where perf_analyzer has not been fetched (into $NEXUS_TEST_TOOLS) or cannot run, "
              "the ladder is skipped too and the servers only start, serve their models and report their plan.")

def ort_limit(path: pathlib.Path, spec: ModelSpec, repeats: int, threads: int = 0) -> dict:
    """ORT called directly (``harness.ort_direct``): l(b) medians, the saturated batch b* and b*/l(b*).
    Past 16, b steps by a quarter: a tiny model's b* is in the hundreds."""
    session = ort_session(path, threads)
    rng = np.random.default_rng(0)
    lim = direct_limit(session, spec.slo_ms, lambda b: rng.standard_normal((b, *spec.input_shape)).astype(np.float32),
                       repeats, next_batch=lambda b: b + 1 if b < 16 else int(b * 1.25), max_batch=MAX_TRITON_BATCH)
    return {"batch": lim["batch"], "l_ms": round(lim["l_ms"], 3), "limit_rps": round(lim["throughput_rps"], 1),
            "batch1_ms": round(lim["latency_ms"][1], 3)}


# ---- machine ----------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children_cpu_s() -> float:
    """CPU seconds of this process's finished children (the perf_analyzer runs)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


# ---- one level, one search ---------------------------------------------------------------------------

class Measurer:
    """Runs perf_analyzer levels against one server and searches its goodput."""

    def __init__(self, args, tool: tuple[pathlib.Path, dict], address: str, server_pid: int, work: pathlib.Path,
                 label: str, describe=None) -> None:
        self.args, self.tool, self.address, self.server_pid = args, tool, address, server_pid
        self.work, self.label = work, label
        self.describe = describe        # () -> what the server says of itself after a level (Nexus: its plan)

    def level(self, rates: dict[str, float]) -> dict:
        pids = [self.server_pid, *descendants(self.server_pid)]
        meter = CpuMeter({str(p): p for p in pids}).start()
        c0 = children_cpu_s()
        binary, env = self.tool
        runs = [pa.start_level(binary, env, self.address, model, rate, self.work, window_ms=self.args.window_ms,
                               stability_pct=self.args.stability_pct, max_trials=self.args.max_trials)
                for model, rate in rates.items()]
        levels = [pa.finish_level(run) for run in runs]
        cpu = meter.stop()
        wall = max(cpu["wall_s"], 1e-9)
        server = sum(v for v in cpu["cpu_s"].values() if v == v)     # NaN: a process gone meanwhile
        client = children_cpu_s() - c0
        slos = {m: MODELS[m].slo_ms for m in rates}
        ok = level_passes(levels, slos, self.args.window_ms / 1000)
        out = {"offered_rps": round(sum(rates.values()), 2), "pass": ok,
               "throughput_rps": round(sum(lv.throughput_rps for lv in levels), 2),
               "worst_p99_over_slo": round(max((lv.p99_us / 1000 / slos[lv.model] if lv.completed else float("inf"))
                                               for lv in levels), 3),
               "cores": {"server": round(server / wall, 3), "client": round(client / wall, 3),
                         "machine": round(cpu["machine_busy_cores"], 3),
                         "others": round(cpu["machine_busy_cores"] - (server + client) / wall, 3)},
               "models": [lv.to_dict() for lv in levels], "load_average": loadavg()}
        if self.describe is not None:
            try:
                out["server_state"] = self.describe()
            except Exception as exc:      # a report, not a measurement: never fail a level for it
                out["server_state"] = f"unavailable: {exc}"
        detail = ", ".join(f"{lv.model} {lv.throughput_rps:.1f}/s p99 {lv.p99_us / 1000:.1f} ms" if lv.completed
                           else f"{lv.model} FAILED: {lv.error[:80]}" for lv in levels)
        print(f"  [{self.label}] {out['offered_rps']:7.1f} rps: {'pass' if ok else 'FAIL'} | {detail} | cores "
              f"server {out['cores']['server']:.2f} client {out['cores']['client']:.2f} machine "
              f"{out['cores']['machine']:.2f} | load {out['load_average']:.1f}", flush=True)
        return out

# ---- Triton ----------------------------------------------------------------------------------------------

class Server:
    """A server process in its own session (killed as a group), output to a log file."""

    def __init__(self, name: str, command: list[str], log_dir: pathlib.Path, env: dict | None = None) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT,
                                     env=env, start_new_session=True)

    def wait_line(self, prefix: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self.log_path.read_text(errors="replace").splitlines():
                if line.startswith(prefix):
                    return line
            if self.proc.poll() is not None:
                break
            time.sleep(0.5)
        tail = self.log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{self.name} not ready (exit {self.proc.poll()}); log tail:\n{tail}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        self.log.close()


def wait_ready(address: str, names, timeout_s: float) -> None:
    from nexus.serve_cmd import wait_models_ready

    missing = wait_models_ready(address, list(names), timeout_s)
    if missing:
        raise RuntimeError(f"not ready at {address} after {timeout_s:.0f} s: {missing}")


@dataclass
class Running:
    """A server started for a scenario: where it listens, its process (all its processes are below it),
    how to stop it, and what it says of itself after a level (None: nothing)."""

    label: str
    address: str
    pid: int
    stop: Callable[[], object]
    describe: Callable[[], object] | None = None
    info: dict = field(default_factory=dict)


def start_triton(args, scenario: str, candidate: dict, paths, work: pathlib.Path) -> Running:
    """PyTriton serving the scenario's models with ``candidate``'s settings (:func:`triton_candidates`)."""
    ports = [free_port() for _ in range(3)]
    config = {"grpc_port": ports[0], "http_port": ports[1], "metrics_port": ports[2],
              "models": [{**m, "path": str(paths[m["name"]])} for m in candidate["models"]]}
    srv = Server("triton", [args.triton_python, str(ROOT / "benchmarks" / "triton_model.py"), json.dumps(config)],
                 work)
    try:
        srv.wait_line("TRITON-READY", 240)
        address = f"127.0.0.1:{ports[0]}"
        wait_ready(address, SCENARIOS[scenario], 120)
    except BaseException:
        srv.stop()
        raise
    favour_tree(srv.proc.pid, args.nice)
    print(f"Triton (PyTriton) on {address}: {candidate['name']}", flush=True)
    return Running(f"triton ({candidate['name']})", address, srv.proc.pid, srv.stop,
                   info={"settings": candidate["models"]})


# ---- Nexus ----------------------------------------------------------------------------------------------

def start_nexus(args, scenario: str, paths, flags: tuple[str, ...], label: str, work: pathlib.Path,
                late: LateRequests | None = None, warm_rps: float = 0.0) -> Running:
    """``nexus serve --no-samples FLAGS`` with the scenario's models uploaded (profiled by a backend),
    with ``late`` as their late requests (None: the default, dropped); with ``--cpu-layout auto``,
    warmed up at ``warm_rps`` in all (0: the scenario's first ladder rate) until its layout settles."""
    names = SCENARIOS[scenario]
    data = work / f"nexus-{scenario}-{label}"
    srv = ServeCluster(data, "--no-samples", *flags, timeout_s=240, log_path=work / f"nexus-{scenario}-{label}.log",
                       log_level="INFO")
    favour_tree(srv.pid, args.nice)      # its own session: the scheduler, backends and frontend share it
    try:
        for name in names:
            srv.upload(Upload(paths[name], name, slo_ms=MODELS[name].slo_ms, late_requests=late), wait=False)
        srv.wait_models_ready(list(names), 600)
        layout = ""
        if "--cpu-layout auto" in " ".join(flags):
            layout = settle_cpu_layout(srv, shares(warm_rps or START_RPS[scenario], names))
    except BaseException:
        srv.stop()
        raise
    favour_tree(srv.pid, args.nice)         # again: backends a layout switch started
    profiles = srv_profiles(srv, names)
    print(f"nexus serve {' '.join(flags) or '(defaults)'} on {srv.frontend}{layout}; profiles {profiles}",
          flush=True)
    return Running(f"nexus {label}", srv.frontend, srv.pid, srv.stop, lambda: plan_now(srv),
                   {"flags": list(flags), "profiles": profiles, "late_requests": (late or LateRequests.DROP).value,
                    "cpu_layout": layout.strip("; ")})


CPU_LAYOUT_SETTLE_S = 120.0
# the warm-up's load before a verdict to stay counts: the serving path's 10 s window, the policy's 10 s
# hold, and its polls (nexus/cpu_layout_switch.py)
CPU_LAYOUT_WARM_S = 40.0


def settle_cpu_layout(srv: ServeCluster, rates: dict[str, float]) -> str:
    """With ``--cpu-layout auto``: once every model has been measured in both layouts (idle, as when a
    deployment is ready before its traffic comes), send the models ``rates`` (the ladder's first
    level), as a user's warm-up would, until the policy's verdict at that load has been carried out
    (a switch done and the old backends gone, or no switch begun in ``CPU_LAYOUT_WARM_S`` of load);
    return the layout in force, as '; LAYOUT' words."""
    deadline = time.monotonic() + CPU_LAYOUT_SETTLE_S
    while srv.logs().count("cpu layout: measured ") < len(rates):
        if time.monotonic() > deadline:
            raise RuntimeError(f"nexus serve --cpu-layout auto: models not measured within {CPU_LAYOUT_SETTLE_S:.0f} s")
        time.sleep(0.5)
    loads = [BackgroundLoad(srv.frontend, name, rps, slo_ms=MODELS[name].slo_ms, seed=i).start()
             for i, (name, rps) in enumerate(rates.items())]
    try:
        start = time.monotonic()
        while time.monotonic() < start + CPU_LAYOUT_SETTLE_S:
            text = srv.logs()
            done = text.split("cpu layout: now ", 1)
            if len(done) == 2 and "stopped, exit status" in done[1]:
                srv.wait_models_ready(list(live_names(srv)), 120)
                return f"; cpu layout {done[1].split(' ', 1)[0]} (switched)"
            if time.monotonic() - start >= CPU_LAYOUT_WARM_S and "cpu layout: switch to" not in text:
                return "; cpu layout machine (stayed)"
            time.sleep(0.5)
    finally:
        for load in loads:
            load.stop()
    raise RuntimeError(f"nexus serve --cpu-layout auto: no verdict carried out within {CPU_LAYOUT_SETTLE_S:.0f} s")


def live_names(srv: ServeCluster) -> list[str]:
    from nexus.scheduler_client import list_models
    return [m.name for m in list_models(srv.scheduler, srv.creds)]


def nexus_label(config: str, late: LateRequests) -> str:
    """A Nexus configuration's name, with its models' late requests when they are served."""
    return config if late is LateRequests.DROP else f"{config}, late {late.value}"


def srv_profiles(srv: ServeCluster, names) -> dict:
    """Each model's profile as the scheduler holds it: its largest batch, l(1) and l(max) in ms."""
    out = {}
    for name, by_type in live_profiles(srv.data_dir / "db", names).items():
        for device_type, p in by_type.items():
            out[name] = {"device_type": device_type, "max_batch": p.max_batch, "l1_ms": round(p.latency_ms(1), 2),
                         "lmax_ms": round(p.latency_ms(p.max_batch), 2)}
    return out


def plan_now(srv: ServeCluster) -> list[dict]:
    """The scheduler's plan now, compact: per device its duty cycle and (model, batch, l(batch), rps)."""
    from nexus.scheduler_client import fetch_status

    st = fetch_status(srv.scheduler, creds=srv.creds)
    return [{"device": d.node_id, "duty_cycle_ms": round(d.duty_cycle_ms, 1),
             "sessions": [[s.model, s.batch, round(s.latency_ms, 1), round(s.device_rate_rps, 1)] for s in d.sessions]}
            for d in st.devices]


# ---- report ----------------------------------------------------------------------------------------------

def summary(result: dict) -> list[dict]:
    """Per scenario, ladder and server: the goodput, its ratio to the best Triton candidate of the same
    ladder, and the cores (server, perf_analyzer, whole machine) at the level of the goodput."""
    rows = []
    for scenario, res in result["scenarios"].items():
        for i, ladder in enumerate(res.get("ladders", []), start=1):
            tritons = [label for label in ladder if label.startswith("triton")]
            best = max((ladder[label]["goodput_rps"] for label in tritons), default=0.0)
            for label, r in ladder.items():
                at = max((s for s in r["steps"] if s["pass"]), key=lambda s: s["rate"], default=None)
                cores = at["cores"] if at else {}
                rows.append({"scenario": scenario, "ladder": i, "server": label, "goodput_rps": r["goodput_rps"],
                             "vs_best_triton": round(r["goodput_rps"] / best, 2) if best else None,
                             "server_cores": cores.get("server"), "client_cores": cores.get("client"),
                             "machine_cores": cores.get("machine")})
    return rows


def print_table(rows: list[dict]) -> None:
    cols = ["scenario", "ladder", "server", "goodput_rps", "vs_best_triton", "server_cores", "client_cores",
            "machine_cores"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")


def plot(result: dict, path: pathlib.Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    scenarios = [s for s, r in result["scenarios"].items() if r.get("ladders")]
    if not scenarios:
        return
    fig = Figure(figsize=(6 * len(scenarios), 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(scenarios), squeeze=False)[0]
    for ax, scenario in zip(axes, scenarios):
        ladder = result["scenarios"][scenario]["ladders"][-1]
        for label, r in ladder.items():
            pts = [(s["rate"], min(s["worst_p99_over_slo"], 3.0), s["pass"]) for s in r["steps"]]
            line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], ".-", lw=0.8, ms=4, label=label)
            ax.scatter([p[0] for p in pts if not p[2]], [p[1] for p in pts if not p[2]], marker="x",
                       color=line.get_color())
        ax.axhline(1.0, color="red", lw=0.8, ls=":", label="SLO")
        ax.set_xlabel("offered rate, total (rps, Poisson)")
        ax.set_ylabel("worst model's p99 / SLO (3: failed level)")
        ax.set_title(f"{scenario} (last ladder): {', '.join(SCENARIOS[scenario])}", fontsize="small")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.savefig(path, dpi=80)


def run_ladder(args, tool, scenario: str, running: list[Running], work: pathlib.Path, tag: str) -> dict:
    """A paired ladder (harness/ladder.py) over the running servers: per server its goodput and levels."""
    names = SCENARIOS[scenario]
    measurers = {r.label: Measurer(args, tool, r.address, r.pid, work, f"{tag} {r.label}", r.describe) for r in running}

    def level(label: str, rate: float) -> dict:
        time.sleep(args.cooldown_s)
        return measurers[label].level(shares(rate, names))

    start = args.start_rps or START_RPS[scenario]
    return paired_ladder(list(measurers), level, start, args.factor, args.max_rps or 8 * start)


def run_scenario(args, tool, scenario: str, servers: list[str], configs: dict[str, tuple[str, ...]],
                 work: pathlib.Path) -> dict:
    """ORT direct; ladder 1: Triton's first-stage candidates and every Nexus configuration; ladder 2:
    the best Triton candidate of ladder 1 and its two queue delays, and the Nexus configurations again
    (all started once per ladder and left running, idle but for the one measured)."""
    names = SCENARIOS[scenario]
    paths = build_models(work, names)
    res: dict = {"models": {n: {"slo_ms": MODELS[n].slo_ms} for n in names}, "ort_direct": {}, "ladders": []}

    def direct(when: str) -> None:
        limits = {n: ort_limit(paths[n], MODELS[n], args.ort_repeats) for n in names}
        res["ort_direct"][when] = limits
        print(f"[{scenario}] ORT direct {when}: " + ", ".join(
            f"{n} b*={v['batch']} l={v['l_ms']} ms limit {v['limit_rps']} rps" for n, v in limits.items()), flush=True)

    def ladder(tag: str, tritons: list[dict], nexus: list[Running]) -> dict:
        started: list[Running] = []
        try:
            for cand in tritons:
                started.append(start_triton(args, scenario, cand, paths, work))
            out = run_ladder(args, tool, scenario, started + nexus, work, tag)
        finally:
            for srv in started:
                srv.stop()
        for srv in started + nexus:
            out[srv.label]["server"] = srv.info
        res["ladders"].append(out)
        return out

    direct("before")
    nexus: list[Running] = []
    try:
        if "nexus" in servers:
            nexus = [start_nexus(args, scenario, paths, flags, nexus_label(label, late), work, late, args.start_rps)
                     for label, flags in configs.items() for late in args.late_requests]
        tritons = triton_candidates(scenario, res["ort_direct"]["before"])[:args.triton_candidates or None] \
            if "triton" in servers else []
        if tool is None:             # a smoke run without perf_analyzer: the servers start, no ladder runs
            for srv in nexus:
                print(f"[{scenario}] {srv.label}: plan {srv.describe()}", flush=True)
            tritons, ladders = [], 0
        else:
            ladders = args.ladders
            first = ladder("ladder 1", tritons, nexus)
        if tritons and ladders > 1:
            best = max(tritons, key=lambda c: first[f"triton ({c['name']})"]["goodput_rps"])
            ladder("ladder 2", [best, *delay_candidates(best)], nexus)
        for _ in range(2, ladders):
            ladder(f"ladder {len(res['ladders']) + 1}", [], nexus)
    finally:
        for srv in nexus:
            srv.stop()
    direct("after")
    return res


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=SMOKE_HELP)
    p.add_argument("--triton-python", default=str(OUT / "pytriton-venv" / "bin" / "python"),
                   help="python of a virtualenv with nvidia-pytriton and onnxruntime")
    p.add_argument("--servers", default="triton,nexus", help="comma-separated, run in this order")
    p.add_argument("--scenarios", default="single,mix", help=f"comma-separated of {', '.join(SCENARIOS)}")
    p.add_argument("--nexus-config", action="append", default=[], metavar="NAME[=FLAGS]",
                   help=f"nexus serve configurations to measure (repeat; default: {', '.join(NEXUS_CONFIGS)})")
    p.add_argument("--late-requests", default="drop", metavar="drop,serve",
                   help="Nexus's models' late requests (common/late_requests.py); both: every Nexus configuration "
                        "twice")
    p.add_argument("--triton-candidates", type=int, default=0,
                   help="tune Triton over only the first N candidates of its grid, without the delay stage")
    p.add_argument("--ladders", type=int, default=2,
                   help="paired ladders: the first with Triton's first-stage grid, the second with its best "
                        "candidate at three queue delays, more with the Nexus configurations alone")
    p.add_argument("--perf-analyzer", default="", help="perf_analyzer binary (default: fetched, see the module doc)")
    p.add_argument("--quick", action="store_true", help="smoke run: short windows, coarse search")
    p.add_argument("--window-ms", type=int, default=3000)
    p.add_argument("--stability-pct", type=float, default=25.0)
    p.add_argument("--max-trials", type=int, default=6)
    p.add_argument("--start-rps", type=float, default=0.0, help="the ladder's first total rate (0: per scenario)")
    p.add_argument("--factor", type=float, default=1.1, help="the ladder's step from one rate to the next")
    p.add_argument("--max-rps", type=float, default=0.0, help="the ladder's top (0: 8x its first rate)")
    p.add_argument("--cooldown-s", type=float, default=1.0)
    p.add_argument("--ort-repeats", type=int, default=11)
    p.add_argument("--nice", type=int, default=0,
                   help="niceness of this process and everything it starts (servers, perf_analyzer, ORT direct); "
                        "negative (root) favours the benchmark over other load on a shared machine")
    p.add_argument("--out", default=str(OUT / "vs_triton.json"))
    p.add_argument("--plot", default=str(PLOT))
    p.add_argument("--replot", metavar="JSON", help="only redraw --plot from a JSON this benchmark wrote")
    add_smoke(p, servers="nexus", scenarios="single", nexus_config=["default"], ladders=1, window_ms=1000,
              max_trials=6, stability_pct=100.0, start_rps=30.0, factor=2.0, max_rps=30.0, cooldown_s=0.0,
              ort_repeats=2)
    args = parse_args(p, argv)
    if args.replot:
        plot(json.loads(pathlib.Path(args.replot).read_text()), pathlib.Path(args.plot))
        return 0
    scenarios = [s for s in args.scenarios.split(",") if s]
    servers = [s for s in args.servers.split(",") if s]
    bad = [s for s in scenarios if s not in SCENARIOS] + [s for s in servers if s not in ("triton", "nexus")]
    if bad:
        p.error(f"unknown scenario or server: {bad}")
    try:
        configs = parse_nexus_configs(args.nexus_config or list(NEXUS_CONFIGS))
    except ValueError as exc:
        p.error(str(exc))
    try:
        args.late_requests = parse_late_requests(args.late_requests)
    except ValueError as exc:
        p.error(str(exc))
    if args.quick:
        args.window_ms, args.max_trials, args.factor, args.ort_repeats = 1500, 4, 1.3, 5
    if "triton" in servers and not pathlib.Path(args.triton_python).exists():
        p.error(f"--triton-python {args.triton_python} does not exist (see the module docstring)")
    try:
        tool = pa.driver_tool(args.perf_analyzer, args.smoke)
    except pa.ToolUnavailable as exc:
        p.error(f"perf_analyzer unavailable: {exc}")
    if tool is None:
        print("smoke: perf_analyzer not fetched or cannot run here: no ladder", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit(143)))
    favour(os.getpid(), args.nice)   # before any thread or child: they inherit it

    sampler = LoadSampler().start()
    t0 = time.monotonic()
    result: dict = {"command": " ".join(["python", "-m", "benchmarks.vs_triton", *argv]),
                    "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpus": os.cpu_count(),
                    "nice": args.nice, "criteria": {"served_fraction": SERVED_FRACTION, "percentile": 99,
                                                    "window_ms": args.window_ms, "stability_pct": args.stability_pct,
                                                    "max_trials": args.max_trials},
                    "scenarios": {}}
    with tempfile.TemporaryDirectory(prefix="vs-triton-") as tmp:
        work = pathlib.Path(tmp)
        for scenario in scenarios:
            try:
                result["scenarios"][scenario] = run_scenario(args, tool, scenario, servers, configs, work)
            except (RuntimeError, subprocess.CalledProcessError) as exc:
                print(f"{scenario} failed: {exc}", file=sys.stderr, flush=True)
                result["scenarios"][scenario] = {"error": str(exc)[-2000:]}
    result["load_average"] = sampler.stop()
    result["wall_s"] = round(time.monotonic() - t0, 1)
    result["summary"] = summary(result)
    out = write_json(args.out, result)
    plot(result, pathlib.Path(args.plot))
    print(f"\nwall {result['wall_s']} s; load average (1 min) during the run: {result['load_average']}")
    print_table(result["summary"])
    print(f"wrote {out} and {args.plot}")
    return 0 if not any("error" in r for r in result["scenarios"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
