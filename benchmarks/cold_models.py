"""A fleet larger than the devices' memory: cold models paged in on demand, on real processes.

A scheduler, a frontend and ``--devices`` emulated T4 backends whose memory (``--memory-mb``) holds
``--resident`` models of ``--model-mb`` each; ``--models`` models are uploaded (the same small file
under different names, each with a profile of that memory). Requests arrive as a Poisson process at
``--rate`` per second in total, each to a model drawn from a heavy-tailed popularity (Zipf, exponent
``--zipf``; the Azure Functions traces' shape: a few models take most requests, most are rarely
called), for ``--duration-s``. Every request is given ``--timeout-s``.

Reported: requests within their SLO, failed by status; cold starts (the frontend's
``nexus_cold_starts_total``) and how long they waited to be paged in
(``nexus_cold_start_wait_seconds``: its p50 and p99 bucket bounds); and the end-to-end latency of the
requests that were not cold starts against those that were (split by the frontend's count: the
slowest N requests, where N is the number of cold starts, are taken as the cold ones).

Run from the repository root: ``python -m benchmarks.cold_models [--models 200 --devices 2 --resident 20]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import sys
import tempfile
import time

import grpc
import numpy as np

from common.pb import kserve, kserve_grpc
from common.profile import Profile
from common.sample_models import mlp_small, model_bytes
from harness.cluster import Cluster
from harness.meters import loadavg
from harness.prometheus import bucket_quantile, buckets, scrape
from harness.smoke import add_smoke, parse_args
from nexus.scheduler_client import list_models, upload_model


def _request(model: str) -> kserve.ModelInferRequest:
    req = kserve.ModelInferRequest(model_name=model)
    req.inputs.add(name="input", datatype="FP32", shape=[1, 64])
    req.raw_input_contents.append(np.zeros((1, 64), np.float32).tobytes())
    return req


async def _drive(frontend: str, names: list[str], weights: np.ndarray, rate: float, duration_s: float,
                 timeout_s: float, seed: int) -> list[tuple[str, str, float]]:
    """(model, status, latency s) of every request sent."""
    rng = np.random.default_rng(seed)
    out: list[tuple[str, str, float]] = []
    examples: dict[str, str] = {}
    async with grpc.aio.insecure_channel(frontend) as channel:
        stub = kserve_grpc.GRPCInferenceServiceStub(channel)

        async def one(model: str) -> None:
            began = time.monotonic()
            try:
                await stub.ModelInfer(_request(model), timeout=timeout_s)
                status = "OK"
            except grpc.aio.AioRpcError as exc:
                status = exc.code().name
                examples.setdefault(status, exc.details())
            out.append((model, status, time.monotonic() - began))

        tasks = []
        start = time.monotonic()
        at = 0.0
        while at < duration_s:
            at += rng.exponential(1.0 / rate)
            delay = start + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(names[rng.choice(len(names), p=weights)])))
        await asyncio.gather(*tasks)
    for status, message in examples.items():
        print(f"  {status}, for example: {message}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=int, default=200)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--resident", type=int, default=20, help="models one device's memory holds")
    p.add_argument("--model-mb", type=float, default=300.0)
    p.add_argument("--rate", type=float, default=60.0, help="requests per second, all models together")
    p.add_argument("--zipf", type=float, default=1.2, help="popularity exponent: model k gets 1/k^s of the requests")
    p.add_argument("--slo-ms", type=float, default=100.0)
    p.add_argument("--duration-s", type=float, default=60.0)
    p.add_argument("--timeout-s", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", help="keep the components' logs here (INFO) instead of a temporary directory")
    add_smoke(p, models=6, devices=1, resident=2, model_mb=10.0, rate=10.0, duration_s=2.0)
    args = parse_args(p, argv)
    memory_mb = args.resident * (args.model_mb + 1) + args.model_mb / 2
    print(f"{args.models} models of {args.model_mb:g} MB on {args.devices} emulated t4 of {memory_mb:g} MB "
          f"({args.resident} each); {args.rate:g} rps, Zipf {args.zipf:g}, SLO {args.slo_ms:g} ms, "
          f"{args.duration_s:g} s; load average {os.getloadavg()[0]:.2f}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(args.workdir or tmp)
        cluster = Cluster(work, backends=args.devices, device="emulated:t4",
                          scheduler={"spare_replicas": False}, backend={"memory_mb": memory_mb},
                          frontend={"report_interval_s": 0.5}, log_level="INFO" if args.workdir else None).start()
        try:
            profile = work / "t4.json"
            profile.write_text(Profile.linear(1.0, 0.5, 16, memory_base_mb=args.model_mb, memory_per_item_mb=1,
                                              device_type="t4").to_json())
            path = work / "m.onnx"
            path.write_bytes(model_bytes(mlp_small()))
            names = [f"m{i:04d}" for i in range(args.models)]
            began = time.monotonic()
            for name in names:
                upload_model(cluster.scheduler.address, path, name, profile_path=str(profile), slo_ms=args.slo_ms)
            print(f"uploaded {len(names)} in {time.monotonic() - began:.1f} s", flush=True)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                states = [m.serving_state for m in list_models(cluster.scheduler.address)]
                if states.count(3) + states.count(5) == len(names):    # READY or COLD: placed
                    break
                time.sleep(1.0)
            resident = states.count(3)
            print(f"placed: {resident} resident, {states.count(5)} cold", flush=True)
            weights = 1.0 / np.arange(1, len(names) + 1) ** args.zipf
            weights /= weights.sum()
            results = asyncio.run(_drive(cluster.frontend.address, names, weights, args.rate, args.duration_s,
                                         args.timeout_s, args.seed))
            metrics = cluster.frontend.info["metrics"]
            scraped = scrape(metrics)
            cold_starts = scraped.total("nexus_cold_starts_total")
            waits = buckets(scraped, "nexus_cold_start_wait_seconds")
            held = [(len(stats.sessions), sum(x.memory_bytes for x in stats.sessions) / 2 ** 20)
                    for _, stats in cluster.backend_stats()]
        finally:
            cluster.stop()
    ok = [lat for _, status, lat in results if status == "OK"]
    failed: dict[str, int] = {}
    for _, status, _ in results:
        if status != "OK":
            failed[status] = failed.get(status, 0) + 1
    within = sum(lat <= args.slo_ms / 1000 for lat in ok)
    latencies = np.sort(np.array([lat for _, _, lat in results]))
    n_cold = int(cold_starts)
    warm = latencies[:len(latencies) - n_cold] if n_cold else latencies
    print(f"requests {len(results)}: within SLO {within} ({100 * within / max(len(results), 1):.2f}%), "
          f"failed {failed or 0}; load average {loadavg():.2f}")
    print(f"warm requests (all but the {n_cold} slowest): {100 * np.mean(warm <= args.slo_ms / 1000):.2f}% within "
          f"SLO, p99 {1000 * np.percentile(warm, 99):.1f} ms")
    print(f"cold starts {n_cold}: wait p50 <= {bucket_quantile({}, waits, 0.5)[0]:g} s, p99 <= "
          f"{bucket_quantile({}, waits, 0.99)[0]:g} s (bucket bounds); slowest request "
          f"{1000 * latencies[-1]:.0f} ms")
    print(f"backends at the end: {held} (sessions, MB of {memory_mb:g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
