"""Measure the load generator's own cost per request: raw pre-serialized bytes vs the generated stub.

    python -m harness.overhead [--requests 800] [--repeats 5] [--item-shape 3,64,64 ...]

Starts :mod:`harness.fake_kserve` in a subprocess (answers at once), then, per input size,
sends the same ModelInfer requests through both call paths of :class:`LoadClient` (the raw-bytes
unary call with identity serializers, and the generated stub, which serializes every request and
parses every response), ``--concurrency`` at a time, alternating the two paths ``--repeats`` times.
It prints the median client CPU time per request (the client process, gRPC's threads included;
the server's CPU is not counted), which is what limits the rate one client can offer.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import sys
import time

from harness.fake_kserve import spawn
from nexus.bench.loadgen import LoadClient


async def _cpu_per_request(call, payload, requests: int, concurrency: int) -> float:
    rounds = max(1, requests // concurrency)
    cpu0 = time.process_time()
    for _ in range(rounds):
        await asyncio.gather(*[call(payload, timeout=10.0) for _ in range(concurrency)])
    return 1e6 * (time.process_time() - cpu0) / (rounds * concurrency)


async def measure(address: str, model: str, requests: int, repeats: int, concurrency: int, batch: int) -> dict:
    """Median client CPU microseconds per request for the raw and the stub path."""
    results: dict[str, list[float]] = {"raw": [], "stub": []}
    clients = {"raw": LoadClient(address, model, batch=batch, raw=True), "stub": LoadClient(address, model, batch=batch, raw=False)}
    for c in clients.values():
        await c.open()
    try:
        paths = {}
        for mode, c in clients.items():
            payload, calls = c.call_path(1000.0)
            paths[mode] = (calls[0], payload)
            await _cpu_per_request(calls[0], payload, 4 * concurrency, concurrency)  # warm up
        for _ in range(repeats):
            for mode, (call, payload) in paths.items():
                results[mode].append(await _cpu_per_request(call, payload, requests, concurrency))
    finally:
        for c in clients.values():
            await c.close()
    raw, stub = statistics.median(results["raw"]), statistics.median(results["stub"])
    return {"raw_us": raw, "stub_us": stub, "saving": 1.0 - raw / stub, "samples": results}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.overhead", description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=800, help="requests per measurement")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--item-shape", action="append", default=None, help="input shape per row, e.g. 3,64,64 (repeatable)")
    p.add_argument("--output-width", type=int, default=1000, help="FP32 outputs per row")
    a = p.parse_args(argv)
    shapes = [tuple(int(d) for d in s.split(",")) for s in (a.item_shape or ["16", "3,64,64", "3,224,224"])]
    models = {
        f"m{i}": {
            "inputs": [["input", "FP32", [-1, *shape]]],
            "outputs": [["output", "FP32", [-1, a.output_width]]],
            "latency_ms": 0,
        }
        for i, shape in enumerate(shapes)
    }
    proc, address = spawn({"models": models})
    try:
        for i, shape in enumerate(shapes):
            n = a.requests if 4 * int(math.prod(shape)) < 200_000 else max(a.concurrency, a.requests // 4)
            r = asyncio.run(measure(address, f"m{i}", n, a.repeats, a.concurrency, a.batch))
            kib = 4 * a.batch * math.prod(shape) / 1024
            print(
                f"input {'x'.join(map(str, shape)):>10} ({kib:7.1f} KiB): raw {r['raw_us']:7.1f} us CPU/req, "
                f"stub {r['stub_us']:7.1f} us CPU/req, raw saves {100 * r['saving']:5.1f}%",
                flush=True,
            )
    finally:
        proc.terminate()
        proc.wait(5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
