"""Control-plane outage: a standby taking over (kill -9, SIGSTOP) against restarting a lone scheduler.

Each case measures, from the fault to the first ``ListModels`` answered OK, how long no scheduler
accepts a control call (upload, load, re-plan). Cases:

- ``standby-kill``: two schedulers on one PostgreSQL database; the leader is killed (kill -9);
- ``standby-pause``: the leader is paused (SIGSTOP) and stays paused: the standby waits out the lease;
- ``restart-sqlite``: one scheduler on SQLite, killed and started again at once by hand (the best a
  supervisor can do; Kubernetes would add its restart back-off and, after a node loss, the volume's
  re-attachment);
- ``restart-postgresql``: the same on PostgreSQL.

Run from the repository root: ``python -m benchmarks.takeover [--repeats 5] [--lease-s 1.5]``. It needs
PostgreSQL's ``initdb`` (Debian's postgresql package); it starts its own server in a temporary directory.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import grpc

from common.pb import control, control_grpc
from harness.meters import loadavg
from nexus.launcher import nexus_command
from harness.postgres import PostgresServer, postgres_bin
from harness.smoke import add_smoke, parse_args


def _answers(address: str) -> bool:
    try:
        with grpc.insecure_channel(address) as channel:
            control_grpc.SchedulerStub(channel).ListModels(control.ListModelsRequest(), timeout=1)
        return True
    except grpc.RpcError:
        return False


def _start(work: pathlib.Path, name: str, listen: str, database: str, lease_s: float) -> tuple[subprocess.Popen, str]:
    argv = [*nexus_command(), "scheduler", "--listen", listen, "--data-dir", str(work / name), "--metrics-listen", "",
            "--leader-lease-s", str(lease_s), *(["--database", database] if database else [])]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=open(work / f"{name}.log", "a"), text=True,
                            env=dict(os.environ, NEXUS_LOG="INFO"))
    line = proc.stdout.readline().split()
    if len(line) < 3:
        raise RuntimeError(f"scheduler {name} did not start; see {work / name}.log")
    return proc, line[2]


def _until_answers(address: str, since: float, timeout_s: float = 60.0) -> float:
    while not _answers(address):
        if time.monotonic() - since > timeout_s:
            raise RuntimeError(f"{address} did not answer within {timeout_s} s")
        time.sleep(0.01)
    return time.monotonic() - since


def standby(work: pathlib.Path, url: str, lease_s: float, sig: signal.Signals) -> float:
    a, addr_a = _start(work, "a", "127.0.0.1:0", url, lease_s)
    b, addr_b = _start(work, "b", "127.0.0.1:0", url, lease_s)
    try:
        leader, standby_address = (a, addr_b) if _answers(addr_a) else (b, addr_a)
        t0 = time.monotonic()
        leader.send_signal(sig)
        return _until_answers(standby_address, t0)
    finally:
        for p in (a, b):
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait()


def restart(work: pathlib.Path, url: str, lease_s: float) -> float:
    p, address = _start(work, "lone", "127.0.0.1:0", url, lease_s)
    _until_answers(address, time.monotonic())
    t0 = time.monotonic()
    p.kill()
    p.wait()
    p, address = _start(work, "lone", address, url, lease_s)      # the same port, as a supervisor would
    try:
        return _until_answers(address, t0)
    finally:
        p.kill()
        p.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="--smoke without PostgreSQL's initdb runs restart-sqlite only.")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--lease-s", type=float, default=1.5)
    add_smoke(ap, repeats=1, lease_s=0.5)
    args = parse_args(ap, argv)
    server = PostgresServer() if postgres_bin() or not args.smoke else None
    if server is None:
        print("no PostgreSQL (initdb): restart-sqlite only")
    else:
        os.environ["PGPASSFILE"] = str(server.passfile)
    results: dict[str, list[float]] = {}
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
        print(f"CPU {cpu}; load average {loadavg():.2f} at the start; lease {args.lease_s} s")
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as tmp:
                work = pathlib.Path(tmp)
                if server is not None:
                    results.setdefault("standby-kill", []).append(standby(work, server.database(), args.lease_s,
                                                                          signal.SIGKILL))
                    results.setdefault("standby-pause", []).append(standby(work, server.database(), args.lease_s,
                                                                           signal.SIGSTOP))
                results.setdefault("restart-sqlite", []).append(restart(work, "", args.lease_s))
                if server is not None:
                    results.setdefault("restart-postgresql", []).append(restart(work, server.database(),
                                                                                args.lease_s))
        print(f"load average {loadavg():.2f} at the end")
        print("| case | median s | min s | max s |")
        print("| --- | --- | --- | --- |")
        for case, xs in results.items():
            print(f"| {case} | {statistics.median(xs):.2f} | {min(xs):.2f} | {max(xs):.2f} |")
    finally:
        if server is not None:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
