"""Serving states: where a model version is on its way from the database to serving requests.

A version is

* ``STORED``: in the database, not loaded (uploaded with ``--no-load``, or unloaded);
* ``LOADING``: loaded, not yet routed: being profiled, placed, loaded and warmed up on backends;
  ``state_reason`` says what it waits for;
* ``READY``: the last routing table the frontends took routes it to backends that hold it;
* ``FAILED``: loaded, but no registered device type can serve it: every one lacks a profile it cannot
  measure, or spent its load attempts (``state_reason`` has the first one's reason);
* ``COLD``: loaded, but resident on no device: their memory holds busier models
  (globalsched/planning/residency.py); a request pages it in.

:func:`serving_state` decides from a version's description and whether it is routed; it is pure.
:class:`Readiness` is the scheduler's record of when each version started loading and first became
routed (``ready_after_s``), with the stages on the way (:data:`STAGES`, each the first time it was
reached: ``stored`` in the database, ``profiled`` on a device type, ``planned`` onto a backend,
``loaded`` and warmed up there, ``routed`` by the frontends), and wakes :meth:`Readiness.changed`
waiters (``nexus models upload`` and the KServe repository load wait on it,
globalsched/state/model_admin.py) whenever something that may change a state happened: a routing table, a
load failure, a profile's end.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Iterable

from common.pb import control

log = logging.getLogger("nexus.scheduler")

_CANNOT = (control.NEEDS_PROFILE, control.CANNOT_LOAD)
STAGES = ("stored", "profiled", "planned", "loaded", "routed")


def serving_state(desc: control.ModelDesc, routed: bool, cold: str = "") -> tuple[int, str]:
    """(control.ServingState, reason) of the version ``desc`` describes; ``routed``: the routing
    table in force routes it to backends; ``cold``: why the plan in force left it cold ("" if not)."""
    if not desc.loaded:
        return control.STORED, "stored, not loaded"
    if routed:
        return control.READY, ""
    if cold:
        return control.COLD, cold
    present = [d for d in desc.device_types if d.backends]
    if not present:
        return control.LOADING, "no backend is registered"
    if all(d.state in _CANNOT for d in present):
        return control.FAILED, f"{present[0].device_type}: {present[0].reason}"
    for d in present:
        if d.state == control.PROFILING:
            return control.LOADING, f"its profile is being measured on {d.device_type}"
    if all(d.state in (*_CANNOT, control.NOT_PROFILED) for d in present):
        waiting = next(d for d in present if d.state == control.NOT_PROFILED)
        return control.LOADING, f"waiting for a backend of {waiting.device_type} to measure its profile"
    return control.LOADING, "being placed, loaded and warmed up on backends"


class Readiness:
    """When versions started loading and first became routed, and a wake-up for those who wait."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.since: dict[str, float] = {}         # version key -> when its upload or load was taken
        self.ready_after_s: dict[str, float] = {}  # version key -> seconds from then to its first route
        self.routed: frozenset[str] = frozenset()  # the version keys the routing table in force routes
        self.stages: dict[str, dict[str, float]] = {}   # version key -> stage -> seconds after ``since``
        self.cold: dict[str, str] = {}             # version key -> why the plan in force left it cold
        self._changed = asyncio.Event()

    def started(self, key: str, at: float | None = None) -> None:
        """``key`` was uploaded or loaded at ``at`` (default: now): its time to ready is measured from there."""
        self.since[key] = self.clock() if at is None else at
        self.ready_after_s.pop(key, None)
        self.stages[key] = {}
        self.poke()

    def forget(self, keys: Iterable[str]) -> None:
        for key in keys:
            self.since.pop(key, None)
            self.ready_after_s.pop(key, None)
            self.stages.pop(key, None)
        self.poke()

    def reached(self, keys: Iterable[str], stage: str) -> None:
        """``keys`` reached ``stage`` now: kept for those on their way, where it is the first time."""
        now = self.clock()
        for key in keys:
            stages = self.stages.get(key)
            if stages is not None and key not in self.ready_after_s and stage not in stages:
                stages[stage] = now - self.since[key]

    def routed_now(self, keys: Iterable[str]) -> None:
        """A routing table routing ``keys`` reached the frontends."""
        self.routed = frozenset(keys)
        self.reached(self.routed, "routed")
        now = self.clock()
        for key in self.routed:
            start = self.since.get(key)
            if start is not None and key not in self.ready_after_s:
                self.ready_after_s[key] = now - start
                log.info("%s ready %.2f s after its upload or load", key, now - start)
        self.poke()

    def poke(self) -> None:
        """Something that may change a serving state happened: wake the waiters."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def changed(self, timeout_s: float) -> None:
        """Return at the next :meth:`poke`, or after ``timeout_s``."""
        try:
            await asyncio.wait_for(self._changed.wait(), max(timeout_s, 0.0))
        except asyncio.TimeoutError:
            pass
