"""Prefix batching ON vs OFF: goodput at an SLO and memory, 10 variants of one backbone on a CPU.

What runs: the backend's own execution engine (``backend.engine.Engine`` with Nexus's early-drop
policy) in this process, with real ONNX Runtime sessions on the CPU, no gRPC. The models are
``common.sample_models.backbone_variant(0..N-1)``: one ResNet-style backbone (same layers, same
weights) with a different two-layer head each.

- OFF: every variant is its own session with its own whole-model runtime (10 runtimes, 10 copies of
  the backbone's weights); the engine runs one session's batch at a time, EDF across sessions.
- ON: the backend's prefix batching: ``find_shared_prefix`` splits the variants, the prefix runtime
  is loaded once and one suffix runtime per variant; the engine merges the ten queues, runs the
  prefix once on the merged batch and each suffix on its slice (``backend.sessions.SharedPrefix``).

Load: open-loop Poisson arrivals at a total rate R, each request for a variant drawn uniformly (so
each variant sees R/N), one image per request, deadline = arrival + SLO. Goodput = requests answered
within the SLO per second of the arrival window; bad = late + dropped. Both configurations are
loaded side by side and measured interleaved at every rate (ON, OFF, OFF, ON, ...) so machine
noise hits both alike; each cell of the summary is the median of its runs. The "sustainable" rate is the highest measured rate with >= 99% good.

Memory: the runtimes' own accounting (``Runtime.memory_mb``: serialized weights + the largest batch's
inputs/outputs) summed over the sessions, and the weight bytes of the split, ON vs OFF; plus the
resident memory a fresh process gains creating (and running once) each configuration's sessions.

Run: ``python -m benchmarks.prefix_batching`` (about 6 minutes on 2 cores, more while other processes
keep the machine busy: each measurement waits up to ``--quiet-wait-s`` for a quiet moment);
``--threads 1`` and ``--emulate`` (the emulated GPU with a GPU-like profile) are the other two runs of
benchmarks/prefix_batching.md, which summarises the results; raw ones go to ``benchmarks/out/``.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import threading
import time

import numpy as np

from backend.engine import Engine

from backend.sessions import Session, SharedPrefix

from backend.work import Work
from backend.model_table import suffix_threads
from common.arrivals import arrival_times
from common.batch_decision import SlidingWindowEarlyDrop
from common.onnx_prefix import find_shared_prefix
from common.profile import Profile
from common.runtimes import load_runtime
from common.sample_models import backbone_variant, model_bytes, variant_name
from common.exec_status import ExecStatus
from harness.meters import CpuMeter, wait_quiet
from harness.smoke import add_smoke, parse_args
from nexus.bench.report import write_json

ROOT = pathlib.Path(__file__).resolve().parent.parent
MB = 1024 * 1024


_RSS_CHILD = r"""
import sys, numpy as np, onnxruntime as ort
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * __import__("resource").getpagesize() / 2**20
files, cut = sys.argv[2:], sys.argv[1]
base = rss()
sessions = [ort.InferenceSession(f, providers=["CPUExecutionProvider"]) for f in files]
x = np.zeros((1, 3, 64, 64), np.float32)
for s in sessions:   # run once so that each session's buffers exist
    name = s.get_inputs()[0].name
    feed = x if name == "input" else np.zeros((1, 256), np.float32)
    s.run(None, {name: feed})
print(rss() - base)
"""


def rss_growth_mb(files: list[pathlib.Path], cut: str) -> float:
    """Resident memory a fresh process gains by creating (and running once) ONNX Runtime sessions of ``files``."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", _RSS_CHILD, cut, *map(str, files)], capture_output=True, text=True,
                         check=True)
    return float(out.stdout.strip().splitlines()[-1])


def measure_profile(data: bytes, threads: int | None, max_batch: int) -> Profile:
    from profiler.profiling import profile_model

    sizes = sorted({1, 2, 4, 8, 16, 32, max_batch} - {b for b in (2, 4, 8, 16, 32) if b > max_batch})
    return profile_model(data, "cpu", "onnxruntime", sizes, warmup=3, iters=12, min_iters=5, threads=threads,
                         device_type="cpu")


class Config:
    """One configuration: its engine and sessions, ready to take load."""

    def __init__(self, name: str, sessions: dict[str, Session], groups: list[SharedPrefix]) -> None:
        self.name = name
        self.sessions = sessions
        self.groups = groups
        self.engine = Engine(SlidingWindowEarlyDrop())
        self.engine.set_sessions(sessions, groups)

    def memory_mb(self) -> float:
        return sum(s.memory_mb for s in self.sessions.values())

    def close(self) -> None:
        self.engine.stop()


def run_load(config: Config, names: list[str], rate: float, duration_s: float, slo_ms: float, seed: int,
             inputs: dict[str, np.ndarray]) -> dict:
    """Open-loop Poisson load at ``rate`` over ``names``; returns counts and rates of the window."""
    rng = np.random.default_rng(seed)
    times = arrival_times(rate, duration_s, rng)
    arrivals = list(zip(times.tolist(), (names[i] for i in rng.integers(0, len(names), len(times)).tolist())))
    engine = config.engine
    lock = threading.Lock()
    outcomes: list[tuple[str, float]] = []
    finished = threading.Event()

    def completer(arrival: float):
        def done(outcome) -> None:
            latency = engine.clock() - arrival
            with lock:
                outcomes.append((outcome.status, latency))
                if len(outcomes) == len(arrivals):
                    finished.set()
        return done

    others = CpuMeter({"self": os.getpid()}).start()
    before = {n: (s.stats.execution_count, s.stats.inference_count) for n, s in config.sessions.items()}
    group_before = {g.name: (g.stats.execution_count, g.stats.inference_count) for g in config.groups}
    start = engine.clock()
    lag = 0.0
    for at, model in arrivals:
        wait = start + at - engine.clock()
        if wait > 0:
            time.sleep(wait)
        now = engine.clock()
        lag = max(lag, now - (start + at))
        engine.submit(Work(model, [inputs[model]], 1, now + slo_ms / 1000.0, now, completer(now)))
    finished.wait(timeout=slo_ms / 1000.0 * 4 + 30)
    with lock:
        done = list(outcomes)
    on_time = sum(1 for status, latency in done if status == ExecStatus.OK and latency * 1000.0 <= slo_ms)
    late = sum(1 for status, latency in done if status == ExecStatus.OK and latency * 1000.0 > slo_ms)
    dropped = sum(1 for status, _ in done if status != ExecStatus.OK) + (len(arrivals) - len(done))
    ok_latencies = sorted(latency * 1000.0 for status, latency in done if status == ExecStatus.OK)
    if config.groups:
        g = config.groups[0]
        execs = g.stats.execution_count - group_before[g.name][0]
        rows = g.stats.inference_count - group_before[g.name][1]
    else:
        execs = sum(s.stats.execution_count - before[n][0] for n, s in config.sessions.items())
        rows = sum(s.stats.inference_count - before[n][1] for n, s in config.sessions.items())
    return {
        "config": config.name, "offered_rps": rate, "sent": len(arrivals), "on_time": on_time, "late": late,
        "dropped": dropped, "goodput_rps": on_time / duration_s,
        "good_fraction": on_time / len(arrivals) if arrivals else 1.0,
        "p99_ms": ok_latencies[int(0.99 * (len(ok_latencies) - 1))] if ok_latencies else None,
        "mean_batch": rows / execs if execs else 0.0, "batches": execs, "client_lag_ms": lag * 1000.0,
        "other_load_cores": max(0.0, others.stop()["external_cores"]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", type=int, default=10)
    parser.add_argument("--slo-ms", type=float, default=150.0)
    parser.add_argument("--duration-s", type=float, default=6.0, help="arrival window per measurement")
    parser.add_argument("--rates", default="",
                        help="total offered rates (req/s), comma-separated (default: 100,200,300,400,600,800,1000; "
                             "--emulate: 600,1000,1200,1400,1600,1800,2000)")
    parser.add_argument("--repeat", type=int, default=3, help="measurements per (config, rate), interleaved")
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads per runtime (0: all cores)")
    parser.add_argument("--max-batch", type=int, default=32, help="largest batch profiled and run")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--emulate", action="store_true",
                        help="run the models on the emulated GPU (common/runtimes/emulated.py) with a GPU-like "
                             "profile l(b) = beta + alpha*b instead of ONNX Runtime on the CPU")
    parser.add_argument("--alpha-ms", type=float, default=0.5, help="--emulate: per-item latency of a whole model")
    parser.add_argument("--beta-ms", type=float, default=5.0, help="--emulate: fixed latency of a whole model")
    parser.add_argument("--prefix-share", type=float, default=0.95,
                        help="--emulate: the prefix's share of a whole model's latency (the rest is the head)")
    parser.add_argument("--quiet-wait-s", type=float, default=20.0,
                        help="before each measurement, wait up to this long for other processes to use < 0.3 cores")
    parser.add_argument("--out", default="")
    add_smoke(parser, variants=2, duration_s=0.5, rates="40", repeat=2, threads=1, max_batch=4, quiet_wait_s=0.0,
              out="prefix_batching.json")
    args = parse_args(parser, argv)
    if args.smoke and not args.emulate:   # a smoke run covers both modes: --emulate first, then the CPU
        given = list(sys.argv[1:] if argv is None else argv)
        rc = main([*given, "--emulate", "--out", str(pathlib.Path(args.out).with_name("prefix_batching_emulated.json"))])
        if rc:
            return rc
    if not args.out:
        args.out = str(ROOT / "benchmarks" / "out" / ("prefix_batching_emulated.json" if args.emulate
                                                       else "prefix_batching.json"))
    sys.setswitchinterval(0.0005)   # as the backend process does
    threads = args.threads or None
    names = [variant_name(i) for i in range(args.variants)]
    models = {n: model_bytes(backbone_variant(i)) for i, n in enumerate(names)}

    t0 = time.perf_counter()
    split = find_shared_prefix(models, min_prefix_weight_bytes=64 * 1024)
    split_s = time.perf_counter() - t0
    assert split is not None
    print(f"split {len(names)} variants in {split_s:.2f} s: prefix {split.prefix_weight_bytes / MB:.2f} MB of weights, "
          f"heads {sum(split.suffix_weight_bytes.values()) / MB:.2f} MB in all", flush=True)

    if args.emulate:
        top = 2 * args.max_batch * args.variants
        profile = Profile.linear(args.alpha_ms, args.beta_ms, top, device_type="emulated")
        prefix_profile = Profile.linear(args.prefix_share * args.alpha_ms, args.prefix_share * args.beta_ms, top,
                                        device_type="emulated")
        head = 1 - args.prefix_share
        suffix_profile = Profile.linear(head * args.alpha_ms, head * args.beta_ms, top, device_type="emulated")
        print(f"emulated GPU: whole model l(b) = {args.beta_ms:g} + {args.alpha_ms:g}*b ms; prefix "
              f"{100 * args.prefix_share:g}% of it, each head the rest", flush=True)
    else:
        print("profiling the whole model on this CPU ...", flush=True)
        profile = measure_profile(models[names[0]], threads, args.max_batch)
    print("  l(b) ms: " + ", ".join(f"{b}:{profile.latency_ms(b):.1f}" for b in (1, 2, 4, 8, 16, 32)
                                    if b <= profile.max_batch), flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        d = pathlib.Path(tmp)
        (d / "prefix.onnx").write_bytes(split.prefix)
        for n in names:
            (d / f"{n}.suffix.onnx").write_bytes(split.suffixes[n])
            (d / f"{n}.onnx").write_bytes(models[n])
        rss_on = rss_growth_mb([d / "prefix.onnx", *(d / f"{n}.suffix.onnx" for n in names)], split.cut_tensor)
        rss_off = rss_growth_mb([d / f"{n}.onnx" for n in names], split.cut_tensor)
        rss_one = rss_growth_mb([d / f"{names[0]}.onnx"], split.cut_tensor)
    if args.emulate:
        emu = "emulated:gpu"
        prefix = load_runtime("emulated", split.prefix, emu, profile=prefix_profile)
        suffixes = {n: load_runtime("emulated", split.suffixes[n], emu, profile=suffix_profile) for n in names}
        off_runtimes = {n: load_runtime("emulated", models[n], emu, profile=profile) for n in names}
    else:
        prefix = load_runtime("onnxruntime", split.prefix, "cpu", intra_op_threads=threads)
        suffixes = {n: load_runtime("onnxruntime", split.suffixes[n], "cpu",     # as the backend loads them
                                    intra_op_threads=suffix_threads(threads, split.prefix_weight_bytes,
                                                                    split.suffix_weight_bytes[n]))
                    for n in names}
        off_runtimes = {n: load_runtime("onnxruntime", models[n], "cpu", intra_op_threads=threads) for n in names}

    def session(n: str, runtime, **kw) -> Session:
        return Session(n, runtime, args.slo_ms, 1, profile, **kw)

    off = Config("off", {n: session(n, off_runtimes[n]) for n in names}, [])
    members = {n: session(n, suffixes[n], inputs=off_runtimes[n].inputs, outputs=off_runtimes[n].outputs)
               for n in names}
    group = SharedPrefix("backbone", prefix, split.cut_tensor, list(members.values()), split.prefix_id)
    on = Config("on", members, [group])
    print(f"max batch: {off.sessions[names[0]].max_batch} per session (OFF), {group.max_batch} per merged batch (ON)",
          flush=True)

    rng = np.random.default_rng(args.seed)
    inputs = {n: rng.standard_normal((1, 3, 64, 64)).astype(np.float32) for n in names}
    # Correctness and warm-up: prefix + suffix give the whole model's outputs; both configurations run.
    if not args.emulate:
        x = inputs[names[0]]
        whole = off_runtimes[names[0]].run({"input": x})["logits"]
        parts = suffixes[names[0]].run({split.cut_tensor: prefix.run({"input": x})[split.cut_tensor]})["logits"]
        np.testing.assert_allclose(parts, whole, rtol=1e-5, atol=1e-6)
    for cfg in (on, off):
        run_load(cfg, names, 50.0, 1.0, 10_000.0, args.seed, inputs)

    rates_text = args.rates or ("600,1000,1200,1400,1600,1800,2000" if args.emulate else "100,200,300,400,600,800,1000")
    rates = [float(r) for r in rates_text.split(",") if r.strip()]
    results = []
    for rate in rates:
        for k in range(args.repeat):
            for cfg in ((on, off) if k % 2 == 0 else (off, on)):
                before = wait_quiet(args.quiet_wait_s, 0.3, window_s=1.0)["busy_cores"] if args.quiet_wait_s > 0 else 0.0
                r = run_load(cfg, names, rate, args.duration_s, args.slo_ms, args.seed + k, inputs)
                r["other_load_before_cores"] = before
                results.append(r)
                print(f"  {cfg.name:>3} {rate:6.0f} rps: goodput {r['goodput_rps']:6.1f} rps, "
                      f"good {100 * r['good_fraction']:5.1f}%, p99 {r['p99_ms'] or 0:6.1f} ms, "
                      f"mean batch {r['mean_batch']:5.2f}, client lag {r['client_lag_ms']:.1f} ms, "
                      f"other load {r['other_load_cores']:.2f} cores", flush=True)

    summary = {}
    for name in ("on", "off"):
        mine = [r for r in results if r["config"] == name]
        by_rate = {}
        for r in mine:
            by_rate.setdefault(r["offered_rps"], []).append(r)
        table = {rate: {key: statistics.median(x[key] for x in rs)
                        for key in ("goodput_rps", "good_fraction", "mean_batch", "other_load_cores")}
                 for rate, rs in by_rate.items()}
        sustainable = max((rate for rate, v in table.items() if v["good_fraction"] >= 0.99), default=0.0)
        summary[name] = {"by_rate": table, "sustainable_rps": sustainable,
                         "max_goodput_rps": max(v["goodput_rps"] for v in table.values())}
    ratios = {rate: summary["on"]["by_rate"][rate]["goodput_rps"] / max(summary["off"]["by_rate"][rate]["goodput_rps"], 1e-9)
              for rate in summary["on"]["by_rate"]}
    heads = sum(split.suffix_weight_bytes.values()) / MB
    one_whole = (split.prefix_weight_bytes + split.suffix_weight_bytes[names[0]]) / MB
    memory = {
        # weights held (deterministic): the prefix once + every head, vs every whole model
        "on_weights_mb": split.total_weight_bytes / MB,
        "off_weights_mb": sum(split.prefix_weight_bytes + w for w in split.suffix_weight_bytes.values()) / MB,
        "one_whole_weights_mb": one_whole, "heads_weights_mb": heads, "target_mb": 1.2 * one_whole + heads,
        # the engine's accounting (Runtime.memory_mb: model bytes + the largest batch's inputs/outputs)
        "on_runtime_mb": on.memory_mb(), "off_runtime_mb": off.memory_mb(),
        # resident memory a fresh process gains creating and running the sessions once
        "on_rss_mb": rss_on, "off_rss_mb": rss_off, "one_whole_rss_mb": rss_one,
    }
    report = {"mode": "emulated" if args.emulate else "cpu", "variants": len(names), "slo_ms": args.slo_ms, "duration_s": args.duration_s, "repeat": args.repeat,
              "threads": args.threads, "profile_ms": {b: profile.latency_ms(b) for b in range(1, profile.max_batch + 1)},
              "split_s": split_s, "results": results, "summary": summary, "goodput_ratio_by_rate": ratios,
              "memory": memory}
    out = write_json(args.out, report, indent=2)
    print()
    print(f"medians of {args.repeat} run(s) per cell; 'other' = cores other processes used meanwhile")
    print(f"{'rate':>6} | {'ON goodput':>10} {'good%':>6} {'batch':>6} {'other':>5} | {'OFF goodput':>11} "
          f"{'good%':>6} {'batch':>6} {'other':>5} | ON/OFF")
    for rate in rates:
        a, b = summary["on"]["by_rate"][rate], summary["off"]["by_rate"][rate]
        print(f"{rate:6.0f} | {a['goodput_rps']:10.1f} {100 * a['good_fraction']:6.1f} {a['mean_batch']:6.2f} "
              f"{a['other_load_cores']:5.2f} | {b['goodput_rps']:11.1f} {100 * b['good_fraction']:6.1f} "
              f"{b['mean_batch']:6.2f} {b['other_load_cores']:5.2f} | {ratios[rate]:.2f}x")
    s_on, s_off = summary["on"]["sustainable_rps"], summary["off"]["sustainable_rps"]
    print(f"sustainable rate (>= 99% within {args.slo_ms:g} ms): ON {s_on:g} rps, OFF {s_off:g} rps"
          + (f" ({s_on / s_off:.2f}x)" if s_off else ""))
    print(f"max goodput: ON {summary['on']['max_goodput_rps']:.1f} rps, OFF {summary['off']['max_goodput_rps']:.1f} rps "
          f"({summary['on']['max_goodput_rps'] / max(summary['off']['max_goodput_rps'], 1e-9):.2f}x)")
    print(f"memory, weights: ON {memory['on_weights_mb']:.2f} MB (prefix once + heads), OFF "
          f"{memory['off_weights_mb']:.2f} MB; target 1.2 x one whole ({one_whole:.2f} MB) + heads ({heads:.2f} MB) "
          f"= {memory['target_mb']:.2f} MB")
    print(f"memory, engine accounting: ON {memory['on_runtime_mb']:.1f} MB, OFF {memory['off_runtime_mb']:.1f} MB")
    print(f"memory, RSS of a fresh process: ON {rss_on:.1f} MB, OFF {rss_off:.1f} MB, one whole model {rss_one:.1f} MB")
    print(f"wrote {out}")
    on.close()
    off.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
