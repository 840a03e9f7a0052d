"""A capacity planner's answer: the fewest devices of a type that keep a workload at a target fraction
within its SLOs, with its margin, and what the scaling policy (its cool-down included) costs beside it.

The search simulates the same arrivals on fixed clusters, from the peak of the demand's lower bound
upwards by doubling, then by bisection between the last miss and the first hit (attainment grows
with devices; the run at each end is kept, so the margin shown is measured, not assumed). Then the
scaling policy runs on the same arrivals between ``--min-backends`` and the answer's count, or the
configured ``--max-backends`` when larger.

Steady state is what is sized: every model is planned from the start for the rate it will get (its
``expected_rate_rps``, as a user who knows the traffic uploads it; where the file gives none, its
share of the arrivals' first ``WARMUP_S`` seconds), and attainment counts the requests from
``WARMUP_S`` on. Devices beyond those the plan uses sit idle, so attainment stops growing with them;
when it levels off below the target the answer says so, and which flags buy more room
(``--burst-sigma``, ``--rate-headroom``, ``--device-headroom``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from nexus.simulate.config import SimConfig
from nexus.simulate.models import SimModel
from nexus.simulate.outcomes import Status
from nexus.simulate.report import lower_bound_series, summarize
from nexus.simulate.run import Simulation
from nexus.simulate.workload import Arrivals

MAX_DEVICES_SEARCHED = 4096
WARMUP_S = 10.0             # requests before this are not counted (the first plan is made and pushed)
LEVEL_OFF = 1e-4            # attainment that grows less than this when devices double has levelled off


@dataclass(frozen=True)
class Trial:
    devices: int
    within_slo: float
    device_seconds: float


@dataclass(frozen=True)
class SizingAnswer:
    target: float
    devices: int | None              # None: not reached (attainment levelled off below the target)
    trials: tuple[Trial, ...]        # every fixed cluster simulated, by devices
    peak_lower_bound: int
    elastic: dict                    # the scaling policy's run: within_slo, device_seconds, max devices held

    def trial(self, devices: int) -> Trial | None:
        return next((t for t in self.trials if t.devices == devices), None)

    def text(self) -> str:
        if self.devices is None:
            best = max(self.trials, key=lambda t: (t.within_slo, -t.devices))
            return (f"no number of devices keeps {100 * self.target:g}% within SLO: attainment levels off at "
                    f"{100 * best.within_slo:.3f}% from {best.devices} devices (more sit idle beside the plan); "
                    f"plan with more room: --burst-sigma, --rate-headroom or --device-headroom\n")
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


def steady(sim: Simulation) -> float:
    """The share of the requests from WARMUP_S on that ended within their SLO."""
    counted = sim.arrivals.times_s >= min(WARMUP_S, sim.arrivals.duration_s / 2)
    total = int(np.sum(counted))
    return float(np.sum(sim.outcomes.status[counted] == Status.ON_TIME)) / total if total else 0.0


def expecting(models: tuple[SimModel, ...], arrivals: Arrivals) -> tuple[SimModel, ...]:
    """``models``, each without an expected rate given its rate over the arrivals' first WARMUP_S."""
    span = min(WARMUP_S, arrivals.duration_s) or 1.0
    early = arrivals.models[arrivals.times_s < span]
    counts = np.bincount(early, minlength=len(arrivals.names))
    rates = {name: counts[j] / span for j, name in enumerate(arrivals.names)}
    return tuple(m if m.expected_rate_rps > 0 else dataclasses.replace(m, expected_rate_rps=float(rates.get(m.name, 0.0)))
                 for m in models)


def _fixed(models, arrivals, config: SimConfig, devices: int) -> Trial:
    scheduler = dataclasses.replace(config.scheduler, min_devices="0", max_devices="")
    sim = Simulation(models, arrivals, dataclasses.replace(config, backends=devices, scheduler=scheduler,
                                                           max_backends=max(devices, config.min_backends)))
    sim.run()
    return Trial(devices, round(steady(sim), 6), summarize(sim)["device_seconds"])


def size_for(models: tuple[SimModel, ...], arrivals: Arrivals, config: SimConfig, target: float,
             steps=()) -> SizingAnswer:
    models = expecting(models, arrivals)
    probe = Simulation(models, arrivals, config)
    peak = max((d for _, d in lower_bound_series(probe)), default=1)
    trials: dict[int, Trial] = {}

    def trial(n: int) -> Trial:
        if n not in trials:
            trials[n] = _fixed(models, arrivals, config, n)
        return trials[n]

    def answer(devices: int | None, elastic: dict) -> SizingAnswer:
        return SizingAnswer(target, devices, tuple(sorted(trials.values(), key=lambda t: t.devices)), peak, elastic)

    n = max(1, peak)
    low = n - 1                       # the largest count known to miss (0: none)
    while trial(n).within_slo < target:
        if n >= MAX_DEVICES_SEARCHED or (low >= 1 and trial(n).within_slo < trial(low).within_slo + LEVEL_OFF):
            return answer(None, {})
        low = n
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
    elastic = {"max_backends": top, "within_slo": round(steady(sim), 6), "device_seconds": r["device_seconds"],
               "seconds_below_99": r["seconds_below_99"], "most_devices": max(r["per_second"]["backends"], default=0),
               "scale_down_cooldown_s": config.scheduler.scale_down_cooldown_s}
    return answer(high, elastic)
