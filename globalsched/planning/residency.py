"""Which sessions are resident on a device type's backends, and which are cold.

Every loaded model used to hold a placement, so a fleet larger than the devices' memory was folded
onto them, beyond what they hold (issue 26: "memory 32,016 of 16,000 MB"). Now the devices keep the
sessions the plan gives traffic, and the rest are cold: loaded (stored, routed with the reason) but
on no device, paged in when a request for them arrives (frontend/frontend_state.py holds it and reports
the demand at once; the scheduler re-plans with it resident).

:func:`choose_resident` is pure. It takes sessions most recently used first: by the time of their
last reported request (globalsched/state/rate_reports.py; a frontend reports a request for a cold session at
once), then by measured demand (the busiest of those reported together), then the planned rate,
then those resident before (no churn between equals), then by name. A page-in thus evicts the least
recently used session, as an LRU cache does: never a busy one, whose requests are reported with
every report. Each goes on the backend with the most free memory,
by its memory at batch 1, while it fits. A session that fits on no device even when that device is
empty is not cold: it can never be served on the type, and says so.
"""

from __future__ import annotations

import heapq
import math
from typing import AbstractSet, Mapping, Sequence

from globalsched.planning.cluster_values import SessionInput
from globalsched.planning.placement import BackendSlot

COLD_PREFIX = "cold: "


def session_memory_mb(session: SessionInput, device_type: str) -> float:
    """The memory a session's model holds on ``device_type``: its profile's at batch 1."""
    return session.profiles[device_type].memory_mb(1)


def requested_while_cold(cold: AbstractSet[str], report) -> list[str]:
    """The sessions a workload report counts requests of that the plan in force left cold: the
    scheduler re-plans at once to page them in (globalsched/rpc/service.py, nexus/simulate/control.py)."""
    return [r.model for r in report.rates if r.requests and r.model in cold]


def choose_resident(sessions: Sequence[SessionInput], slots: Sequence[BackendSlot], device_type: str,
                    demand: Mapping[str, float], resident_before: AbstractSet[str] = frozenset(),
                    last_requested_s: Mapping[str, float] = {}
                    ) -> tuple[list[SessionInput], dict[str, str], dict[str, str]]:
    """(resident sessions in their given order, cold sessions with why, sessions too large for any
    device with why). ``demand``: measured rates by session; ``last_requested_s``: when each
    session's requests were last reported (never: not there); ``slots``: the type's backends, whose
    ``memory_mb`` of 0 means unknown (unbounded)."""
    free = [s.memory_mb if s.memory_mb > 0 else math.inf for s in slots]
    largest = max(free, default=0.0)
    # the backends by free memory, most first (the first of equals): a heap, not a scan of every
    # backend per session (a plan of a thousand backends and thousands of sessions spent seconds here)
    most_free = [(-f, k) for k, f in enumerate(free)]
    heapq.heapify(most_free)
    order = sorted(sessions, key=lambda s: (-last_requested_s.get(s.model, -math.inf), -demand.get(s.model, 0.0),
                                            -s.rate_rps, s.model not in resident_before, s.model))
    resident: set[str] = set()
    cold: dict[str, str] = {}
    too_large: dict[str, str] = {}
    for s in order:
        need = session_memory_mb(s, device_type)
        if need > largest:
            too_large[s.model] = (f"needs {need:,.0f} MB on {device_type}, and its largest device holds "
                                  f"{largest:,.0f} MB")
            continue
        if most_free and need <= -most_free[0][0]:
            left, k = most_free[0]
            heapq.heapreplace(most_free, (left + need, k))
            resident.add(s.model)
    left_out = [s.model for s in sessions if s.model not in resident and s.model not in too_large]
    for name in left_out:
        cold[name] = (f"{COLD_PREFIX}not resident: the memory of the {len(slots)} {device_type} device(s) holds "
                      f"{len(resident)} of {len(resident) + len(left_out)} sessions, the most requested; it is paged "
                      f"in when requested")
    return [s for s in sessions if s.model in resident], cold, too_large
