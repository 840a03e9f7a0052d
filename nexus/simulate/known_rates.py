"""Rates the simulated planner is given instead of the ones it measures: what measuring them costs.

The planner plans for the rates its view reads from the frontends' workload reports
(globalsched/state/read_view.py, ``measured``): window means that lag a step, single reports judged
against noise, holds. Given the trace's true mean rates instead (a :class:`KnownRates` source), the
same planner, scaler and data plane show what they reach when the rates are known, the bound on
what a better estimate of them can buy (benchmarks/elastic.md, "known rates")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

from globalsched.state.rate_reports import PLAN_RATE_WINDOW_S


@dataclass(frozen=True)
class KnownRates:
    """``total_rps(t_s)``: the trace's total rate at ``t_s`` on the simulation's clock; ``shares``:
    each model's share of it; ``ahead_s``: how far ahead the rates are known (0: the rate now; else
    the larger of now and ``ahead_s`` later, a forecast that sees a step before it comes);
    ``dispersions``: each model's index of dispersion of counts (its arrivals' CV squared), where
    known."""

    total_rps: Callable[[float], float]
    shares: Mapping[str, float]
    ahead_s: float = 0.0
    dispersions: Mapping[str, float] | None = None

    def __post_init__(self) -> None:
        if not self.ahead_s >= 0:
            raise ValueError(f"ahead_s must be a number of seconds >= 0, not {self.ahead_s!r}")
        bad = sorted(name for name, share in self.shares.items() if not share >= 0)
        if bad:
            raise ValueError(f"shares must be >= 0: {', '.join(bad[:5])}")

    def view_fields(self, now_s: float) -> dict:
        """The view's measured fields (those of ``read_view.measured``) as if every model had been
        measured at its true rate for a whole window: no surge, no drop, no lag."""
        total = max(self.total_rps(now_s), self.total_rps(now_s + self.ahead_s))
        rates = {name: total * share for name, share in self.shares.items()}
        return dict(rates_rps=rates, surges_rps={}, surge_windows_s={},
                    rate_windows_s=dict.fromkeys(rates, PLAN_RATE_WINDOW_S),
                    latest_reports={name: (rate, PLAN_RATE_WINDOW_S) for name, rate in rates.items()},
                    rate_dispersions=dict(self.dispersions or {}))
