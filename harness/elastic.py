"""The elastic-cluster scenario of benchmarks/elastic.py (issue 17 item 6), as library pieces.

A trace as AlpaServe-style evaluations use: many models with Zipf-distributed shares of the total
rate, Gamma arrivals whose coefficient of variation runs from 1 to 4 across the models, and a total
rate that steps up and back down (:func:`zipf_models`, :func:`run_trace`). It is sent to ``nexus
serve --backends auto`` on emulated GPUs (:class:`~harness.cluster.ServeCluster`) while
:class:`ClusterSampler` reads the scheduler's ``GetStatus`` (devices registered, desired and planned,
the plan's lower bound) and counts the backend processes with their CPU, and :class:`LogTail`
timestamps ``nexus serve``'s lines (when a backend is added, when one is removed and when it exits).

The analysis is pure, over those samples and the per-request outcomes: device-seconds against the
integral of the lower bound (:func:`integral`), the share within SLO, the time until the share
within SLO recovers after a step (:func:`recovery_s`), the requests that failed while a backend
drained (:func:`drain_windows`, :func:`failures_in`), and a plot (:func:`write_elastic_plot`).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import math
import pathlib
import re
import threading
import time
from typing import Callable, Collection, Sequence

import numpy as np

from common.arrivals import step_arrival_times
from common.profile import Profile
from harness.cluster import cmdline, descendants
from nexus.bench.loadgen import LoadClient
from harness.meters import cpu_seconds
from nexus.bench.report import OK, BenchReport
from nexus.status_model import ClusterStatus

DEVICE_TYPE = "t4"


@dataclasses.dataclass(frozen=True)
class TraceModel:
    """One model of the trace: its emulated-GPU profile (None: a model the cluster profiles itself), SLO,
    share of the total rate and arrivals' CV."""

    name: str
    profile: Profile | None
    slo_ms: float
    share: float
    cv: float


def zipf_models(n: int, *, zipf_s: float = 1.0, cvs: Sequence[float] = (1.0, 2.0, 3.0, 4.0), seed: int = 0,
                per_item_ms: tuple[float, float] = (6.0, 14.0), fixed_ms: tuple[float, float] = (4.0, 12.0),
                slo_ms: tuple[float, ...] = (200.0, 300.0, 400.0), max_batch: int = 32) -> list[TraceModel]:
    """``n`` models, the i-th (from 1) taking a share of the total rate proportional to 1 / i**zipf_s;
    profiles l(b) = fixed + per_item * b drawn uniformly from the ranges (GPU-like: a batch costs a
    launch and then per item), SLOs and CVs cycling through the lists."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, n + 1) ** zipf_s
    shares = weights / weights.sum()
    out = []
    for i in range(n):
        alpha = float(rng.uniform(*per_item_ms))
        beta = float(rng.uniform(*fixed_ms))
        out.append(TraceModel(f"m{i:02d}", Profile.linear(round(alpha, 2), round(beta, 2), max_batch,
                                                          device_type=DEVICE_TYPE),
                              slo_ms[i % len(slo_ms)], float(shares[i]), float(cvs[i % len(cvs)])))
    return out


async def _run_trace(frontend: str, models: Sequence[TraceModel], steps: Sequence[tuple[float, float]], seed: int,
                     grace_ms: float) -> dict[str, BenchReport]:
    clients = [LoadClient(frontend, m.name, seed=seed + i) for i, m in enumerate(models)]
    try:
        for c in clients:
            await c.open()
        total_s = sum(d for d, _ in steps)
        runs = []
        for i, (m, c) in enumerate(zip(models, clients)):
            arrivals = step_arrival_times([(d, r * m.share) for d, r in steps], seed * 1000 + i, cv=m.cv)
            mean_rps = sum(d * r * m.share for d, r in steps) / total_s
            runs.append(c.run(mean_rps, total_s, m.slo_ms, arrivals=arrivals, grace_ms=grace_ms))
        reports = await asyncio.gather(*runs)
    finally:
        for c in clients:
            await c.close()
    return {m.name: r for m, r in zip(models, reports)}


def run_trace(frontend: str, models: Sequence[TraceModel], steps: Sequence[tuple[float, float]], *, seed: int = 0,
              grace_ms: float = 1000.0) -> dict[str, BenchReport]:
    """Send every model its arrivals (``steps``: ``(duration_s, total_rps)``, split by the models' shares)
    from one event loop, one connection per model; the reports by model, with their samples."""
    return asyncio.run(_run_trace(frontend, models, steps, seed, grace_ms))


@dataclasses.dataclass(frozen=True)
class ClusterSample:
    t: float                 # monotonic
    processes: int           # backend processes running
    registered: int
    desired: int
    plan_devices: int
    lower_bound: int
    measured_rps: float      # the rates frontends reported, summed over sessions
    cpu_s: float             # CPU seconds of nexus serve and every process below it, so far
    placement: tuple[tuple[str, tuple[str, ...]], ...] = ()   # (node id, the models it serves) per device


class ClusterSampler:
    """Every ``period_s``, in a thread: ``GetStatus`` (``fetch()``) and the backend processes under
    ``serve_pid`` with the CPU seconds of the whole tree (a process's last reading counts once gone)."""

    def __init__(self, fetch: Callable[[], ClusterStatus], serve_pid: int, device_type: str = DEVICE_TYPE,
                 period_s: float = 0.5) -> None:
        self.fetch, self.serve_pid, self.device_type, self.period_s = fetch, serve_pid, device_type, period_s
        self.samples: list[ClusterSample] = []
        self._cpu: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cluster-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(self.sample())
            except Exception:  # noqa: BLE001 - a restarting scheduler: the next sample
                pass
            self._stop.wait(self.period_s)

    def sample(self) -> ClusterSample:
        pids = [self.serve_pid, *descendants(self.serve_pid)]
        backends = 0
        for pid in pids:
            cpu = cpu_seconds(pid)
            if not math.isnan(cpu):
                self._cpu[pid] = cpu
            backends += " backend " in f" {cmdline(pid)} "
        st = self.fetch()
        d = st.decision(self.device_type)
        measured = sum({s.session: s.measured_rate_rps for dev in st.devices for s in dev.sessions}.values())
        placement = tuple((dev.node_id, tuple(sorted({s.session for s in dev.sessions}))) for dev in st.devices)
        return ClusterSample(time.monotonic(), backends, d.registered if d else len(st.devices),
                             d.desired if d else 0, d.plan_devices if d else st.planned_devices, st.lower_bound,
                             measured, sum(self._cpu.values()), placement)

    def start(self) -> "ClusterSampler":
        self._thread.start()
        return self

    def stop(self) -> list[ClusterSample]:
        self._stop.set()
        self._thread.join()
        return self.samples


class LogTail:
    """The lines appended to a file, each with the monotonic time it was seen (every ``period_s``)."""

    def __init__(self, path: str | pathlib.Path, period_s: float = 0.1) -> None:
        self.path, self.period_s = pathlib.Path(path), period_s
        self.lines: list[tuple[float, str]] = []
        self._offset = self.path.stat().st_size if self.path.exists() else 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="log-tail", daemon=True)

    def _read(self) -> None:
        with self.path.open("rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self._offset += end
        now = time.monotonic()
        self.lines += [(now, line) for line in data[:end].decode(errors="replace").splitlines()]

    def _run(self) -> None:
        while not self._stop.is_set():
            self._read()
            self._stop.wait(self.period_s)

    def start(self) -> "LogTail":
        self._thread.start()
        return self

    def stop(self) -> list[tuple[float, str]]:
        self._stop.set()
        self._thread.join()
        self._read()
        return self.lines


# ---- analysis (pure) ------------------------------------------------------------------------------


def integral(times: Sequence[float], values: Sequence[float], start: float, end: float) -> float:
    """The integral over [start, end] of the step function that holds each value from its time to the
    next (the first value also before it)."""
    total = 0.0
    for i, (t, v) in enumerate(zip(times, values)):
        a = max(t if i else start, start)
        b = min(times[i + 1] if i + 1 < len(times) else end, end)
        if b > a:
            total += v * (b - a)
    return total


@dataclasses.dataclass(frozen=True)
class Requests:
    """Every request of a trace, over all models: when it was sent (monotonic), whether it was answered
    within its SLO, its status name and its model."""

    sent_at: np.ndarray
    good: np.ndarray
    status: list[str]
    model: np.ndarray | None = None      # None: unknown (every request counts for every model)

    @staticmethod
    def of(reports: Sequence[BenchReport]) -> "Requests":
        sent, good, status, model = [], [], [], []
        for r in reports:
            s = r.samples
            sent.append(s.sent_at)
            good.append((s.outcome == OK) & (s.latency_ms <= s.slo_ms))
            status += s.statuses()
            model += [r.model] * len(s.sent_at)
        return Requests(np.concatenate(sent) if sent else np.zeros(0),
                        np.concatenate(good) if good else np.zeros(0, bool), status, np.array(model, dtype=object))


def share_within(req: Requests, start: float, end: float) -> tuple[float, int]:
    """(share within SLO, requests) of the requests sent in [start, end)."""
    m = (req.sent_at >= start) & (req.sent_at < end)
    n = int(m.sum())
    return (float(req.good[m].mean()) if n else 1.0), n


def errors_within(req: Requests, start: float, end: float, models: Collection[str] | None = None) -> dict[str, int]:
    """Requests sent in [start, end) that ended with an error status, by status (only those of
    ``models``, when given and the requests' models are known)."""
    status = np.array(req.status)
    m = (req.sent_at >= start) & (req.sent_at < end) & (status != "OK")
    if models is not None and req.model is not None:
        m &= np.isin(req.model, list(models))
    names, counts = np.unique(status[m], return_counts=True)
    return {str(n): int(c) for n, c in zip(names, counts)}


def recovery_s(req: Requests, step_at: float, until: float, *, window_s: float = 1.0, hold_s: float = 5.0,
               target: float = 0.99) -> float | None:
    """Seconds from ``step_at`` until the share of requests within SLO, in consecutive ``window_s``
    windows, reaches ``target`` and stays there for ``hold_s`` (or until ``until``); None if never."""
    starts = np.arange(step_at, until, window_s)
    ok = [share_within(req, a, a + window_s)[0] >= target for a in starts]
    need = max(1, int(round(hold_s / window_s)))
    for i in range(len(starts)):
        run = ok[i:i + need]
        if all(run) and (len(run) == need or starts[i] + len(run) * window_s >= until - 1e-9):
            return float(starts[i] - step_at)
    return None


_REMOVING = re.compile(r"removing (backend-\d+) \((\S*)")
_STOPPED = re.compile(r"(backend-\d+) \(pid \d+\) stopped")


@dataclasses.dataclass(frozen=True)
class DrainWindow:
    """A backend ``nexus serve`` removed: its name, node id, when it was told to drain and when it exited."""

    backend: str
    node_id: str
    start: float
    end: float


def drain_windows(lines: Sequence[tuple[float, str]]) -> list[DrainWindow]:
    """Every backend ``nexus serve`` removed, from its timestamped lines (end: inf if it never exited)."""
    started: dict[str, tuple[str, float]] = {}
    out = []
    for t, line in lines:
        if m := _REMOVING.search(line):
            started[m.group(1)] = (m.group(2), t)
        elif (m := _STOPPED.search(line)) and m.group(1) in started:
            node_id, start = started.pop(m.group(1))
            out.append(DrainWindow(m.group(1), node_id, start, t))
    return out + [DrainWindow(name, node_id, t, math.inf) for name, (node_id, t) in started.items()]


def served_before(samples: Sequence[ClusterSample], node_id: str, t: float) -> frozenset[str]:
    """The models ``node_id`` served in the last sample taken at or before ``t`` that lists it."""
    for s in reversed(samples):
        if s.t <= t:
            for node, models in s.placement:
                if node == node_id:
                    return frozenset(models)
    return frozenset()


def failures_in(req: Requests, windows: Sequence[DrainWindow], before_s: float,
                samples: Sequence[ClusterSample] | None = None) -> dict[str, int]:
    """Requests that ended with an error status, by status, among those sent from ``before_s`` before a
    drain began (in flight when it began) until it ended; with ``samples``, only those of the models
    the drained backend served when it was told to drain (:func:`served_before`), which the drain
    could have lost, not every backend's."""
    failed: collections.Counter[str] = collections.Counter()
    for w in windows:
        models = served_before(samples, w.node_id, w.start) if samples is not None else None
        failed.update(errors_within(req, w.start - before_s, w.end, models))
    return dict(sorted(failed.items()))


def write_elastic_plot(path: str | pathlib.Path, samples: Sequence[ClusterSample], req: Requests, t0: float,
                       end: float, title: str, steps_at: Sequence[float] = ()) -> None:
    """Devices over time (processes, registered, desired, the plan's, the lower bound) against the demand (requests
    sent per second) and the share within SLO per second."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 6), layout="constrained")
    FigureCanvasAgg(fig)
    ax, ax_share = fig.subplots(2, 1, sharex=True, height_ratios=[3, 1])
    ts = [s.t - t0 for s in samples]
    for key, label, style in (("processes", "backend processes", "-"), ("registered", "registered", "--"),
                              ("desired", "desired (policy)", ":"), ("plan_devices", "plan uses", (0, (1, 3))),
                              ("lower_bound", "planner's lower bound", "-.")):
        ax.step(ts, [getattr(s, key) for s in samples], where="post", linestyle=style, label=label)
    ax.set_ylabel("devices")
    ax.set_ylim(bottom=0)
    demand = ax.twinx()
    edges = np.arange(0.0, end - t0 + 1.0, 1.0)
    sent_per_s, _ = np.histogram(req.sent_at - t0, bins=edges)
    good_per_s, _ = np.histogram(req.sent_at[req.good] - t0, bins=edges)
    demand.plot(edges[:-1] + 0.5, sent_per_s, color="0.6", linewidth=0.8, label="demand (requests/s)")
    demand.set_ylabel("requests per second")
    demand.set_ylim(bottom=0)
    for t in steps_at:
        ax.axvline(t - t0, color="0.4", linewidth=0.6)
    handles = ax.get_legend_handles_labels()
    more = demand.get_legend_handles_labels()
    ax.legend(handles[0] + more[0], handles[1] + more[1], loc="upper left", fontsize="small")
    ax.set_title(title, fontsize="medium")
    share = np.divide(good_per_s, sent_per_s, out=np.ones(len(sent_per_s)), where=sent_per_s > 0)
    ax_share.plot(edges[:-1] + 0.5, 100 * share, color="tab:green", linewidth=0.9)
    ax_share.axhline(99.5, color="k", linestyle="--", linewidth=0.6)
    ax_share.set_ylabel("% within SLO")
    ax_share.set_xlabel("seconds since the trace started")
    ax_share.set_ylim(max(0.0, float(np.min(100 * share, initial=100.0)) - 2), 100.5)
    fig.savefig(str(path), dpi=110)
