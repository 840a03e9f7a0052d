"""Plot of one run: latency over time (scatter) and the latency CDF, written with matplotlib's Agg."""

from __future__ import annotations

import os

import numpy as np

from nexus.bench.report import CLIENT_DROPPED, DROPPED, FAILED, OK, BenchReport


def write_plot(report: BenchReport, path: str | os.PathLike) -> None:
    """Write a PNG (or any format matplotlib infers from the suffix) of ``report``'s samples."""
    # Figure + the Agg canvas directly: no pyplot, no global backend switch, no display needed.
    # lazy: matplotlib costs ~0.3 s at start-up and only --plot needs it
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure  # lazy: matplotlib, as above

    s = report.samples
    if s is None:
        raise ValueError("the report carries no samples to plot")
    fig = Figure(figsize=(12, 5), layout="constrained")
    FigureCanvasAgg(fig)
    ax_t, ax_c = fig.subplots(1, 2, width_ratios=[3, 2])
    slo = report.slo_ms
    ok = s.outcome == OK
    within = ok & (s.latency_ms <= slo)
    late = ok & ~within
    bad = np.isin(s.outcome, [DROPPED, FAILED, CLIENT_DROPPED])
    top = report.timeout_ms

    # Legend counts are those of the report (measured window); warmup points are drawn too, shaded.
    size = 6 if len(s.sched_s) < 5000 else 2
    if report.warmup_s > 0:
        ax_t.axvspan(0, report.warmup_s, color="0.9", zorder=0, label="warmup (not counted)")
    ax_t.scatter(s.sched_s[within], s.latency_ms[within], s=size, c="tab:blue", label=f"within SLO ({report.within_slo})")
    ax_t.scatter(s.sched_s[late], s.latency_ms[late], s=size, c="tab:orange", label=f"late ({report.late})")
    if bad.any():
        ax_t.scatter(
            s.sched_s[bad], np.full(int(bad.sum()), top), s=12, marker="x", c="tab:red",
            label=f"dropped / failed, drawn at the client timeout ({report.dropped + report.failed})",
        )
    ax_t.axhline(slo, color="k", linestyle="--", linewidth=1, label=f"SLO {slo:g} ms")
    ax_t.set_xlabel("scheduled send time (s)")
    ax_t.set_ylabel("latency (ms)")
    ax_t.set_ylim(0, max(top, float(np.nanmax(s.latency_ms, initial=0.0))) * 1.05)
    ax_t.set_title(f"{report.model}: {report.offered_rps:g} rps offered, batch {report.batch}")
    ax_t.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, fontsize="small", frameon=False)

    m = s.measured
    lat = np.sort(s.latency_ms[m & ok])
    if lat.size and report.sent:
        # CDF over all requests of the window: dropped / failed ones never arrive, so it tops out below 1.
        frac = np.arange(1, lat.size + 1) / report.sent
        ax_c.step(lat, frac, where="post", color="tab:blue")
        for q, v in (("p50", report.p50_ms), ("p90", report.p90_ms), ("p99", report.p99_ms)):
            if v is not None:
                ax_c.axvline(v, color="0.6", linewidth=0.8)
                ax_c.annotate(q, (v, 0.02), fontsize="small", rotation=90, color="0.4")
    ax_c.axvline(slo, color="k", linestyle="--", linewidth=1)
    ax_c.set_xlabel("latency (ms)")
    ax_c.set_ylabel("fraction of requests")
    ax_c.set_ylim(0, 1.02)
    ax_c.set_xlim(left=0)
    ax_c.set_title(
        f"goodput {report.goodput_rps:.1f} rps, bad rate {100 * report.bad_rate:.2f}%", fontsize="medium"
    )
    ax_c.grid(alpha=0.3)
    fig.savefig(os.fspath(path), dpi=110)
