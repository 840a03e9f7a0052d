"""Rolling restart of every backend and every frontend under steady load: requests sent, answered,
failed by status.

The scenario is :func:`harness.rolling_restart.rolling_restart` (see its module): a scheduler,
``--frontends`` frontends and ``--backends`` emulated backends serve one model while Poisson arrivals
at ``--rate`` go through the frontends; every backend, then every frontend, is restarted in turn
(SIGTERM, drain, start again, ready), ``--rounds`` times over. Every request's outcome is counted:
answered, failed with a gRPC status (by status), or without a response.

    python -m benchmarks.rolling_restart [--rate 100] [--backends 2] [--frontends 2] [--rounds 2] [--json OUT]

Target (issue 10): zero requests without a response, failures at most 0.1% of requests.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from harness.rolling_restart import rolling_restart
from harness.scratch import scratch_dir
from harness.smoke import add_smoke, parse_args


def _run(workdir: pathlib.Path, args) -> dict:
    result = rolling_restart(workdir, rate_rps=args.rate, backends=args.backends, frontends=args.frontends,
                             rounds=args.rounds)
    result["failure_rate"] = result["failed_total"] / max(result["sent"], 1)
    return result


def _met(result: dict) -> bool:
    """The target: no request without a response, failures at most 0.1% of requests."""
    return result["no_response"] == 0 and result["failure_rate"] <= 0.001


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=100.0, help="requests per second (Poisson)")
    parser.add_argument("--backends", type=int, default=2)
    parser.add_argument("--frontends", type=int, default=2, help="restarted too when more than one")
    parser.add_argument("--rounds", type=int, default=2, help="times every backend is restarted")
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--workdir", help="keep the model database and the components' logs here")
    add_smoke(parser, rate=20.0, rounds=1, json="rolling_restart.json")
    args = parse_args(parser, argv)
    if args.workdir:
        workdir = pathlib.Path(args.workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        result = _run(workdir, args)
    else:
        with scratch_dir("nexus-rolling-") as scratch:
            result = _run(scratch.path, args)
            scratch.keep = not (args.smoke or _met(result))      # the components' logs, for a miss
    print(json.dumps(result, indent=2))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if args.smoke or _met(result) else 1


if __name__ == "__main__":
    sys.exit(main())
