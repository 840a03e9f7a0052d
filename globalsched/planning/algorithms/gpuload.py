"""A GPU being packed: its duty cycle, members and running totals, with O(1) feasibility checks.

Working state inside the packers (mutable, never returned): the packers turn loads into frozen
:class:`~globalsched.planning.plan.GpuPlan` values at the end. Feasibility is the shared-device rule of docs/planning.md with
prefix sharing: executions fit the duty cycle, every member's duty cycle + the execution its
requests see fits its SLO budget, memory fits; with burst headroom (members prepared with
``burst_sigma > 0``) the GPU's pooled burst excess H (globalsched/planning/headroom.py) is added to the
executions and to every member's execution, exactly as :func:`globalsched.planning.plan.validate_plan` checks.
Members carry the load routed to them (``Member.rate_rps``), which the plan reports as ``load_rps``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping

from globalsched.planning.headroom import BurstSums
from globalsched.planning.plan import EPS_MS, GpuPlan, SessionAlloc

from .batch_sizing import SessionModel, batch_for
from .prefix import PrefixModel


@dataclass
class Member:
    sm: SessionModel
    rate_rps: float      # the load this GPU carries for the session
    batch: int
    pref_duty_ms: float  # the longest duty cycle the load tolerates (its own residual config)


@dataclass
class _Group:
    batch: int = 0
    suffix_ms: float = 0.0
    suffix_mb: float = 0.0
    min_budget_ms: float = math.inf


REFIT_GRID = (1.0, 0.97, 0.94, 0.9, 0.85, 0.8, 0.7, 0.6, 0.5)


class GpuLoad:
    """Members on one GPU at duty cycle ``duty_ms``; ``exec_ms`` and ``mem_mb`` kept up to date."""

    __slots__ = ("duty_ms", "members", "exec_ms", "mem_mb", "groups", "prefixes", "capacity_mb", "gid", "_names",
                 "burst", "z", "room_ms")

    def __init__(self, duty_ms: float, prefixes: Mapping[str, PrefixModel], capacity_mb: float,
                 gid: int | None = None) -> None:
        self.duty_ms = duty_ms
        self.members: list[Member] = []
        self.exec_ms = 0.0
        self.mem_mb = 0.0
        self.groups: dict[str, _Group] = {}
        self.prefixes = prefixes
        self.capacity_mb = capacity_mb
        self.gid = gid  # GPU id carried over from an existing plan (re-planning), else None
        self._names: set[str] = set()
        self.burst = BurstSums()   # the members' burst terms (headroom)
        self.z = 0.0               # the members' burst_sigma (one planner config: all the same)
        self.room_ms = math.inf    # min over members outside shared groups of budget - l(batch)

    def _headroom_fits(self, burst: BurstSums, z: float, exec_ms: float, room_ms: float,
                       groups: Mapping[str, tuple[int, float, float]]) -> bool:
        """Executions + H within the duty cycle and duty + H within every member's SLO slack."""
        h = burst.excess_ms(self.duty_ms, z)
        if h <= 0:
            return True
        if exec_ms + h > self.duty_ms + EPS_MS:
            return False
        slack = room_ms
        for gname, (batch, suffix_ms, min_budget) in groups.items():
            slack = min(slack, min_budget - self.prefixes[gname].lat(batch) - suffix_ms)
        return self.duty_ms + h <= slack + EPS_MS

    def _group_state(self) -> dict[str, tuple[int, float, float]]:
        return {k: (g.batch, g.suffix_ms, g.min_budget_ms) for k, g in self.groups.items()}

    @property
    def occupancy(self) -> float:
        return self.exec_ms / self.duty_ms

    def names(self) -> set[str]:
        return set(self._names)

    # ---- the incremental rule ----------------------------------------------------------------

    def _delta(self, sm: SessionModel, batch: int) -> tuple[float, float] | None:
        """(added exec ms, added MB) of adding ``sm`` at ``batch`` at the current duty, None if infeasible."""
        d = self.duty_ms
        if sm.group is None or sm.group not in self.prefixes:
            lat = sm.lat(batch)
            if d + lat > sm.budget_ms + EPS_MS:
                return None
            return lat, sm.mem(batch)
        p = self.prefixes[sm.group]
        g = self.groups.get(sm.group)
        old_b = g.batch if g else 0
        new_b = old_b + batch
        if new_b > p.max_batch:
            return None
        suffix_ms = (g.suffix_ms if g else 0.0) + p.suffix_lat(sm, batch)
        new_exec = p.lat(new_b) + suffix_ms
        old_exec = (p.lat(old_b) + g.suffix_ms) if g else 0.0
        if d + new_exec > min(sm.budget_ms, g.min_budget_ms if g else math.inf) + EPS_MS:
            return None
        add_mb = p.mem(new_b) - p.mem(old_b) + p.suffix_mem(sm, batch)
        return new_exec - old_exec, add_mb

    def _with_member(self, sm: SessionModel, batch: int, rate_rps: float, add_ms: float) -> bool:
        """Whether the headroom rule holds once ``sm`` joins at ``batch`` carrying ``rate_rps``."""
        z = self.z if self.z >= sm.burst_sigma else sm.burst_sigma
        if z <= 0:
            return True
        burst = self.burst.copy()
        burst.add(sm.burst_term(batch, rate_rps))
        room = self.room_ms
        groups = self._group_state()
        if sm.group is not None and sm.group in self.prefixes:
            p = self.prefixes[sm.group]
            old = groups.get(sm.group, (0, 0.0, math.inf))
            groups[sm.group] = (old[0] + batch, old[1] + p.suffix_lat(sm, batch), min(old[2], sm.budget_ms))
        else:
            room = min(room, sm.budget_ms - sm.lat(batch))
        return self._headroom_fits(burst, z, self.exec_ms + add_ms, room, groups)

    def _push(self, m: Member, add_ms: float, add_mb: float) -> None:
        self.members.append(m)
        self._names.add(m.sm.name)
        self.exec_ms += add_ms
        self.mem_mb += add_mb
        sm = m.sm
        if sm.burst_sigma > 0:
            self.z = sm.burst_sigma
            self.burst.add(sm.burst_term(m.batch, m.rate_rps))
        if sm.group is None or sm.group not in self.prefixes:
            room = sm.budget_ms - sm.lat(m.batch)
            if room < self.room_ms:
                self.room_ms = room
        if sm.group is not None and sm.group in self.prefixes:
            g = self.groups.setdefault(sm.group, _Group())
            p = self.prefixes[sm.group]
            g.batch += m.batch
            g.suffix_ms += p.suffix_lat(sm, m.batch)
            g.suffix_mb += p.suffix_mem(sm, m.batch)
            g.min_budget_ms = min(g.min_budget_ms, sm.budget_ms)

    def add_at_batch(self, m: Member, check_headroom: bool = True) -> bool:
        """Add ``m`` with its batch as given at the current duty cycle if everything still fits
        (the headroom rule too unless ``check_headroom`` is False: :meth:`rebuilt` checks it once
        all members are in, since a member's rounded-up batch may cover others' bursts)."""
        if m.sm.name in self._names:
            return False
        delta = self._delta(m.sm, m.batch)
        if delta is None:
            return False
        add_ms, add_mb = delta
        if self.exec_ms + add_ms > self.duty_ms + EPS_MS or self.mem_mb + add_mb > self.capacity_mb + EPS_MS:
            return False
        if check_headroom and not self._with_member(m.sm, m.batch, m.rate_rps, add_ms):
            return False
        self._push(m, add_ms, add_mb)
        return True

    def fits_headroom(self) -> bool:
        """Whether the current members keep the headroom rule at the current duty cycle."""
        return self.z <= 0 or self._headroom_fits(self.burst, self.z, self.exec_ms, self.room_ms, self._group_state())

    def rebuilt(self, duty_ms: float, members: Iterable[Member], rebatch: bool) -> "GpuLoad | None":
        """A copy at ``duty_ms`` holding ``members``; with ``rebatch`` batches become ceil(d*rate)."""
        out = GpuLoad(duty_ms, self.prefixes, self.capacity_mb, self.gid)
        for m in members:
            batch = batch_for(m.sm, m.rate_rps, duty_ms) if rebatch else m.batch
            if batch is None or not out.add_at_batch(Member(m.sm, m.rate_rps, batch, m.pref_duty_ms),
                                                     check_headroom=False):
                return None
        return out if out.fits_headroom() else None

    def try_add(self, sm: SessionModel, rate_rps: float, pref_duty_ms: float,
                above: float = -math.inf) -> "tuple[float, object] | None":
        """(occupancy after, token for :meth:`commit`) if the load fits, merged duty = min of the two;
        None also where the occupancy after would not be ``above`` (a caller that keeps the fullest
        fit need not check the rules of one that cannot win: the costliest step at fleet scale)."""
        if sm.name in self._names:  # a session runs at most once per GPU
            return None
        d = min(self.duty_ms, pref_duty_ms)
        if d >= self.duty_ms - 1e-12:
            batch = batch_for(sm, rate_rps, d)
            if batch is None:
                return None
            delta = self._delta(sm, batch)
            if delta is None:
                return None
            add_ms, add_mb = delta
            if self.exec_ms + add_ms > d + EPS_MS or self.mem_mb + add_mb > self.capacity_mb + EPS_MS:
                return None
            if (self.exec_ms + add_ms) / d <= above:
                return None
            if not self._with_member(sm, batch, rate_rps, add_ms):
                return None
            return (self.exec_ms + add_ms) / d, (Member(sm, rate_rps, batch, pref_duty_ms), add_ms, add_mb)
        if not self.groups:  # cheap screen before building a copy: executions at the shorter cycle
            total = 0.0
            for m in self.members:
                b = batch_for(m.sm, m.rate_rps, d)
                if b is None:
                    return None
                total += m.sm.lat(b)
                if total > d + EPS_MS:
                    return None
        new = self.rebuilt(d, [*self.members, Member(sm, rate_rps, 1, pref_duty_ms)], rebatch=True)
        if new is None:
            return None
        return new.occupancy, new

    def refit(self, rates: Mapping[str, float] | None = None, extra: Member | None = None,
              spread: float | None = None) -> "GpuLoad | None":
        """A copy whose members carry ``rates`` (others unchanged), plus ``extra`` if given, at the
        longest feasible duty cycle; None if there is none.

        Batches become ceil(d*rate). Between two breakpoints d = b*1000/rate the batches stay the
        same and occupancy falls as d grows, so only breakpoints (and the current d) are tried, from
        the longest down (longer cycles amortise per-batch overheads best); ``spread`` limits the
        search to ``(1 -+ spread) * duty``.
        """
        rates = rates or {}
        if extra is not None and extra.sm.name in self._names:
            return None
        members = [Member(m.sm, rates.get(m.sm.name, m.rate_rps), m.batch, m.pref_duty_ms) for m in self.members]
        if extra is not None:
            members.append(extra)
        hi = min(m.sm.budget_ms - m.sm.lat(1) for m in members)
        lo = 0.0
        if spread is not None:
            lo, hi = self.duty_ms * (1 - spread), min(hi, self.duty_ms * (1 + spread))
        candidates = {self.duty_ms} if lo <= self.duty_ms <= hi else set()
        for m in members:
            if m.rate_rps <= 0:
                continue
            first = max(1, math.ceil(lo * m.rate_rps / 1000.0))
            for b in range(first, m.sm.max_batch + 1):
                d = b * 1000.0 / m.rate_rps
                if d > hi:
                    break
                candidates.add(d)
        if any(m.sm.burst_sigma > 0 for m in members):
            # With headroom the longest feasible cycle may lie between breakpoints (H grows with d
            # and caps it through the SLOs): also try a grid below the SLOs' limit.
            candidates.update(hi * f for f in REFIT_GRID if lo <= hi * f)
        for d in sorted(candidates, reverse=True):
            new = self.rebuilt(d, members, rebatch=True)
            if new is not None:
                return new
        return None

    def commit(self, token: object) -> None:
        if isinstance(token, GpuLoad):
            self.duty_ms, self.members, self.exec_ms = token.duty_ms, token.members, token.exec_ms
            self.mem_mb, self.groups, self._names = token.mem_mb, token.groups, set(token._names)
            self.burst, self.z, self.room_ms = token.burst.copy(), token.z, token.room_ms
        else:
            m, add_ms, add_mb = token  # type: ignore[misc]
            self._push(m, add_ms, add_mb)

    def copy(self) -> "GpuLoad":
        out = GpuLoad(self.duty_ms, self.prefixes, self.capacity_mb, self.gid)
        out.members = [Member(m.sm, m.rate_rps, m.batch, m.pref_duty_ms) for m in self.members]
        out.exec_ms, out.mem_mb, out._names = self.exec_ms, self.mem_mb, set(self._names)
        out.burst, out.z, out.room_ms = self.burst.copy(), self.z, self.room_ms
        out.groups = {k: _Group(g.batch, g.suffix_ms, g.suffix_mb, g.min_budget_ms) for k, g in self.groups.items()}
        return out

    # ---- output ---------------------------------------------------------------------------------

    def to_gpu_plan(self, gid: int) -> GpuPlan:
        d = self.duty_ms
        shared = tuple(sorted(k for k in self.groups
                              if sum(1 for m in self.members if m.sm.group == k) >= 2))
        with_load = self.z > 0  # plans carry loads only with headroom, which is computed from them
        return GpuPlan(gid, d, tuple(SessionAlloc(m.sm.name, m.batch, m.batch * 1000.0 / d,
                                                  m.rate_rps if with_load else None) for m in self.members),
                       shared)


def best_fit(loads: list[GpuLoad], sm: SessionModel, rate_rps: float, pref_duty_ms: float,
             exclude: GpuLoad | None = None) -> tuple[GpuLoad, object] | None:
    """The load this residual fits best (highest occupancy after the merge); loads already batching
    the session's prefix group are preferred whenever one of them fits."""
    best: tuple[float, GpuLoad, object] | None = None
    best_shared: tuple[float, GpuLoad, object] | None = None
    group = sm.group
    lat1 = sm.lat(1)
    for load in loads:
        if load is exclude:
            continue
        if group is None and pref_duty_ms >= load.duty_ms and load.exec_ms + lat1 > load.duty_ms + EPS_MS:
            continue  # cheap screen: the cycle has no room for even batch 1
        shared = group is not None and group in load.groups
        rival = best_shared if shared else best
        trial = load.try_add(sm, rate_rps, pref_duty_ms, rival[0] if rival is not None else -math.inf)
        if trial is None:
            continue
        occ, token = trial
        if shared:
            if best_shared is None or occ > best_shared[0]:
                best_shared = (occ, load, token)
        elif best is None or occ > best[0]:
            best = (occ, load, token)
    chosen = best_shared or best
    return None if chosen is None else (chosen[1], chosen[2])


def refit_fit(loads: list[GpuLoad], sm: SessionModel, rate_rps: float, pref_duty_ms: float, tries: int,
              exclude: GpuLoad | None = None) -> tuple[GpuLoad, "GpuLoad"] | None:
    """Fallback when :func:`best_fit` finds nothing: re-choose the duty cycle of each of the ``tries``
    emptiest loads with the residual added (:meth:`GpuLoad.refit`); the fullest result wins."""
    candidates = sorted((l for l in loads if l is not exclude), key=lambda l: l.occupancy)[:tries]
    best: tuple[float, GpuLoad, GpuLoad] | None = None
    for load in candidates:
        new = load.refit(extra=Member(sm, rate_rps, 1, pref_duty_ms))
        if new is not None and (best is None or new.occupancy > best[0]):
            best = (new.occupancy, load, new)
    return None if best is None else (best[1], best[2])
