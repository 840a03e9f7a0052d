"""Typed, validated per-process configuration; each process's CLI flags derive from its dataclass.

A field's ``metadata={"help": ...}`` becomes the flag's help text; the flag is the field name with
dashes (``slo_ms`` -> ``--slo-ms``). A field whose type is itself a config dataclass (for example
``security: SecurityConfig``) contributes its own fields as flags of the same level. ``validate()``
raises :class:`ConfigError` naming the flag. :func:`to_argv` is the inverse of :func:`from_args`:
the flags that rebuild a config, which is how launchers start a component.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import math
import os
import pathlib
import types
import typing
from dataclasses import dataclass, field

from common.database_url import DatabaseUrlError, check_postgres_url
from common.emulated_gpus import UnknownGpuError, check_device
from common.security import parse_restricted_header


class ConfigError(ValueError):
    """An invalid configuration value; the message names the flag."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _strip_optional(kind):
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(kind) if a is not type(None)][0]
    return kind


def _nested(kind) -> bool:
    return dataclasses.is_dataclass(kind) and isinstance(kind, type)


def _default(f: dataclasses.Field):
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]


def add_arguments(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = (), prefix: str = "") -> None:
    """Add one flag per field of the config dataclass ``cls`` (nested config fields flattened).

    With ``prefix`` (for one command that configures several components, such as ``nexus serve``)
    the flags are ``--PREFIX-FIELD`` and :func:`from_args` must be given the same prefix.
    """
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.init:
            continue
        kind = _strip_optional(hints[f.name])
        if _nested(kind):
            add_arguments(parser, kind, skip, prefix)
            continue
        default = _default(f)
        help_text = f.metadata.get("help", "")
        name = f"{prefix}_{f.name}" if prefix else f.name
        if kind is bool:
            parser.add_argument(_flag(name), dest=name, action=argparse.BooleanOptionalAction,
                                default=default, help=help_text)
        elif isinstance(kind, type) and issubclass(kind, enum.Enum):
            parser.add_argument(_flag(name), dest=name, default=default.value if default is not None else None,
                                choices=[m.value for m in kind], help=help_text)
        elif typing.get_origin(kind) is tuple:
            parser.add_argument(_flag(name), dest=name, default=list(default), nargs="*", help=help_text)
        else:
            parser.add_argument(_flag(name), dest=name, default=default, type=kind if kind in (int, float, str) else str,
                                help=f"{help_text} (default: {default})")


def _build(cls: type, args: argparse.Namespace, overrides: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.name in overrides:
            values[f.name] = overrides[f.name]
            continue
        kind = _strip_optional(hints[f.name])
        if _nested(kind):
            values[f.name] = _build(kind, args, overrides, prefix)
            continue
        dest = f"{prefix}_{f.name}" if prefix else f.name
        if not hasattr(args, dest):
            continue
        value = getattr(args, dest)
        if isinstance(kind, type) and issubclass(kind, enum.Enum) and value is not None:
            value = kind(value)
        elif kind is pathlib.Path and value is not None:
            value = pathlib.Path(value)
        elif typing.get_origin(kind) is tuple:
            value = tuple(value)
        values[f.name] = value
    return cls(**values)


def from_args(cls: type, args: argparse.Namespace, prefix: str = "", **overrides):
    """Build and validate ``cls`` from parsed flags (plus explicit overrides; ``prefix`` as given to
    :func:`add_arguments`)."""
    config = _build(cls, args, overrides, prefix)
    config.validate()
    return config


def to_argv(config) -> list[str]:
    """The flags that rebuild ``config`` with :func:`from_args`: one per field that differs from its default."""
    argv: list[str] = []
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        if not f.init:
            continue
        value = getattr(config, f.name)
        kind = _strip_optional(hints[f.name])
        if _nested(kind):
            argv += to_argv(value)
            continue
        if value == _default(f):
            continue
        if kind is bool:
            argv.append(_flag(f.name) if value else "--no-" + f.name.replace("_", "-"))
        elif typing.get_origin(kind) is tuple:
            argv += [_flag(f.name), *map(str, value)]
        elif isinstance(value, enum.Enum):
            argv += [_flag(f.name), str(value.value)]
        else:
            argv += [_flag(f.name), str(value)]
    return argv


def split_host_port(value: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[IPV6]:PORT`` -> (host without brackets, port); ValueError when malformed."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    if host.startswith("["):
        if not host.endswith("]"):
            raise ValueError(f"expected [IPV6]:PORT, got {value!r}")
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"an IPv6 address needs brackets, [ADDRESS]:PORT; got {value!r}")
    return host, int(port)


def join_host_port(host: str, port: int) -> str:
    """The inverse of :func:`split_host_port` (IPv6 addresses get their brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


_ADVERTISE_HELP = ("HOST:PORT that peers dial to reach this node (default: the --listen address; with a wildcard "
                   "host such as 0.0.0.0 or [::], the address the scheduler sees this node call from, with the "
                   "listening port)")
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]", "*"})


def _check_address(name: str, value: str) -> None:
    try:
        split_host_port(value)
    except ValueError as exc:
        raise ConfigError(f"{_flag(name)}: {exc}") from None


def scheduler_addresses(value: str) -> tuple[str, ...]:
    """``--scheduler HOST:PORT[,HOST:PORT...]``: every scheduler of the cluster (the leader and its
    standbys), in the order to try them."""
    return tuple(a.strip() for a in value.split(",") if a.strip())


def _check_schedulers(value: str) -> None:
    addresses = scheduler_addresses(value)
    if not addresses:
        raise ConfigError("--scheduler: give HOST:PORT, or several separated by commas")
    for address in addresses:
        _check_address("scheduler", address)


def _check_advertise(value: str) -> None:
    if not value:
        return
    _check_address("advertise", value)
    host, port = split_host_port(value)
    if host in WILDCARD_HOSTS or port == 0:
        raise ConfigError(f"--advertise: peers cannot dial {value!r}; give the host and port they reach this node at")


def _check_positive(name: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{_flag(name)}: must be positive, got {value}")


@dataclass(frozen=True)
class DeviceBounds:
    """The least and most devices of each device type (``--min-devices``/``--max-devices``).

    Written ``N`` (every device type) or ``TYPE=N,TYPE=N`` (``*=N`` for the types not named);
    an empty maximum is unbounded.
    """

    low: tuple[tuple[str, int], ...] = ()
    high: tuple[tuple[str, int], ...] = ()

    @classmethod
    def parse(cls, low: str, high: str) -> DeviceBounds:
        bounds = cls(_parse_counts("min_devices", low), _parse_counts("max_devices", high))
        for t, n in bounds.low:
            top = bounds.of(t)[1] if t != "*" else dict(bounds.high).get("*", 1 << 30)
            if n > top:
                raise ConfigError(f"--min-devices: {t}={n} is above --max-devices {top}")
        return bounds

    def of(self, device_type: str) -> tuple[int, int]:
        low, high = dict(self.low), dict(self.high)
        return low.get(device_type, low.get("*", 0)), high.get(device_type, high.get("*", 1 << 30))

    @property
    def elastic(self) -> bool:
        """Whether some device type has a maximum above its minimum: a cluster whose devices an actuator
        (``nexus serve --backends auto``, a Kubernetes autoscaler) adds and removes. Without a maximum
        the scheduler cannot tell an elastic cluster from a fixed one, and takes it as fixed."""
        return any(n > self.of(t)[0] for t, n in self.high)


def _parse_counts(name: str, text: str) -> tuple[tuple[str, int], ...]:
    out: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        device_type, eq, count = part.rpartition("=")
        device_type = device_type.strip() if eq else "*"
        try:
            n = int(count)
        except ValueError:
            raise ConfigError(f"{_flag(name)}: expected N or TYPE=N[,TYPE=N...], got {part!r}") from None
        if n < 0 or not device_type:
            raise ConfigError(f"{_flag(name)}: expected a device type and a count of at least 0, got {part!r}")
        if device_type in out:
            raise ConfigError(f"{_flag(name)}: {device_type!r} given twice")
        out[device_type] = n
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class SecurityConfig:
    """TLS and the cluster token, the same flags on every component (docs/security.md).

    With ``tls_cert``/``tls_key`` every gRPC port of the component serves TLS. ``tls_ca`` verifies
    the servers this component dials and, on the control ports, the client certificates of peers
    (mutual TLS); the component presents its own certificate when it dials. A cluster token from
    ``token_file`` (or the environment variable ``NEXUS_TOKEN``) guards the control protocol.
    """

    tls_cert: str = field(default="", metadata={"help": "PEM certificate this component serves TLS with"})
    tls_key: str = field(default="", metadata={"help": "PEM private key of --tls-cert"})
    tls_ca: str = field(default="", metadata={
        "help": "PEM CA bundle: verifies the servers this component dials, and the client certificates of "
                "peers on its control ports (mutual TLS)"})
    token_file: str = field(default="", metadata={
        "help": "file holding the cluster token that guards the control protocol (default: $NEXUS_TOKEN)"})

    def validate(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("--tls-cert and --tls-key go together: give both or neither")
        for name in ("tls_cert", "tls_key", "tls_ca", "token_file"):
            path = getattr(self, name)
            if path and not pathlib.Path(path).exists():
                raise ConfigError(f"{_flag(name)}: no such file {path!r}")
            if path and pathlib.Path(path).is_dir():
                raise ConfigError(f"{_flag(name)}: {path!r} is a directory, not a file")
            # anything else that exists is read by Credentials.load, which says what is wrong with it
            # (empty, as /dev/null; unreadable)


DEFAULT_SCHEDULER_METRICS_LISTEN = "127.0.0.1:8102"
# --burst-sigma unset, on a cluster of fixed size whose idle devices are too few for the spares
# (SchedulerConfig.resolved_burst_sigma, globalsched/planning/planner.py type_burst_sigma)
FIXED_BURST_SIGMA = 1.5


def companion_listen(listen: str, value: str, default: str) -> str:
    """Where a component's other listener binds: a component asked for any free gRPC port (tests,
    benchmarks, several on one host) takes any free port for it too, unless it was given explicitly."""
    if value == default and split_host_port(listen)[1] == 0:
        return join_host_port(split_host_port(default)[0], 0)
    return value


class PlannerHostKind(str, enum.Enum):
    """Where the scheduler's planner runs (globalsched/planning/planner_host.py)."""

    PROCESS = "process"          # its own process: the event loop's interpreter never plans
    THREAD = "thread"            # a worker thread of the scheduler's process


class LeaderElection(str, enum.Enum):
    """How the schedulers sharing one database choose their leader."""

    DATABASE = "database"        # a lease row in the database (globalsched/state/database/lease.py)
    KUBERNETES = "kubernetes"    # a Kubernetes Lease (globalsched/leadership/kube_lease.py)


@dataclass(frozen=True)
class SchedulerConfig:
    listen: str = field(default="127.0.0.1:8100", metadata={"help": "address the scheduler serves on"})
    data_dir: pathlib.Path = field(default=pathlib.Path(".nexus-data"),
                                   metadata={"help": "model database directory (SQLite + model files); with "
                                                     "--database, a local cache of model files"})
    database: str = field(default="", metadata={
        "help": "postgresql://USER@HOST:PORT/DATABASE: keep the model database in PostgreSQL, shared by every "
                "scheduler of the cluster (empty: SQLite under --data-dir). The password comes from PGPASSWORD "
                "or a PGPASSFILE, never the URL; TLS from sslmode=... in the URL or PGSSLMODE"})
    advertise: str = field(default="", metadata={
        "help": "HOST:PORT the other schedulers send nodes and admin commands to while this one leads "
                "(with --database; default: the address it listens on)"})
    leader_election: LeaderElection = field(default=LeaderElection.DATABASE, metadata={
        "help": "with --database, who leads: database (a lease row in it; anywhere) or kubernetes (a "
                "coordination.k8s.io Lease in the pod's namespace, the database still fencing each term)"})
    leader_lease_s: float = field(default=1.5, metadata={
        "help": "with --database: the leader's lease; a standby takes over this long after the leader stops "
                "renewing it (at once when the leader's process is gone or it stopped cleanly)"})
    epoch_s: float = field(default=30.0, metadata={"help": "re-planning period in seconds"})
    heartbeat_interval_ms: int = field(default=1000, metadata={"help": "heartbeat period asked of nodes"})
    node_timeout_s: float = field(default=5.0, metadata={"help": "a node missing heartbeats this long is removed"})
    max_heartbeats_per_s: float = field(default=200.0, metadata={
        "help": "heartbeats the scheduler asks for per second, all nodes together, at most: a larger cluster's "
                "nodes are asked for a longer period, and --node-timeout-s stretches alike (0: no limit)"})
    max_upload_mb: float = field(default=512.0, metadata={"help": "largest model file accepted"})
    default_slo_ms: float = field(default=100.0, metadata={"help": "SLO of a session when none is given"})
    default_rate_rps: float = field(default=1.0, metadata={
        "help": "rate planned for a session before any report (low: batches start eager, then follow the load)"})
    solver: str = field(default="squishy", metadata={"help": "placement solver"})
    planner: PlannerHostKind = field(default=PlannerHostKind.PROCESS, metadata={
        "help": "where plans are made: process (a planner process beside the scheduler's; its event loop, which "
                "answers heartbeats, spends nothing on planning) or thread (a worker thread, sharing the loop's "
                "interpreter)"})
    latency_split: str = field(default="dp", metadata={"help": "query latency split: dp | even | proportional"})
    rate_headroom: float = field(default=0.0, metadata={
        "help": "plan every session for its measured rate times (1 + this): room for Poisson bursts and for "
                "growth between epochs"})
    burst_sigma: float | None = field(default=None, metadata={
        "help": "burst headroom Z: every device keeps room for the pooled Poisson burst of its sessions' arrivals, "
                "so that a duty cycle overflows with probability at most 1 - Phi(Z) (6.7%% at 1.5); 0 turns it off. "
                "Unset: 0 on an elastic cluster (a --max-devices above --min-devices), whose bursts go to the spares "
                "on --device-headroom's devices, pooled over every session; on a cluster of fixed size, 0 while a "
                "device type's backends hold its plan and --device-headroom more (at least one) for the spares, "
                "1.5 where they are fewer or spare replicas are off"})
    path_allowance_ms: float = field(default=5.0, metadata={
        "help": "time a request spends outside the device on each hop (frontend, gRPC, serialisation); plans keep "
                "duty cycle + batch latency within every SLO, and every query stage's budget, less this"})
    colocation_report: str = field(default="", metadata={
        "help": "a `nexus profile multitenant` JSON report: l(b) of its models is inflated by the measured "
                "co-location slowdown when planning"})
    min_replicas: int = field(default=1, metadata={
        "help": "backends every session keeps at least when enough exist (a model's own --min-replicas "
                "overrides it); 2 or more: losing a backend needs no re-plan"})
    spare_replicas: bool = field(default=True, metadata={
        "help": "fill the backends a plan leaves idle with extra replicas of the busiest sessions: they absorb "
                "bursts and steps at once and a lost backend without an outage, and go first when devices are "
                "removed"})
    spare_overbook: float = field(default=2.0, metadata={
        "help": "a backend holding only spare replicas may be given this many times its duty cycle of their "
                "batches: the frontends split each session's arrivals over its replicas, so a spare runs a "
                "fraction of its batch but in its own session's burst, and the bursts of the sessions sharing it "
                "rarely coincide (1: every spare's batch fits the duty cycle at once)"})
    surge_floors: bool = field(default=False, metadata={
        "help": "hold a session's surge as the floor of its planned rate until its rate window's mean catches up "
                "(off: a surge is planned for while it is the latest report, and bursts are left to the spare "
                "replicas on --device-headroom's devices, pooled over every session; the floors, held for each "
                "session on its own, served fewer requests within SLO for about as many devices, "
                "benchmarks/elastic.md)"})
    metrics_listen: str = field(default=DEFAULT_SCHEDULER_METRICS_LISTEN, metadata={
        "help": "HOST:PORT of the Prometheus endpoint /metrics: nexus_desired_devices{device_type} and the plan "
                "(port 0: any free port; empty: off; left at its default while --listen has port 0, it takes "
                "any free port too)"})
    min_devices: str = field(default="0", metadata={
        "help": "fewest devices to keep: N for every device type, or TYPE=N[,TYPE=N...]"})
    max_devices: str = field(default="", metadata={
        "help": "most devices to ask for: N for every device type, or TYPE=N[,TYPE=N...] (empty: no limit); "
                "beyond it the plan folds sessions onto busy devices and says so"})
    scale_down_cooldown_s: float = field(default=60.0, metadata={
        "help": "a device surplus must last this long before devices are removed, and removals are this far "
                "apart unless the need falls beyond --scale-down-tolerance again (a Kubernetes HPA on "
                "nexus_desired_devices must use the same)"})
    device_headroom: float = field(default=0.6, metadata={
        "help": "ask for this fraction more devices than the plan uses, rounded to the nearest device (none for a "
                "plan of one device): they hold "
                "spare replicas of the busiest sessions, capacity for bursts and steps pooled over every session"})
    scale_down_tolerance: float = field(default=0.1, metadata={
        "help": "keep the devices while the most needed within the cool-down is within this fraction of their "
                "count, and keep this fraction of the need (rounded down) after a removal (Kubernetes' HPA "
                "keeps 10%% too): a plan whose device count wavers under a constant load does not flap"})
    measured_profiles: bool = field(default=True, metadata={
        "help": "plan with the profiles backends measure while serving once enough samples count (off: "
                "measurements are kept and shown, tables and predictions plan; a pinned table always plans)"})
    profile_update_s: float = field(default=10.0, metadata={
        "help": "how often each (model, device type) folds its new serving samples into its measured profile; "
                "a latency raise beyond 10%% needs three agreeing updates"})
    security: SecurityConfig = field(default_factory=SecurityConfig)

    def validate(self) -> None:
        _check_address("listen", self.listen)
        if self.database:
            try:
                check_postgres_url(self.database)
            except DatabaseUrlError as exc:
                raise ConfigError(str(exc)) from None
        if self.metrics_listen:
            _check_address("metrics_listen", self.metrics_listen)
        if self.advertise:
            _check_advertise(self.advertise)
        elif self.database and split_host_port(self.listen)[0] in WILDCARD_HOSTS:
            raise ConfigError(f"--advertise: with --database, the other schedulers send nodes to the leader's "
                              f"address, and {self.listen!r} is not one they can dial: give --advertise HOST:PORT")
        _check_positive("leader_lease_s", self.leader_lease_s)
        if self.leader_election == LeaderElection.KUBERNETES and not self.database:
            raise ConfigError("--leader-election kubernetes: needs --database (the schedulers share it, and it fences "
                              "each leader's term)")
        self.device_bounds
        _check_positive("scale_down_cooldown_s", self.scale_down_cooldown_s)
        if self.device_headroom < 0:
            raise ConfigError(f"--device-headroom: must not be negative, got {self.device_headroom}")
        if not (math.isfinite(self.spare_overbook) and self.spare_overbook >= 1):
            raise ConfigError(f"--spare-overbook: expected a number at least 1, got {self.spare_overbook}")
        if not 0 <= self.scale_down_tolerance < 1:
            raise ConfigError(f"--scale-down-tolerance: expected at least 0 and below 1, got {self.scale_down_tolerance}")
        self.security.validate()
        _check_positive("min_replicas", self.min_replicas)
        if self.latency_split not in ("dp", "even", "proportional"):
            raise ConfigError(f"--latency-split: expected dp, even or proportional, got {self.latency_split!r}")
        for name in ("epoch_s", "node_timeout_s", "max_upload_mb", "default_slo_ms", "default_rate_rps",
                     "profile_update_s"):
            _check_positive(name, getattr(self, name))
        for name in ("rate_headroom", "burst_sigma", "path_allowance_ms", "max_heartbeats_per_s"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ConfigError(f"{_flag(name)}: must not be negative, got {getattr(self, name)}")
        _check_positive("heartbeat_interval_ms", self.heartbeat_interval_ms)

    @property
    def device_bounds(self) -> DeviceBounds:
        return DeviceBounds.parse(self.min_devices, self.max_devices)

    @property
    def resolved_burst_sigma(self) -> float:
        """``burst_sigma``, or where unset the default of the cluster's kind: 0 on an elastic one, whose
        bursts go to the spares on the device headroom (room pooled over every session: issue 24's trace
        kept more requests within the SLO on fewer device-seconds so, benchmarks/elastic.md), and
        FIXED_BURST_SIGMA on a cluster of fixed size, where the plan may leave too few idle devices for
        spares (a traffic query on two idle devices dropped 3.75% of its queries without the room).
        The planner takes 0 there too while the idle devices are enough for the spares
        (globalsched/planning/planner.py, ``type_burst_sigma``); this is the Z where they are not."""
        if self.burst_sigma is not None:
            return self.burst_sigma
        return 0.0 if self.device_bounds.elastic else FIXED_BURST_SIGMA

    @property
    def resolved_metrics_listen(self) -> str:
        """Where /metrics is served ('' when off)."""
        return companion_listen(self.listen, self.metrics_listen, DEFAULT_SCHEDULER_METRICS_LISTEN)


class BatchStart(str, enum.Enum):
    """When a backend starts a session's next batch."""

    EAGER = "eager"              # as soon as the device is free and a request waits
    DUTY_CYCLE = "duty-cycle"    # once the planned batch is queued or the oldest request waited a duty cycle


@dataclass(frozen=True)
class BackendConfig:
    scheduler: str = field(default="127.0.0.1:8100", metadata={
        "help": "scheduler address; with standby schedulers, every one's, separated by commas (the leader is "
                "followed)"})
    listen: str = field(default="127.0.0.1:0", metadata={"help": "address to serve on (port 0: any free port)"})
    device: str = field(default="cpu", metadata={"help": "cpu | cuda[:N] | emulated:<gpu-name>"})
    device_type: str = field(default="", metadata={"help": "profile key of the device (default: derived from --device)"})
    memory_mb: float = field(default=0.0, metadata={"help": "device memory for models (0: detect)"})
    threads: int = field(default=0, metadata={"help": "intra-op threads per model on CPU (0: the runtime's default, one per core)"})
    executor_cpus: str = field(default="", metadata={
        "help": "CPUs the executor thread (where the runtime runs batches) is pinned to, e.g. 3 or 2,3; the "
                "backend's other threads keep the process's CPUs (empty: no pinning)"})
    inline_max_ms: float = field(default=1.0, metadata={
        "help": "CPU device with an unpinned executor: a batch its profile expects to take at most this long runs "
                "on the event loop's thread when the device is idle, sparing two thread hand-overs per batch (0: "
                "every batch runs on the executor thread)"})
    policy: str = field(default="early_drop", metadata={"help": "batch policy: early_drop | earliest_first"})
    max_queue: int = field(default=4096, metadata={"help": "queued requests per session before shedding"})
    metrics_port: int = field(default=0, metadata={
        "help": "port of the Prometheus text endpoint /metrics, on the --listen host (0: off)"})
    exec_port: int = field(default=0, metadata={
        "help": "port of the framed execute channel frontends send requests on, on the --listen host (0: any "
                "free port, which frontends ask for over gRPC; -1: none, frontends use the gRPC Execute stream)"})
    batch_start: BatchStart = field(default=BatchStart.EAGER, metadata={
        "help": "when the next batch starts: eager (as soon as the device is free; batches grow with the "
                "queue) or duty-cycle (wait for the planned batch, at most one duty cycle)"})
    prefix_batching: bool = field(default=True, metadata={
        "help": "run the shared prefix of a prefix group's models once per merged batch"})
    warmup: bool = field(default=True, metadata={
        "help": "run a session's warm-up batches (its model's model_warmup, else batch 1 and the planned batch) "
                "before it takes traffic; off, the first requests pay the runtime's first-run costs"})
    advertise: str = field(default="", metadata={"help": _ADVERTISE_HELP})
    drain_grace_s: float = field(default=20.0, metadata={
        "help": "on SIGTERM: longest wait for the scheduler to move this backend's sessions and for its queues "
                "to drain before it exits"})
    emulated_latency_factor: float = field(default=1.0, metadata={
        "help": "emulated devices: batches take this times the latency of the model's table (below 1: a device "
                "faster than its table says; the scheduler's measured profile then corrects the table)"})
    security: SecurityConfig = field(default_factory=SecurityConfig)

    def validate(self) -> None:
        _check_schedulers(self.scheduler)
        _check_positive("emulated_latency_factor", self.emulated_latency_factor)
        _check_address("listen", self.listen)
        _check_advertise(self.advertise)
        _check_positive("drain_grace_s", self.drain_grace_s)
        self.security.validate()
        if not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"--metrics-port: expected 0 (off) or a port number, got {self.metrics_port}")
        if not -1 <= self.exec_port < 65536:
            raise ConfigError(f"--exec-port: expected -1 (none), 0 (any free port) or a port number, "
                              f"got {self.exec_port}")
        if self.threads < 0:
            raise ConfigError(f"--threads: must be >= 0, got {self.threads}")
        if not self.inline_max_ms >= 0:
            raise ConfigError(f"--inline-max-ms: must be >= 0, got {self.inline_max_ms}")
        self.executor_cpu_set()
        _check_positive("max_queue", self.max_queue)
        if not (self.device == "cpu" or self.device.startswith("cuda") or self.device.startswith("emulated:")):
            raise ConfigError(f"--device: expected cpu, cuda[:N] or emulated:<gpu-name>, got {self.device!r}")
        try:
            check_device(self.device)
        except UnknownGpuError as exc:
            raise ConfigError(f"--device: {exc}") from None

    def executor_cpu_set(self) -> frozenset[int]:
        """``--executor-cpus`` as CPU numbers (empty: no pinning); ConfigError names what is wrong."""
        if not self.executor_cpus.strip():
            return frozenset()
        try:
            cpus = frozenset(int(c) for c in self.executor_cpus.split(","))
        except ValueError:
            raise ConfigError(f"--executor-cpus: expected CPU numbers separated by commas, got "
                              f"{self.executor_cpus!r}") from None
        # The machine's CPUs, not this process's: the process itself may be confined to the others
        # (taskset), leaving the executor's CPU to the runtime alone.
        machine = set(range(os.cpu_count() or 1))
        if not cpus <= machine:
            raise ConfigError(f"--executor-cpus: CPU {', '.join(map(str, sorted(cpus - machine)))} is not one of "
                              f"this machine's (0-{max(machine)})")
        return cpus

    @property
    def resolved_device_type(self) -> str:
        if self.device_type:
            return self.device_type
        if self.device.startswith("emulated:"):
            return self.device.split(":", 1)[1]
        return "cuda" if self.device.startswith("cuda") else "cpu"


DEFAULT_HTTP_LISTEN = "127.0.0.1:8000"
DEFAULT_METRICS_LISTEN = "127.0.0.1:8002"


@dataclass(frozen=True)
class FrontendConfig:
    scheduler: str = field(default="127.0.0.1:8100", metadata={
        "help": "scheduler address; with standby schedulers, every one's, separated by commas (the leader is "
                "followed)"})
    listen: str = field(default="127.0.0.1:8001", metadata={"help": "KServe v2 gRPC address"})
    report_interval_s: float = field(default=2.0, metadata={"help": "period of workload reports"})
    default_slo_ms: float = field(default=0.0, metadata={"help": "deadline of requests without one (0: the model's SLO)"})
    exec_path: str = field(default="stream", metadata={
        "help": "frontend-to-backend path, for benchmarks/frontend_path.py: stream (one Execute stream per "
                "backend) | unary (one ExecuteOne RPC per request)"})
    advertise: str = field(default="", metadata={"help": _ADVERTISE_HELP})
    drain_grace_s: float = field(default=20.0, metadata={
        "help": "on SIGTERM: longest wait for requests in flight to finish before the frontend exits"})
    metrics_listen: str = field(default=DEFAULT_METRICS_LISTEN, metadata={
        "help": "HOST:PORT of the Prometheus endpoint /metrics (port 0: any free port; empty: off; left at its "
                "default while --listen has port 0, it takes any free port too)"})
    http_listen: str = field(default=DEFAULT_HTTP_LISTEN, metadata={
        "help": "KServe v2 HTTP/REST address ('' turns HTTP off; left at its default while --listen has port 0, "
                "HTTP takes any free port too)"})
    http_max_body_mb: float = field(default=64.0, metadata={
        "help": "largest HTTP request body; a larger one is answered 413"})
    restricted_repository_header: str = field(default="", metadata={
        "help": "KEY=VALUE: serve RepositoryModelLoad/Unload only to callers sending header "
                "triton-grpc-protocol-KEY: VALUE (Triton's --grpc-restricted-protocol=model-repository:KEY=VALUE); "
                "others get UNAVAILABLE"})
    restricted_shared_memory_header: str = field(default="", metadata={
        "help": "KEY=VALUE: serve the SystemSharedMemory* calls only to callers sending header "
                "triton-grpc-protocol-KEY: VALUE (Triton's --grpc-restricted-protocol=shared-memory:KEY=VALUE); "
                "others get UNAVAILABLE (without it they are open, as in Triton)"})
    trace: str = field(default="", metadata={
        "help": "append per-request timelines (validate, hop, queue, batch assembly, compute, ...) to this file "
                "as JSON lines; see frontend/trace.py ('' : off)"})
    trace_every: int = field(default=1, metadata={"help": "with --trace: trace one model request in this many"})
    workers: int = field(default=1, metadata={
        "help": "frontend processes sharing --listen and the HTTP port (SO_REUSEPORT; the kernel spreads "
                "connections over them): 1 serves in this process; N > 1 starts N workers and restarts any "
                "that dies, each registered with the scheduler as a frontend of its own; 0: one per core "
                "this process may run on"})
    worker_control_listen: str = field(default="", metadata={
        "help": "set by a frontend with --workers for each worker: HOST:PORT of the worker's own gRPC port, "
                "the address it registers with the scheduler ('' : not a worker)"})
    worker_siblings: str = field(default="", metadata={
        "help": "set by a frontend with --workers for each worker: the other workers' own gRPC addresses, "
                "comma-separated (ModelStatistics sums their request counts into this one's)"})
    security: SecurityConfig = field(default_factory=SecurityConfig)

    def validate(self) -> None:
        _check_schedulers(self.scheduler)
        _check_address("listen", self.listen)
        if self.workers < 0:
            raise ConfigError(f"--workers: expected 0 (one per core) or a positive count, got {self.workers}")
        if self.worker_control_listen:
            _check_address("worker_control_listen", self.worker_control_listen)
            if self.workers != 1:
                raise ConfigError("--worker-control-listen: a worker runs alone (--workers 1)")
        for address in self.sibling_addresses:
            _check_address("worker_siblings", address)
        if self.worker_siblings and not self.worker_control_listen:
            raise ConfigError("--worker-siblings: only a worker (--worker-control-listen) has siblings")
        _check_positive("trace_every", self.trace_every)
        if self.http_listen:
            _check_address("http_listen", self.http_listen)
        _check_positive("http_max_body_mb", self.http_max_body_mb)
        _check_advertise(self.advertise)
        _check_positive("drain_grace_s", self.drain_grace_s)
        self.security.validate()
        _check_positive("report_interval_s", self.report_interval_s)
        if self.metrics_listen:
            _check_address("metrics_listen", self.metrics_listen)
        for flag, value in (("restricted-repository-header", self.restricted_repository_header),
                            ("restricted-shared-memory-header", self.restricted_shared_memory_header)):
            if value:
                try:
                    parse_restricted_header(value)
                except ValueError as exc:
                    raise ConfigError(f"--{flag}: {exc}") from None
        if self.exec_path not in ("stream", "unary"):
            raise ConfigError(f"--exec-path: expected stream or unary, got {self.exec_path!r}")

    @property
    def resolved_http_listen(self) -> str:
        """Where HTTP binds ('' when off)."""
        return companion_listen(self.listen, self.http_listen, DEFAULT_HTTP_LISTEN)

    @property
    def resolved_workers(self) -> int:
        """How many frontend processes serve (--workers 0: the cores this process may run on)."""
        return self.workers or len(os.sched_getaffinity(0))

    @property
    def is_worker(self) -> bool:
        """One of several processes behind shared ports (started by a frontend with --workers)."""
        return bool(self.worker_control_listen)

    @property
    def sibling_addresses(self) -> list[str]:
        return [a.strip() for a in self.worker_siblings.split(",") if a.strip()]

    @property
    def resolved_metrics_listen(self) -> str:
        """Where /metrics is served ('' when off)."""
        return companion_listen(self.listen, self.metrics_listen, DEFAULT_METRICS_LISTEN)
