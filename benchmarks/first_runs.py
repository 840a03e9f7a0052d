"""How many calls a fresh runtime needs before a shape runs at its steady time: the basis of the
default warm-up's runs per size (common/warmup_spec.py, ``DEFAULT_RUNS``).

For each runtime this machine has (ONNX Runtime; PyTorch when the ``torch`` extra is installed) and
each batch size, ``--sessions`` fresh runtimes of a CNN are loaded, and each is called ``--calls``
times in a row at that batch. A call's time is divided by the steady time of its runtime (the median
of its last three calls); the table gives, per call, the median of that ratio over the runtimes. A
runtime whose second call is at 1.0 needs one warm-up run; one whose third is, two.

    python -m benchmarks.first_runs [--sessions 7] [--calls 8] [--batches 1,8] [--json OUT]

The models: ``resnet18_64`` (a sample model) on ONNX Runtime, and on PyTorch a TorchScript CNN of the
same kind of layers (convolutions, batch norm, ReLU, pooling, a linear head). On CPU only: a GPU's
first run at a shape (kernel loading, cuDNN's algorithm search) is what this cannot show here.
Numbers: benchmarks/warmup.md.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import time

import numpy as np

from common.runtimes import RuntimeKind, load_runtime
from common.sample_models import model_bytes, resnet18_64, sample_input
from common.tensors import TensorSpec
from harness.smoke import add_smoke, parse_args


def call_ratios(load, feeds, calls: int) -> list[float]:
    """Each call's time over the runtime's steady time (the median of its last three calls)."""
    with load() as runtime:
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            runtime.run(feeds)
            times.append(time.perf_counter() - start)
    steady = statistics.median(times[-3:])
    return [t / steady for t in times]


def _torchscript_cnn() -> tuple[bytes, tuple]:
    import torch

    class Cnn(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            layers, width = [], 3
            for out in (32, 64, 128, 256):
                layers += [torch.nn.Conv2d(width, out, 3, stride=2, padding=1), torch.nn.BatchNorm2d(out),
                           torch.nn.ReLU()]
                width = out
            self.body = torch.nn.Sequential(*layers)
            self.head = torch.nn.Linear(width, 1000)

        def forward(self, x):
            return self.head(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(self.body(x), 1), 1))

    torch.manual_seed(0)
    buf = io.BytesIO()
    torch.jit.save(torch.jit.script(Cnn().eval()), buf)
    specs = ((TensorSpec("x", "FP32", (3, 64, 64)),), (TensorSpec("logits", "FP32", (1000,)),))
    return buf.getvalue(), specs


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=7)
    p.add_argument("--calls", type=int, default=8)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads of each runtime")
    p.add_argument("--json", default="")
    add_smoke(p, sessions=1, calls=4, batches="2")
    args = parse_args(p, argv)
    batches = [int(b) for b in args.batches.split(",")]
    onnx_model = resnet18_64()
    runtimes = {RuntimeKind.ONNXRUNTIME: (model_bytes(onnx_model), None,
                                          lambda b: {"input": sample_input(onnx_model, b)})}
    try:
        data, specs = _torchscript_cnn()
        runtimes[RuntimeKind.TORCH] = (data, specs, lambda b: {
            "x": np.random.default_rng(b).random((b, 3, 64, 64), dtype=np.float32)})
    except ImportError:
        print("torch is not installed: ONNX Runtime only")
    print(f"CPU {_cpu_model()}, load average {os.getloadavg()[0]:.2f}")
    rows = []
    for kind, (data, specs, make_feeds) in runtimes.items():
        for batch in batches:
            feeds = make_feeds(batch)
            ratios = [call_ratios(lambda: load_runtime(kind, data, "cpu", io=specs, intra_op_threads=args.threads),
                                  feeds, args.calls) for _ in range(args.sessions)]
            medians = [statistics.median(r[i] for r in ratios) for i in range(args.calls)]
            worst = [max(r[i] for r in ratios) for i in range(args.calls)]
            rows.append({"runtime": str(kind), "batch": batch, "median": medians, "worst": worst})
            print(f"{kind} batch {batch}: call / steady, median over {args.sessions} runtimes: "
                  + " ".join(f"{m:.2f}" for m in medians[:4]) + "; worst: "
                  + " ".join(f"{w:.2f}" for w in worst[:4]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load_average": os.getloadavg()[0], "rows": rows}, f, indent=1)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    main()
