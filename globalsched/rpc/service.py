"""The global scheduler's gRPC servicer: it wires the scheduler's parts together and delegates to them.

- globalsched/state/membership.py: Register (address resolution, dial-back), Heartbeat, Attach, Leave,
  and removing lost nodes; a backend's heartbeat also carries its latency samples, which go to the
  measured profiles (globalsched/state/model_admin.py, globalsched/state/profile_book.py);
- globalsched/state/rate_reports.py: ReportWorkload: smoothed rates, rate windows, fan-out per query edge;
- globalsched/state/model_admin.py: the model database behind Upload/Download/List/Load/Unload/AddProfile,
  query registration, profiling on demand, models that fail to load;
- globalsched/planning/replan_trigger.py: how the parts above ask for a plan;
- globalsched/planning/control_loop.py: the planning task: reads the view (globalsched/state/read_view.py), calls the pure
  planner (globalsched/planning/planner.py) and hands each new plan to the actuators;
- globalsched/actuators/distribution.py, an actuator: model tables to backends, then routing tables to frontends;
- globalsched/actuators/device_scaler.py, an actuator: the devices each device type should have
  (globalsched/planning/scaling_policy.py), as nexus_desired_devices on the metrics port and in GetStatus;
- globalsched/rpc/status.py: GetStatus.

A part refuses a request by raising :class:`globalsched.refusal.Refused`; the servicer turns it
into the RPC's status.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from dataclasses import replace

import grpc
from prometheus_client import CollectorRegistry

from common import grpc_util
from common.config import LeaderElection, PlannerHostKind, SchedulerConfig
from common.health import Health
from common.heap_freezer import HeapFreezer
from common.loop_lag import LoopLagMonitor
from common.pb import control, control_grpc
from common.security import Credentials
from globalsched.planning.control_loop import ControlLoop
from globalsched.actuators.device_scaler import DeviceScaler, ScalerCollector
from globalsched.state.database.cluster_token import TokenMismatch, check_token
from globalsched.state.database.lease import LeaderLease, plan_epoch_base
from globalsched.state.database.plan_store import PlanStore
from globalsched.actuators.distribution import Distribution
from globalsched.leadership.kube_lease import KubeApi, KubeApiError, KubernetesLease
from globalsched.leadership.leader import Leadership, LostLeadership, Role, StandbyGate
from globalsched.state.membership import Membership
from globalsched.state.model_admin import ModelAdmin
from globalsched.state.modeldb import ModelDatabase
from globalsched.planning.planner import PlannerSettings, adopted_state
from globalsched.planning.planner_host import InThreadPlanner, PlannerProcess
from globalsched.planning.prefix_groups import assign_prefix_group
from globalsched.rpc.profile_metrics import ProfileCollector
from globalsched.refusal import Refused
from globalsched.planning.replan_trigger import ReplanTrigger
from globalsched.planning.residency import requested_while_cold
from globalsched.planning.scaling_policy import ScalingConfig
from globalsched.rpc.status import scaling_reply, status_reply
from globalsched.state.read_view import read_view, warm_reads
from globalsched.state.rate_reports import Workload

log = logging.getLogger("nexus.scheduler")

SWITCH_INTERVAL_S = 0.0001

ADOPTION_GRACE_S = 5.0      # how long a new leader waits for the adopted plan's backends before planning


class SchedulerService(control_grpc.SchedulerServicer):
    def __init__(self, config: SchedulerConfig, db: ModelDatabase, prefix_fn=None,
                 creds: Credentials = grpc_util.NO_CREDENTIALS, leadership: Leadership | None = None) -> None:
        self.config = config
        self.leadership = leadership or Leadership.single()
        self.db = db
        self.workload = Workload()
        self.trigger = ReplanTrigger()
        self.membership = Membership(config, creds, self.workload, self.trigger)
        self.nodes = self.membership.nodes
        self.admin = ModelAdmin(config, db, self.nodes, self.trigger, prefix_fn)
        self.distribution = Distribution(self.nodes, events=self.admin, workload=self.workload,
                                         may_act=self.leadership.may_act)
        self.scaler = DeviceScaler(ScalingConfig.from_config(config),
                                   self.membership.backends, self.workload.window_rates,
                                   persist=self._persist_scaling)
        self.plan_store: PlanStore | None = None      # a shared database: the plan in force, for a standby
        settings = PlannerSettings.from_config(config)
        self.planner = (PlannerProcess(settings) if config.planner is PlannerHostKind.PROCESS
                        else InThreadPlanner(settings))
        self.control = ControlLoop(settings, self.trigger, self.read_view,
                                   [self.admin, self.admin.profiling, self.distribution, self.scaler], persist=self._persist,
                                   catalog=self.admin.catalog_steps, may_act=self.leadership.may_act,
                                   planner=self.planner, ahead=[self.scaler.made])
        self.loop_lag = LoopLagMonitor("nexus_scheduler_loop_lag_seconds")
        self.heap = HeapFreezer()       # full collections of the fleet's state held the loop 150-200 ms
        self._tasks: list[asyncio.Task] = []

    def warm(self) -> None:
        """Parse and fingerprint every stored profile once (a worker thread, before the scheduler
        answers anything): at 2,400 models the first plan's read of them held the event loop 2 s
        while a fleet registered (benchmarks/elastic.md). Later reads reuse those objects."""
        self.admin.in_service.choices()

    def read_view(self, now: float, force=None, why: tuple[str, ...] = ()):
        return read_view(now, self.membership.backends(), self.admin, self.workload, force, why)

    # ---- lifecycle ---------------------------------------------------------------------------------

    async def start_leading(self, lease_epoch: int) -> None:
        """Start as the leader elected with ``lease_epoch`` (a shared database): read again what the
        database holds (a standby's view may be older than the last leader's writes), adopt the plan in
        force and the scaling history, and start (:meth:`start`) with plan epochs above every earlier
        leader's."""
        await asyncio.to_thread(self.admin.reread)
        adopted = history = None
        if self.plan_store is not None:
            try:
                adopted = await asyncio.to_thread(self.plan_store.load)
            except Exception as exc:
                log.warning("cannot read the plan in force (planning afresh): %s", exc)
            try:
                history = await asyncio.to_thread(self.plan_store.load_scaling, self.scaler.clock())
            except Exception as exc:
                log.warning("cannot read the scaling history (its cool-downs start again): %s", exc)
        hold: set[str] = set()
        plan = adopted.plan if adopted is not None else None
        if plan is not None:
            self.control.adopt(adopted_state(adopted, self.control.clock()))
            self.distribution.adopt(plan)
            hold = {b.node_id for p in plan.placements.values() for b in p.backends}
            log.info("adopted the plan in force: %d backends, %d sessions; waiting up to %.0f s for its backends "
                     "to register before planning", len(hold), len(plan.sessions), ADOPTION_GRACE_S)
        self.scaler.adopt(plan, history)
        if history is not None:
            log.info("adopted the scaling history: %s", ", ".join(
                f"{t} desired {h.desired}" for t, h in sorted(history.types.items())) or "no device type yet")
        self.start(lease_epoch, hold)

    async def _persist(self, state: bytes) -> None:
        if self.plan_store is None:
            return
        try:
            landed = await asyncio.to_thread(self.plan_store.save_pickled, state, self.leadership.lease_epoch)
        except Exception as exc:
            log.warning("could not store the plan in force (a standby taking over would plan afresh): %s", exc)
            return
        if not landed:
            self.leadership.lost = True       # fenced: nothing is pushed from now on; the lease task exits
            log.error("the plan in force was not stored: another scheduler holds the lease")

    async def _persist_scaling(self, state, now: float) -> None:
        if self.plan_store is None:
            return
        try:
            await asyncio.to_thread(self.plan_store.save_scaling, state, self.leadership.lease_epoch, now)
        except Exception as exc:
            log.warning("could not store the scaling history: %s", exc)

    async def _plan_when_registered(self, backends: set[str]) -> None:
        """Plan once every backend of an adopted plan registered again (or after the grace): planning
        without them would move their sessions. The database's reads are cached first, in a worker thread
        (:func:`~globalsched.state.read_view.warm_reads`)."""
        await asyncio.to_thread(warm_reads, self.admin)
        self.heap.tick()        # the reads are long-lived: full collections while a fleet registers skip them
        deadline = time.monotonic() + ADOPTION_GRACE_S
        while backends - set(self.nodes) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        missing = backends - set(self.nodes)
        if backends:
            log.info("planning from the adopted plan%s", f"; not registered: {', '.join(sorted(missing))}"
                     if missing else ": every backend registered again")
        await self.control.run()

    def start(self, lease_epoch: int = 0, hold: set[str] = frozenset()) -> None:
        """Start planning, reaping and scaling (with several schedulers, once elected: ``lease_epoch`` is
        the leader's, and ``hold`` the backends of an adopted plan the first plan waits for)."""
        self.control.begin_epochs(plan_epoch_base(lease_epoch))
        # From here this scheduler is the database's only writer (a leader that loses its lease exits):
        # what it reads stays true until it writes.
        self.admin.db.keep_reads = True
        self._tasks = [asyncio.create_task(self._plan_when_registered(set(hold))), asyncio.create_task(self.membership.reaper()),
                       asyncio.create_task(self.control.epoch_timer()), asyncio.create_task(self.scaler.run()),
                       asyncio.create_task(self.loop_lag.run()), asyncio.create_task(self.heap.run())]

    async def stop(self) -> None:
        self.membership.stopping = True     # streams that end from now on are the shutdown's
        for t in self._tasks:
            t.cancel()
        self.control.close()
        self.distribution.close()
        await self.membership.close()
        await self.planner.close()

    def close(self) -> None:
        self.admin.close()

    # ---- membership --------------------------------------------------------------------------------

    async def Register(self, request, context):
        try:
            return await self.membership.register(request, context.peer())
        except Refused as r:
            await context.abort(r.code, r.message)

    async def Heartbeat(self, request, context):
        period_s = self.membership.heartbeat(request.node_id)
        node = self.nodes.get(request.node_id)
        backend = node is not None and node.kind == control.NODE_KIND_BACKEND
        if period_s is not None and request.batch_samples and backend:
            self.admin.in_service.serving_samples(node, request.batch_samples, time.monotonic())
        if period_s is None:
            return control.HeartbeatReply(known=False)
        return control.HeartbeatReply(known=True, heartbeat_interval_ms=round(period_s * 1000))

    async def Attach(self, request, context):
        events = self.membership.attach(request.node_id)
        try:
            async for event in events:
                yield event
        except Refused as r:
            await context.abort(r.code, r.message)
        finally:
            await events.aclose()     # the stream's end removes the node now, not when collected

    async def Leave(self, request, context):
        moved = self.control.plan.sessions_on(request.node_id) if self.control.plan is not None else 0
        try:
            await self.membership.leave(request.node_id)
            return control.LeaveReply(sessions_moved=moved)
        except Refused as r:
            await context.abort(r.code, r.message)

    # ---- workload ----------------------------------------------------------------------------------

    async def ReportWorkload(self, request, context):
        if request.node_id not in self.nodes:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"unknown node {request.node_id!r}; register first")
        plan = self.control.latest      # cold there, even while it is being applied
        cold = requested_while_cold(plan.cold, request) if plan is not None else []
        if cold:                # re-plan now, to page them in (globalsched/planning/residency.py)
            now = time.monotonic()
            self.workload.report(request, now)
            self.trigger.request(f"{', '.join(cold)} requested while cold", requests_wait=True)
        elif self.workload.report(request, time.monotonic()):
            self.trigger.evaluate()
        return control.WorkloadReply()

    # ---- model administration ----------------------------------------------------------------------

    async def UploadModel(self, request_iterator, context):
        try:
            return await self.admin.upload(request_iterator)
        except Refused as r:
            await context.abort(r.code, r.message)

    async def DownloadModel(self, request, context):
        try:
            async for chunk in self.admin.download(request.sha256):
                yield chunk
        except Refused as r:
            await context.abort(r.code, r.message)

    async def ListModels(self, request, context):
        return self.admin.list_models()

    async def WaitModelReady(self, request, context):
        try:
            return await self.admin.wait_ready(request)
        except Refused as r:
            await context.abort(r.code, r.message)

    async def LoadModel(self, request, context):
        try:
            return await self.admin.load(request)
        except Refused as r:
            await context.abort(r.code, r.message)

    async def UnloadModel(self, request, context):
        try:
            return await self.admin.unload(request)
        except Refused as r:
            await context.abort(r.code, r.message)

    async def AddProfile(self, request, context):
        try:
            return await self.admin.add_profile(request)
        except Refused as r:
            await context.abort(r.code, r.message)

    async def RegisterQuery(self, request, context):
        try:
            return await self.admin.register_query(request.json)
        except Refused as r:
            await context.abort(r.code, r.message)

    async def ListQueries(self, request, context):
        return control.ListQueriesReply(queries=self.distribution.query_infos(self.control.plan,
                                                                              self.admin.query_store.all()))

    # ---- status ------------------------------------------------------------------------------------

    async def GetStatus(self, request, context):
        plan, epoch = self.control.plan, self.control.epoch
        if request.scaling_only:
            reply = scaling_reply(plan, self.membership.backends(), self.scaler.decisions.values())
        else:
            routing = control.RoutingTable(epoch=epoch) if plan is None else \
                self.distribution.routing_table(replace(plan, catalog=self.admin.catalog(plan)), epoch)   # as of now
            reply = status_reply(plan, routing, self.membership.backends(), len(self.membership.frontends()),
                                 self.admin, max(time.monotonic() - self.control.last_plan_time, 0.0),
                                 self.scaler.decisions.values())
        reply.leader = self.leadership.leader_address
        return reply


async def serve(config: SchedulerConfig, ready=None) -> None:
    """Run the scheduler until cancelled; ``ready(address, metrics=URL, role=ROLE)`` is called once it
    listens. With ``--database`` it may start as a standby (globalsched/leadership/leader.py) and leads once
    elected; it exits with status 3 when it loses the leadership."""
    # A worker thread holds the interpreter while it runs (the planner itself with --planner thread:
    # seconds at a thousand devices; database writes, the metrics text); the event loop that answers
    # heartbeats waits for it at every wake-up, for up to the switch interval (default 5 ms), and a
    # loop that wakes often fell seconds behind. numpy hands the interpreter over inside each
    # operation on a few thousand elements (the rates' running sums), and the loop waits a switch
    # interval to take it back: at 0.5 ms, the rates of 2,400 sessions took 90-170 ms of the loop
    # while a plan ran in a thread (benchmarks/elastic.md).
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        db = ModelDatabase(config.data_dir, int(config.max_upload_mb * 1024 * 1024), database_url=config.database)
    except (ConnectionError, RuntimeError) as exc:     # unreachable, or a schema this release cannot use
        raise SystemExit(f"nexus scheduler: error: {exc}") from None
    creds = Credentials.load(config.security)
    shared = bool(config.database)
    leadership = Leadership(None, shared=shared, warm=db.warm_blob_cache if shared else None)
    service = SchedulerService(config, db, assign_prefix_group, creds, leadership)
    # Started before gRPC has threads: a fork beside them has gRPC log a line on the console.
    await service.planner.start()
    server = grpc_util.server(creds, interceptors=[StandbyGate(leadership)] if shared else None)
    control_grpc.add_SchedulerServicer_to_server(service, server)
    health = await Health.attach(server)
    address = grpc_util.bind(server, config.listen, creds)
    if not shared:
        leadership.leader_address = config.advertise or address
    if shared:
        try:
            await asyncio.to_thread(check_token, db.sql, creds.token)
        except TokenMismatch as exc:
            db.close()
            raise SystemExit(f"nexus scheduler: error: {exc}") from None
        try:
            leadership.lease = await asyncio.to_thread(_lease, config, config.advertise or address)
            if config.leader_election == LeaderElection.KUBERNETES:
                leadership.poll_s = max(0.5, config.leader_lease_s / 4)     # the API server is not a database
            service.plan_store = await asyncio.to_thread(PlanStore, db.sql)
        except (ConnectionError, KubeApiError) as exc:
            db.close()
            raise SystemExit(f"nexus scheduler: error: {exc}") from None
    await asyncio.to_thread(service.warm)
    await server.start()
    metrics = await _start_metrics(config, service, server)

    async def elected(lease_epoch: int) -> None:
        await service.start_leading(lease_epoch)
        await health.set_ready(True)      # readiness: the leader only (a Service sends nodes to it)

    keeper = asyncio.create_task(leadership.run(elected))
    await asyncio.wait({keeper, asyncio.create_task(leadership.decided.wait())}, return_when=asyncio.FIRST_COMPLETED)
    log.info("scheduler listening on %s (model database %s)%s", address, db.describe,
             "" if not shared else f", {leadership.role.value}")
    if ready:
        ready(address, **({"metrics": metrics.url} if metrics is not None else {}),
              **({"role": leadership.role.value} if shared else {}))
    lost: LostLeadership | None = None
    waiter = asyncio.create_task(server.wait_for_termination())
    try:
        done, _ = await asyncio.wait({keeper, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if keeper in done and isinstance(keeper.exception(), LostLeadership):
            lost = keeper.exception()
        elif keeper in done and keeper.exception() is not None:
            raise keeper.exception()
        elif keeper in done:
            await waiter                  # one scheduler: it leads for as long as it runs
    finally:
        keeper.cancel()
        await service.stop()
        if lost is None and leadership.role is Role.LEADER:
            await asyncio.to_thread(leadership.release)
        if metrics is not None:
            await metrics.close()
        await server.stop(grace=1)       # before the waiter goes: cancelling it first cancels the shutdown
        waiter.cancel()
        service.close()
        if leadership.lease is not None:
            leadership.lease.close()
        db.close()
    if lost is not None:
        raise SystemExit(lost.code)


def _lease(config: SchedulerConfig, address: str) -> LeaderLease | KubernetesLease:
    """The lease this scheduler competes for (blocking): a row in the database, or a Kubernetes Lease."""
    if config.leader_election == LeaderElection.KUBERNETES:
        return KubernetesLease(config.database, Leadership.identity(), address, config.leader_lease_s,
                               KubeApi.in_cluster())
    return LeaderLease(config.database, Leadership.identity(), address, config.leader_lease_s)


async def _start_metrics(config: SchedulerConfig, service: SchedulerService, server):
    """The Prometheus endpoint on ``--metrics-listen`` (None when off); exits with a message when it cannot bind."""
    if not config.resolved_metrics_listen:
        return None
    from common.metrics_http import serve_metrics  # lazy: aiohttp (~150 ms at start-up) only with --metrics-listen

    registry = CollectorRegistry()
    registry.register(ScalerCollector(service.scaler))
    registry.register(ProfileCollector(service.admin))
    registry.register(service.loop_lag.histogram)
    registry.register(service.control.apply_seconds)
    try:
        metrics = await serve_metrics("scheduler", config.metrics_listen, config.resolved_metrics_listen, registry)
    except SystemExit:
        await server.stop(grace=0)
        raise
    log.info("Prometheus metrics on %s", metrics.url)
    return metrics
