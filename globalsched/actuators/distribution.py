"""Table distribution, the actuator that pushes a plan: model tables to backends, then routing tables
to frontends.

Backends get their tables first, keeping the sessions the plan moves away from them until the
frontends hold the new routing table (make before break: globalsched/actuators/handover.py), and a frontend's
routing table leaves out every model that a backend reported it could not load, so a frontend never
routes to a backend that has not loaded the model, nor to one that dropped it. A failed push is
logged and the next plan pushes again.

It only sends: everything a table says comes from the plan, whose catalog (globalsched/state/catalog.py)
holds the models' descriptions and profiles as they were when the plan was made, and from the
membership (addresses) and the measured rates. What it learns goes back as events
(:class:`~globalsched.state.catalog.DistributionEvents`): a model that failed to load (model administration
retries it a bounded number of times, then routes it UNAVAILABLE with the reason), and which version
keys a routing table routed (the version rollout, globalsched/planning/version_rollout.py, retires the versions that
routed successors replace).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import AbstractSet, Awaitable, Callable, Iterator, Mapping, Sequence

import grpc

from common.emulated_gpus import OUT_OF_MEMORY
from common.loop_slices import LoopSlices
from common.pb import control
from common.version_policy import version_key
from globalsched.rpc import convert
from globalsched.state.catalog import Catalog, DistributionEvents
from globalsched.planning.cluster_values import ClusterPlan
from globalsched.actuators.early_routes import EARLY_ROUTES_INTERVAL_S, EarlyRoutes
from globalsched.actuators.handover import (Unreleased, backend_tables, handover, pushed, released, superseded,
                                           unreleased_tables)
from globalsched.state.membership import Node
from globalsched.planning.placement import PlacedSession
from globalsched.state.rate_reports import Workload

log = logging.getLogger("nexus.scheduler")

MODEL_TABLE_TIMEOUT_S = 120     # a backend loads its models before it answers
ROUTING_TABLE_TIMEOUT_S = 10


NODE_LEFT = "the node left while the call was in flight"


CALLS_PER_TURN = 8      # calls started per turn of the loop (common/loop_slices.py): 900 at once held it 55-125 ms


async def _answers(calls: Sequence[tuple[Node, Callable[[], Awaitable]]]) -> list[tuple[Node, object, str]]:
    """Start every call (``start()`` makes it), await them all; ``(node, reply, error)`` for each,
    ``error`` empty on success (:func:`_outcome`)."""
    tasks = await _start([start for _, start in calls])
    if tasks:
        await asyncio.wait(tasks)
    return [(node, *_outcome(task)) for (node, _), task in zip(calls, tasks)]


async def _start(starts: Sequence[Callable[[], Awaitable]]) -> list[asyncio.Task]:
    """Start every call, a few per turn of the loop: a call serializes its request and starts in a
    task of its own in the loop's next turn, and a thousand of them in one turn held it for 100 ms.
    The planner stopping cancels the calls started and starts no more."""
    tasks: list[asyncio.Task] = []
    try:
        slices = LoopSlices(max_items=CALLS_PER_TURN)
        for start in starts:
            tasks.append(asyncio.ensure_future(start()))
            await slices.due()
    except asyncio.CancelledError:      # the planner itself is stopping
        for task in tasks:
            task.cancel()
        raise
    return tasks


async def _all_or_cut(tasks: Sequence[asyncio.Task], cut: asyncio.Event) -> bool:
    """Wait for every task, or until ``cut`` is set; whether every task is done. The planner stopping
    cancels the calls."""
    if not tasks or cut.is_set():
        return all(task.done() for task in tasks)
    everything = asyncio.ensure_future(asyncio.wait(tasks))
    cutter = asyncio.ensure_future(cut.wait())
    try:
        await asyncio.wait([everything, cutter], return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        for task in tasks:
            task.cancel()
        raise
    finally:
        everything.cancel()
        cutter.cancel()
    return all(task.done() for task in tasks)


def _outcome(task: asyncio.Task) -> tuple[object, str]:
    """A call's ``(reply, error)``. A node removed while its call is in flight (its Attach stream ended:
    dead, or hung and caught by keepalive) has its channel closed, which cancels the call. That is an
    answer here, "the node left", never a CancelledError escaping into the planner, whose loop it
    would end."""
    if task.cancelled():
        return None, NODE_LEFT
    exc = task.exception()
    if isinstance(exc, grpc.aio.AioRpcError):
        return None, exc.details() or exc.code().name
    if exc is not None:
        raise exc
    return task.result(), ""


class Distribution:
    def __init__(self, nodes: Mapping[str, Node], events: DistributionEvents, workload: Workload,
                 may_act: Callable[[], bool] = lambda: True) -> None:
        """``may_act()``: False when this scheduler no longer leads (globalsched/leadership/leader.py): nothing
        is pushed then, not even a release that was waiting."""
        self.may_act = may_act
        self.nodes = nodes
        self.events = events
        self.workload = workload
        self.in_force: ClusterPlan | None = None    # the plan last pushed: what the nodes hold
        self.releases: set[asyncio.Task] = set()    # release steps waiting out their delay
        # What each backend holds: (its node, what its table said) of the last table it took without a
        # failure; a plan whose table for it says the same sends it nothing (:func:`_table_key`).
        self.held: dict[str, tuple[Node, tuple]] = {}
        self.releasing: dict[str, int] = {}         # backends with a release step to come: how many
        self.unreleased: Unreleased = {}            # backends with a release step to come (handover.py)
        self.sent: control.RoutingTable | None = None   # the routing table last pushed to the frontends
        # Sent early since ``sent``, by session: the routes (early_routes.py), and as plan routes (what a
        # plan that supersedes a make step hands over from).
        self.early_sent: dict[str, control.ModelRoute] = {}
        self.live_routes: dict[str, tuple] = {}
        self.making: _Making | None = None          # the make step under way
        self.pushing: dict[str, int] = {}           # backend -> the epoch of the last table sent to it
        self.late: set[asyncio.Task] = set()        # answers of a make step cut short, still to come

    async def apply(self, plan: ClusterPlan, epoch: int) -> None:
        """Make before break (globalsched/actuators/handover.py): model tables that load the plan's sessions and
        keep the ones it moves away, then the routing tables, then, once what was routed to the kept
        sessions has met its deadline, the tables that drop them (in the background: the next plan
        need not wait; a backend ignores a release older than a table it has). A frontend is never
        routed to a backend before it loaded the model, nor left with routes to one that dropped it.

        A newer plan may cut the make step short (:meth:`supersede`): then no routing table goes, the
        calls under way are answered in the background, and the newer plan hands over from what the
        backends were sent and the frontends were sent early (handover.py, ``superseded``)."""
        steps = handover(self.in_force, plan, unreleased_tables(self.unreleased, self.nodes.get))
        early = _EarlyPush(EarlyRoutes(self.in_force if self.sent is not None else None, plan, steps.make,
                                       self.live_routes))
        making = self.making = _Making(time.monotonic())
        pusher = asyncio.create_task(self._push_early_routes(plan, epoch, early))
        try:
            failed = await self.push_model_tables(plan, epoch, steps.make, early, cut=making.cut)
        finally:
            self.making = None
            await early.stop(pusher)
        if making.cut.is_set():
            superseded(self.unreleased, steps, epoch, self.nodes.get)
            return
        await self.push_routing_tables(plan, epoch, failed)
        self.in_force = plan
        pushed(self.unreleased, steps, epoch, self.nodes.get)
        if steps.release:
            for node_id in steps.release:
                self.releasing[node_id] = self.releasing.get(node_id, 0) + 1
            task = asyncio.create_task(self._release(plan, epoch, steps.release, steps.release_after_s))
            self.releases.add(task)
            task.add_done_callback(self.releases.discard)

    def making_for_s(self) -> float | None:
        """How long the make step under way has run (None: none is, or it was cut short)."""
        making = self.making
        return None if making is None or making.cut.is_set() else time.monotonic() - making.started

    def supersede(self) -> None:
        """A newer plan was made: the make step under way ends now, without its routing tables."""
        if self.making is not None:
            self.making.cut.set()

    def adopt(self, plan: ClusterPlan) -> None:
        """``plan`` is what the nodes hold (another scheduler pushed it): the next push hands over from it."""
        self.in_force = plan

    async def _release(self, plan: ClusterPlan, epoch: int, tables, after_s: float) -> None:
        try:
            await asyncio.sleep(after_s)
            await self.push_model_tables(plan, epoch, tables, release=True)
        finally:
            released(self.unreleased, tables, epoch)
            for node_id in tables:
                left = self.releasing.get(node_id, 0) - 1
                if left > 0:
                    self.releasing[node_id] = left
                else:
                    self.releasing.pop(node_id, None)

    def close(self) -> None:
        """Cancel the releases still waiting and the calls still answering (the scheduler stops)."""
        for task in list(self.releases) + list(self.late):
            task.cancel()

    async def push_model_tables(self, plan: ClusterPlan, epoch: int,
                                tables: Mapping[str, tuple[PlacedSession, ...]] | None = None,
                                early: "_EarlyPush | None" = None, release: bool = False,
                                cut: asyncio.Event | None = None) -> dict[str, str]:
        """Send each backend its table (``tables`` by node; default: the plan's own); return models
        that failed to load, with reasons.

        A backend that holds a table saying the same (the same sessions at the same batches, rates,
        SLOs, descriptions and profiles, and the same duty cycle), taken without a failure, is sent
        nothing: a plan of a thousand backends that moved a few sessions sent a thousand tables. Not
        skipped: a backend with a release step to come (the release would drop what the plan keeps
        there unless a newer table overtakes it), and the release step itself (``release``), after
        which the backend's next table is always sent. ``early``: the make step's early routes, told of
        each backend as it answers (or needs no table). ``cut``: set when a newer plan supersedes the
        make step; then this returns with the answers so far, and the rest are taken as they come."""
        failed: dict[str, str] = {} if early is None else early.failed
        if not self.may_act():
            log.warning("epoch %d: model tables not pushed: this scheduler no longer leads", epoch)
            return failed
        self._forget_departed()
        calls = []
        catalog = plan.catalog or Catalog()
        duty_cycles = {b.node_id: b for placement in plan.placements.values() for b in placement.backends}
        slices = LoopSlices()           # at 1,000 backends a plan's tables took 250-430 ms in one piece
        for node_id, sessions in (backend_tables(plan) if tables is None else tables).items():
            await slices.due()
            node = self.nodes.get(node_id)
            if node is None or node_id not in duty_cycles:
                if early is not None:
                    early.answered(node_id)
                continue
            says = []
            for s in sessions:
                model = plan.model_of(s.model)
                desc = catalog.descs.get(model)
                if desc is None:            # removed from the database since the plan was made
                    continue
                planned = plan.sessions.get(s.model)
                key = (model, node.device_type)
                emulated = catalog.emulated.get(key) if node.device.startswith("emulated:") else None
                says.append((desc, s, planned.slo_ms if planned else 0.0, catalog.profiles.get(key), emulated))
            what = (duty_cycles[node_id].duty_cycle_ms, tuple(says))
            held = self.held.get(node_id)
            if not release and node_id not in self.releasing and held is not None and held[0] is node \
                    and held[1] == what:
                if early is not None:
                    early.answered(node_id)
                continue
            self.held.pop(node_id, None)
            self.pushing[node_id] = max(epoch, self.pushing.get(node_id, epoch))
            table = convert.model_table(epoch, duty_cycles[node_id], [convert.session_entry(*x) for x in says])
            calls.append((node, what, functools.partial(_push_model_table, node, table, early)))
        tasks = await _start([start for _, _, start in calls])
        if cut is None:
            if tasks:
                await asyncio.wait(tasks)
        elif not await _all_or_cut(tasks, cut):
            late = [(call, task) for call, task in zip(calls, tasks) if not task.done()]
            answering = asyncio.create_task(self._late_answers(plan, epoch, late, failed))
            self.late.add(answering)
            answering.add_done_callback(self.late.discard)
        for (node, what, _), task in zip(calls, tasks):
            if task.done():
                self._answered(plan, epoch, node, what, task, failed, release)
        return failed

    def _forget_departed(self) -> None:
        """Drop what is kept of backends no longer registered: a fleet whose backends come and go (a
        scale-down, a restart under a new id) kept an entry per id ever seen. A late answer from one
        records nothing (:meth:`_answered` checks the node is still registered), and a backend that
        registers again under the same id holds nothing yet, so its next table is sent."""
        for kept in (self.held, self.pushing):
            for node_id in [n for n in kept if n not in self.nodes]:
                del kept[node_id]

    def _answered(self, plan: ClusterPlan, epoch: int, node: Node, what: tuple, task: asyncio.Task,
                  failed: dict[str, str], release: bool) -> None:
        """Take a backend's answer to its model table of plan ``epoch``: what it holds, what it loaded and
        what failed to load. An answer that a newer table sent to it overtook says nothing of what it holds."""
        reply, error = _outcome(task)
        if error:
            log.warning("model table push to %s failed: %s", node.node_id, error)
            return
        if not reply.failed and not release and self.nodes.get(node.node_id) is node \
                and self.pushing.get(node.node_id) == epoch:
            self.held[node.node_id] = (node, what)
        self.events.loaded(plan.model_of(name) for name in reply.loaded)
        for name, reason in _failed_loads(reply):
            failed[name] = _not_loaded(node, reason)
            self.events.load_failed(plan.model_of(name), name, node.node_id, node.device_type, reason)

    async def _late_answers(self, plan: ClusterPlan, epoch: int, late: list[tuple[tuple, asyncio.Task]],
                            failed: dict[str, str]) -> None:
        """The answers of a make step cut short, taken as they come (the scheduler stopping cancels the
        calls)."""
        try:
            await asyncio.wait([task for _, task in late])
        except asyncio.CancelledError:
            for _, task in late:
                task.cancel()
            raise
        for (node, what, _), task in late:
            try:
                self._answered(plan, epoch, node, what, task, failed, release=False)
            except Exception:        # nothing waits for these answers to raise it to
                log.exception("model table push to %s of a superseded plan", node.node_id)

    async def _push_early_routes(self, plan: ClusterPlan, epoch: int, early: "_EarlyPush") -> None:
        """While the make step runs: each time sessions are ready to go live (:mod:`early_routes`), the
        routing table last pushed with their routes replaced, at most every EARLY_ROUTES_INTERVAL_S."""
        while True:
            await early.wake.wait()
            early.wake.clear()
            due = early.routes.due()
            if early.done or not due or self.sent is None or not self.may_act():
                continue
            early.pushing = True
            try:
                live = early.routes.live()
                routes = {**self.early_sent, **{r.session or r.model.name: r
                                                for r in self._routes(plan, early.failed, live.keys(), live)}}
                base, extra = self.sent, dict(routes)
                table = control.RoutingTable(
                    epoch=epoch, routes=[extra.pop(r.session or r.model.name, r) for r in base.routes],
                    stored=base.stored, queries=base.queries, planned_devices=base.planned_devices,
                    lower_bound=base.lower_bound, lower_bound_throughput_only=base.lower_bound_throughput_only)
                table.routes.extend(extra.values())
                log.info("epoch %d: %d session(s) live on their new routes before every backend answered",
                         epoch, len(live))
                await self._send_routing_table(table)
                early.routes.sent(due)
                self.early_sent = routes
                self.live_routes.update(live)
            finally:
                early.pushing = False
            if early.done:
                return
            await asyncio.sleep(EARLY_ROUTES_INTERVAL_S)
            early.wake.set()

    async def push_routing_tables(self, plan: ClusterPlan, epoch: int, failed: dict[str, str]) -> None:
        if not self.may_act():
            log.warning("epoch %d: routing tables not pushed: this scheduler no longer leads", epoch)
            return
        routes, slices = [], LoopSlices()
        for route in self._routes(plan, failed):
            routes.append(route)
            await slices.due()
        table = self._table(plan, epoch, routes)
        await self._send_routing_table(table)
        self.sent = table
        self.early_sent, self.live_routes = {}, {}
        routed = [key for r in table.routes      # versions' own routes, not query stages'
                  if r.backends and (key := version_key(r.model.name, r.model.version)) == (r.session or r.model.name)]
        self.events.routed(routed)

    async def _send_routing_table(self, table: control.RoutingTable) -> None:
        calls = [(n, functools.partial(n.stub.UpdateRoutingTable, table, timeout=ROUTING_TABLE_TIMEOUT_S))
                 for n in self.nodes.values() if n.kind == control.NODE_KIND_FRONTEND]
        for node, _, error in await _answers(calls):
            if error == NODE_LEFT:
                log.info("routing table push to %s ended: %s", node.node_id, error)     # it is gone: nothing to do
            elif error:
                log.warning("routing table push to %s failed: %s", node.node_id, error)

    def routing_table(self, plan: ClusterPlan, epoch: int, failed: dict[str, str] | None = None
                      ) -> control.RoutingTable:
        """What frontends hold for ``plan`` (its catalog says what the models are): routes to backends,
        or why a model has none; ``failed``: models that failed to load in this push."""
        return self._table(plan, epoch, list(self._routes(plan, failed or {})))

    def _routes(self, plan: ClusterPlan, failed: Mapping[str, str], only: AbstractSet[str] | None = None,
                placed: Mapping[str, Sequence[tuple[str, float, int, float]]] | None = None
                ) -> Iterator[control.ModelRoute]:
        """The routing table's routes, one at a time (so that a push can hand the loop back between them);
        ``only``: the routes of these sessions alone; ``placed``: where they go, if not where the plan
        places them."""
        catalog = plan.catalog or Catalog()
        measured = self.workload.current_rates(time.monotonic())
        placed = plan.routes() if placed is None else placed
        for session, planned in plan.sessions.items():
            if only is not None and session not in only:
                continue
            model = planned.model
            desc = catalog.descs.get(model)
            if desc is None:
                continue
            backends = []
            for node_id, share, batch, duty_cycle_ms in placed.get(session, ()):
                node = self.nodes.get(node_id)
                if node is not None and model not in failed:
                    backends.append(convert.backend_route(node_id, node.address, share, batch, duty_cycle_ms))
            reason = failed.get(model) or catalog.unavailable.get(model) or plan.unplaced.get(session, "")
            if model in catalog.profiling:
                reason = reason or "being profiled"
            yield convert.model_route(desc, planned.slo_ms, session, backends,
                                      "" if backends else (reason or "not placed"),
                                      planned.rate_rps, measured.get(session, 0.0),
                                      cold=not backends and (session in plan.cold and model not in failed
                                                             or OUT_OF_MEMORY in failed.get(model, "")))
        if only is not None:
            return
        for route in catalog.unplanned:          # served versions the plan could not place, and why
            if route.key in catalog.descs:
                yield convert.model_route(catalog.descs[route.key], route.slo_ms, route.key, reason=route.reason)

    def _table(self, plan: ClusterPlan, epoch: int, routes: list[control.ModelRoute]) -> control.RoutingTable:
        """The routing table of ``routes``, with the stored models none of them serves and the queries."""
        catalog = plan.catalog or Catalog()
        served = {p.model for p in plan.sessions.values() if p.model in catalog.descs}
        served.update(r.key for r in catalog.unplanned if r.key in catalog.descs)
        stored = [desc for key, desc in catalog.descs.items() if key not in served]
        return convert.routing_table(epoch, plan, routes, stored, self.query_infos(plan, catalog.queries))

    def query_infos(self, plan: ClusterPlan | None, queries: Mapping[str, str]) -> list[control.QueryInfo]:
        """The registered queries (``queries``: definitions by name) with what ``plan`` gives them."""
        infos = []
        for name, text in queries.items():
            query_plan = plan.query_plans.get(name) if plan is not None else None
            devices = 0
            if query_plan is not None:
                devices = len({node for st in query_plan.budgets_ms for node, _ in plan.backends_of(f"{name}/{st}")})
            infos.append(convert.query_info(name, text, query_plan, plan.planned_query_rates.get(name, 0.0)
                                            if plan is not None else 0.0, devices))
        return infos


def _push_model_table(node: Node, table: control.ModelTable, early: "_EarlyPush | None") -> Awaitable:
    """The call that sends ``node`` its model table (told to the make step's early routes, if any)."""
    call = node.stub.UpdateModelTable(table, timeout=MODEL_TABLE_TIMEOUT_S)
    return call if early is None else early.answer_of(node, call)


def _failed_loads(reply: control.ModelTableReply) -> Iterator[tuple[str, str]]:
    """(model, the backend's reason) for each model a backend's answer says failed to load."""
    for f in reply.failed:
        name, _, reason = f.partition(": ")
        yield name, reason


def _not_loaded(node: Node, reason: str) -> str:
    """Why a route has no backend for a model that failed to load on ``node``."""
    return f"failed to load on {node.node_id}: {reason}"


@dataclass
class _Making:
    """A make step under way."""

    started: float                                           # time.monotonic()
    cut: asyncio.Event = field(default_factory=asyncio.Event)   # set: a newer plan superseded it


class _EarlyPush:
    """One make step's early routes (globalsched/actuators/early_routes.py) and its pushing task's state."""

    def __init__(self, routes: EarlyRoutes) -> None:
        self.routes = routes
        self.failed: dict[str, str] = {}     # models that failed to load so far in this make step
        self.wake = asyncio.Event()
        self.done = False
        self.pushing = False

    def answered(self, node_id: str) -> None:
        self.routes.answered(node_id)
        if self.routes.due():
            self.wake.set()

    async def answer_of(self, node: Node, call: Awaitable) -> object:
        """``call``'s reply, noted as soon as it comes (its failures first, so no route names them)."""
        try:
            reply = await call
        except BaseException:
            self.answered(node.node_id)
            raise
        self.failed.update((name, _not_loaded(node, reason)) for name, reason in _failed_loads(reply))
        self.answered(node.node_id)
        return reply

    async def stop(self, pusher: asyncio.Task) -> None:
        """The make step ended: a push under way finishes (the routing tables must follow it), none
        starts."""
        self.done = True
        if self.pushing:
            await asyncio.wait([pusher])
        pusher.cancel()
        for outcome in await asyncio.gather(pusher, return_exceptions=True):
            if isinstance(outcome, Exception):      # the plan's own routing tables follow regardless
                log.error("early routes failed: %s", outcome, exc_info=outcome)
