"""What comparing Nexus with Triton needs besides servers and load (benchmarks/vs_triton.py): the
models and scenarios, Triton's tuning grid, when a perf_analyzer level passes, and the Nexus
configurations compared.

- Scenarios: ``single`` (a ResNet-18-class CNN at 100 ms) and ``mix`` (four models of different sizes
  and SLOs behind one machine, equal shares of the total rate).
- :func:`triton_candidates`: Triton configured as its users would tune it (dynamic batching with a
  queue delay and preferred batch sizes, instance count and ORT threads per instance).
- :func:`level_passes`: a level of several models passes when every model's does
  (:meth:`nexus.bench.perf_analyzer.Level.passes`).
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

from nexus.bench.perf_analyzer import Level

MAX_TRITON_BATCH = 64
SERVED_FRACTION = 0.97


@dataclass(frozen=True)
class ModelSpec:
    name: str
    slo_ms: float
    input_shape: tuple[int, ...]


MODELS = {
    "r18_64": ModelSpec("r18_64", 100.0, (3, 64, 64)),
    "small_cnn": ModelSpec("small_cnn", 50.0, (3, 64, 64)),
    "tiny16": ModelSpec("tiny16", 30.0, (3, 16, 16)),
    "mlp": ModelSpec("mlp", 20.0, (64,)),
}
SCENARIOS = {"single": ("r18_64",), "mix": ("r18_64", "small_cnn", "tiny16", "mlp")}
START_RPS = {"single": 150.0, "mix": 200.0}
NEXUS_CONFIGS = {"default": (), "two-devices": ("--backends", "2", "--threads", "1")}


def build_models(directory: pathlib.Path, names) -> dict[str, pathlib.Path]:
    """Write the .onnx files of ``names``; return name -> path."""
    from common.sample_models import mlp_small, model_bytes, resnet18_64, tiny_cnn, vehicle_cls

    builders = {"r18_64": lambda: resnet18_64(seed=1018), "small_cnn": vehicle_cls,
                "tiny16": lambda: tiny_cnn(size=16), "mlp": mlp_small}
    paths = {}
    for name in names:
        paths[name] = directory / f"{name}.onnx"
        paths[name].write_bytes(model_bytes(builders[name]()))
    return paths


def triton_candidates(scenario: str, limits: dict[str, dict]) -> list[dict]:
    """Triton's tuning grid, per candidate a name and each model's settings. ``limits``: each model's
    ORT-direct saturated batch b* (``{"batch": b*}``). ``max_batch_size`` is b* (at most 64),
    ``preferred_batch_size`` [b*/2, b*]; for ``single``, instances x ORT threads in {1 x 2, 2 x 1} and
    a queue delay of 2 or 10 ms; for ``mix``, one instance per model with one ORT thread (side by side,
    a core-thread each) and a queue delay of 0.5 ms or a tenth of the model's SLO, or ORT's default
    threads (the untuned baseline) and 0.5 ms."""
    def model(name: str, instances: int, threads: int, delay_us: int) -> dict:
        b = max(1, min(limits[name]["batch"], MAX_TRITON_BATCH))
        preferred = sorted({max(1, b // 2), b})
        return {"name": name, "max_batch": b, "preferred_batch_sizes": preferred, "queue_delay_us": delay_us,
                "instances": instances, "threads": threads}

    if scenario == "single":
        return [{"name": f"{inst}x{thr} threads, delay {delay // 1000} ms",
                 "models": [model("r18_64", inst, thr, delay)]}
                for inst, thr in ((1, 2), (2, 1)) for delay in (2000, 10000)]
    names = SCENARIOS[scenario]
    out = []
    for threads, label in ((1, "1 thread per model"), (0, "ORT default threads")):
        for delay_name, delay_of in (("0.5 ms", lambda n: 500), ("SLO/10", lambda n: int(MODELS[n].slo_ms * 100))):
            if threads == 0 and delay_name != "0.5 ms":
                continue        # the untuned baseline: one delay is enough
            out.append({"name": f"{label}, delay {delay_name}",
                        "models": [model(n, 1, threads, delay_of(n)) for n in names]})
    return out


def level_passes(levels: list[Level], slos: dict[str, float], window_s: float) -> bool:
    """A level of several models passes when each of theirs does (module docstring)."""
    return bool(levels) and all(lv.passes(slos[lv.model], SERVED_FRACTION, window_s) for lv in levels)


def shares(total_rps: float, models) -> dict[str, float]:
    """Equal shares of the total rate."""
    return {m: total_rps / len(models) for m in models}


def parse_nexus_configs(values: list[str]) -> dict[str, tuple[str, ...]]:
    """``NAME`` (a known configuration) or ``NAME=FLAGS`` (nexus serve flags, space separated)."""
    out = {}
    for value in values:
        name, sep, flags = value.partition("=")
        if not sep:
            if name not in NEXUS_CONFIGS:
                raise ValueError(f"unknown --nexus-config {name!r}; known: {', '.join(NEXUS_CONFIGS)} (or NAME=FLAGS)")
            out[name] = NEXUS_CONFIGS[name]
        else:
            out[name] = tuple(flags.split())
    return out
