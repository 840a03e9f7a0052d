"""What comparing Nexus with Triton needs besides servers and load (benchmarks/vs_triton.py): the
models and scenarios, Triton's tuning grid, when a perf_analyzer level passes, and the Nexus
configurations compared.

- Scenarios: ``single`` (a ResNet-18-class CNN at 100 ms) and ``mix`` (four models of different sizes
  and SLOs behind one machine, equal shares of the total rate).
- :func:`triton_candidates`: Triton configured as its users would tune it (dynamic batching with a
  queue delay and preferred batch sizes, instance count and ORT threads per instance).
- :func:`level_passes`: a level of several models passes when every model's does
  (:meth:`harness.perf_analyzer.Level.passes`).
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

from common.late_requests import LateRequests
from harness.perf_analyzer import Level

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
SCENARIOS = {"single": ("r18_64",), "mix": ("r18_64", "small_cnn", "tiny16", "mlp"), "tiny": ("mlp",)}
START_RPS = {"single": 60.0, "mix": 80.0, "tiny": 200.0}   # the ladders start low: a level of a shared machine fails early
# "default" is what a user gets: since 2026-12-04 the CPU layout auto (nexus/cpu_layout.py); before
# it, one backend for the machine, now "machine"
NEXUS_CONFIGS = {"default": (), "machine": ("--cpu-layout", "machine"),
                 "two-devices": ("--backends", "2", "--threads", "1"),
                 "per-core": ("--cpu-layout", "per-core"), "auto-layout": ("--cpu-layout", "auto")}


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


def _triton_model(name: str, max_batch: int, instances: int, threads: int, delay_us: int) -> dict:
    b = max(1, min(max_batch, MAX_TRITON_BATCH))
    return {"name": name, "max_batch": b, "preferred_batch_sizes": sorted({max(1, b // 2), b}),
            "queue_delay_us": delay_us, "instances": instances, "threads": threads}


def triton_candidates(scenario: str, limits: dict[str, dict]) -> list[dict]:
    """The first stage of Triton's tuning, per candidate a name and each model's settings, as Triton's
    Model Analyzer sweeps them: ``max_batch_size`` with ``preferred_batch_size`` [max/2, max], and
    instances x ORT threads per instance. ``limits``: each model's ORT-direct saturated batch b*
    (``{"batch": b*}``).

    - single: max batch 8, 16 or 32, times 1 instance of 2 threads or 2 of 1, at a 5 ms queue delay;
    - tiny (the MLP alone): max batch b* (at least 8), 1 instance of 1 ORT thread at a 0.5 or 2 ms
      (SLO/10) queue delay, or 2 instances of 1 thread at 0.5 ms;
    - mix: max batch b* (within 8..64) per model; one instance of one ORT thread per model (the four
      models side by side, a core-thread each) at a 0.5 ms queue delay or a tenth of the model's SLO,
      or ORT's default threads (the untuned baseline) at 0.5 ms.

    :func:`delay_candidates` is the second stage."""
    if scenario == "tiny":
        b = max(8, limits["mlp"]["batch"])
        return [{"name": f"max batch {b}, {inst}x1 thread, delay {delay / 1000:g} ms",
                 "models": [_triton_model("mlp", b, inst, 1, delay)]}
                for inst, delay in ((1, 500), (1, 2000), (2, 500))]
    if scenario == "single":
        return [{"name": f"max batch {b}, {inst}x{thr} threads, delay 5 ms",
                 "models": [_triton_model("r18_64", b, inst, thr, 5000)]}
                for b in (8, 16, 32) for inst, thr in ((1, 2), (2, 1))]
    names = SCENARIOS[scenario]

    def batch(n: str) -> int:
        return max(8, limits[n]["batch"])

    return [
        {"name": "1 thread per model, delay 0.5 ms", "models": [_triton_model(n, batch(n), 1, 1, 500) for n in names]},
        {"name": "1 thread per model, delay SLO/10",
         "models": [_triton_model(n, batch(n), 1, 1, int(MODELS[n].slo_ms * 100)) for n in names]},
        {"name": "ORT default threads, delay 0.5 ms", "models": [_triton_model(n, batch(n), 1, 0, 500) for n in names]},
    ]


def delay_candidates(best: dict) -> list[dict]:
    """The second stage: the best first-stage candidate at a shorter and a longer queue delay (a
    quarter and four times its own)."""
    out = []
    for factor, word in ((0.25, "shorter"), (4, "longer")):
        models = [{**m, "queue_delay_us": int(m["queue_delay_us"] * factor)} for m in best["models"]]
        delays = ", ".join(f"{m['queue_delay_us'] / 1000:g}" for m in models)
        out.append({"name": f"{best['name']}, {word} delay ({delays} ms)", "models": models})
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


def parse_late_requests(text: str) -> list[LateRequests]:
    """``drop``, ``serve`` or both, comma-separated: how Nexus's models are uploaded (one server each);
    ValueError names what is wrong."""
    try:
        values = [LateRequests(v) for v in text.split(",") if v]
    except ValueError:
        values = []
    if not values:
        raise ValueError(f"--late-requests: expected drop and/or serve, got {text!r}")
    return values
