"""What the serving path's CPU costs each CPU layout (nexus/cpu_layout.py, "The serving path's share").

    python -m benchmarks.layout_path_share [--path-cores 0,0.2,0.4] [--seconds 8] [--repeats 2]

ONNX Runtime runs ResNet-18 at 3x64x64 (``resnet18_64``) back to back, in the two layouts of
``nexus serve --cpu-layout``: one session of every core's intra-op threads at ``--batch`` (machine),
and one single-thread session per core at ``--batch`` / cores, each in a process of its own
(per-core). Beside them, a process stands for the serving path: it spins in bursts of ``--burst-ms``
at random gaps so as to take each of ``--path-cores`` of a core. Each layout's items per second are
measured for ``--seconds``, the layouts alternating, ``--repeats`` times at every path.

The rule the layout policy plans with: ``P`` cores of path leave a layout ``devices - P`` devices,
so the machine keeps ``1 - P`` of its throughput and one device per core ``1 - P / cores``. Printed
beside what was measured (the throughput with the path over that without, medians over repeats).
Output: a table on stdout and ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pathlib
import statistics
import time

import numpy as np

from harness.smoke import add_smoke, parse_args

OUT = pathlib.Path(__file__).resolve().parent / "out" / "layout_path_share.json"


def _path(cores: float, burst_ms: float, stop) -> None:
    """Spin ``burst_ms`` at a time, at exponential gaps whose mean leaves the spin ``cores`` of a core."""
    rng = np.random.default_rng(0)
    gap_s = burst_ms / 1000.0 * (1.0 / cores - 1.0)
    while not stop.is_set():
        end = time.perf_counter() + burst_ms / 1000.0
        while time.perf_counter() < end:
            pass
        time.sleep(gap_s * rng.exponential())


def _session(threads: int, batch: int, seconds: float, out) -> None:
    from common.runtimes.loader import load_runtime
    from common.sample_models import resnet18_64

    runtime = load_runtime("onnxruntime", resnet18_64().SerializeToString(), "cpu", intra_op_threads=threads)
    feeds = {runtime.inputs[0].name: np.random.default_rng(0).standard_normal((batch, 3, 64, 64)).astype(np.float32)}
    for _ in range(3):
        runtime.run(feeds)
    items, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        runtime.run(feeds)
        items += batch
    out.put(items / seconds)


def layout_rate(layout: str, cores: int, batch: int, seconds: float) -> float:
    """Items per second of one layout's sessions, run at once."""
    queue = mp.Queue()
    shapes = [(cores, batch)] if layout == "machine" else [(1, max(1, batch // cores))] * cores
    procs = [mp.Process(target=_session, args=(threads, b, seconds, queue)) for threads, b in shapes]
    for p in procs:
        p.start()
    rates = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    return sum(rates)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--path-cores", default="0,0.2,0.4", help="the path's share of a core, comma-separated; 0 first")
    p.add_argument("--burst-ms", type=float, default=0.5)
    p.add_argument("--batch", type=int, default=16, help="the machine's batch; per-core runs batch / cores each")
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=str(OUT))
    add_smoke(p, path_cores="0,0.3", seconds=0.5, repeats=1, batch=4)
    args = parse_args(p, argv)
    try:
        paths = [float(x) for x in args.path_cores.split(",")]
    except ValueError:
        p.error(f"--path-cores: expected numbers separated by commas, got {args.path_cores!r}")
    if not paths or paths[0] != 0.0 or any(not 0.0 <= x < 1.0 for x in paths):
        p.error("--path-cores: 0 first, then shares of a core below 1")
    if args.seconds <= 0 or args.repeats < 1 or args.batch < 1 or args.burst_ms <= 0:
        p.error("--seconds and --burst-ms must be positive, --repeats and --batch at least 1")
    cores = len(os.sched_getaffinity(0))
    rows = []
    for path in paths:
        stop = mp.Event()
        spinner = mp.Process(target=_path, args=(path, args.burst_ms, stop)) if path else None
        if spinner:
            spinner.start()
        runs = {"machine": [], "per-core": []}
        for _ in range(args.repeats):
            for layout in runs:
                runs[layout].append(layout_rate(layout, cores, args.batch, args.seconds))
        stop.set()
        if spinner:
            spinner.join()
        rows.append({"path_cores": path, **{k: statistics.median(v) for k, v in runs.items()}, "runs": runs})
    base = rows[0]
    print("| path (cores) | machine (items/s) | kept | rule | per-core (items/s) | kept | rule |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        r["machine_kept"] = r["machine"] / base["machine"]
        r["per_core_kept"] = r["per-core"] / base["per-core"]
        r["machine_rule"], r["per_core_rule"] = 1.0 - r["path_cores"], 1.0 - r["path_cores"] / cores
        print(f"| {r['path_cores']:.2f} | {r['machine']:.0f} | {r['machine_kept']:.2f} | {r['machine_rule']:.2f} | "
              f"{r['per-core']:.0f} | {r['per_core_kept']:.2f} | {r['per_core_rule']:.2f} |")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cores": cores, "batch": args.batch, "burst_ms": args.burst_ms, "rows": rows},
                              indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
