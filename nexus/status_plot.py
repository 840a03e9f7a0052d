"""``nexus status --plot FILE.png``: the plan as a picture (matplotlib's Agg canvas, no display).

One horizontal bar per device, its length the duty cycle (100%), filled left to right by the batches
of its sessions: each segment is l(batch) / duty cycle, coloured by model (a query's stages take their
model's colour), labelled with the session and its batch where it fits. What is left of the cycle is
idle, hatched. Beside each bar: occupancy, planned and measured rate. The title says how many devices
the plan uses against the lower bound. The legend names the models that can be seen (a model whose
every batch takes a sliver too thin to see is left out) and explains every symbol drawn: ``×N``, ``γ``,
the SLO mark, query stages and idle time.
"""

from __future__ import annotations

import os

from nexus.status_model import ClusterStatus

_IDLE = "#eef0f2"
MIN_VISIBLE_PCT = 0.3      # a segment narrower than this share of the duty cycle cannot be seen
_PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
            "#9c755f", "#bab0ac", "#1f77b4", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#17becf")


def _bar_axis_style(ax) -> None:
    """The look both bar charts share: no frame but the bottom, light vertical grid behind the bars."""
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.tick_params(axis="y", length=0)
    ax.grid(axis="x", color="#dddddd", linewidth=0.6, zorder=0)
    ax.set_axisbelow(True)


def _text_colour(hex_colour: str) -> str:
    r, g, b = (int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5))
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.6 else "white"


def model_colours(st: ClusterStatus) -> dict[str, str]:
    models = sorted({s.model for d in st.devices for s in d.sessions})
    return {m: _PALETTE[i % len(_PALETTE)] for i, m in enumerate(models)}


def write_status_plot(st: ClusterStatus, path: str | os.PathLike) -> None:
    """Write the plan picture to ``path`` (PNG, or any format matplotlib infers from the suffix)."""
    status_figure(st).savefig(path, dpi=110)


def status_figure(st: ClusterStatus):
    """The plan picture as a matplotlib Figure (Agg canvas)."""
    # lazy: matplotlib costs ~0.3 s at start-up and only --plot needs it
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure  # lazy: matplotlib, as above

    devices = list(st.devices)
    n = max(len(devices), 1)
    paths = [(q, path) for q in st.queries for path in q.paths if q.budgets_ms]
    device_h, query_h = 0.95 * n + 0.9, (0.42 * len(paths) + 0.9 if paths else 0.0)
    fig = Figure(figsize=(13, 1.0 + device_h + query_h), layout="constrained")
    FigureCanvasAgg(fig)
    if paths:
        ax, qax = fig.subplots(2, 1, height_ratios=[device_h, query_h])
    else:
        ax, qax = fig.subplots(), None
    colours = model_colours(st)
    for q in st.queries:
        for model in q.stage_models.values():
            colours.setdefault(model, _PALETTE[len(colours) % len(_PALETTE)])
    height = 0.78
    capacity: dict[str, float] = {}
    for d in devices:
        for s in d.sessions:
            capacity[s.session] = capacity.get(s.session, 0.0) + s.device_rate_rps
    for row, d in enumerate(devices):
        y = n - 1 - row
        ax.barh(y, 100, height=height, color=_IDLE, edgecolor="#c8ccd0", hatch="//", linewidth=0.6, zorder=1)
        left = 0.0
        # Sessions of one model side by side, the longest batch first, so each model reads as one block.
        for s in sorted(d.sessions, key=lambda x: (x.model, -x.latency_ms, x.session)):
            width = 100 * s.share
            colour = colours[s.model]
            stage = "/" in s.session
            ax.barh(y, width, left=left, height=height, color=colour, edgecolor="white", linewidth=1.2,
                    hatch="...." if stage else None, zorder=2)
            label = f"{s.session} ×{s.batch}"
            ink = _text_colour(colour)
            if width >= 0.68 * len(label):
                ax.text(left + width / 2, y, label, ha="center", va="center", fontsize=8.5, color=ink, zorder=3,
                        bbox=dict(boxstyle="round,pad=0.15", fc=colour, ec="none") if stage else None)
            elif width >= 1.2:
                short = s.session.rpartition("/")[2]
                ax.text(left + width / 2, y, f"{short} ×{s.batch}" if len(short) <= 12 else short, rotation=90,
                        ha="center", va="center", fontsize=6.5, color=ink, zorder=3,
                        bbox=dict(boxstyle="square,pad=0.05", fc=colour, ec="none"))
            left += width
        if d.sessions:
            memory = (f"{d.memory_used_mb / 1000:.1f} of {d.memory_mb / 1000:.0f} GB" if d.memory_mb
                      else f"{d.memory_used_mb / 1000:.1f} GB")
            # A session's rates, split over its devices in proportion to their planned throughput.
            share = {s.session: s.device_rate_rps / capacity[s.session] if capacity[s.session] > 0 else 0.0
                     for s in d.sessions}
            planned = sum(s.planned_rate_rps * share[s.session] for s in d.sessions)
            measured = sum(s.measured_rate_rps * share[s.session] for s in d.sessions)
            note = (f"{d.occupancy:.0%} busy · {memory}\n{len(d.sessions)} session{'s' if len(d.sessions) != 1 else ''}"
                    f"\n{measured:,.0f} rps measured, {planned:,.0f} planned")
        else:
            note = "idle"
        ax.text(101.5, y, note, ha="left", va="center", fontsize=9, color="#333333", linespacing=1.35)
    ax.set_yticks(range(n))
    ax.set_yticklabels([
        f"{d.node_id}\n{d.device_type} · {d.duty_cycle_ms:.1f} ms cycle" if d.sessions else f"{d.node_id}\n{d.device_type}"
        for d in reversed(devices)] if devices else ["(no devices)"], fontsize=9)
    ax.set_xlim(0, 100)
    ax.set_ylim(-0.6, n - 0.4)
    ax.set_xlabel("share of the device's duty cycle (%): each segment is one session's batch, l(batch) / duty cycle")
    _bar_axis_style(ax)
    bound = f"lower bound {st.lower_bound}"
    verdict = "optimal" if st.planned_devices and st.planned_devices <= st.lower_bound else \
        f"{st.planned_devices - st.lower_bound} above the bound" if st.planned_devices else ""
    fig.suptitle(f"{st.devices_in_use} of {len(devices)} devices in use · plan needs {st.planned_devices}, "
                 f"{bound}" + (f" ({verdict})" if verdict else ""), fontsize=13, fontweight="bold")
    ax.set_title(f"epoch {st.epoch} · solver {st.solver or '-'} · plan {st.plan_age_s:.0f} s old", fontsize=9.5,
                 color="#555555", loc="left")
    if qax is not None:
        _draw_queries(qax, paths, colours)
    _legend(fig, st, paths, colours)
    return fig


def _legend(fig, st: ClusterStatus, paths, colours: dict[str, str]) -> None:
    """The models that can be seen, then every symbol the picture uses, each explained."""
    from matplotlib.lines import Line2D  # lazy: matplotlib, as in status_figure
    from matplotlib.patches import Patch  # lazy: matplotlib, as above

    visible = {s.model for d in st.devices for s in d.sessions if 100 * s.share >= MIN_VISIBLE_PCT}
    visible |= {q.stage_models.get(stage, "") for q, path in paths for stage in path if q.budgets_ms.get(stage, 0.0) > 0}
    handles = [Patch(facecolor=c, label=m) for m, c in colours.items() if m in visible]
    fig.legend(handles=handles, loc="outside right upper", frameon=False, title="model", fontsize=9)

    def words(label: str) -> Patch:
        return Patch(facecolor="none", edgecolor="none", label=label)

    symbols = []
    if any(d.sessions for d in st.devices):
        symbols.append(words("name ×N: a session's batch,\nN requests per duty cycle"))
    if any("/" in s.session for d in st.devices for s in d.sessions) or paths:
        symbols.append(Patch(facecolor="#888888", edgecolor="white", hatch="....", label="query stage"))
    symbols.append(Patch(facecolor=_IDLE, edgecolor="#c8ccd0", hatch="//", label="idle share of the cycle"))
    if paths:
        symbols.append(Line2D([], [], color="#c0392b", linewidth=2, label="the query's SLO"))
        if any(q.gamma for q, _ in paths):
            symbols.append(words("γ stage g: fan-out, requests to\nthe stage per request to its parent"))
    fig.legend(handles=symbols, loc="outside right lower", frameon=False, title="symbols", fontsize=9)


def _draw_queries(ax, paths, colours: dict[str, str]) -> None:
    """One bar per root-to-leaf path of each query: its stages' latency budgets end to end, in ms."""
    n = len(paths)
    top = max(max(q.slo_ms, sum(q.budgets_ms.get(st, 0.0) for st in path)) for q, path in paths)
    for row, (q, path) in enumerate(paths):
        y = n - 1 - row
        left = 0.0
        for stage in path:
            width = q.budgets_ms.get(stage, 0.0)
            colour = colours.get(q.stage_models.get(stage, ""), "#999999")
            ax.barh(y, width, left=left, height=0.62, color=colour, edgecolor="white", linewidth=1.2,
                    hatch="....", zorder=2)
            label = f"{stage} {width:.0f} ms"
            if width >= 0.0105 * top * len(label):
                ax.text(left + width / 2, y, label, ha="center", va="center", fontsize=8.5, zorder=3,
                        color=_text_colour(colour), bbox=dict(boxstyle="round,pad=0.15", fc=colour, ec="none"))
            left += width
        if q.slo_ms:
            ax.plot([q.slo_ms, q.slo_ms], [y - 0.42, y + 0.42], color="#c0392b", linewidth=2, zorder=4)
        gammas = ", ".join(f"γ {k.split('->')[1]} {v:.1f}" for k, v in q.gamma.items() if k.split("->")[1] in path)
        ax.text(top * 1.04, y, f"SLO {q.slo_ms:.0f} ms · {q.planned_rate_rps:,.1f} qps planned"
                + (f"\n{gammas}" if gammas else ""), ha="left", va="center", fontsize=9, color="#333333")
    ax.set_yticks(range(n))
    ax.set_yticklabels([f"{q.name}\n{' → '.join(path)}" for q, path in reversed(paths)], fontsize=9)
    ax.set_xlim(0, top * 1.025)
    ax.set_ylim(-0.6, n - 0.4)
    ax.set_xlabel("latency budget per stage along each path of a query (ms); red: the query's SLO")
    _bar_axis_style(ax)
