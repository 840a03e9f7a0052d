"""Plain-text tables for the terminal: a profile, and a multi-tenant report."""

from __future__ import annotations

from typing import Any

from common.profile import Profile


def _f(x: Any, fmt: str = ".3f", none: str = "-") -> str:
    return none if x is None else format(x, fmt)


def format_profile_table(profile: Profile, all_rows: bool = False) -> str:
    """Measured rows (or every row) with mean/std/p99, the planning latency, throughput, memory and the
    CPU other work used meanwhile (other processes plus steal, in cores; a contended size is marked)."""
    measured = set(profile.meta.get("measured_batches", [r.batch for r in profile.rows]))
    loads = profile.meta.get("host_load", {})
    lines = [f"{'batch':>5} {'mean ms':>9} {'std ms':>8} {'p99 ms':>9} {'l(b) ms':>9} {'items/s':>10} {'mem MB':>8} "
             f"{'others':>7}"]
    for r in profile.rows:
        if not all_rows and r.batch not in measured:
            continue
        thr = r.batch * 1000.0 / r.mean_ms if r.mean_ms else None
        load = loads.get(str(r.batch))
        others = load["other_cores"] + load["steal_cores"] if load else None
        mark = "" if r.batch in measured else "  (interpolated)"
        if load and load.get("contended"):
            mark += "  (contended: median-based l(b))"
        lines.append(f"{r.batch:>5} {_f(r.mean_ms):>9} {_f(r.std_ms):>8} {_f(r.p99_ms):>9} {r.latency_ms:>9.3f} "
                     f"{_f(thr, '.0f'):>10} {r.memory_mb:>8.1f} {_f(others, '.2f'):>7}{mark}")
    stop = profile.meta.get("stop")
    lines.append(f"max batch {profile.max_batch}; device type {profile.device_type!r}; "
                 f"{profile.meta.get('runtime', '?')} {profile.meta.get('runtime_version', '')}, "
                 f"{profile.meta.get('threads', '?')} thread(s)")
    if stop:
        lines.append(f"stopped: {stop['reason']}")
    return "\n".join(lines)


def load_warning(profile: Profile) -> str:
    """Why the profile's batch sizes measured on contended cores are planned at a robust figure ("" when
    none were): which sizes, and the worst load seen."""
    contended = profile.meta.get("contended_batches") or []
    if not contended:
        return ""
    loads = profile.meta.get("host_load", {})
    worst = max((loads[str(b)] for b in contended if str(b) in loads),
                key=lambda load: load["other_cores"] + load["steal_cores"], default=None)
    seen = ""
    if worst is not None:
        seen = (f" (at worst: other processes {worst['other_cores']:.2f} cores, steal {worst['steal_cores']:.2f} cores"
                + (f", load average {worst['load_avg']:.2f} on {worst['cores']} cores" if worst.get("load_avg") else "")
                + (", busiest: " + ", ".join(f"{n} {c:.2f}" for n, c in worst["busiest"]) if worst["busiest"] else "")
                + ")")
    return (f"other work shared the cores while batch sizes {', '.join(map(str, contended))} were measured{seen}: "
            f"they are planned at the median-based figure, not the p99; measure on an idle machine for a clean profile")


def format_multitenant_table(report: dict[str, Any]) -> str:
    price = report["price_per_hour"]
    out = [f"device {report['device']} ({report['device_type']}), SLO {report['slo_ms']:g} ms at "
           f"p{report['percentile']:g}, "
           f"<= {report['max_bad_rate'] * 100:g}% dropped/late, {report['duration_s']:g} s per step, "
           f"price {price:g}/hour", "",
           f"{'model':<16} {'max b':>5} {'predicted/s':>12} {'dedicated peak/s':>19} {'(drift)':>8} "
           f"{'cost/1M':>10} {'slowdown':>9}"]
    for m in report["models"]:
        drift = m.get("peak_drift")
        peak = ("rate cap " if m.get("peak_at_rate_cap") else "") + f"{m['dedicated_peak_rps']:.1f}"
        out.append(f"{m['name']:<16} {m['max_batch']:>5} {m['predicted_peak_rps']:>12.1f} "
                   f"{peak:>19} {_f(None if drift is None else drift * 100, '+.0f'):>7}% "
                   f"{_f(m['cost_per_million_dedicated'], '.4f'):>10} {m['slowdown']:>9.3f}")
    names = [m["name"] for m in report["models"]]
    out += ["", "co-located frontier (fixed load on " + ", ".join(report["frontier"][0]["fixed"]) + ", ramped "
            + report["frontier"][0]["ramped"] + "):",
            " ".join(f"{n[:14] + '/s':>16}" for n in names) + f" {'line/s':>10} {'efficiency':>10} "
            f"{'shared/1M':>10} {'dedic./1M':>10} {'change':>8}"]
    for p in report["frontier"]:
        change = p["cost_change_vs_dedicated"]
        out.append(" ".join(f"{p['rates_rps'][n]:>16.1f}" for n in names) + f" {p['line_rps']:>10.1f} "
                   f"{p['efficiency']:>10.3f} {_f(p['cost_per_million_shared'], '.4f'):>10} "
                   f"{_f(p['cost_per_million_dedicated'], '.4f'):>10} "
                   f"{_f(None if change is None else change * 100, '+.1f'):>7}%")
    c = report["costs"]
    if c.get("best_change_vs_dedicated") is not None:
        balanced = c["balanced_change_vs_dedicated"]
        out += ["", f"shared vs dedicated: best {c['best_change_vs_dedicated'] * 100:+.1f}% cost "
                    f"(efficiency {c['best_efficiency']:.3f} at f={c['best_fraction']:g}), balanced point "
                    f"{_f(None if balanced is None else balanced * 100, '+.1f')}%"]
    for w in report.get("meta", {}).get("warnings", []):
        out.append(f"warning: {w}")
    return "\n".join(out)
