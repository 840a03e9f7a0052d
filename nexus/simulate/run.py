"""The discrete-event loop of ``nexus simulate``: a virtual clock, the arrivals, and the cluster's parts.

Arrivals come from an :class:`nexus.simulate.workload.Arrivals` stream (never queued as events:
the loop merges the stream with the event heap), each request going to frontend ``i % frontends``
``path_ms / 2`` after the client sent it, with its deadline at the client's send plus its model's
SLO. Everything else is an event ``(time, sequence, callback, args)``: equal times run in the order
they were scheduled, and every random draw comes from one generator seeded by ``--seed``, so the
same inputs give the same run.

A run ends when every request has ended (each exactly once: :class:`nexus.simulate.outcomes.Outcomes`),
and no later than ``DRAIN_AFTER_END_S`` past the last arrival; a request still open then is an error
of the simulator, reported as such.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass
from typing import Callable

import numpy as np

from common.pb import control as pb
from common.profile import Profile
from frontend.early_report import CHECK_S
from nexus.simulate.config import DeviceTime, FaultKind, SimConfig
from nexus.simulate.control import SimActuator, SimScheduler
from nexus.simulate.devices import Life, SimBackend, device_times
from nexus.simulate.frontends import SimFrontend
from nexus.simulate.known_rates import KnownRates
from nexus.simulate.models import SimModel
from nexus.simulate.outcomes import Loss, Outcomes, Status
from nexus.simulate.workload import Arrivals

DRAIN_AFTER_END_S = 120.0       # a request open this long after the last arrival is a simulator error
SAMPLE_S = 1.0                  # the time series' resolution
ARRIVAL_CHUNK = 65536           # arrivals converted to Python floats this many at a time


class SimulationError(RuntimeError):
    """The simulation itself went wrong (a request never ended); not a property of the cluster."""


@dataclass(frozen=True)
class Sample:
    """The cluster at one instant of the time series."""

    time_s: float
    backends: int          # processes holding a device (starting and draining included)
    registered: int        # backends registered with the scheduler
    desired: int           # the scaling policy's decision
    plan_devices: int      # devices the plan in force uses


class Simulation:
    def __init__(self, models: tuple[SimModel, ...], arrivals: Arrivals, config: SimConfig,
                 known_rates: KnownRates | None = None) -> None:
        """``known_rates``: the planner is given these rates instead of the ones it measures
        (nexus/simulate/known_rates.py)."""
        config.validate()
        known = {m.name for m in models}
        unknown = [name for name in arrivals.names if name not in known]
        if unknown:
            raise ValueError(f"the arrivals name models the models file does not have: {', '.join(unknown[:5])}"
                             + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""))
        self.config = config = config.as_served()
        self.known_rates = known_rates
        self.models = models
        self.arrivals = arrivals
        self.now = 0.0
        self._heap: list = []
        self._seq = 0
        self.rng = random.Random(config.seed)
        self._device_times: dict[int, tuple] = {}
        slo_by_name = {m.name: m.slo_ms for m in models}
        self._names = arrivals.names
        self._slo_s = [slo_by_name[n] / 1000.0 for n in arrivals.names]
        self._times = arrivals.times_s.tolist()       # read per request: Python floats cost least
        self._models = arrivals.models.tolist()
        self._extended: dict[int, float] = {}          # deadlines of requests that found their model cold
        self.outcomes = Outcomes(arrivals.count())
        self.backends: dict[str, SimBackend] = {}
        self.frontends = [SimFrontend(self, f"fe-{i}") for i in range(config.frontends)]
        self.scheduler = SimScheduler(self)
        self.actuator = SimActuator(self, (config.min_backends, config.max_backends)) if config.auto else None
        self.events: list[dict] = []
        self.samples: list[Sample] = []

    # ---- the clock -------------------------------------------------------------------------------

    def at(self, t: float, fn: Callable, *args) -> None:
        """Run ``fn(t, *args)`` at virtual time ``t`` (not before now)."""
        heapq.heappush(self._heap, (max(t, self.now), self._seq, fn, args))
        self._seq += 1

    def jitter(self, sigma: float) -> float:
        """A lognormal factor of mean 1 and log-spread ``sigma`` (1 when 0)."""
        return self.rng.lognormvariate(-sigma * sigma / 2, sigma) if sigma > 0 else 1.0

    def device_times(self, profile: Profile) -> tuple[tuple[float, float], ...]:
        """(mean ms, sigma) per batch of ``profile`` on the simulated device (devices.py), once per profile."""
        key = id(profile)
        if key not in self._device_times:
            self._device_times[key] = (profile, device_times(profile, self.config.device_time is DeviceTime.MEASURED,
                                                              self.config.jitter_cv))
        return self._device_times[key][1]

    def log(self, now: float, kind: str, text: str, **fields) -> None:
        self.events.append({"time_s": round(now, 6), "kind": kind, "text": text, **fields})

    # ---- requests --------------------------------------------------------------------------------

    def model_of(self, request: int) -> str:
        return self._names[self._models[request]]

    def deadline_s(self, request: int) -> float:
        extended = self._extended.get(request)
        return extended if extended is not None else self._times[request] + self._slo_s[self._models[request]]

    def extend_deadline(self, request: int, deadline_s: float) -> None:
        """The request found its model cold: it may wait until ``deadline_s`` for the page-in and its
        answer (frontend/frontend_state.py, ``cold_budget_s`` and ``COLD_START_ALLOWANCE_S``). Once: a
        table that leaves the model cold again does not extend it further, as ``_paged_in`` does not."""
        if request not in self._extended:
            self._extended[request] = max(deadline_s, self.deadline_s(request))

    def _frontend(self, request: int) -> SimFrontend:
        return self.frontends[request % len(self.frontends)]

    def answered(self, request: int, backend: SimBackend, now: float) -> None:
        self._frontend(request).returned(request, backend.node_id)
        latency_s = now + self.config.path_ms / 2000.0 - self._times[request]
        on_time = latency_s <= self._slo_s[self._models[request]] + 1e-9
        self.outcomes.end(request, Status.ON_TIME if on_time else Status.LATE, latency_s * 1000.0)

    def dropped(self, request: int, backend: SimBackend, now: float) -> None:
        self._frontend(request).returned(request, backend.node_id)
        self.ended(request, Status.DROPPED, now)

    def let_go(self, request: int, backend: SimBackend, now: float, why: Loss) -> None:
        self.outcomes.let_go(request, why)
        self._frontend(request).let_go(request, backend.node_id, why is Loss.FAULT, now)

    def ended(self, request: int, status: Status, now: float) -> None:
        latency_s = now + self.config.path_ms / 2000.0 - self._times[request]
        self.outcomes.end(request, status, latency_s * 1000.0)

    # ---- backends --------------------------------------------------------------------------------

    def start_backend(self, now: float) -> SimBackend:
        backend = SimBackend(self, f"be-{len(self.backends)}", now)
        self.backends[backend.node_id] = backend
        hop_s = self.config.control_hop_ms / 1000.0
        self.at(now + self.config.backend_start_s + hop_s, self.scheduler.register, backend.node_id,
                pb.NODE_KIND_BACKEND)
        return backend

    def backend_exited(self, backend: SimBackend, now: float) -> None:
        if backend.why_gone is Loss.FAULT:        # its Attach stream ends: the scheduler removes it at once
            self.log(now, "fault", f"{backend.node_id} killed")
            self.at(now + self.config.control_hop_ms / 1000.0, self.scheduler.stream_ended, backend.node_id)
        else:
            self.log(now, "membership", f"{backend.node_id} drained and exited")

    def died_s(self, node_id: str) -> float | None:
        backend = self.backends.get(node_id)
        return backend.ended_s if backend is not None else None

    # ---- faults and samples ----------------------------------------------------------------------

    def _fault(self, now: float, index: int) -> None:
        fault = self.config.faults[index]
        self.log(now, "fault", fault.describe())
        if fault.kind is FaultKind.STALL_SCHEDULER:
            self.scheduler.stall(now, fault.duration_s)
            return
        plan = self.scheduler.plan
        load = plan.routed_load_rps() if plan is not None else {}
        alive = [b for b in self.backends.values() if b.life is Life.UP]
        for b in sorted(alive, key=lambda b: (-load.get(b.node_id, 0.0), b.node_id))[:fault.count]:
            b.kill(now)

    def _sample(self, now: float) -> None:
        self.at(now + SAMPLE_S, self._sample)
        scheduler = self.scheduler
        decision = scheduler.scaler.decisions.get(self.config.device_type)
        plan = scheduler.plan
        self.samples.append(Sample(now, sum(1 for b in self.backends.values() if b.alive),
                                   len(scheduler.backends()), decision.desired if decision else 0,
                                   plan.devices_needed.get(self.config.device_type, 0) if plan else 0))

    # ---- the loop --------------------------------------------------------------------------------

    def run(self) -> None:
        config = self.config
        hop_s = config.control_hop_ms / 1000.0
        for f in self.frontends:
            self.at(hop_s, self.scheduler.register, f.node_id, pb.NODE_KIND_FRONTEND)
            self.at(self.rng.random() * CHECK_S, f.check_report)      # each frontend's report loop on its own phase
        for _ in range(config.backends if config.backends is not None else config.min_backends):
            backend = SimBackend(self, f"be-{len(self.backends)}", 0.0)
            self.backends[backend.node_id] = backend
            self.at(hop_s, self.scheduler.register, backend.node_id, pb.NODE_KIND_BACKEND)
        self.scheduler.start(0.0)
        if self.actuator is not None:
            self.actuator.start(0.0)
        for i, fault in enumerate(config.faults):
            self.at(fault.at_s, self._fault, i)
        self.at(0.0, self._sample)
        heap = self._heap
        pop = heapq.heappop
        frontends = self.frontends
        n_frontends = len(frontends)
        names = self._names
        path_in_s = config.path_ms / 2000.0
        total = self.arrivals.count()
        times_all, models_all = self.arrivals.times_s, self.arrivals.models
        stop_s = self.arrivals.duration_s + DRAIN_AFTER_END_S
        outcomes = self.outcomes
        i, base = 0, 0
        times: list[float] = []
        models: list[int] = []
        while True:
            k = i - base
            if k >= len(times) and i < total:
                base = i
                times = (times_all[i:i + ARRIVAL_CHUNK] + path_in_s).tolist()
                models = models_all[i:i + ARRIVAL_CHUNK].tolist()
                continue
            ta = times[k] if i < total else math.inf
            if heap and heap[0][0] <= ta:
                t, _, fn, args = pop(heap)
                if t > stop_s:
                    break
                self.now = t
                fn(t, *args)
                if i >= total and outcomes.ended >= total:
                    break
            elif i < total:
                self.now = ta
                frontends[i % n_frontends].accept(i, names[models[k]], ta)
                i += 1
            else:
                break
        if outcomes.ended < total:
            open_ = int(np.sum(outcomes.status == Status.PENDING))
            raise SimulationError(f"{open_} requests never ended by {stop_s:.0f} s (the last arrival at "
                                  f"{self.arrivals.duration_s:.0f} s): a fault of the simulator")
        self.end_s = max(self.arrivals.duration_s, 0.0)
