"""The PNG of a simulation: devices against demand and the lower bound over time, and attainment per
second, with the faults and the steps marked. Drawn from the result's JSON alone (report.py), so a
saved result can be drawn again, or two overlaid (a real run's beside the simulation's)."""

from __future__ import annotations

from typing import Sequence


def plot(result: dict, path: str, title: str = "", overlay: Sequence[tuple[str, dict]] = ()) -> None:
    """Write the PNG of ``result`` to ``path``; ``overlay``: (label, result) whose attainment curves
    are drawn beside this one's."""
    import matplotlib  # lazy: matplotlib costs ~0.3 s at start-up and only --plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib, as above

    series = result["per_second"]
    t = series["time_s"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    n = len(series["backends"])
    top.step(t[:n], series["backends"], where="post", label="devices held (started, draining included)", lw=1.6)
    top.step(t[:n], series["desired"], where="post", label="devices desired (scaling policy)", lw=1, ls="--")
    top.step(t[:n], series["plan_devices"], where="post", label="devices the plan uses", lw=1, ls=":")
    top.step(t, series["lower_bound"], where="post", label="lower bound of the demand", lw=1, color="black", alpha=0.6)
    top.set_ylabel("devices")
    demand = top.twinx()
    demand.plot(t, series["arrivals"], color="tab:gray", alpha=0.35, lw=0.8, label="arrivals per second")
    demand.set_ylabel("requests per second")
    lines = top.get_legend_handles_labels()
    more = demand.get_legend_handles_labels()
    top.legend(lines[0] + more[0], lines[1] + more[1], loc="upper left", fontsize=8)
    attained = [None if a is None else 100 * a for a in series["within_slo"]]
    bottom.plot(t, attained, lw=1, label="this run" if overlay else "within SLO")
    for label, other in overlay:
        bottom.plot(other["per_second"]["time_s"], [None if a is None else 100 * a
                                                    for a in other["per_second"]["within_slo"]], lw=1, label=label)
    bottom.axhline(99, color="black", lw=0.6, ls="--")
    bottom.set_ylabel("% within SLO (per second)")
    bottom.set_xlabel("seconds")
    bottom.set_ylim(max(0, min([a for a in attained if a is not None], default=90) - 2), 100.5)
    if overlay:
        bottom.legend(loc="lower right", fontsize=8)
    for e in result["decisions"]:
        if e["kind"] == "fault" and e["text"].startswith(("kill", "stall")):
            for ax in (top, bottom):
                ax.axvline(e["time_s"], color="tab:red", lw=0.8, alpha=0.7)
    for r in result["recovery"]:
        for ax in (top, bottom):
            ax.axvline(r["at_s"], color="tab:green", lw=0.6, alpha=0.5)
    within = result["within_slo"]
    top.set_title(title or f"{result['requests']:,} requests, {100 * (within or 0):.2f}% within SLO; device-seconds "
                  f"{result['device_seconds']:,.0f} against the bound's {result['lower_bound_device_seconds']:,.0f}",
                  fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
