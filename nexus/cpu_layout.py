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
over the devices the layout has. Its *room* is how far every session's rate may grow at once before
that bound fills the layout's devices. The layout with the more room serves more of this mix. Room,
not the load at today's rates, decides: at a low rate the bound is the fixed cost of a batch-1 run
in each duty cycle, tens of microseconds of a small model, where one noisy measurement would pick
the layout. A layout where some session cannot meet its SLO at all is out. The profiles of both
layouts are measured on the running backend (``ProfileModel`` with ``threads``), the rates and SLOs
are the scheduler's.

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
from dataclasses import dataclass, replace
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
class LayoutLoad:
    """One layout's load: the lower bound's devices over the layout's (None: it cannot serve
    ``blocked``, with why), and ``room_x``: the largest multiple of every session's rate at once
    that the bound still fits in the layout's devices (inf: any, when no session has a rate)."""

    layout: CpuLayout
    devices_needed: float | None
    devices: int
    blocked: str = ""
    room_x: float = 0.0

    @property
    def load(self) -> float:
        return math.inf if self.devices_needed is None else self.devices_needed / self.devices

    def describe(self) -> str:
        if self.devices_needed is None:
            return f"{self.layout.value}: cannot serve {self.blocked}"
        room = "any rate" if math.isinf(self.room_x) else f"{self.room_x:.3g}x the rates"
        return f"{self.layout.value}: {self.devices_needed:.2f} of {self.devices} devices ({self.load:.0%}), room for {room}"


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
                config: PlannerConfig = PlannerConfig()) -> LayoutLoad | None:
    """The load of ``shape`` for ``demands`` and its room; None while a profile of it is not measured."""
    specs = []
    for d in demands:
        profile = d.profiles.get(shape.layout)
        if profile is None:
            return None
        specs.append(SessionSpec(d.session, d.model, d.slo_ms, d.rate_rps, profile))
    try:
        needed = lower_bound_gpus(specs, None, config)
    except PlanningError as exc:
        return LayoutLoad(shape.layout, None, shape.devices, str(exc))
    return LayoutLoad(shape.layout, needed, shape.devices, room_x=_room_x(specs, shape.devices, config))


def _room_x(specs: Sequence[SessionSpec], devices: int, config: PlannerConfig) -> float:
    """The largest k with ``lower_bound_gpus(rates * k) <= devices`` (the bound grows with every
    rate), to 0.1%: 0 when the sessions' fixed costs alone exceed the devices, inf past ROOM_X_MAX."""
    def fits(k: float) -> bool:
        scaled = [replace(s, rate_rps=s.rate_rps * k) for s in specs]
        return lower_bound_gpus(scaled, None, config) <= devices

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
           planner: PlannerConfig = PlannerConfig()) -> tuple[LayoutDecision, LayoutState]:
    """Whether to switch from ``state.running`` now, and the next state (see the module's rules)."""
    other = CpuLayout.PER_CORE if state.running is CpuLayout.MACHINE else CpuLayout.MACHINE
    if not demands:
        return LayoutDecision(None, (), "no sessions to serve"), replace(state, better_since=None)
    running = layout_load(demands, shapes[state.running], planner)
    candidate = layout_load(demands, shapes[other], planner)
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
        better = candidate.load <= running.load * (1.0 - config.margin)     # both short of devices
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
