"""Which rate each session is planned for: a measured rate judged against the noise of its own counts.

The workload reports each session's rate as a window's mean and as the latest short report
(globalsched/state/rate_reports.py). The planner (globalsched/planning/planner.py) plans for the
mean, except where these functions say otherwise:

- :func:`settled_rates`: a mean within noise of the rate planned is the rate planned;
- :func:`real_surges`, :func:`unabsorbed_surges`: a surge is a surge against the rate planned too,
  and needs a plan only beyond what the session's routes serve;
- :func:`held_surges`: a surge held as the session's floor until the mean catches up (with
  ``surge_floors`` on);
- :func:`dropped_rates`, :func:`held_drops`: a drop in the latest report planned for at once, and
  held as a ceiling until the mean comes down.

Noise is that of counts as dispersed as the session's own (common/surge.py). Pure functions: the
state they hold (floors, ceilings) is passed in and returned.
"""

from __future__ import annotations

from typing import AbstractSet, Mapping

from common.surge import NOISE_SIGMAS, is_drop, is_surge, within_noise
from globalsched.planning.cluster_values import ClusterPlan
from globalsched.state.rate_reports import PLAN_RATE_WINDOW_S


def planned_rates(plan: ClusterPlan | None, rate_headroom: float) -> dict[str, float]:
    """The measured rates ``plan`` was made for (its ``rate_headroom`` taken out), per session and query."""
    if plan is None:
        return {}
    headroom = 1.0 + rate_headroom
    out = {name: s.rate_rps / headroom for name, s in plan.sessions.items()}
    out.update({name: rate / headroom for name, rate in plan.planned_query_rates.items()})
    return out


def settled_rates(measured: Mapping[str, float], windows_s: Mapping[str, float], planned: Mapping[str, float],
                  surging: AbstractSet[str] = frozenset(), sigmas: float = NOISE_SIGMAS) -> dict[str, float]:
    """``measured`` rates, except that one within Poisson noise of the rate it is planned for is that
    planned rate: over its window of ``windows_s`` seconds, the requests counted are Poisson noise
    around those the planned rate gives (common/surge.py, at ``sigmas`` standard deviations).

    The rate band of the re-planner (Nexus's [0.8, 1.1]) assumes a rate known to a few percent. A
    session of 0.3 requests/s counts 3 requests in a 10 s window, give or take 1.7, so a long tail of
    such sessions left some session outside its band at every evaluation and re-planned every few
    seconds, each re-plan pushing tables to every node and resizing batches on noise. A change beyond
    noise is planned for as before; a rate without a known window (no counts) or surging is taken as
    measured."""
    out = dict(measured)
    for name, rate in measured.items():
        was, window = planned.get(name), windows_s.get(name, 0.0)
        if was is not None and name not in surging and window > 0 and within_noise(rate * window, was * window, sigmas):
            out[name] = was
    return out


def dropped_rates(latest: Mapping[str, tuple[float, float]], measured_rps: Mapping[str, float],
                  surging: AbstractSet[str] = frozenset(), dispersions: Mapping[str, float] = {}
                  ) -> dict[str, float]:
    """The sessions whose ``latest`` report (rate summed over frontends, its shortest window's seconds)
    is a drop against their window's mean (common/surge.py, :func:`is_drop`), beyond the noise of
    counts as dispersed as the session's own (``dispersions``: its index of dispersion, bursts
    included; 1 where not known): session -> that latest rate, which the plan is made for instead of
    the mean.

    The window's mean lags a step down as it lags a step up: after a 5x step down in the simulator
    the plan came down over 8-20 s, one re-plan at a time as the mean fell, and the devices went
    a cool-down after that (benchmarks/elastic.md). The latest report of a busy session tells within
    seconds; a session expecting a handful of requests in it is never judged, its noise is too wide.

    Judged with Poisson noise alone, a bursty session's lull was a drop: at 115 requests/s with Gamma
    arrivals one fifth of a second counted none (23 expected, a margin of 22), the session was planned
    for 1 request/s, and its next report, a surge against that, placed it again on backends that had
    to load and warm it (benchmarks/elastic.md)."""
    out = {}
    for name, (rate, seconds) in latest.items():
        mean = measured_rps.get(name)
        if mean and seconds > 0 and name not in surging and \
                is_drop(rate * seconds, mean * seconds, dispersions.get(name, 1.0)):
            out[name] = rate
    return out


def held_drops(ceilings: Mapping[str, tuple[float, float]], drops_rps: Mapping[str, float],
               measured_rps: Mapping[str, float], windows_s: Mapping[str, float], now_s: float,
               latest: Mapping[str, tuple[float, float]] = {}, surging: AbstractSet[str] = frozenset(),
               dispersions: Mapping[str, float] = {}) -> dict[str, tuple[float, float]]:
    """The drops held as planned ceilings: session -> (rate, when it dropped); :func:`held_surges`'s
    mirror. A drop (:func:`dropped_rates`) is the latest report only, and the next report, by noise,
    may not be a drop against a mean that still lags: the plan then went back up to the mean and asked
    again for the device the drop had let go (``nexus serve`` with reports every 0.5 s, after a step
    from 110 to 8 requests/s: 2, 1, 2, 1 devices within 10 s). So a drop's rate is the ceiling of the
    session's planned rate until the window's mean comes down to it (below it, or within noise of it),
    a whole rate window has passed, the session surges, or its ``latest`` report (rate, seconds) is
    beyond noise above it: the traffic came back. The noise is that of counts as dispersed as the
    session's own (``dispersions``, 1 where not known), as the drop itself was judged
    (:func:`dropped_rates`). A lower drop replaces a held one."""
    out: dict[str, tuple[float, float]] = {}
    for name, (rate, since) in ceilings.items():
        mean, window = measured_rps.get(name), windows_s.get(name, 0.0)
        if now_s - since >= PLAN_RATE_WINDOW_S or mean is None or name in surging:
            continue
        spread = dispersions.get(name, 1.0)
        if window > 0 and (mean <= rate or within_noise(mean * window, rate * window, dispersion=spread)):
            continue                        # the window came down
        latest_rps, latest_s = latest.get(name, (0.0, 0.0))
        if latest_s > 0 and latest_rps > rate and \
                not within_noise(latest_rps * latest_s, rate * latest_s, dispersion=spread):
            continue                        # the traffic came back
        out[name] = (rate, since)
    for name, rate in drops_rps.items():
        if name not in out or rate <= out[name][0]:
            out[name] = (rate, now_s)
    return out


def real_surges(surges_rps: Mapping[str, float], windows_s: Mapping[str, float],
                planned: Mapping[str, float]) -> dict[str, float]:
    """The surges that are surges against the rate planned too (common/surge.py, the frontends' rule
    for an early report): the workload finds a surge against the recent window's mean, which is zero
    before a model's first requests, so the first report of a model planned for its expected rate was
    a surge, whatever its count, and re-planned the device it ran on (the long-tail benchmark gained a
    device from 6 requests/s measured over 2 s where 5.3 were planned). A surge of a session not
    planned yet, or over a window not known, is taken as one."""
    out = {}
    for name, rate in surges_rps.items():
        window = windows_s.get(name, 0.0)
        if name not in planned or window <= 0 or is_surge(rate * window, planned[name] * window):
            out[name] = rate
    return out


def unabsorbed_surges(surges_rps: Mapping[str, float], plan: ClusterPlan | None,
                      spare_overbook: float) -> dict[str, float]:
    """The surges beyond what their sessions' routes in ``plan`` serve: the throughput of their
    allocations and replicas, and of their spare replicas at 1/``spare_overbook`` of it (a spare
    device's room is overbooked that much: globalsched/planning/plan.py, "Spare GPUs"). The frontends
    send a burst to whichever replica has the least work outstanding, so a surge within that needs no
    plan, and a plan made for it moves the spares that absorb it. A session not in ``plan`` surges.

    Issue 24's step with every device registered (benchmarks/elastic.md, "2026-12-06, 15:05-16:10
    UTC"): planning every surge left a second below 99% within SLO at 3 seeds of 16, this at 1 (within
    the seeds' spread); under auto the step is met as before, since a step outruns the routes."""
    if plan is None or not surges_rps:
        return dict(surges_rps)
    capacity: dict[str, float] = {}
    for placement in plan.placements.values():
        for backend in placement.backends:
            weight = 1.0 / spare_overbook if backend.spare else 1.0
            for s in backend.sessions:
                if s.model in surges_rps:
                    capacity[s.model] = capacity.get(s.model, 0.0) + s.throughput_rps * weight
    return {name: rate for name, rate in surges_rps.items() if rate > capacity.get(name, 0.0)}


def held_surges(floors: Mapping[str, tuple[float, float]], surges_rps: Mapping[str, float],
                measured_rps: Mapping[str, float], windows_s: Mapping[str, float], now_s: float,
                latest: Mapping[str, tuple[float, float]] = {}, dispersions: Mapping[str, float] = {}
                ) -> dict[str, tuple[float, float]]:
    """The surges held as planned floors: session -> (rate, when it surged). A surge (of
    :func:`real_surges`) is planned for at once, but it is the latest report only: a few seconds on,
    the workload's planning rate is the window's mean again, which after a step still holds the counts
    from before it, and a plan made for it gave back the capacity the surge had added (a 5x step
    re-planned from 3 to 8 devices, then fell back to 5-6 until the window filled). So a surge's rate is
    held, as an expected rate is, until the window's mean catches up with it (within noise below it or
    above: :func:`settled_rates` then keeps the plan) or a whole rate window of counts has been
    measured since it surged, or the session's ``latest`` report (rate, seconds) is beyond noise below
    it: a burst, not a step (with Gamma arrivals of CV 3-4 one model or another bursts every few
    seconds, and holding each burst for a window planned 14 devices where 8-11 served the step). The
    noise is that of counts as dispersed as the session's own (``dispersions``, 1 where not known): a
    bursty session's lull is no end of its surge. A higher surge replaces a held one; a lower one
    leaves it."""
    out: dict[str, tuple[float, float]] = {}
    for name, (rate, since) in floors.items():
        mean, window = measured_rps.get(name), windows_s.get(name, 0.0)
        if now_s - since >= PLAN_RATE_WINDOW_S or mean is None:
            continue
        if name not in surges_rps:
            spread = dispersions.get(name, 1.0)
            if window > 0 and (mean >= rate or within_noise(mean * window, rate * window, dispersion=spread)):
                continue                    # the window caught up
            latest_rps, latest_s = latest.get(name, (0.0, 0.0))
            if latest_s > 0 and latest_rps < rate and \
                    not within_noise(latest_rps * latest_s, rate * latest_s, dispersion=spread):
                continue                    # the surge's traffic is gone
        out[name] = (rate, since)
    for name, rate in surges_rps.items():
        if name not in out or rate >= out[name][0]:
            out[name] = (rate, now_s)
    return out
