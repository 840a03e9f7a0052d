"""ONNX Runtime at batch 1, back to back and after an idle pause, with intra-op spinning off, on, and
on within a run only.

    python -m benchmarks.ort_idle [--idle-ms 100] [--runs 40]

A server at a low request rate hands ORT one request at a time after an idle gap, while a
benchmark of ORT alone calls it back to back. This measures the difference on the sample
resnet18_64: the p50 of ``--runs`` timed calls of each kind, for 1 and 2 intra-op threads, with
spinning off (the Nexus backend's setting), on (ORT's default), and on within a run but stopped
when the run returns (``session.force_spinning_stop``). Also the process CPU time per call
after an idle pause, which is what spinning between runs costs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from common.sample_models import model_bytes, resnet18_64
from harness.ort_direct import ort_session, time_batch
from harness.smoke import add_smoke, parse_args

# intra-op spinning: off (the Nexus backend), on (ORT's default), on within a run only
MODES = {"off": (False, {}), "on": (True, {}), "within a run": (True, {"session.force_spinning_stop": "1"})}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--idle-ms", type=float, default=100.0)
    ap.add_argument("--runs", type=int, default=40)
    add_smoke(ap, idle_ms=5.0, runs=3)
    args = parse_args(ap, argv)
    data = model_bytes(resnet18_64())
    x = np.random.default_rng(0).random((1, 3, 64, 64), np.float32)
    print("| intra-op spinning | threads | back-to-back p50 ms | after idle p50 ms | CPU ms per call after idle |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for mode, (spin, config) in MODES.items():
        for threads in (1, 2):
            session = ort_session(data, threads, spin=spin, config=config)
            hot = statistics.median(time_batch(session, x, args.runs, warmup=20))
            cpu0 = time.process_time()
            cold = statistics.median(time_batch(session, x, args.runs, warmup=0, idle_s=args.idle_ms / 1000))
            cpu_ms = (time.process_time() - cpu0) / args.runs * 1000
            print(f"| {mode} | {threads} | {hot:.2f} | {cold:.2f} | {cpu_ms:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
