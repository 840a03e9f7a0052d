"""Who is in the cluster: registration, heartbeats, Attach streams, Leave, and removal of lost nodes.

A node registers with the address its peers dial; a wildcard host is replaced by the host the
registration came from, and the scheduler dials the node back (a health check) before admitting it,
so a node nobody can reach never joins the plan. Each registered node holds an Attach stream open:
its end removes the node at once, and missed heartbeats (the reaper) are the backstop. The stream
carries the plan's epoch when it changes, nothing in between. A stopping
node calls Leave, and its sessions are re-planned before the reply. Every way a node goes ends in
:meth:`Membership.remove_node` or :meth:`Membership.leave`: its reports are forgotten, its channel
closed and the plan repaired.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
import urllib.parse
import uuid
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common import grpc_util
from common.config import WILDCARD_HOSTS, SchedulerConfig, join_host_port, split_host_port
from common.health import LIVENESS
from common.pb import control, control_grpc
from common.security import Credentials
from globalsched.rpc.frontend_stub import frontend_stub
from globalsched.state.failure_detector import DetectorConfig, DetectorState, detect, paused_recently
from globalsched.state.heartbeat_pacing import Pacing, pacing, silence_timeout_s
from globalsched.refusal import Refused
from globalsched.planning.replan_trigger import ReplanTrigger
from globalsched.state.rate_reports import Workload

log = logging.getLogger("nexus.scheduler")

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
    period_s: float = 0.0               # the heartbeat period it was last asked for
    stub: object = None
    channel: object = None
    # set once the node is no longer registered (removed, left, or replaced by a re-registration):
    # it ends the node's Attach stream
    gone: asyncio.Event = field(default_factory=asyncio.Event, repr=False, compare=False)


class NodeTable(dict):
    """The registered nodes by id; ``generation`` grows at every change, so that what is derived from
    the whole table (the device types present) is worked out once per change, not once per model."""

    generation = 0

    def __setitem__(self, key, value) -> None:
        self.generation += 1
        super().__setitem__(key, value)

    def __delitem__(self, key) -> None:
        self.generation += 1
        super().__delitem__(key)

    def pop(self, key, *default):
        self.generation += 1
        return super().pop(key, *default)


class Membership:
    """The registered nodes (``nodes``, shared read-only with the other parts of the scheduler); every
    change of membership asks ``trigger`` for a plan."""

    def __init__(self, config: SchedulerConfig, creds: Credentials, workload: Workload,
                 trigger: ReplanTrigger) -> None:
        self.config = config
        self.creds = creds
        self.workload = workload
        self.trigger = trigger
        self.nodes: NodeTable = NodeTable()
        self.stopping = False
        # the reaper's failure detector (its config follows the nodes' heartbeat periods): a stream that
        # ends just after the scheduler's own pause is left to it (failure_detector.paused_recently)
        self.detector_state = DetectorState()
        self.detector_config = DetectorConfig(interval_s=config.heartbeat_interval_ms / 1000)

    def backends(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.kind == control.NODE_KIND_BACKEND]

    def frontends(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.kind == control.NODE_KIND_FRONTEND]

    async def register(self, request: control.RegisterRequest, peer: str) -> control.RegisterReply:
        """Admit a node (re-registering replaces its old entry); Refused says why not."""
        if request.kind not in (control.NODE_KIND_FRONTEND, control.NODE_KIND_BACKEND):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "kind must be FRONTEND or BACKEND")
        try:
            address = advertised_address(request.address, peer)
        except ValueError as exc:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        kind = "frontend" if request.kind == control.NODE_KIND_FRONTEND else "backend"
        problem = await self._dial_back(address)
        if problem:
            log.warning("refused %s registering from %s: %s", kind, peer, problem)
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"the scheduler cannot reach this {kind} at {address} ({problem}); start it with "
                                  f"--advertise HOST:PORT, an address the scheduler and the frontends can dial")
        node_id = request.node_id or f"{'fe' if request.kind == control.NODE_KIND_FRONTEND else 'be'}-{uuid.uuid4().hex[:8]}"
        old = self._forget(node_id)
        if old is not None and old.channel is not None:
            await old.channel.close()
        node = Node(node_id, request.kind, address, request.device, request.device_type or request.device,
                    request.memory_mb)
        node.channel = grpc_util.aio_channel(node.address, self.creds)
        if request.kind == control.NODE_KIND_BACKEND:
            node.stub = control_grpc.BackendStub(node.channel)
        else:
            node.stub = frontend_stub(node.channel)
        self.nodes[node_id] = node
        self.trigger.request(f"{node_id} registered at {node.address}", joined=True)
        node.period_s = self.pacing().period_s
        return control.RegisterReply(node_id=node_id, heartbeat_interval_ms=round(node.period_s * 1000),
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

    def pacing(self) -> Pacing:
        """The heartbeat period and removal timeout for the nodes registered now
        (globalsched/state/heartbeat_pacing.py)."""
        return pacing(len(self.nodes), self.config.heartbeat_interval_ms / 1000, self.config.node_timeout_s,
                      self.config.max_heartbeats_per_s)

    def heartbeat(self, node_id: str) -> float | None:
        """Note a node's heartbeat; the period it is asked for from now on, or None for a node the
        scheduler does not know (it registers again)."""
        node = self.nodes.get(node_id)
        if node is None:
            return None
        node.last_seen = time.monotonic()
        node.period_s = self.pacing().period_s
        return node.period_s

    async def leave(self, node_id: str) -> None:
        """A stopping node leaves the plan: its sessions are planned elsewhere and every table pushed
        before this returns, so once it has the reply no frontend routes to it any more. Refused when
        the re-plan failed."""
        node = self._forget(node_id)
        if node is None:
            return
        self.workload.forget(node.node_id)
        if node.kind == control.NODE_KIND_BACKEND:
            log.info("%s leaves; moving its sessions", node.node_id)
            try:
                await self.trigger.replan_now(f"{node_id} leaves")
            except Exception:
                log.exception("re-planning without %s failed", node.node_id)
                raise Refused(grpc.StatusCode.INTERNAL, f"could not re-plan without {node.node_id}") from None
        else:
            log.info("%s leaves", node.node_id)
        if node.channel is not None:
            await node.channel.close()

    async def attach(self, node_id: str):
        """A node's Attach stream while it is registered: one event (the plan epoch at attach), then
        nothing until it ends; its end (the node died or stopped) removes the node at once, without
        waiting for missed heartbeats.

        It used to carry an event at every plan, which no node reads: with a thousand nodes, each plan
        wrote a thousand stream messages from the scheduler's event loop. The channels' HTTP/2
        keepalive pings (common/grpc_util.py) tell a dead or hung peer."""
        node = self.nodes.get(node_id)
        if node is None:
            raise Refused(grpc.StatusCode.NOT_FOUND, f"unknown node {node_id!r}; register first")
        try:
            yield control.AttachEvent(epoch=self.trigger.epoch)
            if self.nodes.get(node_id) is node:
                await node.gone.wait()
        finally:
            if not self.stopping and self.nodes.get(node_id) is node:
                if paused_recently(self.detector_state, time.monotonic(), self.detector_config):
                    log.warning("%s: its Attach stream ended just after this scheduler was paused, which may "
                                "have ended it; its heartbeats decide", node.node_id)
                else:
                    await self.remove_node(node.node_id, "its Attach stream ended")

    def _forget(self, node_id: str) -> Node | None:
        """Take ``node_id`` out of the registered nodes (which ends its Attach stream); the node, if it was."""
        node = self.nodes.pop(node_id, None)
        if node is not None:
            node.gone.set()
        return node

    async def remove_node(self, node_id: str, why: str) -> None:
        """Forget a node now (its stream ended, or it missed heartbeats) and repair the plan."""
        node = self._forget(node_id)
        if node is None:
            return
        log.warning("%s removed: %s", node_id, why)
        self.workload.forget(node_id)
        self.trigger.request(f"{node_id} left", membership=True)
        if node.channel is not None:
            await node.channel.close()

    async def reaper(self) -> None:
        """The backstop: remove nodes whose heartbeats stopped (their stream's end is the fast path), as
        the failure detector judges them (globalsched/state/failure_detector.py)."""
        interval_s = self.config.heartbeat_interval_ms / 1000
        note = ""
        while True:
            await asyncio.sleep(interval_s)
            # the timeout of the longest period any node was asked for (a shrinking cluster's nodes
            # beat on their old period until their next heartbeat tells them the new one)
            longest_s = max((n.period_s for n in self.nodes.values()), default=interval_s)
            config = DetectorConfig(timeout_s=silence_timeout_s(longest_s, interval_s, self.config.node_timeout_s),
                                    interval_s=interval_s)
            self.detector_config = config
            verdict, self.detector_state = detect({n.node_id: n.last_seen for n in self.nodes.values()},
                                                  self.detector_state, time.monotonic(), config)
            if verdict.note and not note:
                log.warning("%s", verdict.note)
            note = verdict.note
            for node_id, why in verdict.removed:
                await self.remove_node(node_id, why)

    async def close(self) -> None:
        self.stopping = True
        for node in self.nodes.values():
            if node.channel is not None:
                await node.channel.close()
