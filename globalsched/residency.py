"""Which sessions are resident on a device type's backends, and which are cold.

Every loaded model used to hold a placement, so a fleet larger than the devices' memory was folded
onto them, beyond what they hold (issue 26: "memory 32,016 of 16,000 MB"). Now the devices keep the
sessions the plan gives traffic, and the rest are cold: loaded (stored, routed with the reason) but
on no device, paged in when a request for them arrives (frontend/dispatch.py holds it and reports
the demand at once; the scheduler re-plans with it resident).

:func:`choose_resident` is pure. It takes sessions in order of popularity: demand measured now
first (a cold session that was just requested has some), then the planned rate, then those resident
before (no churn between equals), then by name. Each goes on the backend with the most free memory,
by its memory at batch 1, while it fits. A session that fits on no device even when that device is
empty is not cold: it can never be served on the type, and says so.
"""

from __future__ import annotations

import math
from typing import AbstractSet, Mapping, Sequence

from globalsched.cluster import SessionInput
from globalsched.placement import BackendSlot

COLD_PREFIX = "cold: "


def session_memory_mb(session: SessionInput, device_type: str) -> float:
    """The memory a session's model holds on ``device_type``: its profile's at batch 1."""
    return session.profiles[device_type].memory_mb(1)


def choose_resident(sessions: Sequence[SessionInput], slots: Sequence[BackendSlot], device_type: str,
                    demand: Mapping[str, float], resident_before: AbstractSet[str] = frozenset()
                    ) -> tuple[list[SessionInput], dict[str, str], dict[str, str]]:
    """(resident sessions in their given order, cold sessions with why, sessions too large for any
    device with why). ``demand``: measured rates by session; ``slots``: the type's backends, whose
    ``memory_mb`` of 0 means unknown (unbounded)."""
    free = [s.memory_mb if s.memory_mb > 0 else math.inf for s in slots]
    largest = max(free, default=0.0)
    order = sorted(sessions, key=lambda s: (-(demand.get(s.model, 0.0) > 0), -demand.get(s.model, 0.0),
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
        i = max(range(len(free)), key=lambda k: free[k]) if free else -1
        if i >= 0 and need <= free[i]:
            free[i] -= need
            resident.add(s.model)
    left_out = [s.model for s in sessions if s.model not in resident and s.model not in too_large]
    for name in left_out:
        cold[name] = (f"{COLD_PREFIX}not resident: the memory of the {len(slots)} {device_type} device(s) holds "
                      f"{len(resident)} of {len(resident) + len(left_out)} sessions, the most requested; it is paged "
                      f"in when requested")
    return [s for s in sessions if s.model in resident], cold, too_large
