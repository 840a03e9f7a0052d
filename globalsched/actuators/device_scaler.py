"""The device scaler, an actuator: from each plan (and, between plans, the measured rates and the
clock) to the number of devices each device type should have, by the pure policy in
globalsched/planning/scaling_policy.py. A plan that needs more devices counts as soon as it is made;
one that needs fewer, once it is applied (the policy's window remembers its need when it is made).

It changes nothing itself: the decision is published, with its reason, as the Prometheus gauge
``nexus_desired_devices{device_type}`` on the scheduler's metrics port (a Kubernetes HPA scales the
backend Deployments on it) and in ``GetStatus`` (``nexus serve --backends auto`` starts and drains
local backends by it, and ``nexus status`` shows it). A changed decision is logged with its reason.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Awaitable, Callable, Iterable, Mapping

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from common.surge import noise_margin
from globalsched.planning.cluster_values import ClusterPlan
from globalsched.state.membership import Node
from globalsched.planning.scaling_policy import ScalingConfig, ScalingDecision, ScalingState, TypeDemand, desired_devices
from globalsched.state.rate_reports import WindowRate

log = logging.getLogger("nexus.scheduler")

TICK_S = 0.5        # between plans, the cool-down and the measured rates are looked at this often
PERSIST_EVERY_S = 2.0   # a shared database keeps the policy's state at most this often


def demands(plan: ClusterPlan | None, backends: Iterable[Node], measured: Mapping[str, WindowRate],
            bounded_types: Iterable[str] = ()) -> dict[str, TypeDemand]:
    """The policy's input per device type: every type registered, planned for, or given a bound.

    A session's demand is its planned capacity, or its measured rate where that outruns the capacity
    (:func:`outrunning_rps`); a type's latest reports together may outrun its plan sooner
    (:func:`latest_ratio`)."""
    registered: dict[str, list[str]] = {}
    for n in backends:
        registered.setdefault(n.device_type, []).append(n.node_id)
    types = set(registered) | set(t for t in bounded_types if t != "*")
    if plan is not None:
        types |= set(plan.devices_needed)
    out = {}
    for t in sorted(types):
        cost = {node: 0.0 for node in registered.get(t, [])}
        capacity: dict[str, float] = {}
        folded = 0
        placement = plan.placements.get(t) if plan is not None else None
        if placement is not None:
            folded = placement.overcommitted
            for b in placement.backends:
                for s in b.sessions:
                    capacity[s.model] = capacity.get(s.model, 0.0) + s.throughput_rps
                    if b.node_id in cost and not b.spare:     # a spare's session runs elsewhere too
                        cost[b.node_id] += s.load_rps or s.throughput_rps
        demand = sum(outrunning_rps(measured.get(s), c) or c for s, c in capacity.items())
        planned = {s: plan.sessions[s].rate_rps for s in capacity if s in plan.sessions}   # none without a plan
        out[t] = TypeDemand(t, plan.devices_needed.get(t, 0) if plan is not None else 0, len(registered.get(t, [])),
                            sum(capacity.values()), demand, folded, cost, *report_ratios(planned, measured),
                            bound_gpus=plan.bound_gpus.get(t) if plan is not None else None)
    return out


def _beyond_noise(count: float, expected: float, variance: float) -> float:
    """Requests ``count``ed over those ``expected`` (``variance``: the expected counts, each weighted by
    its session's index of dispersion), when beyond the noise of such counts (common/surge.py); else 1."""
    if expected <= 0 or count <= expected + noise_margin(expected, dispersion=variance / expected):
        return 1.0
    return count / expected


def report_ratios(planned_rps: Mapping[str, float], measured: Mapping[str, WindowRate]) -> tuple[float, float]:
    """(:func:`latest_ratio`, :func:`lag_ratio`) in one pass over the sessions: the scheduler evaluates
    every TICK_S, and at 2,400 sessions a pass costs the loop 1.5-2.5 ms."""
    step, latest, means = [0.0] * 3, [0.0] * 3, [0.0] * 3     # count, expected, variance
    for session, planned in planned_rps.items():
        m = measured.get(session)
        if m is None or planned <= 0:
            continue
        dispersion = max(m.dispersion or 1.0, 1.0)
        if m.latest_s > 0:
            count = m.latest_rps * m.latest_s
            for sums, expected in ((step, max(planned, m.rate_rps) * m.latest_s), (latest, planned * m.latest_s)):
                sums[0] += count
                sums[1] += expected
                sums[2] += expected * dispersion
        if m.window_s > 0:
            expected = planned * m.window_s
            means[0] += m.rate_rps * m.window_s
            means[1] += expected
            means[2] += expected * dispersion
    return _beyond_noise(*step), min(_beyond_noise(*means), _beyond_noise(*latest))


def lag_ratio(planned_rps: Mapping[str, float], measured: Mapping[str, WindowRate]) -> float:
    """How far the load outruns the rates the plan was made for (``planned_rps``: session -> rate),
    in the sessions' windows' means and in their latest reports alike, each summed and beyond the
    noise of their counts: the lower of the two ratios, or 1.

    A plan made while the windows still filled after the load began lagged it: in the constant-load
    trace the plan in force was made for 675 requests/s while the means and the latest reports said
    1,000, and a removal on its need was followed 0.2 s later by the re-plan's need, four devices
    more (a scale reversal; benchmarks/elastic.md). Both must outrun the plan: after a step down the
    means lag above a plan made from the latest reports, and that plan's need is the one to follow."""
    return report_ratios(planned_rps, measured)[1]


def latest_ratio(planned_rps: Mapping[str, float], measured: Mapping[str, WindowRate]) -> float:
    """The ratio of the sessions' latest reports, summed, to the rates the plan was made for
    (``planned_rps``: session -> rate) or, where higher, their windows' means, when the sum is beyond
    the noise of their counts, each session's dispersed as its own (common/surge.py); else 1.

    A step across the cluster shows in the latest reports seconds before any window's mean: the
    means lag it for a window, and the plan, made from them, followed a 5x step over 10-15 s, each
    re-plan asking for a few more devices (benchmarks/elastic.md). One session's burst, or a handful
    of them, is noise in the sum; a step that moves every session is far beyond it, even while each
    session's own report is within its noise. The plan's capacity is no measure of a step: a session
    planned for a few requests per second on a device that serves hundreds has room that no other
    session's excess can use, and summed with the rest it hid a 5x step. Nor is the plan alone: a plan
    made from the first seconds' counts lagged a constant load, and scaling for it added devices
    that went again a cool-down later (two or three scale reversals in the constant-load trace). A step
    outruns the windows' means too."""
    return report_ratios(planned_rps, measured)[0]


def outrunning_rps(measured: WindowRate | None, capacity_rps: float) -> float | None:
    """``measured``'s rate where it outruns ``capacity_rps`` beyond the noise of its window's counts,
    bursts included (common/surge.py); else None.

    Demand read from the latest 2 s report, smoothed, followed every burst: Gamma arrivals of CV 3-4
    read 290-470 requests/s where 200 were offered, and the policy added 2-3 devices the plan never
    used. The window's mean with its own dispersion tells a burst (or a step the planner is already
    re-planning for: the plan's devices follow it) from a rate the plan's batches cannot serve. A rate
    of unknown noise (fewer than two counts) is left to the plan.

    Nor does a mean outrun the plan while the latest report is within what the plan serves: after a
    step down the mean holds the counts from before it, and the planner plans for the latest report's
    drop (globalsched/planning/rate_judgement.py, ``held_drops``). Taken as demand, that mean asked for the
    device the drop had let go (``nexus serve``, from 110 to 8 requests/s: 2, 1, 2, 1 devices)."""
    if measured is None or measured.dispersion is None or measured.window_s <= 0:
        return None
    count, expected = measured.rate_rps * measured.window_s, capacity_rps * measured.window_s
    if count <= expected + noise_margin(expected, dispersion=measured.dispersion):
        return None
    if measured.latest_s > 0:
        latest, served = measured.latest_rps * measured.latest_s, capacity_rps * measured.latest_s
        if latest <= served + noise_margin(served, dispersion=measured.dispersion):
            return None
    return measured.rate_rps


class DeviceScaler:
    def __init__(self, config: ScalingConfig, backends: Callable[[], list[Node]],
                 measured: Callable[[float], Mapping[str, WindowRate]], clock: Callable[[], float] = time.monotonic,
                 persist: Callable[[ScalingState, float], Awaitable[None]] | None = None):
        """``persist(state, now)``: keep the policy's state now and then (a shared database, for the
        standby that may take over: globalsched/state/database/plan_store.py)."""
        self.persist = persist
        self.config = config
        self.backends = backends
        self.measured = measured
        self.clock = clock
        self.plan: ClusterPlan | None = None      # the plan in force: the last one applied
        self.coming: ClusterPlan | None = None    # a plan made and being applied (:meth:`made`)
        self.state = ScalingState()
        self.decisions: dict[str, ScalingDecision] = {}

    def adopt(self, plan: ClusterPlan | None, state: ScalingState | None) -> None:
        """Continue from another scheduler's plan in force and policy history (a standby that took
        over; either may be unknown: None)."""
        if plan is not None:
            self.plan = plan
        if state is not None:
            self.state = state

    async def apply(self, plan: ClusterPlan, epoch: int) -> None:
        self.applied(plan)

    def applied(self, plan: ClusterPlan) -> dict[str, ScalingDecision]:
        """``plan`` is in force now (every node holds its tables): the decisions it gives."""
        self.plan = plan
        self.coming = None
        return self.evaluate()

    def made(self, plan: ClusterPlan) -> dict[str, ScalingDecision]:
        """``plan`` was just made and its tables are about to go out (globalsched/planning/control_loop.py):
        the devices it needs beyond the plan in force are asked for now, not once every node has
        answered. At a step that push took 3-4 s, the plan's own warm-ups on busy backends included,
        while the devices it had folded waited to be started (benchmarks/elastic.md). Returns the
        decisions."""
        self.coming = plan
        return self.evaluate()

    def evaluate(self) -> dict[str, ScalingDecision]:
        now = self.clock()
        backends, measured = self.backends(), self.measured(now)
        bounded = [t for t, _ in self.config.bounds.low + self.config.bounds.high]
        wanted = demands(self.plan, backends, measured, bounded)
        if self.coming is not None:
            # Up at once. Down only once applied: a backend the coming plan leaves idle still serves
            # the plan in force until the frontends' tables change. But the policy's window remembers
            # the coming plan's need, not the plan in force's: after a step down, plans superseding
            # each other for seconds had left the window a need a cool-down older than the plans made.
            for t, d in demands(self.coming, backends, measured, bounded).items():
                if t not in wanted or d.needed > wanted[t].needed:
                    wanted[t] = d
                else:
                    wanted[t] = replace(wanted[t], coming=d)
        decisions, self.state = desired_devices(wanted, self.state, self.config, now)
        for t, d in decisions.items():
            old = self.decisions.get(t)
            if old is None or (old.desired, old.registered, old.drain) != (d.desired, d.registered, d.drain):
                log.info("devices %s: %d desired, %d registered: %s", t, d.desired, d.registered, d.reason)
        self.decisions = decisions
        return decisions

    async def run(self) -> None:
        saved: ScalingState | None = None
        saved_at = float("-inf")
        while True:
            await asyncio.sleep(TICK_S)
            try:
                self.evaluate()
            except Exception:  # keep scaling alive; the next tick tries again
                log.exception("device scaling failed")
            now = self.clock()
            if self.persist is not None and persist_due(self.state, saved, now - saved_at):
                saved, saved_at = self.state, now
                await self.persist(self.state, now)


def persist_due(state: ScalingState, saved: ScalingState | None, since_saved_s: float) -> bool:
    """Whether the policy's state is stored now: at once when a decision in it changed (a device type
    appeared, its desired count, its last drop), so that a standby taking over continues from the
    count in force; otherwise at most every PERSIST_EVERY_S, while only its history of needs moves."""
    if state == saved:
        return False
    if saved is None or _decisions(state) != _decisions(saved):
        return True
    return since_saved_s >= PERSIST_EVERY_S


def _decisions(state: ScalingState) -> dict[str, tuple]:
    return {t: (h.desired, h.last_down_s, h.down_to, h.up_to) for t, h in state.types.items()}


class ScalerCollector(Collector):
    """The scaler's decisions as gauges, read at scrape time (no stale device types)."""

    def __init__(self, scaler: DeviceScaler) -> None:
        self.scaler = scaler

    def collect(self):
        desired = GaugeMetricFamily("nexus_desired_devices", "devices of this type the scaling policy wants "
                                    "(the plan's, demand and headroom, within --min/--max-devices)",
                                    labels=["device_type"])
        registered = GaugeMetricFamily("nexus_registered_devices", "backends of this type registered with the "
                                       "scheduler", labels=["device_type"])
        planned = GaugeMetricFamily("nexus_plan_devices", "devices of this type the current plan uses",
                                    labels=["device_type"])
        for t, d in sorted(self.scaler.decisions.items()):
            desired.add_metric([t], d.desired)
            registered.add_metric([t], d.registered)
            plan = self.scaler.plan
            planned.add_metric([t], plan.devices_needed.get(t, 0) if plan is not None else 0)
        yield desired
        yield registered
        yield planned
