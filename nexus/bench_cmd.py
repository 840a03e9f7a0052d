"""``nexus bench``: open-loop Poisson load with an SLO against a frontend, and its report."""

from __future__ import annotations

import argparse
import os
import sys

from nexus.bench.loadgen import DEFAULT_ADDRESS, BenchError, run_bench
from nexus.bench.plot import write_plot
from nexus.bench.report import lag_warning
from nexus.client_flags import ClientFlagError, add_client_security, client_credentials

PROG = "nexus bench"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench",
        help="open-loop load against a frontend: throughput, goodput, bad rate, latency",
        description=(
            "Send open-loop Poisson load (arrivals at absolute times, never waiting for responses) "
            "to a KServe v2 gRPC frontend and report throughput, goodput (responses within the SLO), "
            "bad rate (late + dropped + failed) and latency percentiles. DEADLINE_EXCEEDED, "
            "RESOURCE_EXHAUSTED and UNAVAILABLE count as dropped, other errors as failed."
        ),
    )
    p.add_argument("--frontend", default=DEFAULT_ADDRESS, metavar="HOST:PORT", help="frontend address (default %(default)s)")
    p.add_argument("--model", required=True, help="model to load")
    p.add_argument("--model-version", default="", help="model version (default: the frontend's choice)")
    p.add_argument("--rate", type=float, default=100.0, help="offered load, requests per second (default %(default)s)")
    p.add_argument("--duration-s", type=float, default=10.0, help="measured window in seconds (default %(default)s)")
    p.add_argument("--warmup-s", type=float, default=0.0, help="load before the window, not counted (default %(default)s)")
    p.add_argument("--slo-ms", type=float, default=100.0, help="per-request latency SLO (default %(default)s)")
    p.add_argument(
        "--grace-ms",
        type=float,
        default=None,
        help="client deadline past the SLO, so late answers are seen as late (default: max(20, SLO/2))",
    )
    p.add_argument("--batch", type=int, default=1, help="rows per request (the model's batch dimension; default 1)")
    p.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="INPUT=D1,D2,...",
        help="shape of an input without its batch dimension, for inputs with variable dimensions",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of arrivals and input data (default %(default)s)")
    p.add_argument("--channels", type=int, default=1, help="gRPC channels (connections) to spread requests over")
    p.add_argument(
        "--concurrency-limit",
        type=int,
        default=None,
        metavar="N",
        help="most requests in flight; arrivals beyond it are not sent and count as dropped (by the client)",
    )
    p.add_argument("--connect-timeout-s", type=float, default=5.0, help="time to reach the frontend (default %(default)s)")
    p.add_argument(
        "--no-timeout-param",
        action="store_true",
        help="do not send the SLO as the request parameter 'timeout' (microseconds)",
    )
    add_client_security(p, token=False)
    p.add_argument("--json", action="store_true", help="print the report as JSON only")
    p.add_argument("-o", "--output", metavar="REPORT.json", help="also write the JSON report to this file")
    p.add_argument("--plot", metavar="OUT.png", help="write latency-over-time and latency-CDF plots")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _parse_shapes(specs: list[str]) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for spec in specs:
        name, sep, dims = spec.partition("=")
        try:
            if not sep or not name:
                raise ValueError
            shape = tuple(int(d) for d in dims.split(",") if d.strip() != "")
            if any(d < 0 for d in shape):
                raise ValueError
        except ValueError:
            raise BenchError(f"bad --shape {spec!r}: expected INPUT=D1,D2,... with non-negative dimensions") from None
        shapes[name] = shape
    return shapes


def _check_writable(path: str | None, flag: str) -> None:
    if path:
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise BenchError(f"{flag} {path}: directory {parent} does not exist")


def run(args: argparse.Namespace) -> int:
    try:
        _check_writable(args.output, "-o")
        _check_writable(args.plot, "--plot")
        try:
            ca = client_credentials(args).ca
        except ClientFlagError as e:
            raise BenchError(str(e)) from None
        report = run_bench(
            args.frontend,
            args.model,
            args.rate,
            args.duration_s,
            args.slo_ms,
            batch=args.batch,
            warmup_s=args.warmup_s,
            seed=args.seed,
            channels=args.channels,
            concurrency_limit=args.concurrency_limit,
            grace_ms=args.grace_ms,
            model_version=args.model_version,
            input_shapes=_parse_shapes(args.shape),
            connect_timeout_s=args.connect_timeout_s,
            progress=not args.quiet,
            timeout_param=not args.no_timeout_param,
            root_certificates=ca,
        )
    except BenchError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130

    try:
        if args.output:
            with open(args.output, "w") as f:
                f.write(report.to_json() + "\n")
        if args.plot:
            write_plot(report, args.plot)
    except OSError as e:
        print(f"{PROG}: error: cannot write {e.filename}: {e.strerror}", file=sys.stderr)
        return 2

    if args.json:
        print(report.to_json())
        warn = lag_warning(report)
        if warn:
            print(f"{PROG}: {warn}", file=sys.stderr)
    else:
        print(report.format_table())
    if report.sent and report.ok == 0:
        print(f"{PROG}: error: no request succeeded; first error: {report.first_error}", file=sys.stderr)
        return 1
    return 0
