"""ONNX Runtime at batch 1, back to back and after an idle pause, with intra-op spinning off, on, and
on within a run only.

    python benchmarks/ort_idle.py [--idle-ms 100] [--runs 40]

A server at a low request rate hands ORT one request at a time after an idle gap, while a
benchmark of ORT alone calls it back to back. This measures the difference on the sample
resnet18_64: the p50 of ``--runs`` timed calls of each kind, for 1 and 2 intra-op threads, with
spinning off (the Nexus backend's setting), on (ORT's default), and on within a run but stopped
when the run returns (``session.force_spinning_stop``). Also the process CPU time per call
after an idle pause, which is what spinning between runs costs.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402

from common.sample_models import model_bytes, resnet18_64  # noqa: E402


def p50_ms(session: ort.InferenceSession, feeds: dict, runs: int, idle_s: float) -> float:
    times = []
    for _ in range(runs):
        if idle_s:
            time.sleep(idle_s)
        start = time.perf_counter()
        session.run(None, feeds)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--idle-ms", type=float, default=100.0)
    ap.add_argument("--runs", type=int, default=40)
    args = ap.parse_args(argv)
    data = model_bytes(resnet18_64())
    print("| intra-op spinning | threads | back-to-back p50 ms | after idle p50 ms | CPU ms per call after idle |")
    print("| --- | ---: | ---: | ---: | ---: |")
    modes = {"off": {"session.intra_op.allow_spinning": "0"},
             "on": {"session.intra_op.allow_spinning": "1"},
             "within a run": {"session.intra_op.allow_spinning": "1", "session.force_spinning_stop": "1"}}
    for mode, entries in modes.items():
        for threads in (1, 2):
            options = ort.SessionOptions()
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
            for key, value in entries.items():
                options.add_session_config_entry(key, value)
            session = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
            feeds = {session.get_inputs()[0].name: np.random.default_rng(0).random((1, 3, 64, 64), np.float32)}
            p50_ms(session, feeds, 20, 0.0)    # warm-up
            hot = p50_ms(session, feeds, args.runs, 0.0)
            cpu0 = time.process_time()
            cold = p50_ms(session, feeds, args.runs, args.idle_ms / 1000)
            cpu_ms = (time.process_time() - cpu0) / args.runs * 1000
            print(f"| {mode} | {threads} | {hot:.2f} | {cold:.2f} | {cpu_ms:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
