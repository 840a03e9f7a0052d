"""The global scheduler service: model database, node registry, epoch re-planning, table pushes.

One asyncio loop. Every change that can alter the plan (a node joins or leaves, a model is
uploaded, loaded or unloaded, a profile arrives, a query's measured fan-out drifts out of its band)
sets an event and forces a re-plan; workload reports and a timer ask the re-planner to judge the
rates (its epoch, band and cooldown decide). A single planner task plans through
:class:`globalsched.planning_loop.PlanningLoop` (the minimal-movement re-planner, with minimum
replicas) and pushes model tables to backends first, then routing tables to frontends, so a
frontend never routes to a backend that has not loaded the model. A node is removed the moment its
Attach stream ends (missed heartbeats are the backstop), and the plan is repaired at once.
"""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import json
import logging
import pathlib
import time
import urllib.parse
import uuid
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common import grpc_util
from common.config import WILDCARD_HOSTS, SchedulerConfig, join_host_port, split_host_port
from common.health import LIVENESS, Health
from common.pb import control, control_grpc
from common.profile import Profile, ProfileError
from common.security import Credentials
from globalsched.algorithms.config import PlannerConfig
from globalsched.algorithms.replan import ReplanConfig, ReplanReason
from globalsched.load_failures import LoadFailures
from globalsched.cluster import MIN_PLANNED_RATE_RPS, ClusterPlan, SessionInput, plan_cluster
from globalsched.convert import model_desc
from globalsched.modeldb import ModelDatabase, UploadError
from globalsched.placement import BackendSlot
from globalsched.planning_loop import PlanningLoop
from globalsched.query_sessions import plan_query_sessions
from globalsched.querydb import QueryStore
from common.query_def import ModelIO, QueryError, parse_query, validate_query

log = logging.getLogger("nexus.scheduler")

# Nexus's epoch rules, from the re-planning policy's defaults: re-plan early when a rate leaves this
# band of the rate planned for, but not sooner than the cooldown after the last plan.
RATE_BAND = (ReplanConfig.band_low, ReplanConfig.band_high)
EARLY_REPLAN_COOLDOWN_S = ReplanConfig.cooldown_s
RATE_REPORT_TTL_S = 10.0        # a frontend's report counts this long
RATE_SMOOTHING = 0.3            # weight of the newest report in the exponentially smoothed rate
PLAN_RATE_WINDOW_S = 10.0       # plans use the mean rate of the reports of this window
MIN_EDGE_SAMPLES = 20           # parent rows before a measured gamma is trusted
# What _inputs derives along with the sessions: kept as they were when the re-planner keeps the plan.
_PLAN_VIEW = ("planned_gammas", "session_models", "stage_sessions", "planned_query_rates", "session_slos",
              "query_plans")
DIAL_BACK_TIMEOUT_S = 3.0       # a registering node must answer the scheduler's health check within this


def peer_host(peer: str) -> str:
    """The IP address in a gRPC peer string (``ipv4:10.0.0.2:5123``, ``ipv6:[fd00::2]:5123``, the
    brackets possibly %-encoded); an IPv4-mapped IPv6 address gives its IPv4 form. ValueError for
    peers without one (a Unix socket)."""
    kind, _, rest = urllib.parse.unquote(peer).partition(":")
    if kind not in ("ipv4", "ipv6"):
        raise ValueError(f"cannot tell the address of a peer on {peer!r}")
    host, _ = split_host_port(rest)
    ip = ipaddress.ip_address(host.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return host


def advertised_address(address: str, peer: str) -> str:
    """Where peers reach a registering node: its own ``address`` (its --advertise, or where it listens),
    with a wildcard host (0.0.0.0, [::]) replaced by the host the registration came from."""
    try:
        host, port = split_host_port(address)
    except ValueError as exc:
        raise ValueError(f"address must be HOST:PORT, got {address!r} ({exc})") from None
    if port == 0:
        raise ValueError(f"address {address!r} has no port")
    if host in WILDCARD_HOSTS:
        host = peer_host(peer)
    return join_host_port(host, port)


@dataclass
class Node:
    node_id: str
    kind: int
    address: str
    device: str = ""
    device_type: str = ""
    memory_mb: float = 0.0
    last_seen: float = field(default_factory=time.monotonic)
    stub: object = None
    channel: object = None


class SchedulerService(control_grpc.SchedulerServicer):
    def __init__(self, config: SchedulerConfig, db: ModelDatabase, prefix_fn=None,
                 creds: Credentials = grpc_util.NO_CREDENTIALS) -> None:
        self.config = config
        self.creds = creds
        self.db = db
        self.prefix_fn = prefix_fn
        # The path allowance is the planner's network margin: spent outside the device on every hop.
        self.planner_config = PlannerConfig(network_ms=config.path_allowance_ms, burst_sigma=config.burst_sigma)
        self.nodes: dict[str, Node] = {}
        self.rates: dict[str, dict[str, tuple[float, float]]] = {}   # frontend -> model -> (rate, t)
        # frontend -> model -> (time, requests, window seconds) of its reports over PLAN_RATE_WINDOW_S
        self.rate_history: dict[str, dict[str, collections.deque]] = {}
        self.plan: ClusterPlan | None = None
        self.planned_query_rates: dict[str, float] = {}    # query -> rate with headroom
        self.stage_sessions: set[str] = set()              # "<query>/<stage>" sessions of the plan
        # Nodes ignore tables older than the last they applied; a restarted scheduler's epochs must be
        # newer than its previous life's, so they start from the wall clock in milliseconds.
        self.epoch = int(time.time() * 1000)
        self.last_plan_time = 0.0
        self._replan = asyncio.Event()
        self._plan_lock = asyncio.Lock()
        self._profiling: set[tuple[str, str]] = set()
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self._force: ReplanReason | None = None
        self.planning = PlanningLoop(ReplanConfig(epoch_s=config.epoch_s, planner=self.planner_config),
                                     config.min_replicas, config.solver)
        self.query_store = QueryStore(config.data_dir)
        self.edges: dict[str, dict[tuple[str, str, str], tuple[int, int, float]]] = {}  # frontend -> edge -> counts
        self.session_models: dict[str, str] = {}        # session -> model it runs
        self.session_slos: dict[str, float] = {}
        self.session_rates: dict[str, float] = {}       # session -> rate planned (headroom included)
        self.query_plans: dict = {}
        self.planned_gammas: dict[tuple[str, str, str], float] = {}
        self.slowdowns = load_slowdowns(config.colocation_report)
        self.session_rates: dict[str, float] = {}       # session -> rate the current plan serves
        self.load_failures = LoadFailures()     # model files a backend could not load: bounded retries

    # ---- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._planner()), asyncio.create_task(self._reaper()),
                       asyncio.create_task(self._epoch_timer())]
        self._replan.set()

    async def stop(self) -> None:
        self._stopping = True
        for t in self._tasks:
            t.cancel()
        for node in self.nodes.values():
            if node.channel is not None:
                await node.channel.close()

    def request_replan(self, why: str, membership: bool = False) -> None:
        """Re-plan now (forced: something the plan depends on changed)."""
        log.info("re-plan requested: %s", why)
        self._force = ReplanReason.MEMBERSHIP if membership or self._force is ReplanReason.MEMBERSHIP \
            else ReplanReason.SESSIONS_CHANGED
        self._replan.set()

    def request_evaluation(self) -> None:
        """Let the re-planner decide whether the plan still fits (rate band, epoch; after its cooldown)."""
        self._replan.set()

    # ---- registration ------------------------------------------------------------------------------

    async def Register(self, request, context):
        if request.kind not in (control.NODE_KIND_FRONTEND, control.NODE_KIND_BACKEND):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "kind must be FRONTEND or BACKEND")
        try:
            address = advertised_address(request.address, context.peer())
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        kind = "frontend" if request.kind == control.NODE_KIND_FRONTEND else "backend"
        problem = await self._dial_back(address)
        if problem:
            log.warning("refused %s registering from %s: %s", kind, context.peer(), problem)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"the scheduler cannot reach this {kind} at {address} ({problem}); start it with "
                                f"--advertise HOST:PORT, an address the scheduler and the frontends can dial")
        node_id = request.node_id or f"{'fe' if request.kind == control.NODE_KIND_FRONTEND else 'be'}-{uuid.uuid4().hex[:8]}"
        old = self.nodes.pop(node_id, None)
        if old is not None and old.channel is not None:
            await old.channel.close()
        node = Node(node_id, request.kind, address, request.device, request.device_type or request.device,
                    request.memory_mb)
        node.channel = grpc_util.aio_channel(node.address, self.creds)
        if request.kind == control.NODE_KIND_BACKEND:
            node.stub = control_grpc.BackendStub(node.channel)
        else:
            node.stub = control_grpc.FrontendStub(node.channel)
        self.nodes[node_id] = node
        self.request_replan(f"{node_id} registered at {node.address}")
        return control.RegisterReply(node_id=node_id, heartbeat_interval_ms=self.config.heartbeat_interval_ms,
                                     address=address)

    async def _dial_back(self, address: str) -> str:
        """Why the scheduler cannot reach a registering node at ``address`` ("" when it answers a health
        check): a node its peers cannot dial would otherwise be a silent black hole."""
        channel = grpc_util.aio_channel(address, self.creds)
        try:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=LIVENESS),
                                                            timeout=DIAL_BACK_TIMEOUT_S)
            return ""
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return f"no answer within {DIAL_BACK_TIMEOUT_S:g} s"
            return f"{exc.code().name}: {exc.details()}"
        finally:
            await channel.close()

    async def Leave(self, request, context):
        """A stopping node leaves the plan: its sessions are planned elsewhere and every table pushed
        before the reply, so once it has the reply no frontend routes to it any more."""
        node = self.nodes.pop(request.node_id, None)
        if node is None:
            return control.LeaveReply()
        self.rates.pop(node.node_id, None)
        self.rate_history.pop(node.node_id, None)
        self.edges.pop(node.node_id, None)
        moved = 0
        if node.kind == control.NODE_KIND_BACKEND:
            if self.plan is not None:
                moved = sum(len(b.sessions) for p in self.plan.placements.values() for b in p.backends
                            if b.node_id == node.node_id)
            log.info("%s leaves; moving its %d sessions", node.node_id, moved)
            self._force = ReplanReason.MEMBERSHIP      # a repair, whatever the re-planner's cooldowns say
            try:
                await self.replan_once()
            except Exception:
                log.exception("re-planning without %s failed", node.node_id)
                await context.abort(grpc.StatusCode.INTERNAL, f"could not re-plan without {node.node_id}")
        else:
            log.info("%s leaves", node.node_id)
        if node.channel is not None:
            await node.channel.close()
        return control.LeaveReply(sessions_moved=moved)

    async def Attach(self, request, context):
        """Held open by every registered node: its end (the node died or stopped) removes the node
        at once, without waiting for missed heartbeats."""
        node = self.nodes.get(request.node_id)
        if node is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown node {request.node_id!r}; register first")
        try:
            while self.nodes.get(request.node_id) is node:
                yield control.AttachEvent(epoch=self.epoch)
                await asyncio.sleep(self.config.heartbeat_interval_ms / 1000)
        finally:
            if not self._stopping and self.nodes.get(request.node_id) is node:
                await self.remove_node(node.node_id, "its Attach stream ended")

    async def remove_node(self, node_id: str, why: str) -> None:
        """Forget a node now (its stream ended, or it missed heartbeats) and repair the plan."""
        node = self.nodes.pop(node_id, None)
        if node is None:
            return
        log.warning("%s removed: %s", node_id, why)
        self.rates.pop(node_id, None)
        self.rate_history.pop(node_id, None)
        self.edges.pop(node_id, None)
        self.request_replan(f"{node_id} left", membership=True)
        if node.channel is not None:
            await node.channel.close()

    async def Heartbeat(self, request, context):
        node = self.nodes.get(request.node_id)
        if node is None:
            return control.HeartbeatReply(known=False)
        node.last_seen = time.monotonic()
        return control.HeartbeatReply(known=True)

    async def ReportWorkload(self, request, context):
        if request.node_id not in self.nodes:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"unknown node {request.node_id!r}; register first")
        now = time.monotonic()
        table = self.rates.setdefault(request.node_id, {})
        for r in request.rates:
            rate = max(r.rate_rps, 0.0)
            old = table.get(r.model)
            if old is not None and now - old[1] <= RATE_REPORT_TTL_S:   # smooth Poisson noise of short windows
                rate = RATE_SMOOTHING * rate + (1 - RATE_SMOOTHING) * old[0]
            table[r.model] = (rate, now)
            if r.window_ms > 0:
                history = self.rate_history.setdefault(request.node_id, {}).setdefault(r.model, collections.deque())
                history.append((now, r.requests, r.window_ms / 1000))
                while history and history[0][0] < now - PLAN_RATE_WINDOW_S:
                    history.popleft()
        edges = self.edges.setdefault(request.node_id, {})
        for e in request.edges:
            key = (e.query, e.parent, e.child)
            old = edges.get(key)
            if old is not None and now - old[2] <= RATE_REPORT_TTL_S:   # keep a window of recent counts
                edges[key] = (old[0] + e.parent_requests, old[1] + e.child_requests, old[2])
            else:
                edges[key] = (e.parent_requests, e.child_requests, now)
        self._check_rate_band(now)
        return control.WorkloadReply()

    def planning_rates(self, now: float) -> dict[str, float]:
        """The rates a plan is made for: requests over time across the reports of the last
        PLAN_RATE_WINDOW_S, per frontend, summed (the smoothed rate where a frontend sent no counts).

        The smoothed rate decides *when* to re-plan, and a re-plan starts when it is at a high (or
        low) excursion; planning on that value would keep the excursion. The window's mean is steadier.
        """
        totals: dict[str, float] = {}
        for node, per_model in self.rates.items():
            for model, (smoothed, t) in per_model.items():
                if now - t > RATE_REPORT_TTL_S:
                    continue
                fresh = [(n, w) for at, n, w in self.rate_history.get(node, {}).get(model, ())
                         if now - at <= PLAN_RATE_WINDOW_S]
                window_s = sum(w for _, w in fresh)
                rate = sum(n for n, _ in fresh) / window_s if window_s > 0 else smoothed
                totals[model] = totals.get(model, 0.0) + rate
        return totals

    def current_rates(self, now: float) -> dict[str, float]:
        totals: dict[str, float] = {}
        for per_model in self.rates.values():
            for model, (rate, t) in per_model.items():
                if now - t <= RATE_REPORT_TTL_S:
                    totals[model] = totals.get(model, 0.0) + rate
        return totals

    def current_gammas(self, now: float) -> dict[tuple[str, str, str], float]:
        """Measured fan-out per query edge: child rows per parent row over the recent window."""
        totals: dict[tuple[str, str, str], list[int]] = {}
        for per_edge in self.edges.values():
            for key, (parent, child, t) in per_edge.items():
                if now - t <= 2 * RATE_REPORT_TTL_S:
                    acc = totals.setdefault(key, [0, 0])
                    acc[0] += parent
                    acc[1] += child
        return {k: c / p for k, (p, c) in totals.items() if p >= MIN_EDGE_SAMPLES}

    def _check_rate_band(self, now: float) -> None:
        """On a workload report: after the re-planner's cooldown, let it decide whether the plan still
        fits the rates (globalsched/planning_loop.py); a query's drifted fan-out re-plans at once."""
        if now - self.last_plan_time < EARLY_REPLAN_COOLDOWN_S:
            return
        why = self.plan_outdated(now)
        if why:
            self.request_replan(why)
        else:
            self.request_evaluation()

    def plan_outdated(self, now: float) -> str:
        """Why the current latency split no longer fits ("" when it still does): a measured gamma
        outside RATE_BAND of the one planned for. (Rates are the re-planner's to judge.)"""
        for key, gamma in self.current_gammas(now).items():
            planned = self.planned_gammas.get(key)
            if planned is None or not (RATE_BAND[0] * planned <= gamma <= RATE_BAND[1] * planned):
                return f"gamma of {key[0]}: {key[1]}->{key[2]} is {gamma:.2f}, planned {planned}"
        return ""

    # ---- model database ----------------------------------------------------------------------------

    async def UploadModel(self, request_iterator, context):
        header = None
        parts: list[bytes] = []
        size = 0
        async for chunk in request_iterator:
            which = chunk.WhichOneof("part")
            if which == "header":
                if header is not None:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "upload: header sent twice")
                header = chunk.header
            elif which == "data":
                if header is None:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "upload: the header must come first")
                size += len(chunk.data)
                if size > self.db.max_upload_bytes:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                        f"model file exceeds the upload limit of {self.db.max_upload_bytes} bytes")
                parts.append(chunk.data)
        if header is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "upload: no header")
        try:
            record = await asyncio.to_thread(
                self.db.add_model, header.name, parts, runtime=header.runtime or "onnxruntime",
                profile_json=header.profile_json, slo_ms=header.slo_ms, io_json=header.io_json,
                default_slo_ms=self.config.default_slo_ms, create_session=header.load, prefix_fn=self.prefix_fn,
                min_replicas=header.min_replicas)
        except UploadError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"upload of {header.name!r} refused: {exc}")
        self.request_replan(f"model {record.name} uploaded")
        return control.UploadReply(model=self._desc(record.name))

    async def DownloadModel(self, request, context):
        try:
            chunks = list(self.db.iter_blob(request.sha256, grpc_util.UPLOAD_CHUNK_BYTES))
        except KeyError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc.args[0]))
        for c in chunks:
            yield control.DownloadChunk(data=c)

    async def ListModels(self, request, context):
        return control.ListModelsReply(models=[self._desc(m.name) for m in self.db.models()])

    async def LoadModel(self, request, context):
        record = self.db.model(request.name)
        if record is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model {request.name!r}")
        if request.slo_ms < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"slo_ms must be positive, got {request.slo_ms}")
        if request.min_replicas:
            try:
                self.db.set_min_replicas(request.name, request.min_replicas)
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self.db.set_session(request.name, request.slo_ms or record.default_slo_ms)
        self.load_failures.forget(record.sha256)      # an explicit load tries afresh
        self.request_replan(f"model {request.name} loaded")
        return control.LoadReply()

    async def UnloadModel(self, request, context):
        if self.db.model(request.name) is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model {request.name!r}")
        self.db.remove_session(request.name)
        self.request_replan(f"model {request.name} unloaded")
        return control.UnloadReply()

    async def AddProfile(self, request, context):
        try:
            profile = Profile.from_json(request.profile_json)
            self.db.add_profile(request.model, profile)
        except ProfileError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"invalid profile: {exc}")
        except KeyError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc.args[0]))
        self.request_replan(f"profile of {request.model} for {profile.device_type}")
        return control.ProfileReply()

    # ---- queries -----------------------------------------------------------------------------------

    def _query_context(self):
        models = {m.name: ModelIO(m.inputs, m.outputs) for m in self.db.models()}
        min_latency = {}
        for name in models:
            profiles = self.db.profiles(name)
            if profiles:
                min_latency[name] = min(p.latency_ms(1) for p in profiles.values())
        return models, min_latency

    async def RegisterQuery(self, request, context):
        try:
            q = parse_query(request.json)
            models, min_latency = self._query_context()
            if q.name in models:
                raise QueryError(f"query {q.name!r}: a model already has that name")
            validate_query(q, models, min_latency)
        except QueryError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self.query_store.put(q.name, request.json)
        self.request_replan(f"query {q.name} registered")
        return control.QueryReply(name=q.name)

    async def ListQueries(self, request, context):
        return control.ListQueriesReply(queries=self._query_infos())

    def _query_infos(self) -> list:
        infos = []
        for name, text in self.query_store.all().items():
            plan = self.query_plans.get(name)
            info = control.QueryInfo(name=name, json=text)
            if plan is not None:
                info.budgets_ms.update(plan.budgets_ms)
                info.gamma.update(plan.gammas)
                info.split_method = plan.method
                info.reason = plan.reason
                info.planned_rate_rps = self.planned_query_rates.get(name, 0.0)
                info.latest_finish_ms.update(plan.latest_finish_ms)
                if self.plan is not None:
                    prefix = name + "/"
                    info.devices = len({node for st in plan.budgets_ms
                                        for node, _ in self.plan.backends_of(prefix + st)})
            infos.append(info)
        return infos

    def _desc(self, name: str) -> control.ModelDesc:
        record = self.db.model(name)
        loaded = any(s.model == name for s in self.db.sessions())
        desc = model_desc(record, self.db.profiles(name), loaded)
        desc.min_replicas = self.db.min_replicas(name)
        return desc

    # ---- planning ----------------------------------------------------------------------------------

    async def _epoch_timer(self) -> None:
        """Now and then, let the re-planner judge the plan (its epoch, rate band and cooldown decide;
        a plan that still fits stands: re-planning on noise would move sessions and cost their queues)."""
        while True:
            await asyncio.sleep(min(self.config.epoch_s, EARLY_REPLAN_COOLDOWN_S))
            why = self.plan_outdated(time.monotonic())
            if why:
                self.request_replan(f"epoch: {why}")
            else:
                self.request_evaluation()

    async def _reaper(self) -> None:
        interval = self.config.heartbeat_interval_ms / 1000
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for node in list(self.nodes.values()):
                if now - node.last_seen > self.config.node_timeout_s:
                    await self.remove_node(node.node_id, f"missed heartbeats for {now - node.last_seen:.1f} s")

    async def _planner(self) -> None:
        while True:
            await self._replan.wait()
            # Coalesce bursts of changes into one plan; a lost node is repaired without delay.
            await asyncio.sleep(0.005 if self._force is ReplanReason.MEMBERSHIP else 0.05)
            self._replan.clear()
            try:
                await self.replan_once()
            except Exception:  # keep the scheduler alive; the next trigger tries again
                log.exception("re-planning failed")

    def _profiles(self, model: str) -> dict[str, Profile]:
        """The model's profiles by device type, inflated by its measured co-location slowdown."""
        profiles = self.db.profiles(model)
        factor = self.slowdowns.get(model) or self.slowdowns.get(self.db.model(model).sha256 if self.db.model(model) else "")
        if factor and factor > 1.0:
            from profiler.slowdown import apply_colocation_slowdown
            profiles = {t: apply_colocation_slowdown(p, factor) for t, p in profiles.items()}
        return profiles

    def _inputs(self, now: float, device_types: list[str]) -> list[SessionInput]:
        """Model sessions from the database plus the stage sessions of every query, at planned rates:
        measured (or default) rates times 1 + ``rate_headroom``."""
        headroom = 1.0 + self.config.rate_headroom
        rates = {k: v * headroom for k, v in self.planning_rates(now).items()}
        default_rate = self.config.default_rate_rps * headroom
        out = []
        models = {}
        for s in self.db.sessions():
            record = self.db.model(s.model)
            if self._cannot_load(s.model, device_types):
                continue                         # routed with its reason, never placed again
            out.append(SessionInput(s.model, s.slo_ms, rates.get(s.model, default_rate),
                                    self._profiles(s.model), record.prefix_group if record else "",
                                    self.db.prefix_share(s.model) if record and record.prefix_group else None))
            models[s.model] = s.model
        queries = {}
        for name, text in self.query_store.all().items():
            try:
                queries[name] = parse_query(text)
            except QueryError as exc:
                log.warning("stored query %s no longer parses: %s", name, exc)
        profiles = {s.model: self._profiles(s.model) for q in queries.values() for s in q.stages}
        gammas = self.current_gammas(now)
        stage_sessions, self.query_plans = plan_query_sessions(
            queries, rates, gammas, profiles, device_types, self.config.latency_split, default_rate,
            self.planner_config)
        for q in queries.values():
            for st in q.stages:
                models[q.session_name(st.name)] = st.model
        self.planned_gammas = {(q, *k.split("->")): g for q, plan in self.query_plans.items()
                               for k, g in plan.gammas.items()}
        self.session_models = models
        self.stage_sessions = {q.session_name(st.name) for q in queries.values() for st in q.stages}
        self.planned_query_rates = {name: max(rates.get(name, default_rate), MIN_PLANNED_RATE_RPS) for name in queries}
        out += [s for s in stage_sessions if not self._cannot_load(models[s.model], device_types)]
        self.session_slos = {s.model: s.slo_ms for s in out}
        self.session_rates = {s.model: max(s.rate_rps, MIN_PLANNED_RATE_RPS) for s in out}
        return out

    async def replan_once(self) -> ClusterPlan:
        async with self._plan_lock:     # the planner task and Leave never plan at the same time
            return await self._replan_locked()

    async def _replan_locked(self) -> ClusterPlan:
        now = time.monotonic()
        backends = [BackendSlot(n.node_id, n.device_type, n.memory_mb) for n in self.nodes.values()
                    if n.kind == control.NODE_KIND_BACKEND]
        counts: dict[str, int] = {}
        for b in backends:
            counts[b.device_type] = counts.get(b.device_type, 0) + 1
        saved = {name: getattr(self, name) for name in _PLAN_VIEW}
        sessions = self._inputs(now, sorted(counts, key=lambda t: (-counts[t], t)))
        previous: dict[str, frozenset[str]] = {}
        if self.plan is not None:
            for placement in self.plan.placements.values():
                for b in placement.backends:
                    previous[b.node_id] = frozenset(s.model for s in b.sessions)
        force, self._force = self._force, None
        self.planning.begin(now, self._min_replicas(), force, previous)
        plan = plan_cluster(sessions, backends, previous, self.config.solver, self.planner_config,
                            solve_type=self.planning.solve_type)
        if force is None and self.plan is not None and not self.planning.changed:
            for name, value in saved.items():   # the re-planner kept the plan: so are its split and rates
                setattr(self, name, value)
            return self.plan
        self.session_rates = {s.model: max(s.rate_rps, MIN_PLANNED_RATE_RPS) for s in sessions}
        self.epoch += 1
        self.last_plan_time = now
        for placement in plan.placements.values():
            for b in placement.backends:
                log.info("epoch %d: %s duty cycle %.1f ms: %s", self.epoch, b.node_id, b.duty_cycle_ms,
                         ", ".join(f"{s.model} b={s.batch} {s.throughput_rps:.1f} rps" for s in b.sessions) or "idle")
        for note in plan.notes:
            log.warning(note)
        for model, why in plan.best_effort.items():
            log.warning("%s: %s", model, why)
        for model, device_type in plan.need_profile.items():
            self._start_profiling(model, device_type)
        failed = await self._push_model_tables(plan)
        self.plan = plan
        await self._push_routing_tables(plan, failed)
        return plan

    def _min_replicas(self) -> dict[str, int]:
        """Backends each model session keeps at least (0: the scheduler's default)."""
        return {s.model: self.db.min_replicas(s.model) for s in self.db.sessions()}

    async def _push_model_tables(self, plan: ClusterPlan) -> dict[str, str]:
        """Send each backend its table; return models that failed to load, with reasons."""
        failed: dict[str, str] = {}
        calls = []
        for placement in plan.placements.values():
            for b in placement.backends:
                node = self.nodes.get(b.node_id)
                if node is None:
                    continue
                entries = []
                for s in b.sessions:
                    model = self.session_models.get(s.model, s.model)
                    profiles = self._profiles(model)
                    entries.append(control.SessionEntry(
                        model=self._desc(model), slo_ms=self.session_slos.get(s.model, 0.0), batch=s.batch,
                        profile_json=profiles[node.device_type].to_json() if node.device_type in profiles else "",
                        rate_rps=s.throughput_rps, session=s.model if s.model != model else ""))
                table = control.ModelTable(epoch=self.epoch, duty_cycle_ms=b.duty_cycle_ms, sessions=entries)
                calls.append((node, node.stub.UpdateModelTable(table, timeout=120)))
        for node, call in calls:
            try:
                reply = await call
                for f in reply.failed:
                    name, _, reason = f.partition(": ")
                    failed[name] = f"failed to load on {node.node_id}: {reason}"
                    record = self.db.model(self.session_models.get(name, name))
                    if record and not self.load_failures.exhausted(record.sha256, node.device_type):
                        # The next plan tries again, or routes it UNAVAILABLE once the attempts are spent.
                        self.load_failures.record(record.sha256, node.device_type, node.node_id, reason)
                        self.request_replan(f"{name} failed to load on {node.node_id}")
            except grpc.aio.AioRpcError as exc:
                log.warning("model table push to %s failed: %s", node.node_id, exc.details())
        return failed

    async def _push_routing_tables(self, plan: ClusterPlan, failed: dict[str, str]) -> None:
        table = self.routing_table(plan, failed)
        calls = [(n, n.stub.UpdateRoutingTable(table, timeout=10)) for n in self.nodes.values()
                 if n.kind == control.NODE_KIND_FRONTEND]
        for node, call in calls:
            try:
                await call
            except grpc.aio.AioRpcError as exc:
                log.warning("routing table push to %s failed: %s", node.node_id, exc.details())

    def routing_table(self, plan: ClusterPlan, failed: dict[str, str] | None = None) -> control.RoutingTable:
        failed = failed or {}
        routes = []
        served = set()
        profiling = self._profiling_models()
        measured = self.current_rates(time.monotonic())
        placed: dict[str, list[tuple[str, float, int, float]]] = {}   # session -> (node, share, batch, duty cycle)
        for placement in plan.placements.values():
            for b in placement.backends:
                for s in b.sessions:
                    placed.setdefault(s.model, []).append((b.node_id, s.throughput_rps, s.batch, b.duty_cycle_ms))
        for session, model in self.session_models.items():
            served.add(model)
            backends = []
            for node_id, share, batch, duty_cycle_ms in placed.get(session, ()):
                node = self.nodes.get(node_id)
                if node is not None and model not in failed:
                    backends.append(control.BackendRoute(node_id=node_id, address=node.address, weight=share,
                                                         batch=batch, duty_cycle_ms=duty_cycle_ms))
            record = self.db.model(model)
            reason = (failed.get(model) or (self.load_failures.reason(record.sha256) if record else "")
                      or plan.unplaced.get(session, ""))
            if model in profiling:
                reason = reason or "being profiled"
            routes.append(control.ModelRoute(model=self._desc(model), slo_ms=self.session_slos.get(session, 0.0),
                                             backends=backends, reason="" if backends else (reason or "not placed"),
                                             session=session if session != model else "",
                                             planned_rate_rps=self.session_rates.get(session, 0.0),
                                             measured_rate_rps=measured.get(session, 0.0)))
        for s in self.db.sessions():        # models no backend could load: UNAVAILABLE with the reason
            record = self.db.model(s.model)
            if s.model not in self.session_models and record and self.load_failures.reason(record.sha256):
                served.add(s.model)
                routes.append(control.ModelRoute(model=self._desc(s.model), slo_ms=s.slo_ms,
                                                 reason=self.load_failures.reason(record.sha256)))
        stored = [self._desc(m.name) for m in self.db.models() if m.name not in served]
        return control.RoutingTable(epoch=self.epoch, routes=routes, stored=stored, queries=self._query_infos(),
                                    planned_devices=plan.num_devices_planned, lower_bound=plan.lower_bound)

    async def GetStatus(self, request, context):
        from globalsched.status import status_reply

        return status_reply(self)

    def _profiling_models(self) -> set[str]:
        return {m for m, _ in self._profiling}

    # ---- profiling on demand -----------------------------------------------------------------------

    def _start_profiling(self, model: str, device_type: str) -> None:
        key = (model, device_type)
        record = self.db.model(model)
        if key in self._profiling or (record and self.load_failures.exhausted(record.sha256, device_type)):
            return
        tried = self.load_failures.tried(record.sha256, device_type) if record else set()
        candidates = [n for n in self.nodes.values()
                      if n.kind == control.NODE_KIND_BACKEND and n.device_type == device_type]
        node = next((n for n in candidates if n.node_id not in tried), candidates[0] if candidates else None)
        if node is None:
            return
        self._profiling.add(key)
        asyncio.create_task(self._profile(node, model, key))

    async def _profile(self, node: Node, model: str, key: tuple[str, str]) -> None:
        try:
            reply = await node.stub.ProfileModel(control.ProfileRequest(model=self._desc(model), budget_s=20.0),
                                                 timeout=300)
            if reply.error:
                log.warning("profiling %s on %s failed: %s", model, node.node_id, reply.error)
                self._record_load_failure(model, node, reply.error)
                return
            profile = Profile.from_json(reply.profile_json)
            self.db.add_profile(model, profile)
            log.info("profiled %s on %s (max batch %d)", model, profile.device_type, profile.max_batch)
        except (grpc.aio.AioRpcError, ProfileError, KeyError) as exc:
            log.warning("profiling %s on %s failed: %s", model, node.node_id, exc)
            self._record_load_failure(model, node, str(exc))
        finally:
            self._profiling.discard(key)
            self.request_replan(f"profile of {model} done")


    def _cannot_load(self, model: str, device_types) -> bool:
        """No backend of any present device type could load the model's file (attempts spent)."""
        record = self.db.model(model)
        return bool(record) and self.load_failures.exhausted_on_all(record.sha256, device_types)

    def _record_load_failure(self, model: str, node: Node, reason: str) -> None:
        record = self.db.model(model)
        if record is not None:
            self.load_failures.record(record.sha256, node.device_type, node.node_id, reason)


def load_slowdowns(path: str) -> dict[str, float]:
    """Slowdown factors by model name and sha256 from a multi-tenant report; {} without one."""
    if not path:
        return {}
    from profiler.slowdown import slowdowns_from_report

    try:
        report = json.loads(pathlib.Path(path).read_text())
        return slowdowns_from_report(report)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"nexus scheduler: error: --colocation-report {path}: {exc}") from None


async def serve(config: SchedulerConfig, ready=None) -> None:
    """Run the scheduler until cancelled; ``ready(address)`` is called once it listens."""
    db = ModelDatabase(config.data_dir, int(config.max_upload_mb * 1024 * 1024))
    prefix_fn = None
    try:
        from globalsched.prefix_groups import assign_prefix_group as prefix_fn  # noqa: F811
    except ImportError:
        pass
    creds = Credentials.load(config.security)
    service = SchedulerService(config, db, prefix_fn, creds)
    server = grpc_util.server(creds)
    control_grpc.add_SchedulerServicer_to_server(service, server)
    health = await Health.attach(server)
    address = grpc_util.bind(server, config.listen, creds)
    await server.start()
    await health.set_ready(True)
    service.start()
    log.info("scheduler listening on %s (data in %s)", address, config.data_dir)
    if ready:
        ready(address)
    try:
        await server.wait_for_termination()
    finally:
        await service.stop()
        await server.stop(grace=1)
        service.query_store.close()
        db.close()
