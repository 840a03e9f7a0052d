"""Nexus against Triton in the same run, same machine, same client (issue 12, item 3).

    python -m benchmarks.vs_triton --triton-python /work/pytriton-venv310/bin/python [--quick] [--py-spy]

One after the other on this machine, for each model (a ResNet-18-class CNN at 64x64, seed 1018,
a different file from the sample ``resnet18_64``, at a 100 ms SLO; a tiny CNN built here, 3x32x32,
at a 20 ms SLO):

1. ORT DIRECT: the model's own limit. The .onnx file in an ``onnxruntime.InferenceSession`` (ORT's
   default threads, one per core, ``--ort-threads``; intra-op spin-waiting off as in the Nexus
   backend unless ``--ort-spin``), called in a loop: l(b) is the median of timed runs of batch b for
   b = 1, 2, ... until 2*l(b) exceeds the SLO twice in a row; the limit is b*/l(b*) at the largest
   b* with 2*l(b*) <= SLO (Nexus's saturated batch), and ``batch1_ms`` is l(1). Measured again
   before each server's phase, so each server is compared with the limit measured next to it.
2. TRITON: a real tritonserver (the one bundled in the ``nvidia-pytriton`` wheel, run from its own
   virtualenv by ``--triton-python``, with benchmarks/triton_model.py as the model script):
   ONNX Runtime with the same session options as ORT direct inside the Python model function
   (PyTriton's ``@batch``), dynamic batching with
   ``max_batch_size`` = b* and a max queue delay (``--triton-queue-delay-us``), the same .onnx file.
3. NEXUS: ``nexus serve --no-samples`` on free ports (defaults otherwise, so what a user gets),
   each model profiled with ``nexus profile MODEL -o P.json`` (defaults) and uploaded with
   ``nexus models upload --profile P.json --slo-ms SLO``.

Both servers get the same open-loop Poisson client, the project's own load generator
(``nexus.bench.loadgen.LoadClient``, KServe v2 gRPC, one serialized request sent as raw bytes,
with the request parameter ``timeout`` = SLO as Triton defines it). Per server and model:

* LOW LOAD: p50 at ``--low-rate`` rps (default 10) for ``--low-s`` seconds; the added p50 is that
  minus ORT direct's l(1).
* GOODPUT: the largest Poisson rate with p99 within the SLO (at least 99% of the sent requests
  answered within the SLO; a dropped request counts as late): start at a per-model rate, double
  until a step fails, then bisect to ``--rel-tol``. Every step lasts
  max(``--step-s``, min(``--min-requests`` / rate, ``--max-step-s``)) seconds after a
  ``--warmup-s`` lead-in, so a step has enough requests for a p99. The steps are the points of the latency-vs-rate plot.
* With ``--py-spy`` (nexus only): at ~0.9x its goodput, the CPU each process used per second
  (/proc/PID/stat: frontend, backend, scheduler, this client) and a py-spy sample of the
  frontend and the backend (``--py-spy-bin``; all threads, idle frames dropped) reduced to the
  functions that take the most samples.

The load average is sampled throughout; ``--nice -15`` (as root) favours the whole benchmark (servers,
client, ORT direct alike) over other load on a shared machine. Output: a table on stdout, benchmarks/out/vs_triton.json,
benchmarks/vs_triton.png (latency vs offered rate, both servers, per model). ``--quick`` is a
smoke run (short steps, coarse search, a few minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

from nexus.bench import pyspy
from nexus.bench.cluster import ServeCluster
from nexus.bench.meters import CpuMeter, LoadSampler, favour, favour_tree, loadavg
from nexus.bench.ort_direct import ort_limit as direct_limit
from nexus.bench.ort_direct import ort_session
from nexus.bench.report import step_summary, write_json
from nexus.launcher import nexus_command

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out"
PLOT = ROOT / "benchmarks" / "vs_triton.png"

# name -> (SLO ms, input shape, first rate of the search in rps)
MODELS = {
    "r18_64": (100.0, (3, 64, 64), 80.0),
    "tiny_cnn": (20.0, (3, 32, 32), 300.0),
}


# ---- models ----------------------------------------------------------------------------------------

def build_models(directory: pathlib.Path) -> dict[str, pathlib.Path]:
    """Write both .onnx files; return name -> path."""
    from common.sample_models import model_bytes, resnet18_64, tiny_cnn

    paths = {}
    for name, model in (("r18_64", resnet18_64(seed=1018)), ("tiny_cnn", tiny_cnn())):
        paths[name] = directory / f"{name}.onnx"
        paths[name].write_bytes(model_bytes(model))
    return paths


def ort_limit(path: pathlib.Path, slo_ms: float, repeats: int, threads: int = 0, spin: bool = False) -> dict:
    """ORT called directly in a loop (``nexus.bench.ort_direct``): l(b) medians, the saturated batch b*
    and b*/l(b*). Past 16, b steps by a quarter: the tiny model's b* is in the hundreds."""
    session = ort_session(path, threads, spin=spin)
    shape = session.get_inputs()[0].shape[1:]
    rng = np.random.default_rng(0)
    lim = direct_limit(session, slo_ms, lambda b: rng.standard_normal((b, *shape)).astype(np.float32), repeats,
                       next_batch=lambda b: b + 1 if b < 16 else int(b * 1.25))
    lat = lim["latency_ms"]
    return {"latency_ms": {k: round(v, 3) for k, v in lat.items()}, "batch": lim["batch"],
            "l_ms": round(lim["l_ms"], 3), "limit_rps": round(lim["throughput_rps"], 1),
            "batch1_ms": round(lat[1], 3), "threads": threads or "ORT default", "spin": spin}


# ---- machine ----------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- load ---------------------------------------------------------------------------------------------

def step_dict(r) -> dict:
    return step_summary(r, 3)


async def measure_server(address: str, model: str, slo_ms: float, start_rps: float, args, label: str,
                         during_near_max=None) -> dict:
    """Low-load p50, then the goodput search; returns both with every step."""
    from nexus.bench import LoadClient, search_rate

    steps: list[dict] = []
    async with LoadClient(address, model, seed=1) as client:
        low = await client.run(args.low_rate, args.low_s, slo_ms, warmup_s=1.0, seed=100)
        print(f"  [{label}] {model} low load {args.low_rate:g} rps: p50 {low.p50_ms:.2f} ms p99 {low.p99_ms:.2f} ms "
              f"({low.sent} requests)", flush=True)

        def step(r) -> None:
            ok = r.sent > 0 and r.good_fraction >= 0.99
            steps.append({**step_dict(r), "pass": ok})
            print(f"  [{label}] {model} {r.offered_rps:7.1f} rps: {'pass' if ok else 'FAIL'} good {r.good_fraction:.4f} "
                  f"p50 {r.p50_ms or float('nan'):.1f} p99 {r.p99_ms or float('nan'):.1f} ms, {r.sent} req, "
                  f"lag {r.client_lag_ms:.0f} ms, load {loadavg():.1f}", flush=True)

        # Unrecorded warm-up at the first rate: batch sizes, arenas and connections seen once.
        await client.run(start_rps, 2.0, slo_ms, seed=0)
        # From the first rate: double while passing or halve while failing (down to 5 rps), then bisect.
        best, _ = await search_rate(
            client, slo_ms, start_rps, step_duration_s=lambda rate: max(args.step_s, min(args.min_requests / rate,
                                                                                          args.max_step_s)),
            warmup_s=args.warmup_s, cooldown_s=args.cooldown_s, seed=1, on_step=step,
            rel_tol=args.rel_tol, max_steps=args.max_steps, floor=5.0)
        near = None
        if during_near_max is not None and best > 0:
            near = await during_near_max(client, 0.9 * best)
    return {"low": step_dict(low), "goodput_rps": round(best, 1), "steps": steps, "near_max": near}


# ---- Triton --------------------------------------------------------------------------------------------

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


def wait_ready(address: str, names: list[str], timeout_s: float) -> None:
    from nexus.serve_cmd import wait_models_ready

    missing = wait_models_ready(address, names, timeout_s)
    if missing:
        raise RuntimeError(f"not ready at {address} after {timeout_s:.0f} s: {missing}")


def run_triton(args, paths, limits, work: pathlib.Path) -> dict:
    ports = [free_port() for _ in range(3)]
    specs = [f"{n}={paths[n]}:{limits[n]['batch']}" for n in args.models]
    srv = Server("triton", [args.triton_python, str(ROOT / "benchmarks" / "triton_model.py"),
                            *map(str, ports), str(args.triton_queue_delay_us), str(args.ort_threads),
                            str(int(args.ort_spin)), *specs], work)
    try:
        srv.wait_line("TRITON-READY", 180)
        address = f"127.0.0.1:{ports[0]}"
        wait_ready(address, args.models, 120)
        favour_tree(srv.proc.pid, args.nice)
        print(f"Triton (pytriton) serving on {address}: {', '.join(specs)}", flush=True)
        out = {}
        for name in args.models:
            slo, _, start = MODELS[name]
            out[name] = asyncio.run(measure_server(address, name, slo, start, args, "triton"))
        return out
    finally:
        srv.stop()


# ---- Nexus ----------------------------------------------------------------------------------------------

def run_nexus(args, paths, work: pathlib.Path) -> dict:
    nexus = nexus_command()
    data = work / "nexus-data"
    flags = ["--no-samples"]
    if args.nexus_threads:
        flags += ["--threads", str(args.nexus_threads)]
    if args.nexus_batch_start:
        flags += ["--batch-start", args.nexus_batch_start]
    srv = ServeCluster(data, *flags, timeout_s=180, log_path=work / "nexus.log", log_level="INFO")
    favour_tree(srv.pid, args.nice)      # its own session: the scheduler, backend and frontend share it
    try:
        frontend, scheduler = srv.frontend, srv.scheduler
        profiles = {}
        for name in args.models:
            prof = work / f"{name}.profile.json"
            subprocess.run([*nexus, "profile", str(paths[name]), "-o", str(prof), "--no-plot", "-q"],
                           check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
            p = json.loads(prof.read_text())
            profiles[name] = {"max_batch": max(int(b) for b in p["meta"]["measured_batches"])}
            subprocess.run([*nexus, "models", "upload", str(paths[name]), "--name", name, "--profile", str(prof),
                            "--slo-ms", str(MODELS[name][0]), "--scheduler", scheduler,
                            "--token-file", str(data / "token")],     # the cluster token nexus serve made
                           check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        srv.wait_models_ready(args.models, 180)
        favour_tree(srv.pid, args.nice)
        print(f"nexus serve on {frontend} (scheduler {scheduler}); profiles {profiles}", flush=True)
        pids = {"serve": srv.pid, **srv.components()}
        out = {}
        for name in args.models:
            slo, _, start = MODELS[name]
            near = make_near_max(args, pids, work, name) if args.py_spy else None
            out[name] = asyncio.run(measure_server(frontend, name, slo, start, args, "nexus", near))
            out[name]["profile"] = profiles[name]
        return out
    finally:
        srv.stop()


def make_near_max(args, pids: dict[str, int], work: pathlib.Path, model: str):
    """A step at ``rate`` with CPU accounting per process and py-spy on frontend and backend."""

    async def near_max(client, rate: float) -> dict:
        slo = MODELS[model][0]
        duration = max(args.spy_s, min(args.min_requests / rate, args.max_step_s))
        spies = {}
        for comp in ("frontend", "backend"):
            if comp in pids:
                raw = work / f"spy-{model}-{comp}.txt"
                spies[comp] = (raw, pyspy.record(args.py_spy_bin, pids[comp], duration, raw))
        await asyncio.sleep(0.5)
        watched = {**{k: v for k, v in pids.items() if k != "serve"}, "client": os.getpid()}
        meter = CpuMeter(watched).start()
        r = await client.run(rate, duration, slo, warmup_s=0.0, seed=999)
        cpu = meter.stop()
        cores = {k: round(v / cpu["wall_s"], 3) for k, v in cpu["cpu_s"].items()}
        cores["machine"] = round(cpu["machine_busy_cores"], 3)
        cores["others"] = round(cores["machine"] - sum(v for k, v in cores.items() if k != "machine"), 3)
        per_req_ms = {k: round(v * 1000 / max(r.throughput_rps, 1e-9), 3) for k, v in cores.items()}
        tops = {comp: pyspy.finish(proc, raw, duration) for comp, (raw, proc) in spies.items()}
        print(f"  [nexus] {model} near max {rate:.0f} rps: cores {cores}", flush=True)
        return {"rate_rps": round(rate, 1), "step": step_dict(r), "cores": cores, "cpu_ms_per_request": per_req_ms,
                "py_spy": tops}

    return near_max


# ---- report ----------------------------------------------------------------------------------------------

def plot(result: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = result["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(5.2 * len(models), 3.6), squeeze=False)
    colors = {"nexus": "tab:blue", "triton": "tab:orange"}
    for ax, name in zip(axes[0], models):
        slo = MODELS[name][0]
        for server in ("nexus", "triton"):
            res = result.get(server, {}).get(name)
            if not res:
                continue
            pts = sorted(s for s in ((st["offered_rps"], st["p50_ms"], st["p99_ms"]) for st in res["steps"])
                         if s[1] is not None)
            if not pts:
                continue
            x = [p[0] for p in pts]
            ax.plot(x, [p[1] for p in pts], "o--", color=colors[server], ms=3, label=f"{server} p50")
            ax.plot(x, [p[2] for p in pts], "s-", color=colors[server], ms=3, label=f"{server} p99")
            ax.axvline(res["goodput_rps"], color=colors[server], lw=0.8, alpha=0.5)
        lim = result["ort_direct"]["nexus" if "nexus" in result["ort_direct"] else "triton"][name]["limit_rps"]
        right = ax.get_xlim()[1]
        if lim < 3 * right:     # the tiny model's limit is far off the served range: left out
            ax.axvline(lim, color="gray", lw=0.8, ls=":", label="ORT-direct limit")
            right = max(right, lim * 1.05)
        ax.axhline(slo, color="red", lw=0.8, ls=":", label=f"SLO {slo:g} ms")
        ax.set_yscale("log")
        ax.set_xlabel("offered rate (rps, Poisson)")
        ax.set_ylabel("latency (ms)")
        ax.set_title(f"{name}, SLO {slo:g} ms")
        ax.set_xlim(0, right)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def summary(result: dict) -> list[dict]:
    rows = []
    for name in result["models"]:
        row = {"model": name, "slo_ms": MODELS[name][0]}
        for server in ("triton", "nexus"):
            res = result.get(server, {}).get(name)
            lim = result["ort_direct"].get(server, {}).get(name)
            if res is None or lim is None:
                continue
            row[f"{server}_rps"] = res["goodput_rps"]
            row[f"{server}_ort_rps"] = lim["limit_rps"]
            row[f"{server}_ort_batch"] = lim["batch"]
            row[f"{server}_of_ort"] = round(res["goodput_rps"] / lim["limit_rps"], 3)
            row[f"{server}_p50_low_ms"] = res["low"]["p50_ms"]
            row[f"{server}_added_p50_ms"] = round(res["low"]["p50_ms"] - lim["batch1_ms"], 2)
        if "nexus_rps" in row and row.get("triton_rps"):
            row["nexus_over_triton"] = round(row["nexus_rps"] / row["triton_rps"], 3)
        rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    cols = ["model", "slo_ms", "triton_rps", "nexus_rps", "nexus_over_triton", "triton_ort_rps", "nexus_ort_rps",
            "triton_of_ort", "nexus_of_ort", "triton_added_p50_ms", "nexus_added_p50_ms"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--triton-python", default="/work/pytriton-venv310/bin/python",
                   help="python of a virtualenv with nvidia-pytriton and onnxruntime")
    p.add_argument("--servers", default="triton,nexus", help="comma-separated, run in this order")
    p.add_argument("--models", default="r18_64,tiny_cnn", help=f"comma-separated of {', '.join(MODELS)}")
    p.add_argument("--quick", action="store_true", help="smoke run: short steps, coarse search")
    p.add_argument("--step-s", type=float, default=4.0)
    p.add_argument("--min-requests", type=int, default=1000, help="requests per search step at least")
    p.add_argument("--max-step-s", type=float, default=12.0, help="cap of a step's length at low rates")
    p.add_argument("--nice", type=int, default=0,
                   help="niceness of this process and everything it starts (servers, client, ORT direct); "
                        "negative (root) favours the benchmark over other load on a shared machine")
    p.add_argument("--warmup-s", type=float, default=1.0)
    p.add_argument("--cooldown-s", type=float, default=0.5)
    p.add_argument("--rel-tol", type=float, default=0.05)
    p.add_argument("--max-steps", type=int, default=9)
    p.add_argument("--low-rate", type=float, default=10.0)
    p.add_argument("--low-s", type=float, default=15.0)
    p.add_argument("--ort-repeats", type=int, default=15)
    p.add_argument("--triton-queue-delay-us", type=int, default=1000)
    p.add_argument("--ort-threads", type=int, default=0,
                   help="intra-op threads of ORT direct and of ORT inside Triton (0: ORT's default, one per core)")
    p.add_argument("--ort-spin", action="store_true",
                   help="ORT direct and Triton: keep ORT's intra-op spin-waiting on (ORT's default; the Nexus "
                        "backend turns it off, and so does this benchmark unless this is given)")
    p.add_argument("--nexus-threads", type=int, default=0, help="nexus serve --threads (0: its default)")
    p.add_argument("--nexus-batch-start", choices=("eager", "duty-cycle"), help="nexus serve --batch-start (default: its default)")
    p.add_argument("--py-spy", action="store_true", help="nexus: CPU per process and py-spy at 0.9x goodput")
    p.add_argument("--py-spy-bin", default=str(pathlib.Path("/work/pytriton-venv310/bin/py-spy")))
    p.add_argument("--spy-s", type=float, default=8.0)
    p.add_argument("--out", default=str(OUT / "vs_triton.json"))
    p.add_argument("--plot", default=str(PLOT))
    p.add_argument("--replot", metavar="JSON", help="only redraw --plot from a JSON this benchmark wrote")
    args = p.parse_args(argv)
    if args.replot:
        plot(json.loads(pathlib.Path(args.replot).read_text()), pathlib.Path(args.plot))
        return 0
    args.models = [m for m in args.models.split(",") if m]
    servers = [s for s in args.servers.split(",") if s]
    bad = [m for m in args.models if m not in MODELS] + [s for s in servers if s not in ("triton", "nexus")]
    if bad:
        p.error(f"unknown model or server: {bad}")
    if args.quick:
        args.step_s, args.min_requests, args.rel_tol, args.max_steps = 2.0, 300, 0.2, 5
        args.low_s, args.ort_repeats, args.spy_s = 5.0, 5, 4.0
    if "triton" in servers and not pathlib.Path(args.triton_python).exists():
        p.error(f"--triton-python {args.triton_python} does not exist (see the module docstring)")
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit(143)))
    favour(os.getpid(), args.nice)   # before any thread or child: they inherit it

    sampler = LoadSampler().start()
    t0 = time.monotonic()
    result: dict = {"command": " ".join(["python", "-m", "benchmarks.vs_triton", *argv]), "models": args.models,
                    "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpus": os.cpu_count(), "nice": args.nice,
                    "ort_direct": {}}
    with tempfile.TemporaryDirectory(prefix="vs-triton-") as tmp:
        work = pathlib.Path(tmp)
        paths = build_models(work)
        for server in servers:
            limits = {}
            for name in args.models:
                limits[name] = ort_limit(paths[name], MODELS[name][0], args.ort_repeats, args.ort_threads,
                                         args.ort_spin)
                print(f"ORT direct before {server}: {name} b*={limits[name]['batch']} l={limits[name]['l_ms']} ms "
                      f"limit {limits[name]['limit_rps']} rps, batch-1 {limits[name]['batch1_ms']} ms", flush=True)
            result["ort_direct"][server] = limits
            try:
                if server == "triton":
                    result["triton"] = run_triton(args, paths, limits, work)
                else:
                    result["nexus"] = run_nexus(args, paths, work)
            except (RuntimeError, subprocess.CalledProcessError) as e:
                print(f"{server} failed: {e}", file=sys.stderr, flush=True)
                result[f"{server}_error"] = str(e)
        if args.py_spy:
            for f in work.glob("spy-*.txt"):
                OUT.mkdir(parents=True, exist_ok=True)
                (OUT / f"vs_triton.{f.name}").write_text(f.read_text())
    result["load_average"] = sampler.stop()
    result["wall_s"] = round(time.monotonic() - t0, 1)
    result["summary"] = summary(result)
    out = write_json(args.out, result)
    plot(result, pathlib.Path(args.plot))
    print(f"\nwall {result['wall_s']} s; load average (1 min) during the run: {result['load_average']}")
    print_table(result["summary"])
    print(f"wrote {out} and {args.plot}")
    return 0 if not any(k.endswith("_error") for k in result) else 1


if __name__ == "__main__":
    sys.exit(main())
