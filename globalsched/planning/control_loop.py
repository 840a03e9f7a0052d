"""The scheduler's planning task: when to plan, and handing each new plan to the actuators.

One task plans. It waits on the :class:`globalsched.planning.replan_trigger.ReplanTrigger` (a forced change:
a node joined or left, a model was uploaded, loaded or unloaded, a profile arrived; or an
evaluation: a workload report, the epoch timer), lets a burst of triggers coalesce, reads the view
(``read_view``), calls the pure planner (globalsched/planning/planner.py) off the event loop (its own
process, or a worker thread: globalsched/planning/planner_host.py), so that the loop goes on answering
heartbeats and reports while it plans, and, when the planner returns a new
plan, numbers it with the next epoch, tells those who act ahead of it (the device scaler), and hands
it to each actuator in turn: whatever profiles the
models it needs profiled, then the table distribution (model tables to backends, then routing
tables to frontends). A lost node is planned for without delay, and a Leave waits until the plan
without its node has been applied.

A plan is applied in a task of its own. The next plan waits for it, except in its make step (the
backends loading and warming their new sessions): a change the plan depends on (a node joined or
left) is planned for at once, and the newer plan supersedes the make step under way; anything else
does so only after a long make step (:func:`may_supersede`). Whoever waits for a superseded plan (a
Leave) is answered once the plan that superseded it is applied.

Epochs start from the wall clock in milliseconds: nodes ignore tables older than the last one they
applied, so a restarted scheduler's epochs must be newer than its previous life's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Awaitable, Callable, Iterable, Protocol, Sequence, runtime_checkable

from prometheus_client import Histogram

from globalsched.planning.algorithms.replan import ReplanReason
from globalsched.planning.cluster_values import ClusterPlan, ClusterView
from common.loop_slices import Steps, run_in_slices
from globalsched.state.catalog import Catalog
from globalsched.planning.planner import PlannerSettings, PlannerState
from globalsched.planning.planner_host import InThreadPlanner, PlannerHost
from globalsched.planning.replan_trigger import ReplanTrigger

log = logging.getLogger("nexus.scheduler")

COALESCE_S = 0.05               # bursts of changes become one plan
# Applying a plan (its make step, then its routing tables) holds the next plan back: at 1,000 devices
# in the simulator it took 2-3.6 s after a step (benchmarks/elastic.md).
APPLY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0, 120.0)
REPAIR_COALESCE_S = 0.005       # a lost node is repaired without delay
# A plan may cut short the make step of the one before it (see ``may_supersede``) once that has run
# this long: at once for a node that joined or left, and after a long make step for anything else.
SUPERSEDE_NODES_AFTER_S = 0.0
SUPERSEDE_AFTER_S = 3.0
SUPERSEDE_POLL_S = 0.05         # a plan waiting for a make step looks this often whether it may supersede it


def may_supersede(make_step_s: float, nodes_changed: bool) -> bool:
    """Whether a plan may be made now, over one whose make step has run ``make_step_s`` and goes on
    (``nodes_changed``: a node joined or left since; else the rates moved, or a model changed).

    A make step waits for every backend to load and warm its new sessions, and on a backend a step
    overloads the warm-ups get a share of a busy device. Made one after the other, the plans then
    stood still: at a step in the simulator no plan was made for 25 s while one make step waited, the
    step's devices registered and idle meanwhile, and the device scaler judged them surplus by the plan
    in force (benchmarks/elastic.md). The newer plan hands over from what the backends and frontends
    hold (globalsched/actuators/handover.py, :func:`~globalsched.actuators.handover.superseded`); the
    older plan's routing tables never go. Anything but a node's change cuts a make step short only when
    it is long, so that plans made one after another still reach their routing tables: cold models
    paged in by every report, each plan superseding the last one's page-in, left their requests
    waiting for routing tables that never went (tests/unit/test_simulate_cold.py)."""
    return make_step_s >= supersede_after_s(nodes_changed)


def supersede_after_s(nodes_changed: bool) -> float:
    """How long a make step runs before a plan may supersede it (:func:`may_supersede`)."""
    return SUPERSEDE_NODES_AFTER_S if nodes_changed else SUPERSEDE_AFTER_S


class Actuator(Protocol):
    async def apply(self, plan: ClusterPlan, epoch: int) -> None:
        """Make the world follow ``plan`` (numbered ``epoch``); failures are logged, not raised."""


@runtime_checkable
class Supersedable(Protocol):
    """An actuator whose apply has a make step that a newer plan may cut short (the distribution)."""

    def making_for_s(self) -> float | None:
        """How long the make step under way has run, or None when none is."""

    def supersede(self) -> None:
        """End the make step under way: its apply returns without its routing tables."""


ReadView = Callable[[float, "ReplanReason | None", "tuple[str, ...]"], ClusterView]


class ControlLoop:
    def __init__(self, settings: PlannerSettings, trigger: ReplanTrigger, read_view: ReadView,
                 actuators: Sequence[Actuator], clock: Callable[[], float] = time.monotonic,
                 persist: Callable[[bytes], Awaitable[None]] | None = None,
                 catalog: Callable[[ClusterPlan], Steps[Catalog]] | None = None,
                 may_act: Callable[[], bool] = lambda: True, planner: PlannerHost | None = None,
                 ahead: Sequence[Callable[[ClusterPlan], None]] = ()) -> None:
        """``planner``: where the planner runs (default: a worker thread). ``persist(state)``: keep each
        new plan's state, pickled, before it is applied (a shared database, for the standby that may take
        over: globalsched/state/database/plan_store.py). ``catalog(plan)``: what the
        plan's tables say about its models, read when the plan is made and attached to it, so that the
        actuators act on a complete value (globalsched/state/catalog.py); in steps, run in slices of the
        loop (common/loop_slices.py). ``may_act()``: False once this
        scheduler no longer leads (globalsched/leadership/leader.py): it plans nothing from then on.
        ``ahead``: told of each new plan as soon as it is made, before it is stored and applied (the
        device scaler starts the devices a step needs while the plan's tables go out)."""
        self.may_act = may_act
        self.settings = settings
        self.persist = persist
        self.catalog = catalog
        self.planned: ClusterPlan | None = None   # the planner's own value of the plan in force
        self.trigger = trigger
        self.read_view = read_view
        self.actuators = list(actuators)
        self.clock = clock
        self.planner = planner if planner is not None else InThreadPlanner(settings)
        self.ahead = list(ahead)
        self.begin_epochs(0)
        self.last_plan_time = 0.0
        self.plan: ClusterPlan | None = None      # the plan in force: the last one applied
        self._warned: set[str] = set()            # the plan notes logged as warnings, while they hold
        self.latest: ClusterPlan | None = None    # the last plan made, also while it is being applied
        self._made: ClusterPlan | None = None     # the planner's own value of the latest plan
        self._applying: _Applying | None = None   # the latest plan's apply
        # The actuators' time per new plan; the next plan waits for it (served on the metrics port).
        self.apply_seconds = Histogram("nexus_scheduler_plan_apply_seconds",
                                       "how long the actuators took to apply a new plan, its make step and "
                                       "routing tables (seconds); the next plan waits for it",
                                       buckets=APPLY_BUCKETS_S, registry=None)

    def adopt(self, state: PlannerState) -> None:
        """Continue from a plan in force another process made (a standby that took over): the planner
        repairs it as its own, so that nothing placed moves."""
        self.planner.adopt(state)
        self.plan = self.planned = self._made = state.plan
        self.last_plan_time = self.clock()

    def begin_epochs(self, base: int) -> None:
        """Number the next plans from ``base`` plus the wall clock in ms: above every earlier life's
        (a restart) and, with a leader's lease epoch in ``base``, above every earlier leader's."""
        self.epoch = base + int(time.time() * 1000)
        self.trigger.epoch = self.epoch

    async def run(self) -> None:
        """The planning task: one plan per burst of triggers. A plan is applied in a task of its own,
        so that a newer plan may supersede its make step (:func:`may_supersede`); otherwise the next
        plan waits for it."""
        self.trigger.evaluate()
        while True:
            await self.trigger.wait()
            await asyncio.sleep(REPAIR_COALESCE_S if self.trigger.urgent else COALESCE_S)
            await self._until_plannable()
            requests = self.trigger.take()
            try:
                await self._plan(requests.force, requests.why, list(requests.waiters))
            except Exception as exc:  # keep the scheduler alive; the next trigger tries again
                log.exception("re-planning failed")
                _settle(requests.waiters, exc)

    async def plan_once(self, force: ReplanReason | None = None, why: tuple[str, ...] = ()) -> ClusterPlan | None:
        """Plan now, after the apply under way, and apply a new plan; returns the plan in force then."""
        while self._applying is not None and not self._applying.task.done():
            await asyncio.wait([self._applying.task])
        await self._plan(force, why, [])
        if self._applying is not None:
            await asyncio.wait([self._applying.task])
        return self.plan

    async def _until_plannable(self) -> None:
        """Return once no plan is being applied, or once the one being applied is in a make step that a
        new plan may cut short."""
        while (applying := self._applying) is not None and not applying.task.done():
            making_s = self._making_for_s()
            if making_s is not None and may_supersede(making_s, self.trigger.nodes_changed):
                return
            await asyncio.wait([applying.task], timeout=SUPERSEDE_POLL_S)

    def _making_for_s(self) -> float | None:
        return max((s for a in self.actuators if isinstance(a, Supersedable)
                    if (s := a.making_for_s()) is not None), default=None)

    async def _plan(self, force: ReplanReason | None, why: tuple[str, ...], waiters: list[asyncio.Future]) -> None:
        """Make a plan; a new one starts being applied (superseding the make step under way, if any),
        and ``waiters`` are settled once it is applied. An unchanged plan settles them at once, or with
        the plan being applied."""
        if not self.may_act():
            _settle(waiters)
            return
        now = self.clock()
        view = self.read_view(now, force, why)
        # Off the event loop: a plan of a thousand devices takes a second or more of CPU, and the loop
        # answers heartbeats and reports meanwhile (a stalled loop looked like a dead cluster).
        plan = await self.planner.plan(view)
        before = self._applying if self._applying is not None and not self._applying.task.done() else None
        if plan is self._made:
            if before is not None:
                before.waiters.extend(waiters)
            else:
                _settle(waiters)
            return
        planned = plan
        if self.catalog is not None:
            plan = replace(plan, catalog=await run_in_slices(self.catalog(plan)))
        self._made = planned
        self.latest = plan
        self.epoch += 1
        self.trigger.epoch = self.epoch
        self.last_plan_time = now
        self._log(plan)
        for told in self.ahead:
            told(plan)
        if self.persist is not None:          # write-ahead: stored before any node holds it
            await self.persist(await self.planner.pickled_state())
        if before is not None and not before.task.done():
            if self._making_for_s() is not None:
                before.superseded = True
                for actuator in self.actuators:
                    if isinstance(actuator, Supersedable):
                        actuator.supersede()
            await asyncio.wait([before.task])
            if before.superseded:
                log.info("epoch %d supersedes epoch %d's make step after %.2f s", self.epoch, before.epoch,
                         self.clock() - before.started)
                waiters = before.waiters + waiters
        applying = _Applying(plan, planned, self.epoch, waiters, self.clock())
        applying.task = asyncio.create_task(self._apply(applying))
        self._applying = applying

    async def _apply(self, applying: _Applying) -> None:
        """Hand ``applying``'s plan to each actuator in turn; settle its waiters once it is in force.
        Superseded (its make step cut short by a newer plan), it stops: the newer plan's apply settles
        them."""
        try:
            for actuator in self.actuators:
                await actuator.apply(applying.plan, applying.epoch)
                if applying.superseded:
                    return
        except Exception as exc:   # the actuators log their failures; anything else ends this apply only
            log.exception("applying epoch %d failed", applying.epoch)
            _settle(applying.waiters, exc)
            return
        took_s = max(0.0, self.clock() - applying.started)
        self.apply_seconds.observe(took_s)
        log.info("epoch %d: applied in %.2f s", applying.epoch, took_s)
        self.plan, self.planned = applying.plan, applying.planned
        _settle(applying.waiters)

    def close(self) -> None:
        """Cancel the apply under way (the scheduler stops)."""
        if self._applying is not None:
            self._applying.task.cancel()

    def _log(self, plan: ClusterPlan) -> None:
        reasons = ", ".join(f"{t} {r.value}" for t, r in sorted(plan.reasons.items()) if r is not ReplanReason.NONE)
        log.info("epoch %d: re-planned: %s%s", self.epoch, reasons or "no device type changed",
                 f" ({'; '.join(plan.why)})" if plan.why else "")
        # Each backend whose assignment changed, and how many did not: at 1,000 backends, a line for
        # every one of them held the event loop 100-180 ms per plan.
        held = {b.node_id: b for p in self.plan.placements.values() for b in p.backends} if self.plan else {}
        unchanged = 0
        for placement in plan.placements.values():
            for b in placement.backends:
                if held.get(b.node_id) == b:
                    unchanged += 1
                    continue
                log.info("epoch %d: %s duty cycle %.1f ms: %s", self.epoch, b.node_id, b.duty_cycle_ms,
                         ", ".join(f"{s.model} b={s.batch} {s.throughput_rps:.1f} rps" for s in b.sessions) or "idle")
        if unchanged:
            log.info("epoch %d: %d backend(s) as before", self.epoch, unchanged)
        # Warnings that still hold are not repeated with every plan. A plan made while models are
        # being profiled is provisional (a first start plans each model as its profile arrives, some
        # with a prediction): its notes are only information until a plan without profiling runs.
        before = self.plan
        profiling = plan.catalog.profiling if plan.catalog is not None else frozenset()
        for note in plan.notes:
            if note in self._warned:
                continue
            if profiling:
                log.info("%s (provisional: %s still being profiled)", note, ", ".join(sorted(profiling)))
            else:
                log.warning(note)
        self._warned = self._warned & set(plan.notes) if profiling else set(plan.notes)
        for model, why in plan.best_effort.items():
            if before is None or before.best_effort.get(model) != why:
                log.warning("%s: %s", model, why)

    async def epoch_timer(self) -> None:
        """Now and then, let the planner judge the plan (its epoch, rate bands and cooldown decide; a
        plan that still fits stands: re-planning on noise would move sessions and cost their queues)."""
        replan = self.settings.replan
        while True:
            await asyncio.sleep(min(replan.epoch_s, replan.cooldown_s))
            self.trigger.evaluate()


@dataclass
class _Applying:
    """A plan being applied, in its own task."""

    plan: ClusterPlan
    planned: ClusterPlan             # the planner's own value of it
    epoch: int
    waiters: list[asyncio.Future]    # settled once it is in force
    started: float                   # on the loop's clock
    superseded: bool = False
    task: asyncio.Task = field(default=None)    # type: ignore[assignment]


def _settle(waiters: Iterable[asyncio.Future], exc: BaseException | None = None) -> None:
    for waiter in waiters:
        if not waiter.done():
            if exc is None:
                waiter.set_result(None)
            else:
                waiter.set_exception(exc)
