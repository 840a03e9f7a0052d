"""Serving a model's versions: which to plan, and when an old one retires (the zero-downtime update).

The version policy says which stored versions are served (common/version_policy.py); each served version
is a session of its own, named by its version key, so the planner places versions as it places any
session and never needs to know they are versions. This module decides which versions to hand it.

An update (a new version uploaded, the policy serving only the latest) goes in three steps:

1. the new version is planned *beside* the old one, which keeps serving: backends load the new one
   and run its warm-up before they answer their model table (backend/model_table.py), and routing tables
   go out only after that answer (globalsched/actuators/distribution.py);
2. the routing table that routes the new version reaches the frontends, where a request without a
   version goes to the newest version that has backends: traffic moves to the new version, warm;
3. :data:`RETIRE_GRACE_S` after that push, time for the requests already sent to the old version to
   be answered, a re-plan leaves the old version out and the backends unload it.

While the newest version the policy selects has no backend (being profiled, or it cannot load),
the versions served before keep serving. After a scheduler restart nothing is known to be routed,
so the plan starts from what the policy selects.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Iterable, Mapping, Sequence

from common.version_policy import split_key, version_key

log = logging.getLogger("nexus.scheduler")

RETIRE_GRACE_S = 2.0    # an old version stays loaded this long after the new one is routed


def versions_to_plan(selected: Sequence[int], routed_since: Mapping[int, float], now_s: float,
                     grace_s: float = RETIRE_GRACE_S) -> tuple[int, ...]:
    """The versions of one model to plan: those its policy ``selected``, and the versions routed now
    (``routed_since``: version -> when first routed) that it no longer selects, until the newest
    selected version has been routed for ``grace_s``. Pure."""
    keep = set(selected)
    old = [v for v in routed_since if v not in keep]
    if old:
        since = routed_since.get(max(selected)) if selected else None
        if since is None or now_s - since < grace_s:
            keep.update(old)
    return tuple(sorted(keep))


def rates_for_versions(selected: Mapping[str, Sequence[int]], rates_rps: Mapping[str, float]) -> dict[str, float]:
    """``rates_rps`` (by session) with the newest selected version of each model in ``selected`` (its
    name -> the versions its policy selects) planned for the demand of its versions that the policy no
    longer selects as well: a request without a version moves to the newest, and it must carry that
    load from the moment it is routed. A model selecting none keeps its rates. One pass over the
    rates, whatever the number of models. Pure."""
    out = dict(rates_rps)
    for key, rate in rates_rps.items():
        name, version = split_key(key)
        chosen = selected.get(name)
        if chosen and version not in chosen and rate > 0:
            newest = version_key(name, max(chosen))
            out[newest] = out.get(newest, 0.0) + rate
    return out


class VersionRollout:
    """Which version keys the frontends route now, since when; asks for the re-plan that retires old
    versions once their grace is over (``request(why)``, the scheduler's re-plan trigger)."""

    def __init__(self, request: Callable[[str], None], grace_s: float = RETIRE_GRACE_S) -> None:
        self.request = request
        self.grace_s = grace_s
        self.routed_since: dict[str, float] = {}      # version key -> when a pushed table first routed it
        self._by_name: dict[str, dict[int, float]] | None = None     # routed_since by model name and version
        self._retiring: set[str] = set()               # version keys whose retirement is asked for

    def plan(self, name: str, selected: Sequence[int], now_s: float) -> tuple[int, ...]:
        """The versions of ``name`` to plan now (:func:`versions_to_plan`)."""
        if self._by_name is None:           # grouped once per change of routed_since
            self._by_name = {}
            for key, since in self.routed_since.items():
                n, v = split_key(key)
                self._by_name.setdefault(n, {})[v] = since
        return versions_to_plan(selected, self._by_name.get(name, {}), now_s, self.grace_s)

    def replaced(self, key: str) -> None:
        """Version ``key`` was uploaded again: it counts as routed only once a table routes the new upload."""
        self.routed_since.pop(key, None)
        self._by_name = None

    def routed(self, keys: Iterable[str], selected: Callable[[str], Sequence[int]], now_s: float) -> None:
        """A routing table that routes ``keys`` reached the frontends at ``now_s``; ``selected(name)``
        gives the versions a model's policy selects. Old versions whose newest selected one is routed
        now retire after the grace."""
        keys = set(keys)
        self.routed_since = {k: self.routed_since.get(k, now_s) for k in keys}
        self._by_name = None
        self._retiring &= keys
        by_name: dict[str, list[int]] = {}
        for key in keys:
            name, version = split_key(key)
            by_name.setdefault(name, []).append(version)
        for name, versions in by_name.items():
            chosen = selected(name)
            old = [v for v in versions if v not in chosen]
            if not chosen or not old or max(chosen) not in versions:
                continue
            retiring = {version_key(name, v) for v in old} - self._retiring
            if retiring:
                self._retiring |= retiring
                why = (f"model {name}: version {max(chosen)} is routed; version "
                       f"{', '.join(str(v) for v in sorted(old))} retires")
                wait_s = max(self.routed_since[version_key(name, max(chosen))] + self.grace_s - now_s, 0.0) + 0.01
                asyncio.get_running_loop().call_later(wait_s, self.request, why)
