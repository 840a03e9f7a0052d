"""The Triton side of benchmarks/vs_triton.py: a PyTriton server of ONNX models, run by the python of
PyTriton's own virtualenv (``--triton-python``), which has neither this project nor its
dependencies: this file needs only numpy, onnxruntime and pytriton.

    PYTRITON_PYTHON benchmarks/triton_model.py CONFIG_JSON

CONFIG_JSON (text)::

    {"grpc_port": 8001, "http_port": 8000, "metrics_port": 8002,
     "models": [{"name": "r18_64", "path": "/x/r18.onnx", "max_batch": 16, "queue_delay_us": 5000,
                 "preferred_batch_sizes": [8, 16], "instances": 2, "threads": 1, "spin": false}]}

Each model gets ``instances`` model instances (Triton's ``instance_group`` count; PyTriton runs one
callable per instance), each with its own ONNX Runtime session of ``threads`` intra-op threads (0:
ORT's default, one per core) from the direct-ORT baseline (``harness/ort_direct.py``, loaded by
its path), called in PyTriton's ``@batch`` model function; dynamic batching with ``max_batch_size``,
``max_queue_delay_microseconds`` and ``preferred_batch_size``. No endpoint is restricted (PyTriton 0.7
guards statistics with a generated token by default; perf_analyzer reads them). Prints
``TRITON-READY`` once it serves.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import sys
import sysconfig

import numpy as np


def _ort_direct():
    """``harness/ort_direct.py``, loaded by its path: this interpreter cannot import the project,
    and that module needs only numpy and onnxruntime."""
    path = pathlib.Path(__file__).resolve().parents[1] / "harness" / "ort_direct.py"
    spec = importlib.util.spec_from_file_location("ort_direct", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _dims(shape) -> tuple[int, ...]:
    """ORT's shape without the batch dimension, a symbolic dimension as -1."""
    return tuple(d if isinstance(d, int) else -1 for d in shape)


def _infer_fn(session):
    from pytriton.decorators import batch

    in_name, out_name = session.get_inputs()[0].name, session.get_outputs()[0].name

    @batch
    def infer(**inputs):
        return {out_name: session.run([out_name], {in_name: inputs[in_name]})[0]}
    return infer


def main(argv: list[str]) -> int:
    # The python backend's stub loads libpython of this interpreter's version; a pyenv build keeps it
    # in its own LIBDIR, off the loader's path, where a system library of another patch release may be.
    os.environ["LD_LIBRARY_PATH"] = ":".join(filter(None, [sysconfig.get_config_var("LIBDIR"),
                                                         os.environ.get("LD_LIBRARY_PATH")]))
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig, TritonSecurityConfig

    ort_direct = _ort_direct()
    config = json.loads(argv[0])
    triton_config = TritonConfig(grpc_port=config["grpc_port"], http_port=config["http_port"],
                                 metrics_port=config["metrics_port"], grpc_address="127.0.0.1",
                                 http_address="127.0.0.1", metrics_address="127.0.0.1")
    # PyTriton restricts the statistics and repository endpoints to callers with its generated token by
    # default; perf_analyzer reads statistics and model configs, and the server listens on loopback only.
    with Triton(config=triton_config, security_config=TritonSecurityConfig(restricted_endpoints=[])) as triton:
        for m in config["models"]:
            sessions = [ort_direct.ort_session(m["path"], m.get("threads", 0), spin=m.get("spin", False))
                        for _ in range(max(1, m.get("instances", 1)))]
            inp, out = sessions[0].get_inputs()[0], sessions[0].get_outputs()[0]
            batcher = DynamicBatcher(max_queue_delay_microseconds=int(m.get("queue_delay_us", 0)),
                                     preferred_batch_size=list(m.get("preferred_batch_sizes") or []) or None)
            triton.bind(
                model_name=m["name"],
                infer_func=[_infer_fn(s) for s in sessions],
                inputs=[Tensor(name=inp.name, dtype=np.float32, shape=_dims(inp.shape[1:]))],
                outputs=[Tensor(name=out.name, dtype=np.float32, shape=_dims(out.shape[1:]))],
                config=ModelConfig(max_batch_size=int(m["max_batch"]), batcher=batcher),
                strict=False,
            )
        print("TRITON-READY", flush=True)
        triton.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
