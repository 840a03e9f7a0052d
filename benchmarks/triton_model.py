"""The Triton side of benchmarks/vs_triton.py: a PyTriton server of ONNX models, run by the python of
PyTriton's own virtualenv (``--triton-python``), which has neither this project nor its
dependencies: this file needs only numpy, onnxruntime and pytriton.

    PYTRITON_PYTHON benchmarks/triton_model.py GRPC HTTP METRICS DELAY_US THREADS SPIN NAME=PATH:MAXB ...

ONNX Runtime runs inside the Python model function (PyTriton's ``@batch``) in a session of the
direct-ORT baseline (``nexus/bench/ort_direct.py``, loaded by its path), dynamic batching with
``max_batch_size`` = MAXB and a max queue delay of DELAY_US. Prints ``TRITON-READY`` once it serves.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys
import sysconfig

import numpy as np


def _ort_direct():
    """``nexus/bench/ort_direct.py``, loaded by its path: this interpreter cannot import the project,
    and that module needs only numpy and onnxruntime."""
    path = pathlib.Path(__file__).resolve().parents[1] / "nexus" / "bench" / "ort_direct.py"
    spec = importlib.util.spec_from_file_location("ort_direct", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _dims(shape) -> tuple[int, ...]:
    """ORT's shape without the batch dimension, a symbolic dimension as -1."""
    return tuple(d if isinstance(d, int) else -1 for d in shape)


def main(argv: list[str]) -> int:
    # The python backend's stub loads libpython of this interpreter's version; a pyenv build keeps it
    # in its own LIBDIR, off the loader's path, where a system library of another patch release may be.
    os.environ["LD_LIBRARY_PATH"] = ":".join(filter(None, [sysconfig.get_config_var("LIBDIR"),
                                                         os.environ.get("LD_LIBRARY_PATH")]))
    from pytriton.decorators import batch
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig

    ort_direct = _ort_direct()
    grpc_port, http_port, metrics_port, delay_us, threads, spin = (int(a) for a in argv[:6])
    config = TritonConfig(grpc_port=grpc_port, http_port=http_port, metrics_port=metrics_port,
                          grpc_address="127.0.0.1", http_address="127.0.0.1", metrics_address="127.0.0.1")
    with Triton(config=config) as triton:
        for spec in argv[6:]:
            name, rest = spec.split("=", 1)
            path, max_batch = rest.rsplit(":", 1)
            session = ort_direct.ort_session(path, threads, spin=bool(spin))
            inp, out = session.get_inputs()[0], session.get_outputs()[0]

            def make_fn(session=session, in_name=inp.name, out_name=out.name):
                @batch
                def infer(**inputs):
                    return {out_name: session.run([out_name], {in_name: inputs[in_name]})[0]}
                return infer

            triton.bind(
                model_name=name,
                infer_func=make_fn(),
                inputs=[Tensor(name=inp.name, dtype=np.float32, shape=_dims(inp.shape[1:]))],
                outputs=[Tensor(name=out.name, dtype=np.float32, shape=_dims(out.shape[1:]))],
                config=ModelConfig(max_batch_size=int(max_batch),
                                   batcher=DynamicBatcher(max_queue_delay_microseconds=delay_us)),
                strict=False,
            )
        print("TRITON-READY", flush=True)
        triton.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
