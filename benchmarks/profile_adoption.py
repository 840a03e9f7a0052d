"""Does a measured profile replace a pessimistic start-up table while serving on a busy machine?
(benchmarks/profile_vs_serving.md, "Adoption under load"; issue 18, item 1.)

``nexus serve --no-samples`` with the ResNet-18-class model of benchmarks/vs_triton.py
(``resnet18_64(seed=1018)``, 100 ms SLO), uploaded with the table given (``--table``: a profile
JSON, e.g. one the backend measured at start-up on a busy machine), under a steady Poisson load
from the library's LoadClient. Every 10 s it prints the scheduler's status: the plan (duty cycle;
model, batch, l(batch), planned device rate), and the profiles (which one plans, the clean and
contended samples held, the measured l(b)). ``--burn-cores`` runs a busy loop at nice 10 using that
many cores meanwhile: other work on the cores, which the backend's contention monitor flags.

    python -m benchmarks.profile_adoption --table slow.json --rate 100 --duration 60 --burn-cores 0.8

To compare with another revision, run it with that revision's tree first on PYTHONPATH (the
``nexus serve`` it starts inherits the environment).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import subprocess
import sys
import threading
import time

import nexus
from harness.cluster import ServeCluster, Upload
from harness.scratch import scratch_dir
from nexus.bench.loadgen import LoadClient
from harness.smoke import add_smoke, parse_args
from harness.triton_compare import build_models
from nexus.scheduler_client import fetch_status

BURNER = """
import sys, time
busy = float(sys.argv[1]) * 0.1
while True:
    t = time.time()
    while time.time() - t < busy:
        pass
    time.sleep(0.1 - busy)
"""


def snapshot(srv: ServeCluster, tag: str) -> None:
    st = fetch_status(srv.scheduler, creds=srv.creds)
    plan = [(round(d.duty_cycle_ms, 1), [(s.model, s.batch, round(s.latency_ms, 1), round(s.device_rate_rps, 1))
                                         for s in d.sessions]) for d in st.devices]
    profiles = [{"in_use": p.in_use, "samples": p.samples, "contended": p.contended_samples,
                 "table": p.table, "measured": [(b, round(v, 1)) for b, v in p.measured], "held_back": p.held_back}
                for p in st.profiles]
    print(json.dumps({"t": tag, "load_avg": os.getloadavg()[0], "plan": plan, "profiles": profiles}), flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--table", help="profile JSON uploaded with the model (default: the backend profiles it)")
    ap.add_argument("--rate", type=float, default=100.0)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--burn-cores", type=float, default=0.0, help="a busy loop at nice 10 using this many cores (< 1)")
    add_smoke(ap, rate=10.0, duration=2.0, burn_cores=0.1)
    args = parse_args(ap, argv)
    if not 0 <= args.burn_cores < 1:
        ap.error("--burn-cores must be in [0, 1)")
    print("code:", nexus.__file__, flush=True)
    with scratch_dir("profile-adoption-") as scratch:
        _adopt(args, scratch.path)


def _adopt(args: argparse.Namespace, work: pathlib.Path) -> None:
    burner = subprocess.Popen(["nice", "-n", "10", sys.executable, "-c", BURNER, str(args.burn_cores)]) \
        if args.burn_cores else None
    paths = build_models(work, ["r18_64"])
    # one backend for the machine: this follows one backend's profile adoption, not a layout switch
    srv = ServeCluster(work / "data", "--no-samples", "--cpu-layout", "machine", timeout_s=240,
                       log_path=work / "serve.log", log_level="INFO")
    try:
        srv.upload(Upload(paths["r18_64"], "r18_64", slo_ms=100.0, profile_path=args.table), wait=False)
        srv.wait_models_ready(["r18_64"], 600)
        snapshot(srv, "start")
        result = {}

        async def load() -> None:
            async with LoadClient(srv.frontend, "r18_64") as client:
                result["report"] = await client.run(args.rate, args.duration, 100.0)

        thread = threading.Thread(target=lambda: asyncio.run(load()))
        thread.start()
        t0 = time.time()
        while thread.is_alive():
            thread.join(10)
            snapshot(srv, f"{time.time() - t0:.0f}s")
        r = result["report"]
        print(f"offered {r.offered_rps:.0f} rps: goodput {r.goodput_rps:.1f} rps, within SLO {r.good_fraction:.2%}, "
              f"dropped {r.dropped}, late {r.late}, p50 {r.p50_ms:.1f} ms, p99 {r.p99_ms:.1f} ms", flush=True)
    finally:
        srv.stop()
        if burner is not None:
            burner.kill()
            burner.wait()


if __name__ == "__main__":
    main()
