"""How many devices of each type to have: a pure policy, ``decisions, state = desired_devices(...)``.

Inputs per device type (:class:`TypeDemand`): the devices the plan uses, the backends registered,
what the plan's batches serve of each session placed there against its measured rate, and what
moving each backend's sessions would cost. Output per type (:class:`ScalingDecision`): the desired count, why, and when it is below
the registered count, which backends to drain, the cheapest to move first.

The rules (an operator's expectations: no flapping, nothing lost, no idle device held for long):

* **Up at once.** The raw need is the plan's devices, times the ratio by which demand outruns what
  the plan's batches can serve when it does by more than ``outrun_ratio`` (the plan catches up after
  it; the devices should already be starting). Demand counts each session at its capacity, or at
  its measured rate where that outruns the capacity beyond the noise of the rate window's counts,
  bursts included (globalsched/actuators/device_scaler.py, :func:`outrunning_rps`: a burst, or a step the
  planner already re-plans for, adds only the devices the plan uses); an idle session's room does
  not absorb another's excess, and the capacity is the throughput of its planned batches, not the
  rate it was planned for: a plan for a few requests per second on a device that serves hundreds
  needs no device more when they come. A step across the cluster counts sooner: when the sessions'
  latest reports, summed, outrun the rates planned (and the windows' means) beyond the noise of
  their counts (``latest_ratio``, :func:`globalsched.actuators.device_scaler.latest_ratio`), the
  raw need is the plan's devices grown as its lower bound grows at that ratio (:func:`grown`: the
  sessions' fixed costs are paid, each request more costs its best time), from the first reports
  after the step rather than a device or a few per re-plan as the means follow it. Times the ratio
  itself, a plan made for the default rates, mostly fixed costs, asked for 51 devices where the next
  plan used 20. Then ``headroom`` times it more,
  rounded to the nearest device (spares pooled over every session), within the bounds. A plan of one
  device gets none: a model served at a trickle would otherwise keep two devices (rounded up, a
  plan of one got a second, and tests/e2e/test_elastic.py's model never went back to one). When it
  exceeds the registered count the desired count is that need, at once: this covers a plan that
  folds sessions onto busy devices. A scale-up under way keeps the count it asked for while that
  need is within the cool-down's window, so a need that wavers while the devices start does not
  start them a poll at a time.
* **Down after a cool-down, to what the window needed.** The desired count never drops below the
  largest raw need seen over the last ``cooldown_s`` (the stabilization window of Kubernetes' HPA):
  that need is the plan's devices with demand and headroom counted, so the survivors absorb the
  load (the N/(N-1) check, for any number removed). Once surplus has lasted a whole cool-down, the
  desired count drops to that need at once, however many devices that removes, and holds there
  for the next cool-down (one step per cool-down: no flapping), unless the window's need falls so far
  that the next removal takes more than the tolerance of the count: the window then held nothing above
  it for a whole cool-down. After a step down in the simulator, the first removal took 2 of 86 devices
  while the window still held the step's need (77); the window's need fell to 60 within 4 s and to 43
  within 8 s, and 84 devices waited for the cool-down's end. Removals of the tolerance or less still
  wait for it (benchmarks/elastic.md). While a plan that needs fewer devices
  is being applied, the plan in force holds its devices, but the window remembers the coming plan's
  need (``TypeDemand.coming``): after a step down, plans that superseded each other for seconds
  left the window the need of a plan older than the plans made, and the next removal stopped there
  (benchmarks/elastic.md). A scale-up the plan in force asks for is remembered as asked. Nothing
  goes while the plan lags the load: when the sessions' windows'
  means and their latest reports alike, summed, outrun the rates it was made for beyond the noise of
  their counts (``lag_ratio``, :func:`globalsched.actuators.device_scaler.lag_ratio`), its need
  understates; a removal on it, as the windows filled after the load began, was followed 0.2 s later
  by the next plan's four devices more (a scale reversal under constant load). A count whose need is within
  ``down_tolerance`` of it (the need at least 90% of the count) is kept, as Kubernetes' HPA keeps a
  count whose metric ratio is within its 10% tolerance: a plan whose count wavers by one or two
  under a constant load reversed the device count up to 6 times in 30 minutes in the simulator
  (benchmarks/elastic.md). A removal leaves the need and its tolerance (10% of it, rounded down).
  The tolerance was first taken of the need alone: a plan that wavered between 31 and 28 devices
  then removed one (28 + 2 < 31) and asked for it again 45 s later. Removing one device per cool-down
  took 120 devices 110 cool-downs to shrink (benchmarks/simulator.md). The device drained is the
  one whose sessions move most cheaply (an idle one first; then the fewest planned requests per
  second), and scaling down goes through the backend's drain (SIGTERM, then ``Leave``), so no
  request is lost. The decision names every backend of the surplus, cheapest first, and they
  drain together: one drain at a time took 24 s to remove 46 devices after a step down in the
  simulator (benchmarks/elastic.md).
* **Bounds.** ``min``/``max`` per device type (``--min-devices``/``--max-devices``); when the
  maximum binds and the plan folds sessions, the decision says so.

Time is passed in; nothing here reads a clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Mapping

from common.config import DeviceBounds, SchedulerConfig


@dataclass(frozen=True)
class ScalingConfig:
    cooldown_s: float = 60.0        # surplus must last this long; removals this far apart (see _falls_beyond_tolerance)
    headroom: float = 0.0           # devices beyond the plan's, as a fraction of it
    outrun_ratio: float = 1.1       # demand / capacity above which demand, not the plan, sets the need
    bounds: DeviceBounds = field(default_factory=DeviceBounds)
    down_tolerance: float = 0.1     # a count is kept while the window's need is within this fraction of it

    @classmethod
    def from_config(cls, config: SchedulerConfig) -> ScalingConfig:
        return cls(config.scale_down_cooldown_s, config.device_headroom, bounds=config.device_bounds,
                   down_tolerance=config.scale_down_tolerance)


@dataclass(frozen=True)
class TypeDemand:
    """One device type as the policy sees it."""

    device_type: str
    needed: int                      # devices the plan uses (before folding onto those registered)
    registered: int
    capacity_rps: float = 0.0        # what the plan's batches serve of the sessions placed on this type
    demand_rps: float = 0.0          # each such session at its capacity or, beyond noise above it, its measured rate
    folded: int = 0                  # plan devices folded onto busy backends
    move_cost: Mapping[str, float] = field(default_factory=dict)   # backend -> planned rps of its sessions
    latest_ratio: float = 1.0        # the latest reports summed over the rates planned, where beyond noise (else 1)
    lag_ratio: float = 1.0           # the load over the rates planned, in the means and the latest reports alike
    # the plan's (tight, throughput-only) lower bounds before rounding up: how the plan grows with its
    # rates (:func:`grown`); None: in proportion to them
    bound_gpus: tuple[float, float] | None = None
    # A plan made and being applied that needs fewer devices than this one, the plan in force: this
    # demand holds the devices now, and the window remembers the coming plan's need (module docstring).
    coming: TypeDemand | None = None


@dataclass(frozen=True)
class ScalingDecision:
    device_type: str
    desired: int
    registered: int
    needed: int                      # the raw need (plan, demand, headroom, bounds) now
    reason: str
    drains: tuple[str, ...] = ()     # when desired < registered: the backends to drain, cheapest move first

    @property
    def drain(self) -> str:
        """The backend to drain first ('' when none)."""
        return self.drains[0] if self.drains else ""


@dataclass(frozen=True)
class TypeHistory:
    needs: tuple[tuple[float, int], ...] = ()     # (time, raw need) within the last cooldown
    last_down_s: float | None = None              # when the desired count last dropped
    desired: int | None = None
    down_to: int | None = None                    # the count the last drop aimed at
    up_to: int | None = None                      # the count a scale-up under way aims at


@dataclass(frozen=True)
class ScalingState:
    types: Mapping[str, TypeHistory] = field(default_factory=dict)


def shifted(state: ScalingState, offset_s: float) -> ScalingState:
    """``state`` with every time moved by ``offset_s``: the history another process kept (a leader that
    a standby replaced) on the clock of this one, so that its cool-downs run on where they were."""
    types = {t: replace(h, needs=tuple((when + offset_s, need) for when, need in h.needs),
                        last_down_s=None if h.last_down_s is None else h.last_down_s + offset_s)
             for t, h in state.types.items()}
    return ScalingState(types)


def desired_devices(demands: Mapping[str, TypeDemand], state: ScalingState, config: ScalingConfig, now_s: float
                    ) -> tuple[dict[str, ScalingDecision], ScalingState]:
    decisions: dict[str, ScalingDecision] = {}
    types: dict[str, TypeHistory] = {}
    for t, d in demands.items():
        decisions[t], types[t] = _decide(d, state.types.get(t, TypeHistory()), config, now_s)
    return decisions, ScalingState(types)


def headroom_devices(need: int, headroom: float) -> int:
    """The devices asked for beyond a need of ``need``: ``headroom`` of it, rounded to the nearest
    device; none beside a need of one device (a model served at a trickle would keep two)."""
    return math.floor(need * headroom + 0.5) if need > 1 else 0


def _need(d: TypeDemand, config: ScalingConfig, low: int, high: int) -> tuple[int, int, str]:
    """(the need within the bounds, before them, why) of one demand: its plan's devices, demand and
    steps counted, headroom added."""
    need, why = d.needed, f"the plan uses {d.needed}"
    if d.capacity_rps > 0 and d.demand_rps > config.outrun_ratio * d.capacity_rps:
        ratio = d.demand_rps / d.capacity_rps
        need = math.ceil(d.needed * ratio - 1e-9)
        why = (f"demand {d.demand_rps:.0f} rps outruns the {d.capacity_rps:.0f} rps the plan's batches serve "
               f"(x{ratio:.2f}): {need} for the plan's {d.needed}")
    growth = grown(d, d.latest_ratio)
    stepped = math.ceil(d.needed * growth - 1e-9)
    if d.latest_ratio > config.outrun_ratio and stepped > need:
        need = stepped
        bound = f", the plan's bound x{growth:.2f} at those rates" if d.bound_gpus is not None else ""
        why = (f"the latest reports are x{d.latest_ratio:.2f} the rates planned (a step){bound}: "
               f"{need} for the plan's {d.needed}")
    extra = headroom_devices(need, config.headroom)
    if extra > 0:
        need += extra
        why += f", {config.headroom:.0%} headroom: {need}"
    raw = need
    if need > high:
        why += f"; capped at --max-devices {high}"
        if d.folded:
            why += f" ({d.folded} plan devices folded onto busy backends)"
        need = high
    if need < low:
        need, why = low, why + f"; --min-devices {low}"
    return need, raw, why


def grown(d: TypeDemand, ratio: float) -> float:
    """How many times its devices ``d``'s plan would use at ``ratio`` times the rates it was made for:
    as many as its tight lower bound grows (globalsched/planning/algorithms/lower_bound.py). Each
    session's fixed cost per duty cycle is paid already; each request more costs at least the
    session's best time per request, the throughput-only bound's term. So the bound at those rates is
    at most the tight bound plus ``ratio - 1`` times the throughput-only one (for each session,
    ``max(k*a, F) <= max(a, F) + (k - 1)*a``), and that estimate is taken.

    A plan made before any rate was measured (every session at the default rate) is mostly fixed
    costs: in the simulator's constant load, 14 devices for a bound of 12.7, 3.7 of it requests.
    Scaled with the rate, the first reports (x3.6 the default rates) asked for 51 devices, 82-85
    with the headroom, where the plans made from those reports used 20-25; 45 went again a cool-down
    later. Grown as the bound, they ask for 25 (benchmarks/elastic.md). At a 5x step from a measured
    load the two differ less: 42 devices against 63 for the plan's 18 and a fresh plan's 34-36."""
    if d.bound_gpus is None or d.bound_gpus[0] <= 0:
        return ratio
    tight, per_request = d.bound_gpus
    return 1.0 + max(ratio - 1.0, 0.0) * min(per_request / tight, 1.0)


def _falls_beyond_tolerance(history: TypeHistory, registered: int, kept: int, config: ScalingConfig) -> bool:
    """Whether a removal may follow the last one before the cool-down ends: the last one is done (no
    more registered than it aimed at), and what the window now needs would remove more than the
    tolerance of the count again (the window's every need is then below it for a whole cool-down)."""
    return (history.down_to is not None and registered <= history.down_to
            and kept <= (1 - config.down_tolerance) * registered + 1e-9)


def _decide(d: TypeDemand, history: TypeHistory, config: ScalingConfig, now_s: float
            ) -> tuple[ScalingDecision, TypeHistory]:
    low, high = config.bounds.of(d.device_type)
    need, raw, why = _need(d, config, low, high)
    remembered = need
    if d.coming is not None:
        remembered, _, coming_why = _need(d.coming, config, low, high)
        if remembered < need:
            why = f"{why} (the plan being applied: {coming_why})"
    # A scale-up is remembered at the need that asked for it, though the coming plan needs fewer: the
    # plan being applied at a constant load's cold start had its own reports' step hidden by one
    # session planned for its surge, whose window's spread was that surge (22 devices against 40-42).
    # Remembered at 23, the desired count fell from 42 to 22 when that plan was applied, while 18
    # devices started, and rose to 35 as they registered (an HPA would have stopped the pods).
    asked = need if need > d.registered else min(need, remembered)
    needs = tuple((t, n) for t, n in history.needs if now_s - t < config.cooldown_s) + ((now_s, asked),)
    window_max = max(max(n for _, n in needs), need)
    kept = window_max + math.floor(config.down_tolerance * window_max + 1e-9)    # what a removal leaves
    registered = d.registered
    within = window_max >= (1 - config.down_tolerance) * registered - 1e-9     # the HPA's ratio: need / count
    lagging = d.lag_ratio > config.outrun_ratio         # the plan lags the load: its need is no ground to remove
    # A type seen for the first time (a scheduler that just started, whose backends re-register
    # before its first plan) waits a whole cool-down before anything goes, as after a removal.
    last_down = now_s if not history.needs else history.last_down_s
    down_to: int | None = None
    if need > registered:
        # a scale-up under way keeps its count while the need that asked for it is in the window: a
        # need that wavered while devices started (a step's reports, a plan that folds and the next
        # one that does not) asked for 25, 21, 25 and 21 devices within 2 s, and the actuator started
        # them a poll at a time
        rising = history.up_to is not None and history.up_to > registered
        desired = max(need, min(history.up_to, window_max)) if rising else need
        if d.folded and raw <= high:
            why = f"{why}; {d.folded} plan devices folded onto busy backends: add {desired - registered}"
        else:
            why = f"{why}: add {desired - registered}"
        if desired > need:
            why = f"{why} ({desired} asked for within the {config.cooldown_s:g} s window)"
    elif window_max >= registered:
        # never below the window's largest need: a device asked for a moment ago and still starting
        # is not given up (a gauge that dipped would have an HPA remove the pod it is starting)
        desired = window_max
        if window_max > registered:
            why = f"{why}; {window_max} needed within the {config.cooldown_s:g} s window: {window_max - registered} to come"
        elif need < registered:
            why = f"{why}; {registered - need} surplus, held for the {config.cooldown_s:g} s cool-down"
    elif within:
        desired = registered
        why = (f"{why}; {registered - window_max} surplus over the window's {window_max}, within the "
               f"{config.down_tolerance:.0%} tolerance: kept")
    elif lagging:
        desired = registered
        why = (f"{why}; {registered - window_max} surplus over the window's {window_max}, but the load is "
               f"x{d.lag_ratio:.2f} the rates planned (the plan lags it): kept")
    elif last_down is not None and now_s - last_down < config.cooldown_s and not _falls_beyond_tolerance(
            history, registered, kept, config):
        # the removal in progress goes on to its aim; a lower count left from when fewer were
        # registered (backends that missed heartbeats and came back) is no licence to remove any
        aim = history.down_to if history.down_to is not None and history.desired is not None \
            and history.desired < registered else registered
        desired = max(aim, kept)
        why = f"{why}; surplus, next removal {config.cooldown_s - (now_s - last_down):.0f} s after the last"
        if desired < registered:
            why = f"{why}; removing {registered - desired} more to {desired}"
    else:
        desired = kept
        down_to = desired
        last_down = now_s
        why = (f"{why}; surplus for {config.cooldown_s:g} s: remove {registered - desired} "
               f"(the most needed within it: {window_max}"
               + (f", and {kept - window_max} within the {config.down_tolerance:.0%} tolerance)" if kept > window_max
                  else ")"))
    desired = max(min(desired, max(high, low)), low)
    drains: tuple[str, ...] = ()
    if desired < registered and d.move_cost:
        drains = tuple(sorted(d.move_cost, key=lambda n: (d.move_cost[n], n))[:registered - desired])
        cost = d.move_cost[drains[0]]
        more = f"; then {', '.join(drains[1:4])}{' ...' if len(drains) > 4 else ''}" if len(drains) > 1 else ""
        why += f" ({drains[0]}: {'idle' if cost == 0 else f'its sessions carry {cost:.0f} rps'}{more})"
    if desired == registered and need == registered:
        why = f"{why}: steady"
    decision = ScalingDecision(d.device_type, desired, registered, need, why, drains)
    return decision, replace(history, needs=needs, last_down_s=last_down, desired=desired,
                             down_to=down_to if down_to is not None else history.down_to,
                             up_to=desired if desired > registered else None)
