"""``nexus queries register FILE`` and ``nexus queries list``: multi-model query applications."""

from __future__ import annotations

import json
import pathlib
import sys

from nexus.client_flags import ClientFlagError, add_client_security, client_credentials
from nexus.scheduler_client import DEFAULT_SCHEDULER, AdminCallError, list_queries, register_query


def _run_register(args) -> int:
    try:
        text = pathlib.Path(args.file).read_text()
    except OSError as exc:
        print(f"nexus queries register: error: cannot read {args.file}: {exc.strerror}", file=sys.stderr)
        return 2
    try:
        name = register_query(args.scheduler, text, client_credentials(args))
    except (AdminCallError, ClientFlagError) as exc:
        print(f"nexus queries register: error: {exc}", file=sys.stderr)
        return 2
    print(f"registered query {name}")
    return 0


def _run_list(args) -> int:
    try:
        queries = list_queries(args.scheduler, client_credentials(args))
    except (AdminCallError, ClientFlagError) as exc:
        print(f"nexus queries list: error: {exc}", file=sys.stderr)
        return 2
    out = [{"name": q.name, "split": q.split_method, "budgets_ms": dict(q.budgets_ms), "gamma": dict(q.gamma),
            "planned_rate_rps": q.planned_rate_rps, "devices": q.devices,
            "latest_finish_ms": dict(q.latest_finish_ms), "reason": q.reason, "definition": json.loads(q.json)}
           for q in queries]
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    for q in out:
        budgets = ", ".join(f"{k}={v:.0f}ms" for k, v in q["budgets_ms"].items()) or "-"
        gammas = ", ".join(f"{k}={v:.2f}" for k, v in q["gamma"].items()) or "-"
        print(f"{q['name']}: split {q['split'] or '-'} [{budgets}] gamma [{gammas}] "
              f"planned {q['planned_rate_rps']:.1f} qps on {q['devices']} devices {q['reason']}".rstrip())
    return 0


def register(sub) -> None:
    p = sub.add_parser("queries", help="register and list multi-model queries")
    qsub = p.add_subparsers(dest="queries_command", metavar="ACTION", required=True)
    reg = qsub.add_parser("register", help="register a query definition file (JSON)")
    reg.add_argument("file")
    reg.add_argument("--scheduler", default=DEFAULT_SCHEDULER)
    add_client_security(reg)
    reg.set_defaults(func=_run_register)
    ls = qsub.add_parser("list", help="list queries with their latency split and measured fan-out")
    ls.add_argument("--scheduler", default=DEFAULT_SCHEDULER)
    add_client_security(ls)
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=_run_list)
