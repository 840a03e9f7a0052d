"""PNG plots: a profile's latency and throughput against batch size, and a multi-tenant frontier.

matplotlib runs with the non-interactive Agg backend; nothing here needs a display.
"""

from __future__ import annotations

from typing import Any

from common.profile import Profile


def _pyplot():
    import matplotlib  # lazy: matplotlib costs ~0.3 s at start-up and only --plot needs it

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt  # lazy: matplotlib, as above

    return plt


def plot_profile(profile: Profile, path: str, title: str = "") -> str:
    """Latency (mean with p99 band, conservative planning figure) and throughput per batch size."""
    plt = _pyplot()
    measured = set(profile.meta.get("measured_batches", [r.batch for r in profile.rows]))
    batches = [r.batch for r in profile.rows]
    planning = [r.latency_ms for r in profile.rows]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    mrows = [r for r in profile.rows if r.batch in measured and r.mean_ms is not None]
    if mrows:
        ax.errorbar([r.batch for r in mrows], [r.mean_ms for r in mrows], yerr=[r.std_ms or 0 for r in mrows],
                    fmt="o", ms=4, color="tab:blue", capsize=2, label="measured mean ± std")
        ax.plot([r.batch for r in mrows], [r.p99_ms for r in mrows], "v", ms=4, color="tab:cyan", label="measured p99")
    ax.plot(batches, planning, "-", color="tab:red", lw=1.2, label="planning latency l(b)")
    ax.set_xlabel("batch size")
    ax.set_ylabel("latency (ms)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    thr = [r.batch * 1000.0 / r.latency_ms for r in profile.rows]
    ax2.plot(batches, thr, "--", color="tab:green", lw=1.2, label="throughput b/l(b)")
    if mrows:
        ax2.plot([r.batch for r in mrows], [r.batch * 1000.0 / r.mean_ms for r in mrows], "s", ms=3,
                 color="tab:green", alpha=0.6, label="throughput at mean")
    ax2.set_ylabel("throughput (items/s)")
    ax2.set_ylim(bottom=0)
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper left", fontsize=8)
    meta = profile.meta
    ax.set_title(title or f"{profile.device_type} · {meta.get('runtime', '?')} {meta.get('runtime_version', '')} · "
                          f"{meta.get('threads', '?')} threads", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_frontier(report: dict[str, Any], path: str) -> str:
    """The co-located frontier against the straight line between dedicated peaks.

    Two models: the ramped model's rate against the fixed one's. More models: the ramped model's rate
    against the fixed models' combined load as a fraction of their dedicated peaks."""
    plt = _pyplot()
    models = report["models"]
    peaks = {m["name"]: m["dedicated_peak_rps"] for m in models}
    pts = sorted(report["frontier"], key=lambda p: p["fraction"])
    ramped = pts[0]["ramped"]
    fixed = pts[0]["fixed"]
    two = len(models) == 2
    fig, ax = plt.subplots(figsize=(6, 5))
    if two:
        (a,) = fixed
        xs = [p["rates_rps"][a] for p in pts]
        x_end, xlabel = peaks[a], f"{a} throughput (req/s)"
    else:
        xs = [sum(p["rates_rps"][n] / peaks[n] for n in fixed) for p in pts]
        x_end, xlabel = 1.0, "fixed models' load (sum of rate / dedicated peak)"
    ys = [p["rates_rps"][ramped] for p in pts]
    ax.plot([0, x_end], [peaks[ramped], 0], "--", color="gray", label="time-sliced (line between dedicated peaks)")
    ax.plot([0] + xs + [x_end], [peaks[ramped]] + ys + [0], "o-", color="tab:blue",
            label="co-located frontier (measured)")
    for p, x, y in zip(pts, xs, ys):
        ax.annotate(f"e={p['efficiency']:.2f}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"{ramped} throughput (req/s)")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    change = report.get("costs", {}).get("best_change_vs_dedicated")
    title = f"{report['device_type']} · SLO {report['slo_ms']:g} ms"
    if change is not None:
        title += f" · best cost change shared vs dedicated {change * 100:+.0f}%"
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
