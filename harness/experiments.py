"""The serving benchmarks' set-up (benchmarks/serving.py, frontend_path.py, hotpath.py,
profile_vs_serving.py): a cluster of one CPU backend and one frontend serving sample models, with
experiment switches, and the measurements those benchmarks share.

:class:`SampleCluster` is a :class:`~harness.cluster.Cluster` with these switches, each made of
the product's own options and standard tools, none patched in: ``cprofile`` runs the named
components under ``python -m cProfile`` (main thread: the event loop); ``pin`` runs every node under
``taskset`` on all CPUs but the last, and gives the backend's executor thread, where ORT runs, the
last alone (``--executor-cpus``); ``code_dir`` runs the nodes from another checkout of the project
(an A/B of two versions in one run).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import sys
import tempfile
from typing import Callable, Mapping

from common.config import BatchStart
from harness.cluster import Cluster, Upload
from nexus.bench.loadgen import find_max_rate, run_bench
from harness.meters import CpuMeter
from nexus.bench.report import BenchReport, step_summary

# pin: the backend's executor thread (ORT with one intra-op thread runs on it) gets the last CPU,
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


def exit_on_sigterm() -> None:
    """SIGTERM raises SystemExit, so that ``with`` blocks around clusters stop their processes."""
    def handler(signum, frame):
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, handler)


class SampleCluster(Cluster):
    """Scheduler + one CPU backend + one frontend on loopback, serving the sample ``models`` (only
    those, uploaded before the backend starts so that it profiles them, as ``nexus serve`` does), in
    a temporary directory removed on exit unless ``keep_dir``. ``with SampleCluster(...) as c`` starts
    it. ``backend`` and ``frontend`` override more configuration fields; ``env`` adds environment."""

    def __init__(self, models: list[str], *, threads: int = 0, exec_path: str = "stream",
                 cprofile: tuple[str, ...] = (), cprofile_dir: pathlib.Path | None = None, pin: bool = False, batch_start: str = "eager", epoch_s: float = 30.0,
                 tag: str = "cluster", keep_dir: bool = False, code_dir: pathlib.Path | None = None,
                 env: Mapping[str, str] | None = None, backend: Mapping | None = None,
                 frontend: Mapping | None = None) -> None:
        self.models = list(models)
        self.tag, self.keep_dir = tag, keep_dir
        self.cprofile, self.cprofile_dir = tuple(cprofile), cprofile_dir
        self.pin = pin
        self.code_dir = pathlib.Path(code_dir) if code_dir else None
        self.extra_env = dict(env or {})
        super().__init__(
            tempfile.mkdtemp(prefix=f"nexus-bench-{tag}-"), device="cpu", scheduler={"epoch_s": epoch_s},
            backend={"threads": threads, "batch_start": BatchStart(batch_start),
                     **({"executor_cpus": ",".join(map(str, PIN_EXEC))} if pin else {}), **(backend or {})},
            frontend={"metrics_listen": "", "exec_path": exec_path, **(frontend or {})},
            env=self._env, command=self._command, cwd=self.code_dir)

    def _command(self, kind: str) -> list[str]:
        command = ["taskset", "-c", ",".join(map(str, PIN_OTHER))] if self.pin else []
        command.append(sys.executable)
        if kind in self.cprofile:
            out = self.cprofile_dir or self.workdir
            out.mkdir(parents=True, exist_ok=True)
            command += ["-m", "cProfile", "-o", str(out / f"{self.tag}.{kind}.prof")]
        return command + ["-m", "nexus"]

    def _env(self, kind: str) -> dict:
        env = {"PYTHONPATH": str(self.code_dir)} if self.code_dir is not None else {}
        env.update(self.extra_env)
        return env

    def __enter__(self) -> "SampleCluster":
        from common.sample_models import SAMPLE_MODELS, write_sample_models

        try:
            paths = write_sample_models(self.workdir / "samples", self.models)
            self.start([Upload(path, name, slo_ms=SAMPLE_MODELS[name].slo_ms) for name, path in paths.items()])
        except BaseException:
            self.cleanup()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        self.cleanup()

    def cleanup(self) -> None:
        if not self.keep_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def pids(self, client: bool = True) -> dict[str, int]:
        """The frontend's, the backend's and the scheduler's pid (and this client's)."""
        pids = {"frontend": self.frontend.pid, "backend": self.backends[0].pid, "scheduler": self.scheduler.pid}
        if client:
            pids["client"] = os.getpid()
        return pids


def require_answers(latencies_ms: list, reports: list, what: str) -> None:
    """SystemExit saying what ``reports`` sent and how each request ended, when none was answered
    within its measurement window (``latencies_ms`` empty): such a phase has no percentile to report.
    ``what`` names the phase in the message."""
    if latencies_ms:
        return
    statuses: dict[str, int] = {}
    for r in reports:
        for k, v in r.samples.status_counts().items():
            statuses[k] = statuses.get(k, 0) + v
    raise SystemExit(f"{what}: no request was answered within its measurement window: "
                     f"sent {sum(r.sent for r in reports)}, statuses {statuses}")


# ---- the per-request path benchmarks (hotpath.py, frontend_path.py) -----------------------------

def add_path_arguments(p, *, cap_s: float) -> None:
    """The flags of the per-request path benchmarks: a low-rate run, a CPU run and an overload
    (capacity) run of one model."""
    p.add_argument("--slo-ms", type=float, default=0.0, help="0: the model's SLO")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--low-rate", type=float, default=50.0)
    p.add_argument("--low-s", type=float, default=8.0)
    p.add_argument("--cpu-rate", type=float, default=300.0)
    p.add_argument("--cpu-s", type=float, default=8.0)
    p.add_argument("--cap-rate", type=float, default=3000.0, help="overload rate for the capacity measurement")
    p.add_argument("--cap-s", type=float, default=cap_s)
    p.add_argument("--cap-inflight", type=int, default=32, help="0: no limit (open loop: goodput at --cap-rate)")


def low_and_cpu_runs(cluster: SampleCluster, args, slo_ms: float, warmup_rate: float) -> tuple[dict, dict]:
    """On a running cluster: a warm-up, ``--low-rate`` for ``--low-s`` (the low-load latency), then
    ``--cpu-rate`` for ``--cpu-s`` with the frontend's, the backend's and this client's CPU metered.
    Returns the runs' reports (``low``, ``cpu_run``, ``cpu_ms_per_request``) and the meter's result."""
    frontend = cluster.frontend.address
    run_bench(frontend, args.model, warmup_rate, 2, slo_ms)   # warm up connections and code paths
    out = {"low": step_summary(run_bench(frontend, args.model, args.low_rate, args.low_s, slo_ms, warmup_s=1.0))}
    pids = cluster.pids()
    del pids["scheduler"]
    meter = CpuMeter(pids).start()
    r = run_bench(frontend, args.model, args.cpu_rate, args.cpu_s, slo_ms)
    cpu = meter.stop()
    out["cpu_run"] = step_summary(r)
    out["cpu_ms_per_request"] = {k: v * 1000 / max(r.sent, 1) for k, v in cpu["cpu_s"].items()}
    return out, cpu


# ---- rate searches with the machine's other load per step (serving.py, frontend_path.py) ----------

def max_rate(frontend: str, model: str, slo_ms: float, lo: float, hi: float | None, step_s: float,
             rel_tol: float = 0.03, max_steps: int | None = 9,
             on_step: Callable[[BenchReport], dict | None] | None = None, pids: dict | None = None,
             warmup_s: float = 4.0, **search) -> tuple[float, list[dict]]:
    """``find_max_rate`` (99% within SLO); every step's :func:`step_summary` plus the load on the
    machine from other processes than ``pids`` (the cluster and this client) during the step, and
    what ``on_step`` adds. ``search``: more keywords of the search (``growth``, ``max_rate``,
    ``refine``, ``cooldown_s``, default 1 s).

    ``warmup_s`` (not measured) lets the scheduler re-plan for the step's rate first: the frontend
    reports rates every 2 s and the backend batches to the plan's duty cycle, so a step that follows
    a higher rate would otherwise be measured against a plan made for the higher rate."""
    out: list[dict] = []
    meter = CpuMeter(pids or {}).start()

    def step(r: BenchReport) -> None:
        nonlocal meter
        cpu = meter.stop()
        d = step_summary(r)
        d["machine_busy_cores"] = cpu["machine_busy_cores"]
        d["external_cores"] = cpu["external_cores"]
        if on_step is not None:
            d.update(on_step(r) or {})
        out.append(d)
        meter = CpuMeter(pids or {}).start()

    search = {"cooldown_s": 1.0, **search}
    rate, _ = find_max_rate(frontend, model, slo_ms, 0.99, lo=lo, hi=hi, step_duration_s=step_s,
                            rel_tol=rel_tol, max_steps=max_steps, warmup_s=warmup_s, on_step=step, **search)
    return rate, out


def ramp_rate(frontend: str, model: str, slo_ms: float, start: float, stop: float, factor: float, step_s: float,
              on_step: Callable[[BenchReport], dict | None] | None = None, pids: dict | None = None,
              warmup_s: float = 4.0) -> tuple[float, list[dict]]:
    """The largest rate of the ramp start, start*factor, ... (< stop) at which 99% finish within the SLO.

    :func:`max_rate` growing by ``factor`` without bisection: the ramp stops at the first failing
    rate. Rates only go up: the backend batches to a duty cycle that the scheduler plans from
    smoothed rate reports, so a step below a previous, higher one would be served with a plan made
    for the higher rate (longer waits) for 10-20 s; bisection would measure that lag, not the capacity.
    """
    if not start < stop:
        return 0.0, []
    last = start
    while last * factor < stop:
        last *= factor
    return max_rate(frontend, model, slo_ms, start, None, step_s, max_steps=None, on_step=on_step, pids=pids,
                    warmup_s=warmup_s, growth=factor, max_rate=last, refine=0, cooldown_s=0.0)
