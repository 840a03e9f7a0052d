"""Per-request CPU of the request path's Python work and of a gRPC stream under each event loop,
measured in one process each (no cluster, so far less noise from a shared machine than end to end).

    python -m benchmarks.hotpath_micro --before DIR [--repeats 7]

``path``: for a request of one row of mlp_small (64 FP32) and of resnet18_64 (3x64x64 FP32), the
CPU microseconds (``time.process_time``) per request of the frontend's edge work (parse and validate
the ModelInferRequest, build and serialise the ExecItem; then parse the ExecResult, build and
serialise the ModelInferResponse) and the backend's (parse the ExecItem, decode its inputs; encode
the ExecResult), run from this checkout and from ``--before DIR`` in alternating subprocesses.

``loop``: a grpc.aio bidirectional stream in one process (a server echoing each message, a client
keeping 32 in flight), 20,000 messages of 64 bytes: CPU microseconds per message with asyncio's
event loop and with uvloop, alternating.

Medians over ``--repeats``; ratios within each repeat. JSON to benchmarks/out/hotpath-micro.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys

from harness.smoke import add_smoke, parse_args

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out"

_PATH = r'''
import json, sys, time, types
import numpy as np
from common.pb import control, kserve
from common.tensors import TensorSpec
from common.exec_status import ExecStatus
from frontend.routing import ModelEntry
from frontend.requests import parse_infer_request
try:
    import backend.wire as bs          # the wire codec, since it left backend/server.py
except ImportError:
    import backend.server as bs
from backend.work import Outcome
try:
    from frontend.backend_pool import Reply
except ImportError:
    Reply = None
N = int(sys.argv[1])
out = {}
for name, shape in (("mlp_small", (64,)), ("resnet18_64", (3, 64, 64))):
    spec = TensorSpec("input", "FP32", shape)
    ospec = TensorSpec("output", "FP32", (10,))
    entry = ModelEntry(name, "onnxruntime", (spec,), (ospec,), 100.0, 64, True, ())
    session = types.SimpleNamespace(inputs=(spec,), outputs=(ospec,))
    req = kserve.ModelInferRequest(model_name=name)
    req.inputs.add(name="input", datatype="FP32", shape=[1, *shape])
    req.raw_input_contents.append(np.ones((1, *shape), np.float32).tobytes())
    wire_req = req.SerializeToString()
    out_arr = np.ones((1, 10), np.float32)
    sizes = bs.item_nbytes(session) if hasattr(bs, "item_nbytes") else None
    def frontend_in():
        r = kserve.ModelInferRequest.FromString(wire_req)
        p = parse_infer_request(r, entry)
        return control.ExecItem(request_id=1, model=name, budget_us=1000, inputs=p.inputs, rows=p.rows).SerializeToString()
    wire_item = frontend_in()
    def backend_in():
        item = control.ExecItem.FromString(wire_item)
        return bs.decode_inputs(session, item, sizes) if sizes is not None else bs.decode_inputs(session, item)
    outcome = Outcome(ExecStatus.OK, outputs=[out_arr], queue_ns=1, compute_ns=2, batch_size=1)
    def backend_out():
        return bs.encode_result(1, outcome).SerializeToString()
    wire_res = backend_out()
    def frontend_out():
        res = control.ExecResult.FromString(wire_res)
        if Reply is not None:
            res = Reply.from_pb(res)
        resp = kserve.ModelInferResponse(model_name=name, model_version="1", id="")
        shape0 = res.output_shapes[0]
        resp.outputs.add(name="output", datatype="FP32", shape=list(getattr(shape0, "shape", shape0)))
        resp.raw_output_contents.append(res.outputs[0])
        return resp.SerializeToString()
    for stage, f in (("frontend_in", frontend_in), ("backend_in", backend_in), ("backend_out", backend_out),
                     ("frontend_out", frontend_out)):
        for _ in range(200):
            f()
        t = time.process_time()
        for _ in range(N):
            f()
        out[f"{name}.{stage}"] = (time.process_time() - t) / N * 1e6
print(json.dumps(out))
'''

_LOOP = r'''
import asyncio, json, sys, time
import grpc
N, LOOP = int(sys.argv[1]), sys.argv[2]
async def main():
    async def echo(request_iterator, context):
        async for m in request_iterator:
            yield m
    handler = grpc.method_handlers_generic_handler("b.E", {"S": grpc.stream_stream_rpc_method_handler(echo)})
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    call = ch.stream_stream("/b.E/S")()
    window = asyncio.Semaphore(32)
    payload = b"x" * 64
    async def writer():
        for _ in range(N):
            await window.acquire()
            await call.write(payload)
        await call.done_writing()
    t = time.process_time()
    w = asyncio.create_task(writer())
    got = 0
    async for _ in call:
        got += 1
        window.release()
    await w
    cpu = time.process_time() - t
    await ch.close()
    await server.stop(None)
    return cpu / got * 1e6
if LOOP == "uvloop":
    import uvloop
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as r:
        print(json.dumps({"cpu_us_per_message": r.run(main())}))
else:
    print(json.dumps({"cpu_us_per_message": asyncio.run(main())}))
'''


def _run(code: str, cwd: pathlib.Path, *argv: str) -> dict:
    env = {"PYTHONPATH": str(cwd), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code, *argv], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=600)
    if out.returncode:
        raise RuntimeError(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", help="required, except with --smoke (which compares this checkout with itself)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--n", type=int, default=5000)
    p.add_argument("--messages", type=int, default=20000)
    p.add_argument("--out", default=str(OUT / "hotpath-micro.json"))
    add_smoke(p, before=str(ROOT), repeats=2, n=100, messages=300)
    args = parse_args(p, argv)
    if args.before is None:
        p.error("the following arguments are required: --before")
    before = pathlib.Path(args.before)
    path_runs, loop_runs = [], []
    for i in range(args.repeats):
        order = [("before", before), ("after", ROOT)][:: 1 if i % 2 == 0 else -1]
        path_runs.append({n: _run(_PATH, d, str(args.n)) for n, d in order})
        loops = ("asyncio", "uvloop")[:: 1 if i % 2 == 0 else -1]
        loop_runs.append({lp: _run(_LOOP, ROOT, str(args.messages), lp)["cpu_us_per_message"] for lp in loops})
        print(f"repeat {i}: {json.dumps(path_runs[-1])} {json.dumps(loop_runs[-1])}", flush=True)
    keys = list(path_runs[0]["after"])
    print("\n| stage (CPU us per request) | before | after | after/before (median of same-repeat ratios) |")
    print("| --- | ---: | ---: | ---: |")
    summary: dict = {"path": {}, "loop": {}}
    for k in keys:
        b = statistics.median(r["before"][k] for r in path_runs)
        a = statistics.median(r["after"][k] for r in path_runs)
        ratio = statistics.median(r["after"][k] / r["before"][k] for r in path_runs)
        summary["path"][k] = {"before_us": b, "after_us": a, "ratio": ratio}
        print(f"| {k} | {b:.1f} | {a:.1f} | {ratio:.2f} |")
    a = statistics.median(r["asyncio"] for r in loop_runs)
    u = statistics.median(r["uvloop"] for r in loop_runs)
    ratio = statistics.median(r["uvloop"] / r["asyncio"] for r in loop_runs)
    summary["loop"] = {"asyncio_us": a, "uvloop_us": u, "ratio": ratio}
    print(f"\ngrpc.aio stream, CPU us per echoed message: asyncio {a:.1f}, uvloop {u:.1f}, uvloop/asyncio {ratio:.2f}")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    options = {k: v for k, v in vars(args).items() if not k.startswith("_")}   # not add_smoke's own
    out.write_text(json.dumps({"runs": {"path": path_runs, "loop": loop_runs}, "median": summary, "args": options},
                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
