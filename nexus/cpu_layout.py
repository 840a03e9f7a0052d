"""How ``nexus serve`` lays its backends out on a CPU machine: a pure policy,
``decision, state = decide(demands, state, now)``.

Two layouts share the machine's cores (:class:`CpuLayout`):

* **machine**: one backend whose runtime uses every core (intra-op threads), device type ``cpu``.
  Each batch is as fast as the machine makes it: the layout for a model whose single-thread batch
  cannot meet its SLO.
* **per-core**: one backend per core, one intra-op thread each, device type ``cpu-1t``. Intra-op
  threads scale less than linearly, so the machine serves more in all when each core runs its own
  batches (benchmarks/vs_triton.md: 1.10x a tuned Triton on the single model against 0.87x, 1.30x
  on the mix against 1.00x).

Which one serves more is a property of the models' profiles and their rates, so it is decided from
them: each layout's *load* is the tight lower bound on its devices
(:func:`globalsched.planning.algorithms.lower_bound.lower_bound_gpus`, the planner's own bound: the
throughput every session needs and the fixed cost of one batch per duty cycle, at the session's SLO)
over the devices the layout has left once the serving path has its share (below). Its *room* is how far
every session's rate may grow at once before that bound fills those devices. The layout with the more
room serves more of this mix. Room, not the load at today's rates, decides: at a low rate the bound is
the fixed cost of a batch-1 run in each duty cycle, tens of microseconds of a small model, where one
noisy measurement would pick the layout. A layout where some session cannot meet its SLO at all is
out. The profiles of both layouts are measured on the running backend (``ProfileModel`` with
``threads``), beside whatever it serves at the time (a model is measured when it is first placed);
the rates and SLOs are the scheduler's.

**The serving path's share** (:class:`ServingPath`: the CPU the frontend, the scheduler, the clients
and everything else outside the backends take at today's rates, measured by
:mod:`nexus.serving_path_cpu`; the frontends' part grows with the rates, the rest is taken as it is,
so that an idle machine's other work is not multiplied by the room's large k). The path runs on the
same cores as the models. A device whose batches span ``d`` of the machine's ``C`` cores waits while
any of them runs the path: its intra-op threads meet at the end of every operator, so one preempted
thread holds the batch. With the path's ``P`` cores spread over the cores, each device is held ``P * d / C`` of the
time, and over the layout's ``C / d`` devices that is ``P`` devices, whichever the layout: so a
layout has ``devices - P`` devices left, and the one machine-wide device loses ``P`` of its one
while one device per core loses ``P`` of ``C``. Measured on two cores (``python -m
benchmarks.layout_path_share``: ResNet-18 at 3x64x64, one 2-thread session at batch 16 against two
1-thread sessions at batch 8, beside a process taking 0.2 or 0.4 of a core in 0.5 ms bursts;
benchmarks/vs_triton.md): the machine-wide layout kept 82% and 66% of its items per second, one
per core 90% and 82%, where the rule says 80%, 60%, 90% and 80%. Without the path's share, the
layouts' profiles, measured on an idle machine whose two threads ran a batch 1.9x faster than one,
tied (room for 4.99x against 5.18x the rates, inside the margin), where one backend per core then
served 15% more within the SLO (349.8 against 304.2 requests/s, benchmarks/vs_triton.md).

The rules, so that a switch (which starts the other layout's backends before the running ones
drain: :mod:`nexus.cpu_layout_switch`) is worth its cost and never flaps:

* the running layout's room must be at most ``1 - margin`` of the other's (or the running one
  cannot serve a session the other can; while no session has a rate, neither has more room; when
  neither has room, the other's load must be ``margin`` lower);
* that must hold for ``hold_s`` without a break (not when the running layout cannot serve a
  session: a session is then failing);
* and no switch within ``cooldown_s`` of the last one.

Nothing here reads a clock or a socket.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

from common.profile import Profile
from globalsched.planning.algorithms.config import PlannerConfig
from globalsched.planning.algorithms.lower_bound import lower_bound_gpus
from globalsched.planning.plan import PlanningError, SessionSpec


class CpuLayout(str, enum.Enum):
    MACHINE = "machine"
    PER_CORE = "per-core"


@dataclass(frozen=True)
class LayoutShape:
    """What a layout runs: ``devices`` backends of ``threads`` intra-op threads (0: the runtime's
    default, every core), registered as ``device_type``."""

    layout: CpuLayout
    devices: int
    threads: int
    device_type: str


PER_CORE_DEVICE_TYPE = "cpu-1t"


def layout_shapes(cores: int) -> dict[CpuLayout, LayoutShape]:
    """The two layouts of a machine with ``cores`` cores (at least 1)."""
    if cores < 1:
        raise ValueError(f"a machine has at least one core, got {cores}")
    return {CpuLayout.MACHINE: LayoutShape(CpuLayout.MACHINE, 1, 0, "cpu"),
            CpuLayout.PER_CORE: LayoutShape(CpuLayout.PER_CORE, cores, 1, PER_CORE_DEVICE_TYPE)}


@dataclass(frozen=True)
class SessionDemand:
    """A session as the scheduler plans it (its rate and SLO) with its model's profile in each layout
    (None: not measured yet)."""

    session: str
    model: str
    slo_ms: float
    rate_rps: float
    profiles: Mapping[CpuLayout, Profile | None]


@dataclass(frozen=True)
class ServingPath:
    """The serving path's CPU at today's rates, in cores: ``fixed_cores`` taken as it is (other work,
    clients) and ``rate_cores`` that grows with the rates (the frontends'); module docstring."""

    fixed_cores: float = 0.0
    rate_cores: float = 0.0

    def cores(self, rates_x: float = 1.0) -> float:
        """The path's cores at ``rates_x`` times today's rates."""
        return self.fixed_cores + rates_x * self.rate_cores


@dataclass(frozen=True)
class LayoutLoad:
    """One layout's load: the lower bound's devices over the layout's left to the models (None: it
    cannot serve ``blocked``, with why), and ``room_x``: the largest multiple of every session's rate
    at once that the bound still fits in the devices left (inf: any, when no session has a rate).
    ``path``: the serving path's share (module docstring)."""

    layout: CpuLayout
    devices_needed: float | None
    devices: int
    blocked: str = ""
    room_x: float = 0.0
    path: ServingPath = field(default_factory=ServingPath)

    @property
    def devices_left(self) -> float:
        return left_devices(self.devices, self.path.cores())

    @property
    def load(self) -> float:
        if self.devices_needed is None:
            return math.inf
        return self.devices_needed / self.devices_left if self.devices_left > 0 else math.inf

    def describe(self) -> str:
        if self.devices_needed is None:
            return f"{self.layout.value}: cannot serve {self.blocked}"
        room = "any rate" if math.isinf(self.room_x) else f"{self.room_x:.3g}x the rates"
        path = self.path.cores()
        left = f", {self.devices_left:.2f} left beside the path's {path:.2f} cores" if path else ""
        return (f"{self.layout.value}: {self.devices_needed:.2f} of {self.devices} devices{left} ({self.load:.0%}), "
                f"room for {room}")


def left_devices(devices: int, path_cores: float) -> float:
    """The devices of a layout of ``devices`` left to the models while the serving path takes
    ``path_cores`` of the machine's cores (module docstring): ``devices - path_cores``, at least 0."""
    return max(0.0, devices - path_cores)


@dataclass(frozen=True)
class LayoutConfig:
    margin: float = 0.15            # the running layout's room must be this fraction smaller
    hold_s: float = 10.0            # ... for this long without a break
    cooldown_s: float = 60.0        # and the last switch this long ago


@dataclass(frozen=True)
class LayoutState:
    running: CpuLayout
    better_since: float | None = None      # since when the other layout has been better by the margin
    last_switch_at: float = -math.inf


@dataclass(frozen=True)
class LayoutDecision:
    """``switch_to``: the layout to switch to now (None: stay); ``reason`` gives the numbers."""

    switch_to: CpuLayout | None
    loads: tuple[LayoutLoad, ...]
    reason: str


ROOM_X_MAX = 1e6            # rates this many times the present are "any rate"


def layout_load(demands: Sequence[SessionDemand], shape: LayoutShape,
                config: PlannerConfig = PlannerConfig(), path: ServingPath = ServingPath()) -> LayoutLoad | None:
    """The load of ``shape`` for ``demands`` and its room beside the serving ``path``; None while a
    profile of it is not measured."""
    specs = []
    for d in demands:
        profile = d.profiles.get(shape.layout)
        if profile is None:
            return None
        specs.append(SessionSpec(d.session, d.model, d.slo_ms, d.rate_rps, profile))
    try:
        needed = lower_bound_gpus(specs, None, config)
    except PlanningError as exc:
        return LayoutLoad(shape.layout, None, shape.devices, str(exc), path=path)
    return LayoutLoad(shape.layout, needed, shape.devices, room_x=_room_x(specs, shape.devices, config, path),
                      path=path)


def _room_x(specs: Sequence[SessionSpec], devices: int, config: PlannerConfig, path: ServingPath = ServingPath()
            ) -> float:
    """The largest k with ``lower_bound_gpus(rates * k) <= left_devices(devices, path.cores(k))``
    (the bound grows with every rate, the devices left shrink), to 0.1%: 0 when the sessions' fixed
    costs alone exceed the devices, inf past ROOM_X_MAX."""
    def fits(k: float) -> bool:
        scaled = [replace(s, rate_rps=s.rate_rps * k) for s in specs]
        return lower_bound_gpus(scaled, None, config) <= left_devices(devices, path.cores(k))

    if not fits(0.0):
        return 0.0
    low, high = 0.0, 1.0
    while fits(high):
        low, high = high, high * 4.0
        if high > ROOM_X_MAX:
            return math.inf
    while high - low > 1e-3 * high:
        middle = (low + high) / 2.0
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def decide(demands: Sequence[SessionDemand], shapes: Mapping[CpuLayout, LayoutShape], state: LayoutState,
           now: float, config: LayoutConfig = LayoutConfig(),
           planner: PlannerConfig = PlannerConfig(), path: ServingPath = ServingPath()
           ) -> tuple[LayoutDecision, LayoutState]:
    """Whether to switch from ``state.running`` now, and the next state (see the module's rules);
    ``path``: the serving path's CPU beside the models."""
    other = CpuLayout.PER_CORE if state.running is CpuLayout.MACHINE else CpuLayout.MACHINE
    if not demands:
        return LayoutDecision(None, (), "no sessions to serve"), replace(state, better_since=None)
    running = layout_load(demands, shapes[state.running], planner, path)
    candidate = layout_load(demands, shapes[other], planner, path)
    if running is None or candidate is None:
        return LayoutDecision(None, (), "profiles of both layouts not measured yet"), replace(state, better_since=None)
    loads = (running, candidate)
    numbers = f"{running.describe()}; {candidate.describe()}"
    if candidate.devices_needed is None:
        better = False
    elif running.devices_needed is None:
        better = True
    elif math.isinf(candidate.room_x):
        better = False                         # no rates: nothing to serve more of
    elif candidate.room_x == 0.0 == running.room_x:
        # both short of devices: the lower load by the margin (none, when the path leaves the other none)
        better = math.isfinite(candidate.load) and candidate.load <= running.load * (1.0 - config.margin)
    else:
        better = running.room_x <= candidate.room_x * (1.0 - config.margin) and candidate.room_x > 0.0
    if not better:
        return LayoutDecision(None, loads, f"stay {state.running.value}: {numbers}"), replace(state, better_since=None)
    since = now if state.better_since is None else state.better_since
    held = now - since
    if held < config.hold_s and running.devices_needed is not None:
        why = f"{other.value} better for {held:.0f} of {config.hold_s:.0f} s"
    elif now - state.last_switch_at < config.cooldown_s:
        why = f"{other.value} better, within {config.cooldown_s:.0f} s of the last switch"
    else:
        return (LayoutDecision(other, loads, f"switch to {other.value}: {numbers}"),
                LayoutState(other, None, now))
    return LayoutDecision(None, loads, f"stay {state.running.value} ({why}): {numbers}"), replace(state, better_since=since)
