"""The device scaler, an actuator: from each plan (and, between plans, the measured rates and the
clock) to the number of devices each device type should have, by the pure policy in
globalsched/scaling_policy.py.

It changes nothing itself: the decision is published, with its reason, as the Prometheus gauge
``nexus_desired_devices{device_type}`` on the scheduler's metrics port (a Kubernetes HPA scales the
backend Deployments on it) and in ``GetStatus`` (``nexus serve --backends auto`` starts and drains
local backends by it, and ``nexus status`` shows it). A changed decision is logged with its reason.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Iterable, Mapping

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from globalsched.cluster import ClusterPlan
from globalsched.membership import Node
from globalsched.scaling_policy import ScalingConfig, ScalingDecision, ScalingState, TypeDemand, desired_devices

log = logging.getLogger("nexus.scheduler")

TICK_S = 0.5        # between plans, the cool-down and the measured rates are looked at this often


def demands(plan: ClusterPlan | None, backends: Iterable[Node], measured_rps: Mapping[str, float],
            bounded_types: Iterable[str] = ()) -> dict[str, TypeDemand]:
    """The policy's input per device type: every type registered, planned for, or given a bound."""
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
                    if b.node_id in cost:
                        cost[b.node_id] += s.load_rps or s.throughput_rps
        demand = sum(max(measured_rps.get(s, 0.0), c) for s, c in capacity.items())
        out[t] = TypeDemand(t, plan.devices_needed.get(t, 0) if plan is not None else 0, len(registered.get(t, [])),
                            sum(capacity.values()), demand, folded, cost)
    return out


class DeviceScaler:
    def __init__(self, config: ScalingConfig, backends: Callable[[], list[Node]],
                 measured_rps: Callable[[float], Mapping[str, float]], clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.backends = backends
        self.measured_rps = measured_rps
        self.clock = clock
        self.plan: ClusterPlan | None = None
        self.state = ScalingState()
        self.decisions: dict[str, ScalingDecision] = {}

    async def apply(self, plan: ClusterPlan, epoch: int) -> None:
        self.plan = plan
        self.evaluate()

    def evaluate(self) -> dict[str, ScalingDecision]:
        now = self.clock()
        wanted = demands(self.plan, self.backends(), self.measured_rps(now),
                         [t for t, _ in self.config.bounds.low + self.config.bounds.high])
        decisions, self.state = desired_devices(wanted, self.state, self.config, now)
        for t, d in decisions.items():
            old = self.decisions.get(t)
            if old is None or (old.desired, old.registered, old.drain) != (d.desired, d.registered, d.drain):
                log.info("devices %s: %d desired, %d registered: %s", t, d.desired, d.registered, d.reason)
        self.decisions = decisions
        return decisions

    async def run(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                self.evaluate()
            except Exception:  # keep scaling alive; the next tick tries again
                log.exception("device scaling failed")


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
