"""``nexus status [--json] [--plot FILE.png]``: what the scheduler is doing now.

The scaling policy's decision per device type (devices desired, registered and used by the plan,
why, and which backend drains next), every device with its duty cycle and occupancy (the share of
the duty cycle it executes, a prefix its sessions share counted once), the sessions on it with
batch (and the model's batch cap), planned and measured rate and SLO, the queries with their
latency split, the plan's device count against the lower bound, and per model and device type its
profiles: the table, the measured profile and the prediction (l(b) at a few batches), which one the
plan uses, the serving samples held and a prediction's error once a measurement replaced it. The data comes from the
scheduler's read-only ``GetStatus`` RPC (:func:`nexus.scheduler_client.fetch_status`) as a
:class:`nexus.status_model.ClusterStatus`; this module prints it.
"""

from __future__ import annotations

import json
import sys

from nexus.client_flags import ClientFlagError, add_client_security, client_credentials
from nexus.scheduler_client import DEFAULT_SCHEDULER, AdminCallError, fetch_status
from nexus.status_model import ClusterStatus
from nexus.status_plot import write_status_plot


def _table(rows: list[list[str]], indent: str = "") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
            for r in rows]


def render_text(st: ClusterStatus) -> str:
    lines = [f"epoch {st.epoch} · solver {st.solver or '-'} · plan {st.plan_age_s:.1f} s old · "
             f"{st.frontends} frontend(s)" + (f" · leader {st.leader}" if st.leader else ""),
             f"devices: {st.devices_in_use} in use of {len(st.devices)} registered · plan needs "
             f"{st.planned_devices} · lower bound {st.lower_bound} "
             f"(throughput alone: {st.lower_bound_throughput_only})"]
    for sc in st.scaling:
        more = len(sc.drain_node_ids) - 1
        drain = f" · drain {sc.drain_node_id}" + (f" and {more} more" if more else "") if sc.drain_node_id else ""
        lines.append(f"scaling {sc.device_type}: {sc.desired} desired · {sc.registered} registered · plan uses "
                     f"{sc.plan_devices}{drain}: {sc.reason}")
    lines.append("")
    for d in st.devices:
        memory = f"{d.memory_used_mb:,.0f} of {d.memory_mb:,.0f} MB" if d.memory_mb else f"{d.memory_used_mb:,.0f} MB"
        if not d.sessions:
            lines.append(f"{d.node_id}  {d.device}  idle  ({memory})")
            lines.append("")
            continue
        lines.append(f"{d.node_id}  {d.device}  duty cycle {d.duty_cycle_ms:.1f} ms  occupancy {d.occupancy:.0%}  "
                     f"memory {memory}")
        rows = [["session", "batch", "cap", "l(b) ms", "share", "here rps", "planned rps", "measured rps", "SLO ms"]]
        for s in d.sessions:
            rows.append([s.session, str(s.batch), str(s.batch_cap or "-"), f"{s.latency_ms:.2f}", f"{s.share:.0%}",
                         f"{s.device_rate_rps:.1f}", f"{s.planned_rate_rps:.1f}", f"{s.measured_rate_rps:.1f}",
                         f"{s.slo_ms:.0f}"])
        lines += _table(rows, "  ")
        lines.append("")
    if st.queries:
        rows = [["query", "SLO ms", "split", "stage budgets ms", "fan-out", "planned qps", "devices"]]
        for q in st.queries:
            rows.append([q.name, f"{q.slo_ms:g}", q.split or "-",
                         ", ".join(f"{k} {v:.0f}" for k, v in q.budgets_ms.items()) or "-",
                         ", ".join(f"{k} {v:.2f}" for k, v in q.gamma.items()) or "-",
                         f"{q.planned_rate_rps:.1f}", str(q.devices)])
        lines += _table(rows)
        lines += [f"  {q.name}: {q.reason}" for q in st.queries if q.reason]
        lines.append("")
    lines += _profile_lines(st)
    for name, why in st.unplaced.items():
        lines.append(f"not placed: {name}: {why}")
    for name, why in st.best_effort.items():
        lines.append(f"best effort: {name}: {why}")
    for note in st.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines).rstrip() + "\n"


def _curve(points: tuple[tuple[int, float], ...], used: bool) -> str:
    if not points:
        return "-"
    return " ".join(f"{b}:{ms:.3g}" for b, ms in points) + (" *" if used else "")


def _profile_lines(st: ClusterStatus) -> list[str]:
    """The profiles section: one row per (model, device type), '*' on the profile the plan uses."""
    if not st.profiles:
        return []
    lines = ["profiles: l(b) in ms as batch:ms; * the one the plan uses"]
    rows = [["model", "device type", "plans with", "table", "measured", "predicted", "samples", "contended", "drift"]]
    for p in st.profiles:
        rows.append([p.model, p.device_type, p.in_use + (" (pinned)" if p.pinned else ""),
                     _curve(p.table, p.in_use == "table"), _curve(p.measured, p.in_use == "measured"),
                     _curve(p.predicted, p.in_use == "predicted"), str(p.samples), str(p.contended_samples),
                     f"{p.drift:.0%}"])
    lines += _table(rows, "  ")
    for p in st.profiles:
        if p.held_back:
            lines.append(f"  {p.model} on {p.device_type}: {p.held_back}")
        if p.prediction_error:
            e = p.prediction_error
            lines.append(f"  {p.model} on {p.device_type}: the prediction (from {p.predicted_from or '?'}) was "
                         f"replaced by {e['replaced_by']}: off by {e['mean']:.0%} on average, {e['max']:.0%} at "
                         f"batch {e['batch']} ({'pessimistic' if e['bias'] > 0 else 'optimistic'})")
    lines.append("")
    return lines


def _run(args) -> int:
    try:
        st = fetch_status(args.scheduler, creds=client_credentials(args))
    except (AdminCallError, ClientFlagError) as exc:
        print(f"nexus status: error: {exc}", file=sys.stderr)
        return 2
    if args.plot:
        try:
            write_status_plot(st, args.plot)
        except (OSError, ValueError) as exc:
            print(f"nexus status: error: cannot write {args.plot}: {exc}", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps(st.to_json_obj(), indent=2))
    else:
        sys.stdout.write(render_text(st))
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("status", help="show the scheduler's plan: scaling, devices, sessions, queries, lower bound",
                       description="Show what the scheduler is doing now: the devices each device type should have "
                                   "and why, every device with its duty cycle and occupancy, the sessions on it, the "
                                   "queries' latency split and the lower bound.")
    p.add_argument("--scheduler", default=DEFAULT_SCHEDULER, help=f"scheduler address (default {DEFAULT_SCHEDULER})")
    p.add_argument("--json", action="store_true", help="print the status as JSON")
    add_client_security(p)
    p.add_argument("--plot", metavar="FILE.png", default="",
                   help="also draw the devices as bars filled by their sessions' shares of the duty cycle")
    p.set_defaults(func=_run)
