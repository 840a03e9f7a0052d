"""Frontend-to-backend transport, measured alone: CPU per request on each side of a grpc.aio
bidirectional stream (the gRPC Execute stream), of the framed execute channel's frames
(common/exec_frames.py, asyncio protocols over TCP; the hello left out) and of a pyzmq DEALER/ROUTER
pair over a Unix socket (``ipc://``), two processes, the same protobuf messages.

    pip install pyzmq        # optional, not a project dependency
    python -m benchmarks.transport_micro [--repeats 5] [--n 6000] [--inflight 8]

``--smoke`` runs a few hundred requests per transport; without pyzmq the zmq side is left out.

The "backend" process answers each ``control.ExecItem`` with a ``control.ExecResult`` carrying an
output of 1000 FP32 (what a classifier returns); the "frontend" process keeps ``--inflight``
requests outstanding, matching replies to requests by id through futures, as
``frontend.backend_pool`` does. Inputs of 3x32x32 and 3x64x64 FP32 (the two models of
vs_triton.py). Both processes run on uvloop when it is installed. Each process reports its own CPU
time (``time.process_time``) over the timed messages; the figure is CPU microseconds per request
and side, and the wall-clock rate. Transports alternate within each repeat; medians over repeats.
JSON to benchmarks/out/transport-micro.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile

from harness.smoke import add_smoke, parse_args
from nexus.bench.report import write_json

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out"

BACKEND = r"""
import asyncio, sys, time
from common.pb import control, control_grpc
from nexus.process import loop_factory

transport, address, n_total = sys.argv[1], sys.argv[2], int(sys.argv[3])
OUTPUT = bytes(4000)

def answer(data):
    item = control.ExecItem.FromString(data)
    return control.ExecResult(request_id=item.request_id, outputs=[OUTPUT],
                              output_shapes=[control.TensorDesc(shape=[1, 1000])]).SerializeToString()

async def grpc_main():
    import grpc
    class Echo(control_grpc.BackendServicer):
        async def Execute(self, request_iterator, context):
            async for item in request_iterator:
                yield control.ExecResult(request_id=item.request_id, outputs=[OUTPUT],
                                         output_shapes=[control.TensorDesc(shape=[1, 1000])])
    server = grpc.aio.server()
    control_grpc.add_BackendServicer_to_server(Echo(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    c0 = time.process_time()
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    print(time.process_time() - c0, flush=True)
    await server.stop(0)

async def zmq_main():
    import zmq, zmq.asyncio
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(address)
    print(0, flush=True)
    c0 = time.process_time()
    for _ in range(n_total):
        ident, data = await sock.recv_multipart(copy=False)
        await sock.send_multipart([ident, answer(data.buffer)], copy=False)
    print(time.process_time() - c0, flush=True)
    sock.close(0)
    ctx.term()

async def framed_main():
    from common.exec_frames import FrameKind, FrameReader, FrameWriter
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    class P(asyncio.Protocol):
        def connection_made(self, t):
            self.writer, self.reader = FrameWriter(t), FrameReader()
        def data_received(self, data):
            for kind, payload in self.reader.feed(data):
                self.writer.send(FrameKind.RESULT, answer(payload))
        def connection_lost(self, exc):
            done.set_result(None)
    server = await loop.create_server(P, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    c0 = time.process_time()
    await done
    print(time.process_time() - c0, flush=True)

with asyncio.Runner(loop_factory=loop_factory()) as r:
    r.run({"grpc": grpc_main, "zmq": zmq_main, "framed": framed_main}[transport]())
"""

FRONTEND = r"""
import asyncio, json, sys, time
from common.pb import control, control_grpc
from nexus.process import loop_factory

transport, address, n, warm, inflight, side = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
PAYLOAD = bytes(3 * side * side * 4)

def item(i):
    return control.ExecItem(request_id=i, model="m", budget_us=100000, inputs=[PAYLOAD], rows=1,
                            input_shapes=[control.TensorDesc(shape=[1, 3, side, side])])

async def drive(send_one):
    sem = asyncio.Semaphore(inflight)
    marks = {}
    async def one(i):
        async with sem:
            if i == warm:
                marks["t0"], marks["c0"] = time.perf_counter(), time.process_time()
            await send_one(i)
    await asyncio.gather(*[one(i) for i in range(n + warm)])
    return time.perf_counter() - marks["t0"], time.process_time() - marks["c0"]

async def grpc_main():
    import grpc
    ch = grpc.aio.insecure_channel(address)
    stub = control_grpc.BackendStub(ch)
    outbox, pending = asyncio.Queue(), {}
    async def requests():
        while True:
            it = await outbox.get()
            if it is None:
                return
            yield it
    call = stub.Execute(requests())
    async def reader():
        async for result in call:
            pending.pop(result.request_id).set_result(result)
    task = asyncio.create_task(reader())
    loop = asyncio.get_running_loop()
    async def send_one(i):
        fut = pending[i] = loop.create_future()
        outbox.put_nowait(item(i))
        res = await fut
        assert len(res.outputs[0]) == 4000
    wall, cpu = await drive(send_one)
    outbox.put_nowait(None)
    await task
    await ch.close()
    return wall, cpu

async def zmq_main():
    import zmq, zmq.asyncio
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    pending = {}
    async def reader():
        for _ in range(n + warm):
            data = await sock.recv(copy=False)
            res = control.ExecResult.FromString(data.buffer)
            pending.pop(res.request_id).set_result(res)
    task = asyncio.create_task(reader())
    loop = asyncio.get_running_loop()
    async def send_one(i):
        fut = pending[i] = loop.create_future()
        await sock.send(item(i).SerializeToString(), copy=False)
        res = await fut
        assert len(res.outputs[0]) == 4000
    wall, cpu = await drive(send_one)
    await task
    sock.close(0)
    ctx.term()
    return wall, cpu

async def framed_main():
    from common.exec_frames import FrameKind, FrameReader, FrameWriter
    loop = asyncio.get_running_loop()
    pending = {}
    class P(asyncio.Protocol):
        def connection_made(self, t):
            self.writer, self.reader = FrameWriter(t), FrameReader()
        def data_received(self, data):
            for kind, payload in self.reader.feed(data):
                res = control.ExecResult.FromString(payload)
                pending.pop(res.request_id).set_result(res)
    host, port = address.rsplit(":", 1)
    t, proto = await loop.create_connection(P, host, int(port))
    async def send_one(i):
        fut = pending[i] = loop.create_future()
        proto.writer.send(FrameKind.ITEM, item(i).SerializeToString())
        res = await fut
        assert len(res.outputs[0]) == 4000
    wall, cpu = await drive(send_one)
    t.close()
    return wall, cpu

with asyncio.Runner(loop_factory=loop_factory()) as r:
    wall, cpu = r.run({"grpc": grpc_main, "zmq": zmq_main, "framed": framed_main}[transport]())
print(json.dumps({"wall_s": wall, "cpu_s": cpu}))
"""


def run_pair(transport: str, n: int, warm: int, inflight: int, side: int, tmp: pathlib.Path) -> dict:
    ipc = f"ipc://{tmp}/backend.sock"
    # Both run from the repository root (``python -c`` imports from its working directory first).
    backend = subprocess.Popen([sys.executable, "-c", BACKEND, transport, ipc, str(n + warm)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    port = backend.stdout.readline().strip()
    address = ipc if transport == "zmq" else f"127.0.0.1:{port}"
    front = subprocess.run([sys.executable, "-c", FRONTEND, transport, address, str(n), str(warm),
                            str(inflight), str(side)], capture_output=True, text=True, check=True, cwd=ROOT)
    got = json.loads(front.stdout.strip().splitlines()[-1])
    if transport == "grpc":
        backend.stdin.write("\n")
        backend.stdin.flush()
    backend_cpu = float(backend.stdout.readline())
    backend.wait(timeout=30)
    # The backend's CPU is over the whole run (warm-up included): scale to the timed messages.
    return {"frontend_us": got["cpu_s"] / n * 1e6, "backend_us": backend_cpu / (n + warm) * 1e6,
            "rate_rps": n / got["wall_s"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--n", type=int, default=6000, help="timed requests per run")
    ap.add_argument("--warm", type=int, default=500)
    ap.add_argument("--inflight", type=int, default=8)
    ap.add_argument("--out", default=str(OUT / "transport-micro.json"))
    add_smoke(ap, repeats=1, n=200, warm=20)
    args = parse_args(ap, argv)
    transports = ("grpc", "framed", "zmq") if importlib.util.find_spec("zmq") else ("grpc", "framed")
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for side in (32, 64):
                order = transports if i % 2 == 0 else transports[::-1]
                for transport in order:
                    r = run_pair(transport, args.n, args.warm, args.inflight, side, pathlib.Path(tmp))
                    runs.setdefault(f"{transport}-{side}", []).append(r)
                    print(f"repeat {i} {transport:4s} 3x{side}x{side}: frontend {r['frontend_us']:.0f} us, "
                          f"backend {r['backend_us']:.0f} us per request, {r['rate_rps']:.0f} rps", flush=True)
    summary = {}
    for key, rs in runs.items():
        summary[key] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
    for side in (32, 64):
        g = summary[f"grpc-{side}"]
        line = [f"3x{side}x{side}: grpc frontend {g['frontend_us']:.0f} us + backend {g['backend_us']:.0f} us, "
                f"{g['rate_rps']:.0f} rps"]
        for other in transports[1:]:
            z = summary[f"{other}-{side}"]
            line.append(f"{other} frontend {z['frontend_us']:.0f} us + backend {z['backend_us']:.0f} us, "
                        f"{z['rate_rps']:.0f} rps, {other}/grpc CPU "
                        f"{(z['frontend_us'] + z['backend_us']) / (g['frontend_us'] + g['backend_us']):.2f}")
        print("; ".join(line))
    write_json(args.out, {"args": {k: v for k, v in vars(args).items() if not k.startswith("_")}, "runs": runs,
                          "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
