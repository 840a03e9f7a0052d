"""Serving efficiency on one CPU backend (issue 2): the system against the model's own limit.

    python benchmarks/serving.py [--threads 1] [--repeats 3] [--step-s 5] [--warmup-s 4] [--slo-ms 100]

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
    doubling and bisection; see :func:`ramp_rate` for why it is not the default). The ratio
    served / limit is the result. For reference it also reports the BATCHING BOUND: the same search on
    ``backend.simulate`` (an ideal work-conserving server executing exactly the ORT-direct l(b)
    with the backend's early-drop policy, no RPC, no CPU sharing), i.e. what Poisson arrivals and
    batching allow before any implementation cost.
(c) ADDED LATENCY: p50 of the full path (client -> frontend -> backend -> ORT) at a low rate,
    batch 1, minus ORT's own batch-1 p50; served and ORT-direct phases alternate so both see the
    same background. Where the time goes: the frontend's own per-request time (ModelStatistics
    inference_stats.success), the backend's queue and compute times (queue, compute_input + _infer + _output), the
    CPU each process spent per request (/proc/PID/stat), and the p50 of one bare gRPC hop with the
    same client (``nexus.bench.fake_kserve`` answering at once).

Client, frontend, backend and ORT share the machine's cores; other engineers' tests share it
too: every step records the CPU used by processes outside this benchmark ("other load"), and each
repeat first waits (up to ``--quiet-wait-s``) for a quiet moment. JSON goes to
benchmarks/out/serving.json. The cluster harness here (:class:`Cluster`) is also used by
benchmarks/frontend_path.py and benchmarks/profile_vs_serving.py.

Harness-only experiment switches (environment of the component processes, set only by this
file; the project never reads them): ``--cprofile frontend,backend`` runs those components under
cProfile (main thread: the event loop) into benchmarks/out/<tag>.<name>.prof; ``--ort-no-spin``
starts the backend with ORT's intra-op spin-waiting off (a proposed fix in
common/runtimes/onnx_runtime.py, which this benchmark does not own); ``--budget-margin-ms M``
makes the frontend send backends a budget M ms below the time left (a proposed fix in
frontend/kserve.py: reserve the return trip); ``--pin`` (with ``--threads 1``) puts the backend's
executor thread, where ORT runs, alone on the last CPU and every other thread of the cluster and
the client on the others (a proposed option for backend/engine.py). ``--batch-start duty-cycle``
passes the backend's own flag, for an A/B against eager batch starts on the same code.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from common.config import BackendConfig, BatchStart, FrontendConfig, SchedulerConfig
from nexus.launcher import Child, component_argv
from nexus.serve_cmd import wait_models_ready

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out"

# Bootstrap of every component process: optional experiment patches, then ``nexus <argv>``.
_BOOT = r"""
import os, sys
if os.environ.get("NEXUS_BENCH_CPUS"):
    os.sched_setaffinity(0, {int(c) for c in os.environ["NEXUS_BENCH_CPUS"].split(",")})
if os.environ.get("NEXUS_BENCH_EXEC_CPUS"):
    import backend.engine as _be
    _exec_cpus = {int(c) for c in os.environ["NEXUS_BENCH_EXEC_CPUS"].split(",")}
    _loop = _be.Engine._loop
    def _pinned_loop(self):
        os.sched_setaffinity(0, _exec_cpus)   # this thread only: the executor, which runs ORT
        return _loop(self)
    _be.Engine._loop = _pinned_loop
if os.environ.get("NEXUS_BENCH_ORT_NOSPIN") == "1":
    import onnxruntime as ort
    _init = ort.InferenceSession.__init__
    def _no_spin(self, path_or_bytes, sess_options=None, providers=None, provider_options=None, **kw):
        if sess_options is None:
            sess_options = ort.SessionOptions()
        sess_options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        _init(self, path_or_bytes, sess_options, providers, provider_options, **kw)
    ort.InferenceSession.__init__ = _no_spin
_margin_ms = float(os.environ.get("NEXUS_BENCH_BUDGET_MARGIN_MS") or 0)
if _margin_ms:
    import frontend.backend_pool as _bp
    _execute = _bp.BackendConnection.execute
    async def _execute_with_margin(self, item):
        item.budget_us = max(1, item.budget_us - int(_margin_ms * 1000))
        return await _execute(self, item)
    _bp.BackendConnection.execute = _execute_with_margin
from nexus.cli import main
out = os.environ.get("NEXUS_BENCH_CPROFILE_OUT")
if out:
    import cProfile
    prof = cProfile.Profile()
    prof.enable()
    try:
        code = main(sys.argv[1:])
    finally:
        prof.disable()
        prof.dump_stats(out)
    sys.exit(code)
sys.exit(main(sys.argv[1:]))
"""


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except Exception:
        return pathlib.Path("/proc/loadavg").read_text().strip()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads."""
    try:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs, from /proc/stat."""
    parts = [int(x) for x in pathlib.Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = parts[3] + parts[4]
    return float(sum(parts) - idle), float(sum(parts))


def busy_cores(window_s: float = 2.0) -> float:
    """Cores busy on the whole machine over ``window_s``."""
    b0 = machine_busy()
    time.sleep(window_s)
    b1 = machine_busy()
    return (b1[0] - b0[0]) / max(b1[1] - b0[1], 1) * (os.cpu_count() or 1)


def wait_quiet(timeout_s: float, threshold_cores: float = 0.4) -> dict:
    """Wait (up to ``timeout_s``) until the machine's other load is below ``threshold_cores``.

    Other engineers' tests share this machine; starting a measurement in a quiet moment makes it
    less noisy, it does not make it noise-free. Returns what was seen.
    """
    t0 = time.monotonic()
    busy = busy_cores()
    while busy > threshold_cores and time.monotonic() - t0 < timeout_s:
        busy = busy_cores()
    return {"busy_cores": round(busy, 2), "waited_s": round(time.monotonic() - t0, 1)}


def exit_on_sigterm() -> None:
    """SIGTERM raises SystemExit, so that ``with Cluster(...)`` blocks stop their processes."""
    def handler(signum, frame):
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, handler)


class Component(Child):
    """One ``nexus <name>`` process started through the harness's boot code, stderr to a log file."""

    def __init__(self, name: str, argv: list[str], env: dict, log_dir: pathlib.Path,
                 code_dir: pathlib.Path = ROOT) -> None:
        self.log = open(log_dir / f"{name}.log", "w")
        super().__init__(name, argv, env, command=[sys.executable, "-c", _BOOT], stderr=self.log, cwd=code_dir,
                         start_new_session=True)

    def stop(self) -> None:
        super().stop(timeout_s=20)
        self.log.close()


class Cluster:
    """Scheduler + one CPU backend + one frontend on loopback, with ``models`` uploaded (only those)."""

    def __init__(self, models: list[str], *, threads: int = 0, exec_path: str = "stream",
                 cprofile: tuple[str, ...] = (), ort_no_spin: bool = False, budget_margin_ms: float = 0.0,
                 pin: bool = False, batch_start: str = "eager", epoch_s: float = 30.0, tag: str = "cluster",
                 keep_dir: bool = False, code_dir: pathlib.Path | None = None, env: dict | None = None,
                 frontend_args: tuple[str, ...] = (), backend_args: tuple[str, ...] = ()) -> None:
        """``code_dir``: run the components from another checkout of the project (A/B of two
        versions in one run, benchmarks/hotpath.py); ``env``: more environment for every component."""
        self.models = models
        self.code_dir = pathlib.Path(code_dir) if code_dir else ROOT
        self.extra_env = dict(env or {})
        self.frontend_args = tuple(frontend_args)
        self.backend_args = tuple(backend_args)
        self.threads = threads
        self.exec_path = exec_path
        self.cprofile = cprofile
        self.ort_no_spin = ort_no_spin
        self.budget_margin_ms = budget_margin_ms
        self.pin = pin
        self.batch_start = batch_start
        self.epoch_s = epoch_s
        self.tag = tag
        self.keep_dir = keep_dir
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix=f"nexus-bench-{tag}-"))
        self.components: dict[str, Component] = {}
        self.frontend = self.scheduler = ""

    def _env(self, name: str) -> dict:
        env = dict(os.environ, PYTHONUNBUFFERED="1", NEXUS_LOG="WARNING")
        env.pop("NEXUS_BENCH_CPROFILE_OUT", None)
        env.pop("NEXUS_BENCH_ORT_NOSPIN", None)
        env.pop("NEXUS_BENCH_BUDGET_MARGIN_MS", None)
        env.pop("NEXUS_BENCH_CPUS", None)
        env.pop("NEXUS_BENCH_EXEC_CPUS", None)
        if self.pin:
            env["NEXUS_BENCH_CPUS"] = ",".join(map(str, PIN_OTHER))
            if name == "backend":
                env["NEXUS_BENCH_EXEC_CPUS"] = ",".join(map(str, PIN_EXEC))
        if name == "frontend" and self.budget_margin_ms:
            env["NEXUS_BENCH_BUDGET_MARGIN_MS"] = str(self.budget_margin_ms)
        if name in self.cprofile:
            OUT.mkdir(parents=True, exist_ok=True)
            env["NEXUS_BENCH_CPROFILE_OUT"] = str(OUT / f"{self.tag}.{name}.prof")
        if name == "backend" and self.ort_no_spin:
            env["NEXUS_BENCH_ORT_NOSPIN"] = "1"
        if self.code_dir != ROOT:
            env["PYTHONPATH"] = str(self.code_dir)
        env.update(self.extra_env)
        return env

    def _start(self, name: str, argv: list[str]) -> Component:
        c = Component(name, argv, self._env(name), self.dir, self.code_dir)
        self.components[name] = c
        return c

    def start(self, ready_timeout_s: float = 240) -> "Cluster":
        from common.sample_models import SAMPLE_MODELS, write_sample_models
        from nexus.scheduler_client import upload_model

        try:
            sched = self._start("scheduler", component_argv(SchedulerConfig(
                listen="127.0.0.1:0", data_dir=self.dir / "db", epoch_s=self.epoch_s)))
            self.scheduler = sched.wait_ready()
            paths = write_sample_models(self.dir / "samples", self.models)
            for name, path in paths.items():
                upload_model(self.scheduler, path, name, slo_ms=SAMPLE_MODELS[name].slo_ms)
            self._start("backend", [*component_argv(BackendConfig(
                scheduler=self.scheduler, listen="127.0.0.1:0", device="cpu", threads=self.threads,
                batch_start=BatchStart(self.batch_start))), *self.backend_args]).wait_ready()
            self.frontend = self._start("frontend", [*component_argv(FrontendConfig(
                scheduler=self.scheduler, listen="127.0.0.1:0", metrics_listen="",
                exec_path=self.exec_path)), *self.frontend_args]).wait_ready()
            self._wait_models_ready(ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_models_ready(self, timeout_s: float) -> None:
        pending = wait_models_ready(self.frontend, list(self.models), timeout_s)
        if pending:
            raise RuntimeError(f"models not ready in {timeout_s} s: {pending}")

    def pid(self, name: str) -> int:
        return self.components[name].proc.pid

    def live_profiles(self) -> dict:
        """The profiles the scheduler holds now, by model and device type (read-only SQLite, while it runs)."""
        import sqlite3

        from common.profile import Profile

        db = sqlite3.connect(f"file:{self.dir / 'db' / 'nexus.db'}?mode=ro", uri=True)
        try:
            out: dict = {m: {} for m in self.models}
            for model, device_type, text in db.execute("SELECT model, device_type, profile_json FROM profiles"):
                if model in out:
                    out[model][device_type] = Profile.from_json(text)
            return out
        finally:
            db.close()

    def profiles(self):
        """The profiles the scheduler holds, by model (reads the model database; call after stop())."""
        from globalsched.modeldb import ModelDatabase

        db = ModelDatabase(self.dir / "db")
        try:
            return {m: db.profiles(m) for m in self.models}
        finally:
            db.close()

    def stop(self) -> None:
        for name in ("frontend", "backend", "scheduler"):
            c = self.components.get(name)
            if c is not None:
                c.stop()

    def cleanup(self) -> None:
        if not self.keep_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        self.cleanup()


# ---- statistics ----------------------------------------------------------------------------------

def model_stats(frontend: str, model: str) -> dict:
    """ModelStatistics of one model through the KServe API, as plain numbers."""
    from common import grpc_util
    from common.pb import kserve, kserve_grpc

    with grpc_util.channel(frontend) as ch:
        reply = kserve_grpc.GRPCInferenceServiceStub(ch).ModelStatistics(
            kserve.ModelStatisticsRequest(name=model), timeout=10)
    s = reply.model_stats[0]
    inf = s.inference_stats
    return {
        "success_count": inf.success.count, "success_ns": inf.success.ns, "fail_count": inf.fail.count,
        "queue_count": inf.queue.count, "queue_ns": inf.queue.ns,
        # per request (Triton's count: one sample per success): the phases of the batch it ran in
        "compute_count": inf.compute_infer.count,
        "compute_ns": inf.compute_input.ns + inf.compute_infer.ns + inf.compute_output.ns,
        "execution_count": s.execution_count, "inference_count": s.inference_count,
        "batches": {b.batch_size: (b.compute_infer.count, b.compute_infer.ns) for b in s.batch_stats},
    }


def stats_delta(after: dict, before: dict) -> dict:
    d = {k: after[k] - before[k] for k in after if k != "batches"}
    batches = {}
    for size, (count, ns) in after["batches"].items():
        c0, n0 = before["batches"].get(size, (0, 0))
        if count - c0 > 0:
            batches[size] = (count - c0, ns - n0)
    d["batches"] = batches
    return d


class CpuMeter:
    """CPU seconds of named processes (and of the whole machine) between start() and stop()."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids

    def start(self) -> "CpuMeter":
        self.t0 = time.monotonic()
        self.c0 = {n: cpu_seconds(p) for n, p in self.pids.items()}
        self.m0 = machine_busy()
        return self

    def stop(self) -> dict:
        wall = time.monotonic() - self.t0
        c1 = {n: cpu_seconds(p) for n, p in self.pids.items()}
        m1 = machine_busy()
        ncpu = os.cpu_count() or 1
        busy = (m1[0] - self.m0[0]) / max(m1[1] - self.m0[1], 1) * ncpu
        return {"wall_s": wall, "cpu_s": {n: c1[n] - self.c0[n] for n in self.pids},
                "machine_busy_cores": busy}


# ---- ONNX Runtime directly -----------------------------------------------------------------------

# --pin: the backend's executor thread (ORT with one intra-op thread runs on it) gets the last CPU,
# everything else (the backend's event loop and gRPC threads, frontend, scheduler, client) the others.
_ALL_CPUS = sorted(os.sched_getaffinity(0))
PIN_EXEC = _ALL_CPUS[-1:]
PIN_OTHER = _ALL_CPUS[:-1] or _ALL_CPUS


class on_exec_cpus:
    """With pinning on, run ORT-direct measurements on the executor's CPU (this thread only)."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin

    def __enter__(self):
        if self.pin:
            self.saved = os.sched_getaffinity(0)
            os.sched_setaffinity(0, set(PIN_EXEC))

    def __exit__(self, *exc):
        if self.pin:
            os.sched_setaffinity(0, self.saved)


def ort_session(model_bytes: bytes, threads: int, no_spin: bool = True):
    """An InferenceSession with the options common/runtimes/onnx_runtime.py uses (since commit
    d54f56d that includes intra-op spinning off; ``no_spin=False`` measures the old default)."""
    import onnxruntime as ort

    o = ort.SessionOptions()
    o.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    o.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    o.inter_op_num_threads = 1
    if threads:
        o.intra_op_num_threads = threads
    o.log_severity_level = 3
    if no_spin:
        o.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model_bytes, sess_options=o, providers=["CPUExecutionProvider"])


def time_batch(session, x: np.ndarray, repeats: int, warmup: int = 3) -> list[float]:
    for _ in range(warmup):
        session.run(None, {"input": x})
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        session.run(None, {"input": x})
        out.append((time.perf_counter() - t) * 1000)
    return out


def ort_limit(model: str, threads: int, slo_ms: float, repeats: int = 15, no_spin: bool = True) -> dict:
    """Median l(b) for b = 1, 2, ... until 2*l(b) exceeds the SLO twice in a row; the saturated b."""
    from common.sample_models import build_sample_model, model_bytes, sample_input

    m = build_sample_model(model)
    session = ort_session(model_bytes(m), threads, no_spin)
    lat: dict[int, float] = {}
    over = 0
    b = 1
    while over < 2 and b <= 256:
        lat[b] = statistics.median(time_batch(session, sample_input(m, b, seed=b), repeats))
        over = over + 1 if 2 * lat[b] > slo_ms else 0
        b += 1
    ok = [b for b, l in lat.items() if 2 * l <= slo_ms]
    best = max(ok) if ok else 1
    return {"latency_ms": lat, "batch": best, "l_ms": lat[best], "throughput_rps": best * 1000 / lat[best]}


# ---- load ---------------------------------------------------------------------------------------

def report_dict(r) -> dict:
    keys = ("offered_rps", "sent", "within_slo", "late", "dropped", "failed", "goodput_rps", "throughput_rps",
            "bad_rate", "p50_ms", "p90_ms", "p99_ms", "client_lag_ms")
    return {k: getattr(r, k) for k in keys}


def add_path_arguments(p, *, cap_s: float) -> None:
    """The flags of the per-request path benchmarks (hotpath.py, frontend_path.py): a low-rate run,
    a CPU run and an overload (capacity) run of one model."""
    p.add_argument("--slo-ms", type=float, default=0.0, help="0: the model's SLO")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--low-rate", type=float, default=50.0)
    p.add_argument("--low-s", type=float, default=8.0)
    p.add_argument("--cpu-rate", type=float, default=300.0)
    p.add_argument("--cpu-s", type=float, default=8.0)
    p.add_argument("--cap-rate", type=float, default=3000.0, help="overload rate for the capacity measurement")
    p.add_argument("--cap-s", type=float, default=cap_s)
    p.add_argument("--cap-inflight", type=int, default=32, help="0: no limit (open loop: goodput at --cap-rate)")


def low_and_cpu_runs(cluster, args, slo_ms: float, warmup_rate: float) -> tuple[dict, dict]:
    """On a running cluster: a warm-up, ``--low-rate`` for ``--low-s`` (the low-load latency), then
    ``--cpu-rate`` for ``--cpu-s`` with the frontend's, the backend's and this client's CPU metered.
    Returns the runs' reports (``low``, ``cpu_run``, ``cpu_ms_per_request``) and the meter's result."""
    from nexus.bench import run_bench

    run_bench(cluster.frontend, args.model, warmup_rate, 2, slo_ms)   # warm up connections and code paths
    out = {"low": report_dict(run_bench(cluster.frontend, args.model, args.low_rate, args.low_s, slo_ms,
                                        warmup_s=1.0))}
    meter = CpuMeter({"frontend": cluster.pid("frontend"), "backend": cluster.pid("backend"),
                      "client": os.getpid()}).start()
    r = run_bench(cluster.frontend, args.model, args.cpu_rate, args.cpu_s, slo_ms)
    cpu = meter.stop()
    out["cpu_run"] = report_dict(r)
    out["cpu_ms_per_request"] = {k: v * 1000 / max(r.sent, 1) for k, v in cpu["cpu_s"].items()}
    return out, cpu


def max_rate(frontend: str, model: str, slo_ms: float, lo: float, hi: float | None, step_s: float,
             rel_tol: float = 0.03, max_steps: int = 9, on_step=None, pids: dict | None = None,
             warmup_s: float = 4.0) -> tuple[float, list[dict]]:
    """``find_max_rate`` (99% within SLO); every step's report as a dict plus the load on the machine
    from other processes than ``pids`` (the cluster and this client) during the step.

    ``warmup_s`` (not measured) lets the scheduler re-plan for the step's rate first: the frontend
    reports rates every 2 s and the backend batches to the plan's duty cycle, so a step that follows
    a higher rate would otherwise be measured against a plan made for the higher rate."""
    from nexus.bench import find_max_rate

    out: list[dict] = []
    meter = CpuMeter(pids or {}).start()

    def step(r) -> None:
        nonlocal meter
        cpu = meter.stop()
        d = report_dict(r)
        d["machine_busy_cores"] = cpu["machine_busy_cores"]
        d["external_cores"] = cpu["machine_busy_cores"] - sum(cpu["cpu_s"].values()) / cpu["wall_s"]
        if on_step is not None:
            d.update(on_step(r) or {})
        out.append(d)
        meter = CpuMeter(pids or {}).start()

    rate, _ = find_max_rate(frontend, model, slo_ms, 0.99, lo=lo, hi=hi, step_duration_s=step_s,
                            rel_tol=rel_tol, max_steps=max_steps, warmup_s=warmup_s, cooldown_s=1.0, on_step=step)
    return rate, out


def ramp_rate(frontend: str, model: str, slo_ms: float, start: float, stop: float, factor: float, step_s: float,
              on_step=None, pids: dict | None = None, warmup_s: float = 4.0) -> tuple[float, list[dict]]:
    """The largest rate of the ramp start, start*factor, ... (< stop) at which 99% finish within the SLO.

    Each rate is one ``find_max_rate`` step (``max_steps=1``: it tests ``lo`` only); the ramp stops
    at the first failing rate. Rates only go up: the backend batches to a duty cycle that the
    scheduler plans from smoothed rate reports, so a step below a previous, higher one would be
    served with a plan made for the higher rate (longer waits) for 10-20 s; bisection would measure
    that lag, not the capacity.
    """
    from nexus.bench import find_max_rate

    out: list[dict] = []
    best = 0.0
    rate = start
    while rate < stop:
        meter = CpuMeter(pids or {}).start()
        got, reports = find_max_rate(frontend, model, slo_ms, 0.99, lo=rate, step_duration_s=step_s, max_steps=1,
                                     warmup_s=warmup_s, cooldown_s=0.0)
        cpu = meter.stop()
        d = report_dict(reports[0])
        d["machine_busy_cores"] = cpu["machine_busy_cores"]
        d["external_cores"] = cpu["machine_busy_cores"] - sum(cpu["cpu_s"].values()) / cpu["wall_s"]
        if on_step is not None:
            d.update(on_step(reports[0]) or {})
        out.append(d)
        if got <= 0:
            break
        best = rate
        rate *= factor
    return best, out


def low_load(cluster: Cluster, model: str, rate: float, duration_s: float, slo_ms: float, threads: int,
             no_spin: bool = True, rounds: int = 5, pin: bool = False) -> dict:
    """p50 at a low rate against ORT's own batch-1 p50, with where the time and the CPU go.

    The served phases and ORT-direct phases alternate (``rounds`` of each, ``duration_s`` in all
    for each side), and ORT direct idles between runs at the same mean gap as the arrivals, so that
    both sides sample the same background load and the same cold caches.
    """
    from common.sample_models import build_sample_model, model_bytes, sample_input
    from nexus.bench import LoadClient

    m = build_sample_model(model)
    session = ort_session(model_bytes(m), threads, no_spin)
    x = sample_input(m, 1)
    time_batch(session, x, 0, warmup=5)
    rng = np.random.default_rng(1)
    pids = {n: cluster.pid(n) for n in ("frontend", "backend", "scheduler")}
    pids["client"] = os.getpid()
    phase_s = duration_s / rounds

    async def served() -> tuple[list, list, list, dict, dict]:
        lat, ort, reports = [], [], []
        cpu_total: dict[str, float] = {}
        busy = []
        before = model_stats(cluster.frontend, model)
        async with LoadClient(cluster.frontend, model) as client:
            await client.run(rate, 1.0, slo_ms)  # warm up
            for i in range(rounds):
                meter = CpuMeter(pids).start()
                r = await client.run(rate, phase_s, slo_ms, seed=100 + i)
                cpu = meter.stop()
                for k, v in cpu["cpu_s"].items():
                    cpu_total[k] = cpu_total.get(k, 0.0) + v
                busy.append(cpu["machine_busy_cores"] - sum(cpu["cpu_s"].values()) / cpu["wall_s"])
                reports.append(r)
                s = r.samples
                ok = s.measured & np.isfinite(s.latency_ms)
                lat.extend(s.latency_ms[ok].tolist())
                end = time.monotonic() + phase_s
                with on_exec_cpus(pin):
                    while time.monotonic() < end:
                        time.sleep(rng.exponential(1.0 / rate))
                        t = time.perf_counter()
                        session.run(None, {"input": x})
                        ort.append((time.perf_counter() - t) * 1000)
        after = model_stats(cluster.frontend, model)
        return lat, ort, reports, cpu_total, {"stats": stats_delta(after, before), "external_cores": busy}

    lat, ort, reports, cpu_total, extra = asyncio.run(served())
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
    from common.batching import SlidingWindowEarlyDrop
    from backend.simulate import poisson_arrivals, simulate

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
    lo, hi = 1.0, 1.2 * max_batch * 1000.0 / mono[max_batch]
    for _ in range(14):
        mid = 0.5 * (lo + hi)
        ok = True
        for seed in range(3):
            r = simulate(SlidingWindowEarlyDrop(), poisson_arrivals(mid, 40.0, seed), slo_ms, mono.__getitem__,
                         max_batch)
            if r.on_time < 0.99 * r.offered:
                ok = False
                break
        lo, hi = (mid, hi) if ok else (lo, mid)
    return lo


def hop_floor(rate: float, duration_s: float, slo_ms: float) -> dict:
    """p50 of one bare gRPC hop with the same client: ``nexus.bench.fake_kserve`` answering a
    resnet18_64-shaped ModelInfer at once (no frontend logic, no backend, no model)."""
    from nexus.bench import run_bench
    from nexus.bench.fake_kserve import spawn

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
    with Cluster([model], threads=args.threads, cprofile=cprofile, ort_no_spin=args.ort_no_spin,
                 budget_margin_ms=args.budget_margin_ms, pin=args.pin, batch_start=args.batch_start, tag=f"serving{i}") as c:
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
        meter = CpuMeter({"frontend": c.pid("frontend"), "backend": c.pid("backend"), "client": os.getpid()}).start()
        before = model_stats(c.frontend, model)
        pids = {n: c.pid(n) for n in ("frontend", "backend", "scheduler")}
        pids["client"] = os.getpid()
        if args.search == "ramp":
            rate, steps = ramp_rate(c.frontend, model, args.slo_ms, args.ramp_start * lim["throughput_rps"], hi,
                                    args.ramp_factor, args.step_s, on_step=next_to_step, pids=pids,
                                    warmup_s=args.warmup_s)
        else:
            rate, steps = max_rate(c.frontend, model, args.slo_ms, lo, hi, args.step_s, on_step=next_to_step,
                                   pids=pids, warmup_s=args.warmup_s)
            if rate == 0.0:      # even the lowest rate failed (a burst of other load, or a slow config): go lower
                rate, more = max_rate(c.frontend, model, args.slo_ms, lo / 3, lo, args.step_s, on_step=next_to_step,
                                      pids=pids, max_steps=6, warmup_s=args.warmup_s)
                steps += more
        d = stats_delta(model_stats(c.frontend, model), before)
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
        prof = c.profiles()[model].get("cpu")
        if prof is not None:
            from backend.engine import session_max_batch
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
    p.add_argument("--ort-no-spin", action="store_true",
                   help="experiment: force ORT intra-op spinning off in the backend (its default since commit d54f56d)")
    p.add_argument("--pin", action="store_true",
                   help="experiment: the backend's executor thread (ORT, use with --threads 1) on the last CPU, "
                        "every other thread of the cluster and the client on the others")
    p.add_argument("--batch-start", default="eager", choices=["eager", "duty-cycle"],
                   help="the backend's --batch-start (duty-cycle: wait for the planned batch, at most a duty cycle)")
    p.add_argument("--budget-margin-ms", type=float, default=0.0,
                   help="experiment: the frontend sends backends a budget this much below the time left")
    p.add_argument("--quiet-wait-s", type=float, default=60.0,
                   help="wait up to this long before each repeat for the machine's other load to drop")
    p.add_argument("--out", default=str(OUT / "serving.json"))
    args = p.parse_args(argv)
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
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "runs": runs, "summary": summary}, indent=1, default=str))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
