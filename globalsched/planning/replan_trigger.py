"""The one way the scheduler's parts ask for a plan, and the epoch of the plan in force.

Membership, model administration and the workload reports sit below the planning task and never
hold a reference to it: they call :meth:`ReplanTrigger.request` (something the plan depends on
changed: re-plan now), :meth:`ReplanTrigger.evaluate` (rates or time moved on: let the planner judge
whether its plan still fits) or ``await`` :meth:`ReplanTrigger.replan_now` (a node leaves: return once
a plan without it is applied). The planning task (globalsched/planning/control_loop.py) waits on the trigger,
takes what accumulated with :meth:`take`, plans once for the whole burst, applies the plan and
sets its ``epoch`` here.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from globalsched.planning.algorithms.replan import ReplanReason

log = logging.getLogger("nexus.scheduler")


@dataclass(frozen=True)
class Requests:
    """What accumulated since the planning task last took it."""

    force: ReplanReason | None        # None: an evaluation only (the planner's bands and epoch decide)
    why: tuple[str, ...]
    waiters: tuple[asyncio.Future, ...]


class ReplanTrigger:
    def __init__(self, epoch: int = 0) -> None:
        self.epoch = epoch                 # of the plan in force; set by the planning task
        self._event = asyncio.Event()
        self._force: ReplanReason | None = None
        self._why: list[str] = []
        self._waiters: list[asyncio.Future] = []
        self._waiting_requests = False     # requests wait for this plan (a cold model's page-in)
        self._nodes_changed = False        # a node joined or left

    def request(self, why: str, membership: bool = False, requests_wait: bool = False, joined: bool = False) -> None:
        """Re-plan now: ``membership`` when devices were lost or added (repair in place, at once);
        ``requests_wait`` when requests are held until the plan is in force (a cold model paged in):
        planned without delay too; ``joined`` when a node registered. A lost or joined node's plan may
        supersede a make step under way (globalsched/planning/control_loop.py, ``may_supersede``)."""
        log.info("re-plan requested: %s", why)
        self._waiting_requests = self._waiting_requests or requests_wait
        self._nodes_changed = self._nodes_changed or membership or joined
        if membership or self._force is ReplanReason.MEMBERSHIP:
            self._force = ReplanReason.MEMBERSHIP
        else:
            self._force = ReplanReason.SESSIONS_CHANGED
        if why not in self._why:           # a cold model requested by every report until paged in: once
            self._why.append(why)
        self._event.set()

    def evaluate(self) -> None:
        """Let the planner judge whether the plan still fits (after its cooldown, by its bands)."""
        self._event.set()

    async def replan_now(self, why: str) -> None:
        """A forced membership re-plan; returns once the plan made for it has been applied, or
        raises what planning raised."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self.request(why, membership=True)
        await waiter

    @property
    def urgent(self) -> bool:
        """Whether the pending request is a membership repair or a page-in (planned without delay)."""
        return self._force is ReplanReason.MEMBERSHIP or self._waiting_requests

    @property
    def nodes_changed(self) -> bool:
        """Whether a node joined or left since the last take."""
        return self._nodes_changed

    @property
    def pending(self) -> bool:
        """Whether anything was asked for since the last take."""
        return self._event.is_set()

    async def wait(self) -> None:
        await self._event.wait()

    def take(self) -> Requests:
        """Everything asked for since the last take; the trigger is clear afterwards."""
        self._event.clear()
        taken = Requests(self._force, tuple(self._why), tuple(self._waiters))
        self._force, self._why, self._waiters = None, [], []
        self._waiting_requests = self._nodes_changed = False
        return taken
