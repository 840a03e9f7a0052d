"""Typed, validated per-process configuration; each process's CLI flags derive from its dataclass.

A field's ``metadata={"help": ...}`` becomes the flag's help text; the flag is the field name with
dashes (``slo_ms`` -> ``--slo-ms``). ``validate()`` raises :class:`ConfigError` naming the field.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import pathlib
import typing
from dataclasses import dataclass, field


class ConfigError(ValueError):
    """An invalid configuration value; the message names the flag."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """Add one flag per field of the config dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.init:
            continue
        kind = hints[f.name]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        help_text = f.metadata.get("help", "")
        if kind is bool:
            parser.add_argument(_flag(f.name), dest=f.name, action=argparse.BooleanOptionalAction,
                                default=default, help=help_text)
            continue
        origin = typing.get_origin(kind)
        if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
            args = [a for a in typing.get_args(kind) if a is not type(None)]
            kind = args[0]
        if isinstance(kind, type) and issubclass(kind, enum.Enum):
            parser.add_argument(_flag(f.name), dest=f.name, default=default.value if default is not None else None,
                                choices=[m.value for m in kind], help=help_text)
        elif typing.get_origin(kind) is tuple:
            parser.add_argument(_flag(f.name), dest=f.name, default=list(default), nargs="*", help=help_text)
        else:
            parser.add_argument(_flag(f.name), dest=f.name, default=default, type=kind if kind in (int, float, str) else str,
                                help=f"{help_text} (default: {default})")


def from_args(cls: type, args: argparse.Namespace, **overrides):
    """Build and validate ``cls`` from parsed flags (plus explicit overrides)."""
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.name in overrides:
            values[f.name] = overrides[f.name]
            continue
        if not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        kind = hints[f.name]
        if typing.get_origin(kind) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
            kind = [a for a in typing.get_args(kind) if a is not type(None)][0]
        if isinstance(kind, type) and issubclass(kind, enum.Enum) and value is not None:
            value = kind(value)
        elif kind is pathlib.Path and value is not None:
            value = pathlib.Path(value)
        elif typing.get_origin(kind) is tuple:
            value = tuple(value)
        values[f.name] = value
    config = cls(**values)
    config.validate()
    return config


def _check_address(name: str, value: str) -> None:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not (0 <= int(port) < 65536):
        raise ConfigError(f"{_flag(name)}: expected HOST:PORT, got {value!r}")


def _check_positive(name: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{_flag(name)}: must be positive, got {value}")


@dataclass(frozen=True)
class SchedulerConfig:
    listen: str = field(default="127.0.0.1:8100", metadata={"help": "address the scheduler serves on"})
    data_dir: pathlib.Path = field(default=pathlib.Path(".nexus-data"),
                                   metadata={"help": "model database directory (SQLite + model files)"})
    epoch_s: float = field(default=30.0, metadata={"help": "re-planning period in seconds"})
    heartbeat_interval_ms: int = field(default=1000, metadata={"help": "heartbeat period asked of nodes"})
    node_timeout_s: float = field(default=5.0, metadata={"help": "a node missing heartbeats this long is removed"})
    max_upload_mb: float = field(default=512.0, metadata={"help": "largest model file accepted"})
    default_slo_ms: float = field(default=100.0, metadata={"help": "SLO of a session when none is given"})
    default_rate_rps: float = field(default=1.0, metadata={
        "help": "rate planned for a session before any report (low: batches start eager, then follow the load)"})
    solver: str = field(default="squishy", metadata={"help": "placement solver"})
    latency_split: str = field(default="dp", metadata={"help": "query latency split: dp | even | proportional"})
    rate_headroom: float = field(default=0.0, metadata={
        "help": "plan every session for its measured rate times (1 + this): room for Poisson bursts and for "
                "growth between epochs"})
    burst_sigma: float = field(default=1.5, metadata={
        "help": "provision every session for Poisson bursts: a duty cycle of its saturated batch holds n + "
                "this * sqrt(n) arrivals instead of their mean n"})
    path_allowance_ms: float = field(default=5.0, metadata={
        "help": "time a request spends outside the device on each hop (frontend, gRPC, serialisation); plans keep "
                "duty cycle + batch latency within every SLO, and every query stage's budget, less this"})
    colocation_report: str = field(default="", metadata={
        "help": "a `nexus profile multitenant` JSON report: l(b) of its models is inflated by the measured "
                "co-location slowdown when planning"})

    def validate(self) -> None:
        _check_address("listen", self.listen)
        if self.latency_split not in ("dp", "even", "proportional"):
            raise ConfigError(f"--latency-split: expected dp, even or proportional, got {self.latency_split!r}")
        for name in ("epoch_s", "node_timeout_s", "max_upload_mb", "default_slo_ms", "default_rate_rps"):
            _check_positive(name, getattr(self, name))
        for name in ("rate_headroom", "burst_sigma", "path_allowance_ms"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{_flag(name)}: must not be negative, got {getattr(self, name)}")
        _check_positive("heartbeat_interval_ms", self.heartbeat_interval_ms)


class BatchStart(str, enum.Enum):
    """When a backend starts a session's next batch."""

    EAGER = "eager"              # as soon as the device is free and a request waits
    DUTY_CYCLE = "duty-cycle"    # once the planned batch is queued or the oldest request waited a duty cycle


@dataclass(frozen=True)
class BackendConfig:
    scheduler: str = field(default="127.0.0.1:8100", metadata={"help": "scheduler address"})
    listen: str = field(default="127.0.0.1:0", metadata={"help": "address to serve on (port 0: any free port)"})
    device: str = field(default="cpu", metadata={"help": "cpu | cuda[:N] | emulated:<gpu-name>"})
    device_type: str = field(default="", metadata={"help": "profile key of the device (default: derived from --device)"})
    memory_mb: float = field(default=0.0, metadata={"help": "device memory for models (0: detect)"})
    threads: int = field(default=0, metadata={"help": "intra-op threads per model on CPU (0: all cores but one)"})
    policy: str = field(default="early_drop", metadata={"help": "batch policy: early_drop | earliest_first"})
    max_queue: int = field(default=4096, metadata={"help": "queued requests per session before shedding"})
    metrics_port: int = field(default=0, metadata={
        "help": "port of the Prometheus text endpoint /metrics, on the --listen host (0: off)"})
    batch_start: BatchStart = field(default=BatchStart.EAGER, metadata={
        "help": "when the next batch starts: eager (as soon as the device is free; batches grow with the "
                "queue) or duty-cycle (wait for the planned batch, at most one duty cycle)"})
    prefix_batching: bool = field(default=True, metadata={
        "help": "run the shared prefix of a prefix group's models once per merged batch"})

    def validate(self) -> None:
        _check_address("scheduler", self.scheduler)
        _check_address("listen", self.listen)
        if not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"--metrics-port: expected 0 (off) or a port number, got {self.metrics_port}")
        if self.threads < 0:
            raise ConfigError(f"--threads: must be >= 0, got {self.threads}")
        _check_positive("max_queue", self.max_queue)
        if not (self.device == "cpu" or self.device.startswith("cuda") or self.device.startswith("emulated:")):
            raise ConfigError(f"--device: expected cpu, cuda[:N] or emulated:<gpu-name>, got {self.device!r}")

    @property
    def resolved_device_type(self) -> str:
        if self.device_type:
            return self.device_type
        if self.device.startswith("emulated:"):
            return self.device.split(":", 1)[1]
        return "cuda" if self.device.startswith("cuda") else "cpu"


@dataclass(frozen=True)
class FrontendConfig:
    scheduler: str = field(default="127.0.0.1:8100", metadata={"help": "scheduler address"})
    listen: str = field(default="127.0.0.1:8001", metadata={"help": "KServe v2 gRPC address"})
    report_interval_s: float = field(default=2.0, metadata={"help": "period of workload reports"})
    default_slo_ms: float = field(default=0.0, metadata={"help": "deadline of requests without one (0: the model's SLO)"})
    exec_path: str = field(default="stream", metadata={
        "help": "frontend-to-backend path, for benchmarks/frontend_path.py: stream (one Execute stream per "
                "backend) | unary (one ExecuteOne RPC per request)"})

    def validate(self) -> None:
        _check_address("scheduler", self.scheduler)
        _check_address("listen", self.listen)
        _check_positive("report_interval_s", self.report_interval_s)
        if self.exec_path not in ("stream", "unary"):
            raise ConfigError(f"--exec-path: expected stream or unary, got {self.exec_path!r}")
