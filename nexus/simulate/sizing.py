"""A capacity planner's answer: the fewest devices of a type that keep a workload at a target fraction
within its SLOs, with its margin, and what the scaling policy (its cool-down included) costs beside it.

The search simulates the same arrivals on fixed clusters, from the peak of the demand's lower bound
upwards by doubling, then by bisection between the last miss and the first hit (attainment grows
with devices; the run at each end is kept, so the margin shown is measured, not assumed). Then the
scaling policy runs on the same arrivals between ``--min-backends`` and the answer's count, or the
configured ``--max-backends`` when larger.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from nexus.simulate.config import SimConfig
from nexus.simulate.models import SimModel
from nexus.simulate.report import lower_bound_series, summarize
from nexus.simulate.run import Simulation
from nexus.simulate.workload import Arrivals

MAX_DEVICES_SEARCHED = 4096


@dataclass(frozen=True)
class Trial:
    devices: int
    within_slo: float
    device_seconds: float


@dataclass(frozen=True)
class SizingAnswer:
    target: float
    devices: int | None              # None: not reached within MAX_DEVICES_SEARCHED
    trials: tuple[Trial, ...]        # every fixed cluster simulated, by devices
    peak_lower_bound: int
    elastic: dict                    # the scaling policy's run: within_slo, device_seconds, max devices held

    def trial(self, devices: int) -> Trial | None:
        return next((t for t in self.trials if t.devices == devices), None)

    def text(self) -> str:
        if self.devices is None:
            return (f"no cluster of up to {MAX_DEVICES_SEARCHED} devices keeps {100 * self.target:g}% within SLO "
                    f"(the most tried: {self.trials[-1].devices}, {100 * self.trials[-1].within_slo:.3f}%)\n")
        hit, below = self.trial(self.devices), self.trial(self.devices - 1)
        lines = [f"{self.devices} devices keep {100 * hit.within_slo:.3f}% within SLO (target "
                 f"{100 * self.target:g}%; the demand's lower bound peaks at {self.peak_lower_bound})"]
        if below is not None:
            lines.append(f"margin: {self.devices - 1} devices keep {100 * below.within_slo:.3f}%")
        e = self.elastic
        lines.append(f"scaling policy (up to {e['max_backends']}): {100 * e['within_slo']:.3f}% within SLO, "
                     f"{e['device_seconds']:,.0f} device-seconds against {hit.device_seconds:,.0f} for "
                     f"{self.devices} fixed ({e['device_seconds'] / hit.device_seconds:.2f}x), "
                     f"{e['seconds_below_99']} seconds below 99%")
        return "\n".join(lines) + "\n"

    def to_json_obj(self) -> dict:
        return {"target": self.target, "devices": self.devices, "peak_lower_bound": self.peak_lower_bound,
                "trials": [dataclasses.asdict(t) for t in self.trials], "elastic": self.elastic}


def _fixed(models, arrivals, config: SimConfig, devices: int) -> Trial:
    scheduler = dataclasses.replace(config.scheduler, min_devices="0", max_devices="")
    sim = Simulation(models, arrivals, dataclasses.replace(config, backends=devices, scheduler=scheduler,
                                                           max_backends=max(devices, config.min_backends)))
    sim.run()
    r = summarize(sim)
    return Trial(devices, r["within_slo"] or 0.0, r["device_seconds"])


def size_for(models: tuple[SimModel, ...], arrivals: Arrivals, config: SimConfig, target: float,
             steps=()) -> SizingAnswer:
    probe = Simulation(models, arrivals, config)
    peak = max((d for _, d in lower_bound_series(probe)), default=1)
    trials: dict[int, Trial] = {}

    def trial(n: int) -> Trial:
        if n not in trials:
            trials[n] = _fixed(models, arrivals, config, n)
        return trials[n]

    n = max(1, peak)
    low = n - 1                       # the largest count known to miss (0: none)
    while trial(n).within_slo < target:
        low = n
        if n >= MAX_DEVICES_SEARCHED:
            return SizingAnswer(target, None, tuple(sorted(trials.values(), key=lambda t: t.devices)), peak, {})
        n = min(2 * n, MAX_DEVICES_SEARCHED)
    high = n
    while high - low > 1:
        mid = (low + high) // 2
        if trial(mid).within_slo >= target:
            high = mid
        else:
            low = mid
    if high > 1:
        trial(high - 1)
    top = max(high, config.max_backends)
    scheduler = dataclasses.replace(config.scheduler, min_devices=f"{config.device_type}={config.min_backends}",
                                    max_devices=f"{config.device_type}={top}")
    sim = Simulation(models, arrivals, dataclasses.replace(config, backends=None, max_backends=top, scheduler=scheduler))
    sim.run()
    r = summarize(sim, steps)
    elastic = {"max_backends": top, "within_slo": r["within_slo"] or 0.0, "device_seconds": r["device_seconds"],
               "seconds_below_99": r["seconds_below_99"], "most_devices": max(r["per_second"]["backends"], default=0),
               "scale_down_cooldown_s": config.scheduler.scale_down_cooldown_s}
    return SizingAnswer(target, high, tuple(sorted(trials.values(), key=lambda t: t.devices)), peak, elastic)
