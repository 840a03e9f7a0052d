"""A tiny scripted KServe v2 gRPC server for testing and calibrating the load generator.

Not a serving system: each model answers ModelInfer after a fixed sleep, or follows a ``pattern``
of actions cycled by a per-model request counter, so that tests get exact counts of late, dropped
and failed requests. Actions: ``"ok"`` (sleep ``latency_ms``, answer), ``"sleep:MS"`` (sleep MS,
answer), ``"error:CODE"`` (abort with that gRPC status, e.g. ``error:RESOURCE_EXHAUSTED``).
With ``"workers": N`` at most N requests of the model sleep at once and the others queue (FIFO),
which gives the model a capacity of ``N * 1000 / latency_ms`` requests per second.

    python -m harness.fake_kserve [--port 0] [--config JSON | --config @file.json]

prints ``listening on 127.0.0.1:PORT`` once it serves. Config::

    {"models": {"fake": {"inputs": [["input", "FP32", [-1, 16]]],
                         "outputs": [["output", "FP32", [-1, 10]]],
                         "latency_ms": 1.0, "pattern": ["ok"]}}}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
from dataclasses import dataclass, field

import grpc
import grpc.aio
import numpy as np

from common.pb import kserve, kserve_grpc
from common.tensors import numpy_dtype
from nexus.process import loop_factory

DEFAULT_CONFIG = {
    "models": {
        "fake": {
            "inputs": [["input", "FP32", [-1, 16]]],
            "outputs": [["output", "FP32", [-1, 10]]],
            "latency_ms": 1.0,
            "pattern": ["ok"],
        }
    }
}


# Scripted models with known answers, for the checks of the load generator itself (tests/e2e/test_bench.py,
# benchmarks/timing_checks.py), run at an SLO of SLO_MS with GRACE_MS of grace (a 500 ms client deadline).
SLO_MS = 250.0
GRACE_MS = 250.0
# Cycled per request by the server: 5 on time, 1 late, 2 failed, 2 dropped (one by the server
# shedding, one by the client's deadline passing).
MIXED_PATTERN = [
    "ok",
    "ok",
    "sleep:350",  # late: > SLO, well before the 500 ms client deadline
    "error:INTERNAL",  # failed
    "ok",
    "error:RESOURCE_EXHAUSTED",  # dropped
    "ok",
    "sleep:1500",  # dropped: the client's DEADLINE_EXCEEDED
    "error:INVALID_ARGUMENT",  # failed
    "ok",
]

SCRIPTED_CONFIG = {
    "models": {
        "fast": {"inputs": [["input", "FP32", [-1, 8]]], "outputs": [["output", "FP32", [-1, 4]]], "latency_ms": 1},
        "mixed": {
            "inputs": [["input", "FP32", [-1, 8]]],
            "outputs": [["output", "FP32", [-1, 4]]],
            "latency_ms": 0,
            "pattern": MIXED_PATTERN,
        },
        "slow": {"inputs": [["input", "FP32", [-1, 8]]], "outputs": [["output", "FP32", [-1, 4]]], "latency_ms": 300},
        # One worker, 10 ms per request: a capacity of 100 rps.
        "single": {
            "inputs": [["input", "FP32", [-1, 8]]],
            "outputs": [["output", "FP32", [-1, 4]]],
            "latency_ms": 10,
            "workers": 1,
        },
        "multi": {
            "inputs": [["a", "FP32", [-1, 3, 4]], ["b", "INT64", [-1, 2]], ["c", "UINT8", [-1, -1]]],
            "outputs": [["y", "FP16", [-1, 5]]],
            "latency_ms": 0,
        },
    }
}


@dataclass
class FakeModel:
    name: str
    inputs: list[tuple[str, str, list[int]]]
    outputs: list[tuple[str, str, list[int]]]
    latency_ms: float = 1.0
    pattern: list[str] = field(default_factory=lambda: ["ok"])
    workers: int = 0  # 0: unlimited
    count: int = 0
    _slots: asyncio.Semaphore | None = None
    _responses: dict[int, object] = field(default_factory=dict)

    @staticmethod
    def from_obj(name: str, obj: dict) -> "FakeModel":
        def tensors(key: str) -> list[tuple[str, str, list[int]]]:
            return [(str(n), str(dt), [int(d) for d in shape]) for n, dt, shape in obj.get(key, [])]

        return FakeModel(
            name=name,
            inputs=tensors("inputs"),
            outputs=tensors("outputs"),
            latency_ms=float(obj.get("latency_ms", 1.0)),
            pattern=list(obj.get("pattern", ["ok"])),
            workers=int(obj.get("workers", 0)),
        )

    def response(self, rows: int) -> object:
        resp = self._responses.get(rows)
        if resp is None:
            resp = kserve.ModelInferResponse(model_name=self.name, model_version="1")
            for name, dt, shape in self.outputs:
                full = [rows if d < 0 else d for d in shape]
                resp.outputs.add(name=name, datatype=dt, shape=full)
                nbytes = int(np.prod(full, dtype=np.int64)) * numpy_dtype(dt).itemsize
                resp.raw_output_contents.append(bytes(nbytes))
            self._responses[rows] = resp
        return resp


class FakeInferenceService(kserve_grpc.GRPCInferenceServiceServicer):
    def __init__(self, models: dict[str, FakeModel]) -> None:
        self.models = models

    async def ServerLive(self, request, context):
        return kserve.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return kserve.ServerReadyResponse(ready=True)

    async def ModelReady(self, request, context):
        return kserve.ModelReadyResponse(ready=request.name in self.models)

    async def ModelMetadata(self, request, context):
        m = self.models.get(request.name)
        if m is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model {request.name!r}")
        resp = kserve.ModelMetadataResponse(name=m.name, versions=["1"], platform="fake")
        for name, dt, shape in m.inputs:
            resp.inputs.add(name=name, datatype=dt, shape=shape)
        for name, dt, shape in m.outputs:
            resp.outputs.add(name=name, datatype=dt, shape=shape)
        return resp

    async def ModelInfer(self, request, context):
        m = self.models.get(request.model_name)
        if m is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model {request.model_name!r}")
        if len(request.inputs) != len(m.inputs) or len(request.raw_input_contents) != len(m.inputs):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"expected {len(m.inputs)} raw inputs")
        rows = 1
        for (name, dt, shape), t, raw in zip(m.inputs, request.inputs, request.raw_input_contents):
            if t.name != name or t.datatype != dt or len(t.shape) != len(shape):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad input {t.name!r}")
            if shape and shape[0] < 0:
                rows = int(t.shape[0])
            want = int(np.prod(list(t.shape), dtype=np.int64)) * numpy_dtype(dt).itemsize
            if len(raw) != want:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"input {name!r}: {len(raw)} bytes, want {want}")
        action = m.pattern[m.count % len(m.pattern)]
        m.count += 1
        kind, _, arg = action.partition(":")
        if kind == "error":
            await context.abort(grpc.StatusCode[arg], f"scripted {arg}")
        delay_ms = float(arg) if kind == "sleep" else m.latency_ms
        if m.workers > 0:
            if m._slots is None:
                m._slots = asyncio.Semaphore(m.workers)
            async with m._slots:
                await asyncio.sleep(delay_ms / 1000.0)
        elif delay_ms > 0:
            await asyncio.sleep(delay_ms / 1000.0)
        return m.response(rows)


async def start(config: dict | None = None, port: int = 0) -> tuple[grpc.aio.Server, int, FakeInferenceService]:
    """Start the fake server on 127.0.0.1 (``port`` 0: a free one); returns (server, port, service)."""
    cfg = config or DEFAULT_CONFIG
    models = {name: FakeModel.from_obj(name, obj) for name, obj in cfg["models"].items()}
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", -1)])
    service = FakeInferenceService(models)
    kserve_grpc.add_GRPCInferenceServiceServicer_to_server(service, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, bound, service


def spawn(config: dict | None = None, port: int = 0) -> tuple[subprocess.Popen, str]:
    """Run the fake server in a subprocess; returns (process, "127.0.0.1:PORT") once it serves.

    The caller ends it with ``proc.terminate(); proc.wait()``.
    """
    cmd = [sys.executable, "-m", "harness.fake_kserve", "--port", str(port)]
    if config is not None:
        cmd += ["--config", json.dumps(config)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"fake KServe server did not start: {line!r}")
    return proc, line.split()[-1]


async def _main(config: dict, port: int) -> None:
    server, bound, _ = await start(config, port)
    print(f"listening on 127.0.0.1:{bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(0.5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.fake_kserve", description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--config", default=None, help="JSON text, or @FILE")
    a = p.parse_args(argv)
    config = DEFAULT_CONFIG
    if a.config:
        text = open(a.config[1:]).read() if a.config.startswith("@") else a.config
        config = json.loads(text)
    # The components' event loop (uvloop unless NEXUS_EVENT_LOOP says otherwise), so that this server is
    # a like-for-like baseline of a frontend's gRPC cost (benchmarks/cpu_per_request.py).
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(_main(config, a.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
