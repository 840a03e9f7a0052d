"""What a simulation models beside the scheduler's own configuration: the cluster's shape, the times
the real processes take (hops, periods, start and load times, planning), the device's jitter, and
the faults to inject. One frozen, validated value; ``nexus simulate``'s flags derive from it.

Defaults and their basis (measured on ``nexus serve --device emulated:t4 --backends auto`` on this
project's 2-core machines by benchmarks/sim_fidelity.py, rounded; each is a flag, and
benchmarks/simulator.md keeps the measurement):

* ``path_ms``: a request's time outside the device, frontend to backend and back (gRPC, the
  frontend's parsing and the reply): 3 ms (measured 2.7-3.1: the 1st percentile of a model's
  latency less l(1)).
* ``control_hop_ms``: one control RPC between the scheduler and a node (a table push, a report): 2 ms.
* ``backend_start_s``: from the actuator starting a backend process to its registration: 1.2 s
  (measured 1.09-1.24, median of 10 starts each).
* ``model_load_s``: one model's runtime created by a table push, before its warm-up batches (which
  the simulated device runs, as the engine does): 0.03 s (a plan's way grew 0.145-0.159 s per
  model new to a backend, of which the warm-up batches took 0.108-0.115 s).
* ``planning_ms``: the scheduler's time for one plan (plan_cluster): 50 ms (measured median
  47-49 ms for this benchmark's 24 models; the simulator's own runs of plan_cluster show how it grows).
* ``table_update_ms``: a backend's fixed time to take a model table and answer it, models aside
  (its parsing, the warm-up bookkeeping, the answer, on a shared CPU): 200 ms (a plan that moved
  nothing still took 0.15-0.28 s to reach the frontends; the fitted intercept was 0.26-0.33 s,
  less planning and three hops).
* ``jitter_cv``: the spread of a batch's time about l(b) on an emulated device (coefficient of
  variation, lognormal): 0.03. With ``device_time`` MEASURED, a profile row's own measured mean and
  standard deviation (``mean_ms``, ``std_ms``: what the profiler and the backends' per-batch samples
  give) set the batch's time and spread instead, where the row has them.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace

from common.config import ConfigError, SchedulerConfig


class DeviceTime(str, enum.Enum):
    """What a simulated batch of b rows takes on its device."""

    PROFILE = "profile"      # l(b), the profile's conservative figure, as an emulated device waits it
    MEASURED = "measured"    # the profile's measured mean at b with its measured spread (rows with mean_ms
                             # and std_ms, as the profiler and the backends' samples give them); l(b) elsewhere


class FaultKind(str, enum.Enum):
    KILL_BACKENDS = "kill"            # SIGKILL the backends the frontends send the most (ClusterPlan.routed_load_rps)
    STALL_SCHEDULER = "stall"         # the scheduler's loop answers nothing for a while


@dataclass(frozen=True)
class Fault:
    kind: FaultKind
    at_s: float
    count: int = 0                    # backends killed
    duration_s: float = 0.0           # how long the scheduler stalls

    @staticmethod
    def parse(text: str) -> "Fault":
        """``kill:T:K`` (kill K backends at T seconds) or ``stall:T:S`` (stall the scheduler for S
        seconds from T); ConfigError naming what is wrong."""
        parts = text.split(":")
        kinds = ", ".join(k.value for k in FaultKind)
        if len(parts) != 3:
            raise ConfigError(f"--fault {text!r}: expected KIND:SECONDS:AMOUNT (kinds: {kinds}), e.g. kill:60:2")
        try:
            kind = FaultKind(parts[0])
        except ValueError:
            raise ConfigError(f"--fault {text!r}: unknown kind {parts[0]!r} (kinds: {kinds})") from None
        try:
            at_s, amount = float(parts[1]), float(parts[2])
        except ValueError:
            raise ConfigError(f"--fault {text!r}: time and amount must be numbers") from None
        if not (math.isfinite(at_s) and at_s >= 0 and math.isfinite(amount) and amount > 0):
            raise ConfigError(f"--fault {text!r}: the time must be >= 0 and the amount > 0")
        if kind is FaultKind.KILL_BACKENDS:
            if amount != int(amount):
                raise ConfigError(f"--fault {text!r}: the number of backends must be a whole number")
            return Fault(kind, at_s, count=int(amount))
        return Fault(kind, at_s, duration_s=amount)

    def describe(self) -> str:
        if self.kind is FaultKind.KILL_BACKENDS:
            return f"kill {self.count} backend(s) at {self.at_s:g} s"
        return f"stall the scheduler for {self.duration_s:g} s at {self.at_s:g} s"


TIME_PARAMETERS = ("path_ms", "control_hop_ms", "backend_start_s", "model_load_s", "planning_ms", "table_update_ms",
                   "jitter_cv")      # what the real processes take: measured, and flags of nexus simulate


@dataclass(frozen=True)
class SimConfig:
    device_type: str = "t4"
    memory_mb: float = 16000.0          # of each device (0: unbounded)
    backends: int | None = None         # a fixed count; None: auto, by the scaling policy
    min_backends: int = 1
    max_backends: int = 8
    frontends: int = 1
    path_ms: float = 3.0
    control_hop_ms: float = 2.0
    backend_start_s: float = 1.2
    model_load_s: float = 0.03
    planning_ms: float = 50.0
    table_update_ms: float = 200.0
    jitter_cv: float = 0.03
    device_time: DeviceTime = DeviceTime.PROFILE
    report_interval_s: float = 2.0      # the frontends' workload reports (FrontendConfig's default)
    batch_policy: str = "early_drop"
    max_queue: int = 4096               # per session, as the backend's --max-queue
    seed: int = 0
    faults: tuple[Fault, ...] = ()
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    @property
    def auto(self) -> bool:
        return self.backends is None

    def as_served(self) -> "SimConfig":
        """This configuration as ``nexus serve --backends auto`` runs it: with auto and no maximum of the
        scheduler's own, the bounds are ``min_backends``/``max_backends`` of the device type, so that the
        scheduler knows its cluster is elastic (``SchedulerConfig.resolved_burst_sigma``)."""
        if not self.auto or self.scheduler.device_bounds.high:
            return self
        return replace(self, scheduler=replace(
            self.scheduler, min_devices=f"{self.device_type}={self.min_backends}",
            max_devices=f"{self.device_type}={self.max_backends}"))

    def validate(self) -> None:
        if self.backends is not None and self.backends < 1:
            raise ConfigError(f"--backends: expected at least 1 or 'auto', got {self.backends}")
        if self.min_backends < 1:
            raise ConfigError(f"--min-backends: must be at least 1, got {self.min_backends}")
        if self.max_backends < self.min_backends:
            raise ConfigError(f"--max-backends {self.max_backends} is below --min-backends {self.min_backends}")
        if self.frontends < 1:
            raise ConfigError(f"--frontends: must be at least 1, got {self.frontends}")
        for name in (*TIME_PARAMETERS, "memory_mb"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"--{name.replace('_', '-')}: must be a number >= 0, got {value}")
        if not self.report_interval_s > 0:
            raise ConfigError(f"--report-interval-s: must be positive, got {self.report_interval_s}")
        if self.max_queue < 1:
            raise ConfigError(f"--max-queue: must be at least 1, got {self.max_queue}")
        self.scheduler.validate()
