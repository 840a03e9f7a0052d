"""Planner configuration and the solver names (``nexus plan --solver``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Solver(str, enum.Enum):
    """Every planner ``solve`` can run. The last three are the benchmark's baselines."""

    SQUISHY = "squishy"                  # memory- and prefix-aware squishy bin packing + consolidation
    CPSAT = "cpsat"                      # exact CP-SAT on small instances, else CP-SAT LNS from squishy
    CPSAT_LNS = "cpsat-lns"              # always the improvement step starting from squishy
    NEXUS = "nexus"                      # squishy as published: no memory check, no consolidation
    BATCH_OBLIVIOUS = "batch-oblivious"  # squishy with every session at batch 1
    ONE_PER_GPU = "one-per-gpu"          # one model per GPU at its largest SLO-feasible batch


@dataclass(frozen=True)
class PlannerConfig:
    """Margins taken from every SLO and the CP-SAT knobs.

    ``margins_ms`` (network + preprocess + postprocess) is the part of each request's SLO spent
    outside the GPU; plans keep ``duty_cycle + exec <= slo - margins_ms``. CP-SAT stops after
    ``cpsat_time_limit_s`` (the exact model, or the LNS as a whole) and the result says whether it
    proved optimality. ``exact_max_sessions``/``exact_max_gpus`` decide what "small" means for
    ``cpsat``; larger instances get the LNS improvement step.
    """

    network_ms: float = 0.0
    preprocess_ms: float = 0.0
    postprocess_ms: float = 0.0
    burst_sigma: float = 0.0             # z: each GPU keeps room for its sessions' pooled Poisson burst, a
    #                                      cycle overflowing with probability <= 1 - Phi(z) (globalsched/planning/headroom.py)
    cpsat_time_limit_s: float = 10.0
    cpsat_workers: int = 2
    exact_max_sessions: int = 8
    exact_max_gpus: int = 8
    lns_neighbourhood_gpus: int = 4
    lns_max_rounds: int = 200
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("network_ms", "preprocess_ms", "postprocess_ms", "burst_sigma"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must not be negative")
        if self.cpsat_time_limit_s <= 0:
            raise ValueError("cpsat_time_limit_s: must be positive")

    @property
    def margins_ms(self) -> float:
        return self.network_ms + self.preprocess_ms + self.postprocess_ms
