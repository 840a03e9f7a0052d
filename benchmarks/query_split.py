"""Issue 6 benchmark: a traffic-style query on emulated GPUs, DP latency split vs even vs proportional.

For each split method the same offered load (Poisson, --rate queries/s, 400 ms SLO) runs against a
real local cluster (`nexus serve --device emulated:gtx1080ti`) with as many emulated GPUs as the
scheduler's own planning functions say that split needs. Reported: GPUs needed, goodput, bad rate.

    python benchmarks/query_split.py [--rate 60] [--duration-s 20] [--warmup-s 12]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.plan import GpuSpec, SessionSpec  # noqa: E402
from common.profile import Profile  # noqa: E402
from common.query_def import parse_query  # noqa: E402
from common.sample_models import detector_64, face_cls, model_bytes, vehicle_cls  # noqa: E402
from globalsched.algorithms import solve  # noqa: E402
from globalsched.query_sessions import plan_query_sessions  # noqa: E402
from nexus.bench import run_bench  # noqa: E402
from nexus.models_cmd import upload_model  # noqa: E402
from nexus.queries_cmd import register_query  # noqa: E402
from tests.conftest import start_cluster  # noqa: E402

GPU = "gtx1080ti"
BOXES = 3   # every detection fans out: gamma = 3 on each edge
# GPU-like profiles, l(b) = alpha*b + beta (ms), memory base + per item (MB).
PROFILES = {"det3": (10.0, 30.0, 800.0, 20.0), "vehicle": (4.0, 15.0, 400.0, 8.0), "face": (4.8, 15.0, 400.0, 8.0)}
QUERY = {
    "name": "traffic", "slo_ms": 400, "inputs": [{"name": "image", "datatype": "FP32", "shape": [3, 64, 64]}],
    "stages": [
        {"name": "detect", "model": "det3", "inputs": {"input": "image"}},
        {"name": "vehicle", "model": "vehicle", "inputs": {"input": "detect.crops"}, "fanout": True},
        {"name": "face", "model": "face", "inputs": {"input": "detect.crops"}, "fanout": True},
    ],
    "outputs": {"vehicles": "vehicle.logits", "faces": "face.logits"},
}


def profile(name: str) -> Profile:
    a, b, m0, m1 = PROFILES[name]
    return Profile.linear(a, b, 64, m0, m1, device_type=GPU)


def gpus_needed(method: str, rate: float) -> tuple[int, dict]:
    q = parse_query(json.dumps(QUERY))
    gammas = {("traffic", "detect", "vehicle"): float(BOXES), ("traffic", "detect", "face"): float(BOXES)}
    sessions, plans = plan_query_sessions({"traffic": q}, {"traffic": rate}, gammas,
                                          {m: {GPU: profile(m)} for m in PROFILES}, [GPU], method)
    specs = [SessionSpec(s.model, s.model, s.slo_ms, s.rate_rps, s.profiles[GPU]) for s in sessions]
    plan = solve(specs, GpuSpec(GPU, 11000))
    return len(plan.gpus), dict(plans["traffic"].budgets_ms)


def run_method(method: str, rate: float, duration_s: float, warmup_s: float, workdir: pathlib.Path) -> dict:
    n, budgets = gpus_needed(method, rate)
    models = {"det3": detector_64(BOXES), "vehicle": vehicle_cls(), "face": face_cls()}
    cluster = start_cluster(workdir / method, "--device", f"emulated:{GPU}", "--backends", str(n), "--no-samples",
                            "--latency-split", method)
    try:
        for name, model in models.items():
            path = workdir / f"{name}.onnx"
            path.write_bytes(model_bytes(model))
            prof = workdir / f"{name}.json"
            prof.write_text(profile(name).to_json())
            upload_model(cluster.scheduler, path, name, profile_path=str(prof), slo_ms=400, load=False)
        register_query(cluster.scheduler, json.dumps(QUERY))
        time.sleep(3)
        warm = run_bench(cluster.frontend, "traffic", rate, warmup_s, 400.0, seed=1)
        report = run_bench(cluster.frontend, "traffic", rate, duration_s, 400.0, seed=2)
    finally:
        cluster.stop()
    return {"method": method, "gpus": n, "budgets_ms": budgets, "offered_rps": rate,
            "goodput_rps": report.goodput_rps, "bad_rate": report.bad_rate, "p99_ms": report.p99_ms,
            "sent": report.sent, "late": report.late, "dropped": report.dropped, "failed": report.failed,
            "warmup_bad_rate": warm.bad_rate}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=60.0)
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument("--warmup-s", type=float, default=12.0)
    parser.add_argument("--methods", default="dp,even,proportional")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for method in args.methods.split(","):
            rows.append(run_method(method, args.rate, args.duration_s, args.warmup_s, pathlib.Path(tmp)))
            r = rows[-1]
            print(f"{method:13s} gpus={r['gpus']}  goodput={r['goodput_rps']:.1f}/{args.rate:g} rps  "
                  f"bad_rate={100 * r['bad_rate']:.2f}%  p99={r['p99_ms']:.0f} ms  budgets={r['budgets_ms']}",
                  flush=True)
    out = ROOT / "benchmarks" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "query_split.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
