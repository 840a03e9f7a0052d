"""``nexus serve --cpu-layout auto``: the actuator of :mod:`nexus.cpu_layout` (which layout of backends
the machine's cores serve most in).

What it does, from ``nexus serve``'s supervision loop (:meth:`CpuLayoutSwitch.step`, never blocking
it: measurements run in a worker thread):

* **Measures.** Every model the scheduler serves is profiled once per version in both layouts on a
  backend of the running one, at the moment it is first seen: ``Backend.ProfileModel`` with the
  layout's intra-op threads, batch sizes 1 to 32, each within a time budget of runs (a profile that
  stops short, on a failure or a memory limit, is extrapolated). It runs in the background, below the
  serving threads' CPU priority (backend/profile_requests.py), since the backend serves meanwhile.
  The layouts are measured in turn, twice (machine, per-core, per-core, machine), and each batch
  size keeps the faster of its two figures: other work on the cores only ever adds time, and a model
  of microseconds is otherwise judged by whichever run a preemption hit.
* **Decides** with :func:`nexus.cpu_layout.decide` from the sessions' rates and SLOs
  (``GetStatus``), the layouts' *typical* profiles, and the serving path's CPU on the backends'
  cores over the last 10 s (:mod:`nexus.serving_path_cpu`; its readings restart when the backends
  change). A typical profile is each size's median run times the planning
  margin (:func:`typical`). A profile's own figure is a tail (the larger of a margin over mean plus
  deviation, and the p99 of ten runs), which one preempted run sets; the medians of two layouts
  compare their batches, not their bad luck. Each change of verdict is logged with the numbers.
* **Switches make-before-break.** The scheduler is given the measured profile of every served model
  for the other layout's device type where it holds none (``AddProfile``: a table its serving
  measurements then correct; the scheduler profiles a model only for a type none of its profiles
  covers). The other layout's backends start beside the running ones; once
  each has registered and the scheduler holds a profile of every served model for their device type,
  the running backends drain (SIGTERM: the scheduler moves their sessions first, then they answer
  what they hold and exit). Sessions move to the new type as the planner sends each to the type of
  the most backends it has a profile for. A switch that is not ready within ``switch_timeout_s``
  is called off: the new backends drain instead, and the cool-down starts again.

Meanwhile the cores are shared by both layouts' backends; that is the switch's cost, paid once per
cool-down at most.
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from common import grpc_util
from common.security import Credentials
from common.profile import LATENCY_MARGIN, BatchLatency, Profile
from common.pb import control, control_grpc
from nexus.cpu_layout import CpuLayout, LayoutConfig, LayoutShape, LayoutState, ServingPath, SessionDemand, decide
from nexus.launcher import Child, Supervisor
from nexus.scheduler_client import AdminCallError
from nexus.serving_path_cpu import ServingPathMeter
from nexus.status_model import ClusterStatus

POLL_S = 2.0
SWITCH_TIMEOUT_S = 180.0        # new backends registered and profiled within this, or the switch is off
RETRY_MEASURE_S = 60.0          # a model whose measurement failed is measured again after this

# measured, not extrapolated from the quick profile's 4 and 8 (globalsched/actuators/profiling.py): the
# room a layout leaves is its large batches' per-item time, which an extrapolation of two noisy small
# sizes got wrong by several times on a model of microseconds
MEASURE_BATCH_SIZES = (1, 2, 4, 8, 16, 32)
MEASURE_EXTEND_TO_BATCH = 32
MEASURE_BUDGET_S = 20.0
MEASURE_ORDER = (CpuLayout.MACHINE, CpuLayout.PER_CORE, CpuLayout.PER_CORE, CpuLayout.MACHINE)

# (backend address, model, intra-op threads) -> the profile measured there
Measure = Callable[[str, control.ModelDesc, int], Profile]


@dataclass
class _Switch:
    target: CpuLayout
    new: list[Child]
    old: list[Child]
    started_at: float


def session_demands(status: ClusterStatus, profiles: Mapping[str, Mapping[CpuLayout, Profile]]) -> list[SessionDemand]:
    """Every placed session once (replicas folded), at its measured rate, or its planned one while
    nothing was measured, with its model's profiles by layout (``profiles``: model -> layout -> profile)."""
    seen: dict[str, SessionDemand] = {}
    for device in status.devices:
        for s in device.sessions:
            if s.session in seen:
                continue
            by_layout = profiles.get(s.model, {})
            capped = {layout: (p.capped(s.batch_cap) if s.batch_cap and s.batch_cap < p.max_batch else p)
                      for layout, p in by_layout.items()}
            seen[s.session] = SessionDemand(s.session, s.model, s.slo_ms,
                                            s.measured_rate_rps or s.planned_rate_rps,
                                            {layout: capped.get(layout) for layout in CpuLayout})
    return list(seen.values())


def typical(profile: Profile) -> Profile:
    """``profile`` with each measured size's median run times the planning margin as its latency (never
    below a smaller size's), extended past the last size with a median as :meth:`Profile.extended`
    does; ``profile`` itself when no row has a median (a backend of an earlier release)."""
    rows = []
    for r in profile.rows:
        if r.median_ms is None:
            break
        rows.append(BatchLatency(r.batch, r.median_ms * LATENCY_MARGIN, r.memory_mb, median_ms=r.median_ms))
    if not rows:
        return profile
    return Profile.monotone_from_measurements(rows, profile.device_type, profile.meta).extended(profile.max_batch)


def faster_rows(profiles: Sequence[Profile]) -> Profile:
    """One profile from several measurements of the same model and device: each batch size's row
    from the measurement that timed it fastest, up to the largest size every one measured."""
    if not profiles:
        raise ValueError("no profile to take rows from")
    shortest = min(len(p.rows) for p in profiles)
    rows = tuple(min((p.rows[i] for p in profiles), key=lambda r: r.latency_ms) for i in range(shortest))
    first = profiles[0]
    return Profile(rows, first.device_type, dict(first.meta, measurements=len(profiles)))


class CpuLayoutSwitch:
    """Keeps ``nexus serve``'s backends in the layout that serves most (module docstring).

    ``start_backend(shape, name)`` starts one backend of a layout (not yet supervised);
    ``fetch_status()`` is ``GetStatus`` (AdminCallError while the scheduler does not answer);
    ``models()`` the scheduler's served models; ``measure`` profiles one on a backend;
    ``add_profile(model, version, profile)`` stores a table with the scheduler (AdminCallError);
    ``path_meter`` meters the serving path's CPU (default: a :class:`ServingPathMeter` of this machine),
    of which ``frontends``' grows with the rates.
    """

    def __init__(self, supervisor: Supervisor, start_backend: Callable[[LayoutShape, str], Child],
                 shapes: Mapping[CpuLayout, LayoutShape], running: CpuLayout, first: Sequence[Child],
                 fetch_status: Callable[[], ClusterStatus], models: Callable[[], Sequence[control.ModelDesc]],
                 measure: Measure, add_profile: Callable[[str, int, Profile], None], log: Callable[[str], None],
                 *, cores: int, drain_timeout_s: float,
                 stop_after: Child | None = None, config: LayoutConfig = LayoutConfig(), poll_s: float = POLL_S,
                 switch_timeout_s: float = SWITCH_TIMEOUT_S, clock: Callable[[], float] = time.monotonic,
                 path_meter: ServingPathMeter | None = None, frontends: Sequence[Child] = ()) -> None:
        self.supervisor = supervisor
        self.start_backend = start_backend
        self.shapes = shapes
        self.fetch_status = fetch_status
        self.models = models
        self.measure = measure
        self.add_profile = add_profile
        self.log = log
        self.cores = cores
        self.drain_timeout_s = drain_timeout_s
        self.stop_after = stop_after
        self.config = config
        self.poll_s = poll_s
        self.switch_timeout_s = switch_timeout_s
        self.clock = clock
        self.path_meter = path_meter if path_meter is not None else ServingPathMeter()
        self.path = ServingPath()
        self.frontends = list(frontends)
        self.state = LayoutState(running)
        self.backends: list[Child] = list(first)
        self.started = len(first)
        self.profiles: dict[str, dict[CpuLayout, Profile]] = {}      # model -> layout -> profile
        self.typical: dict[str, dict[CpuLayout, Profile]] = {}       # the same, typical (what decides)
        self._measured_version: dict[str, int] = {}
        self._failed_at: dict[str, float] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cpu-layout-measure")
        self._measuring: tuple[str, int, concurrent.futures.Future] | None = None
        self._switch: _Switch | None = None
        self._next_poll = 0.0
        self._verdict = ""

    @property
    def running(self) -> CpuLayout:
        return self.state.running

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def step(self) -> None:
        now = self.clock()
        self._collect(now)
        if now < self._next_poll:
            return
        self._next_poll = now + self.poll_s
        try:
            status = self.fetch_status()
        except AdminCallError:
            return
        if self._switch is not None:
            self._follow_switch(status, now)
            return
        self._measure_next(status, now)
        self.path = self.path_meter.sample([c.proc.pid for c in self.backends if c.proc is not None],
                                           [c.proc.pid for c in self.frontends if c.proc is not None])
        decision, self.state = decide(session_demands(status, self.typical), self.shapes, self.state, now,
                                      self.config, path=self.path)
        verdict = decision.reason.split(":", 1)[0].split(" (", 1)[0]      # stay/switch, not the seconds held
        if verdict != self._verdict:
            self._verdict = verdict
            self.log(f"cpu layout: {decision.reason}")
        if decision.switch_to is not None:
            self._start_switch(decision.switch_to, status, now)

    # ---- measuring ------------------------------------------------------------------------------------

    def _threads(self, layout: CpuLayout) -> int:
        return self.shapes[layout].threads or self.cores

    def _collect(self, now: float) -> None:
        if self._measuring is None or not self._measuring[2].done():
            return
        name, version, future = self._measuring
        self._measuring = None
        try:
            runs = future.result()
            self.profiles[name] = {layout: faster_rows(profiles) for layout, profiles in runs.items()}
            self.typical[name] = {layout: faster_rows([typical(p) for p in profiles])
                                  for layout, profiles in runs.items()}
            self._measured_version[name] = version
            self._failed_at.pop(name, None)
            curves = "; ".join(f"{layout.value} l(1)={p.latency_ms(1):.3g} ms, l({p.max_batch})="
                               f"{p.latency_ms(p.max_batch):.3g} ms" for layout, p in self.typical[name].items())
            self.log(f"cpu layout: measured {name} (typical): {curves}")
        except Exception as exc:     # an RPC error, or the backend's own: said once, tried again later
            self._failed_at[name] = now
            self.log(f"cpu layout: measuring {name} failed ({exc}); again in {RETRY_MEASURE_S:.0f} s")

    def _measure_next(self, status: ClusterStatus, now: float) -> None:
        if self._measuring is not None:
            return
        backend = next((c.address for c in self.backends if c.address and c in self.supervisor.children), "")
        if not backend:
            return
        served = {s.model for d in status.devices for s in d.sessions}
        try:
            descs = {m.name: m for m in self.models() if m.name in served}
        except AdminCallError:
            return
        for name in sorted(served):
            desc = descs.get(name)
            if desc is None or self._measured_version.get(name) == desc.version:
                continue
            if now - self._failed_at.get(name, -RETRY_MEASURE_S) < RETRY_MEASURE_S:
                continue
            threads = {layout: self._threads(layout) for layout in CpuLayout}

            def run(desc=desc, threads=threads) -> dict[CpuLayout, list[Profile]]:
                runs: dict[CpuLayout, list[Profile]] = {}
                for layout in MEASURE_ORDER:
                    runs.setdefault(layout, []).append(self.measure(backend, desc, threads[layout]))
                return runs

            self._measuring = (name, desc.version, self._pool.submit(run))
            return

    # ---- switching ------------------------------------------------------------------------------------

    def _start_switch(self, target: CpuLayout, status: ClusterStatus, now: float) -> None:
        shape = self.shapes[target]
        held = {p.model for p in status.profiles if p.device_type == shape.device_type}
        served = {s.model for d in status.devices for s in d.sessions}
        for name in sorted(served - held):
            profile = self.profiles[name][target]
            try:
                self.add_profile(name, self._measured_version[name],
                                 Profile(profile.rows, shape.device_type, {**profile.meta, "source": "nexus serve "
                                         f"--cpu-layout auto, measured at {self._threads(target)} thread(s)"}))
            except AdminCallError as exc:
                self.log(f"cpu layout: switch to {target.value} put off: storing {name}'s profile for "
                         f"{shape.device_type} failed ({exc})")
                self.state = LayoutState(self._other(target), None, now)
                return
        new = []
        for _ in range(shape.devices):
            child = self.start_backend(shape, f"backend-{self.started}")
            self.started += 1
            self.supervisor.add(child, stop_after=self.stop_after)
            new.append(child)
        old = [c for c in self.backends if c in self.supervisor.children]
        self._switch = _Switch(target, new, old, now)
        self.path_meter.reset()
        self.log(f"cpu layout: starting {len(new)} {target.value} backend(s) ({shape.threads or self.cores} "
                 f"intra-op thread(s) each, device type {shape.device_type}) beside the running "
                 f"{len(old)}; those drain once the new ones are registered and profiled")

    def _follow_switch(self, status: ClusterStatus, now: float) -> None:
        sw = self._switch
        shape = self.shapes[sw.target]
        registered = {d.address for d in status.devices if d.device_type == shape.device_type}
        served = {s.model for d in status.devices for s in d.sessions}
        profiled = {p.model for p in status.profiles if p.device_type == shape.device_type}
        ready = all(c.address in registered for c in sw.new) and served <= profiled
        if ready:
            for child in sw.old:
                self.supervisor.retire(child, self.drain_timeout_s)
            self.backends = list(sw.new)
            self._switch = None
            self.path_meter.reset()
            self.log(f"cpu layout: now {sw.target.value} ({len(sw.new)} backend(s) registered, every served "
                     f"model profiled for {shape.device_type}, after {now - sw.started_at:.0f} s); draining "
                     f"the {len(sw.old)} {self._other(sw.target).value} backend(s)")
            return
        if now - sw.started_at >= self.switch_timeout_s:
            for child in sw.new:
                self.supervisor.retire(child, self.drain_timeout_s)
            self._switch = None
            self.path_meter.reset()
            self.state = LayoutState(self._other(sw.target), None, now)
            missing = sorted(served - profiled)
            self.log(f"cpu layout: switch to {sw.target.value} called off after {self.switch_timeout_s:.0f} s "
                     f"(registered {sum(c.address in registered for c in sw.new)} of {len(sw.new)}; "
                     f"not profiled: {', '.join(missing) or 'none'}); staying "
                     f"{self._other(sw.target).value}")

    @staticmethod
    def _other(layout: CpuLayout) -> CpuLayout:
        return CpuLayout.PER_CORE if layout is CpuLayout.MACHINE else CpuLayout.MACHINE


def measure_on_backend(creds: Credentials = grpc_util.NO_CREDENTIALS) -> Measure:
    """:data:`Measure` by ``Backend.ProfileModel`` (RuntimeError with the backend's reason when it
    could not measure; grpc.RpcError when it did not answer), in the background: the backend serves
    meanwhile, and its serving threads keep their priority over the measurement's."""

    def measure(address: str, desc: control.ModelDesc, threads: int) -> Profile:
        request = control.ProfileRequest(model=desc, batch_sizes=MEASURE_BATCH_SIZES, budget_s=MEASURE_BUDGET_S,
                                          extend_to_batch=MEASURE_EXTEND_TO_BATCH, threads=threads, background=True)
        with grpc_util.channel(address, creds) as channel:
            reply = control_grpc.BackendStub(channel).ProfileModel(request, timeout=4 * MEASURE_BUDGET_S + 60)
        if reply.error:
            raise RuntimeError(reply.error)
        return Profile.from_json(reply.profile_json, f"{desc.name}'s profile at {threads} thread(s)")

    return measure
