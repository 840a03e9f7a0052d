"""``nexus serve --backends auto``: the local actuator of the scheduler's scaling policy.

The scheduler decides how many devices of each type it wants, why, and which backend should go
first when it wants fewer (globalsched/planning/scaling_policy.py; ``GetStatus``'s ``scaling``). This module
makes the backend processes of ``nexus serve`` follow that decision for the one device type they
run:

* **More desired than backends running** (those starting included): start the difference at once.
* **Fewer desired than registered**: SIGTERM the backends the policy names (``drain_node_ids``,
  the cheapest to move first, matched to children by the addresses they registered), which drain
  (the scheduler moves their sessions first, ``Leave``; each answers what it holds, then exits).
  They drain together, as many as the surplus; none while a backend is still starting. The
  supervisor never restarts them.
* **Bounds.** ``--min-backends``/``--max-backends`` are the scheduler's ``--min-devices``/
  ``--max-devices`` for the type, so the policy keeps within them; the actuator holds them too.

Backends of the same type that this process did not start (registered with its scheduler by hand)
count towards the total, and the policy's choice of one of them to drain is left alone.

:func:`next_step` is the pure part (what to do, from the decision and the backends);
:class:`LocalScaler` polls ``GetStatus`` with the cluster token (every ``POLL_S``) and does it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Sequence

from nexus.launcher import Child, Supervisor
from nexus.scheduler_client import AdminCallError
from nexus.status_model import ClusterStatus, ScalingStatus

# How often the scheduler's decision is read (its scaling part alone, on a kept channel:
# nexus/scheduler_client.py, StatusReader). A step's devices start up to this much after the scaler
# asked for them. In the simulated 5x step under auto (100 devices, seeds 1-24; benchmarks/elastic.md,
# "2026-12-06, 12:00-13:30 UTC"), read every 0.5 s: 99.40% within SLO, 623 requests failed in the
# step's first 3 s on average; every 0.1 s: 99.47%, 529.
POLL_S = 0.1


@dataclass(frozen=True)
class LocalBackend:
    """A backend process as the actuator sees it."""

    name: str
    address: str = ""            # where it serves; '' until it printed its ready line
    retiring: bool = False       # SIGTERM sent: draining, then gone


@dataclass(frozen=True)
class Start:
    count: int
    reason: str


@dataclass(frozen=True)
class Drain:
    name: str
    node_id: str
    address: str
    reason: str


def next_step(decision: ScalingStatus | None, backends: Sequence[LocalBackend], registered: Mapping[str, str],
              bounds: tuple[int, int]) -> Start | Drain | None:
    """What to do now. ``registered``: node id -> address of the backends of the type registered with
    the scheduler (this process's and any other); ``bounds``: (--min-backends, --max-backends).

    A :class:`Drain` is one backend: the caller marks it retiring and asks again, until the drains
    under way cover the surplus (:func:`drains`)."""
    if decision is None:
        return None
    low, high = bounds
    live = [b for b in backends if not b.retiring]
    ours = {b.address for b in backends if b.address}       # draining ones too: they are not others'
    others = sum(1 for address in registered.values() if address not in ours)
    want = max(low, min(decision.desired, high))
    if want > len(live) + others:
        return Start(min(want - len(live) - others, high - len(live)), decision.reason)
    if decision.desired >= decision.registered or not decision.drain_node_ids or len(live) <= low:
        return None
    if any(b.address not in registered.values() for b in live):
        return None          # one is still starting: counts are settled once it registered
    if len(live) + others <= want:
        return None          # the drains under way reach the desired count
    # The policy removes a whole surplus in one step and each drain takes a re-plan and the backend's
    # exit, a second or more: the first named backend that is ours and not yet draining goes now.
    by_address = {b.address: b for b in live if b.address}
    for node_id in decision.drain_node_ids:
        target = by_address.get(registered.get(node_id, ""))
        if target is not None:
            return Drain(target.name, node_id, target.address, decision.reason)
    return None              # none of ours, or all draining already


def drains(decision: ScalingStatus | None, backends: Sequence[LocalBackend], registered: Mapping[str, str],
           bounds: tuple[int, int]) -> list[Drain]:
    """Every backend to drain now: :func:`next_step`'s drains, one after another, each marked retiring."""
    out: list[Drain] = []
    backends = list(backends)
    while isinstance(step := next_step(decision, backends, registered, bounds), Drain):
        out.append(step)
        backends = [replace(b, retiring=True) if b.name == step.name else b for b in backends]
    return out


class LocalScaler:
    """Applies the scheduler's decision for ``device_type`` to the backends of ``supervisor``.

    ``start_backend(name)`` starts one backend process (not yet supervised); ``fetch_status()`` is
    ``GetStatus`` as a :class:`ClusterStatus` (AdminCallError when the scheduler does not answer: a
    restarting scheduler is waited for); ``stop_after``: the child that new backends stop after when
    the cluster stops (the frontend); ``drain_timeout_s``: how long a backend may drain before it is
    killed. :meth:`step` is called from ``nexus serve``'s supervision loop.
    """

    def __init__(self, supervisor: Supervisor, start_backend: Callable[[str], Child], device_type: str,
                 bounds: tuple[int, int], fetch_status: Callable[[], ClusterStatus], log: Callable[[str], None], *,
                 drain_timeout_s: float, stop_after: Child | None = None, poll_s: float = POLL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.supervisor = supervisor
        self.start_backend = start_backend
        self.device_type = device_type
        self.bounds = bounds
        self.fetch_status = fetch_status
        self.log = log
        self.drain_timeout_s = drain_timeout_s
        self.stop_after = stop_after
        self.poll_s = poll_s
        self.clock = clock
        self.backends: list[Child] = []
        self.started = 0                 # backends named so far (backend-0, backend-1, ...)
        self._next_poll = 0.0
        self._desired: int | None = None
        self._announce: list[Child] = []  # started, not yet announced as ready

    def add(self, child: Child) -> Child:
        """A backend started outside (the first ones): adopted, supervised where the caller put it."""
        self.backends.append(child)
        self.started += 1
        return child

    def step(self) -> None:
        for child in [c for c in self._announce if c.ready_fields]:
            self._announce.remove(child)
            self.log(f"{child.name} started (pid {child.proc.pid}) at {child.address}")
        now = self.clock()
        if now < self._next_poll:
            return
        self._next_poll = now + self.poll_s
        retiring = self.supervisor.retiring
        self.backends = [c for c in self.backends if c in retiring or c in self.supervisor.children]
        try:
            status = self.fetch_status()
        except AdminCallError:
            return
        decision = status.decision(self.device_type)
        if decision is not None and decision.desired != self._desired:
            was = f" (was {self._desired})" if self._desired is not None else ""
            self.log(f"{self.device_type}: {decision.desired} devices desired{was}, {decision.registered} "
                     f"registered: {decision.reason}")
            self._desired = decision.desired
        registered = {d.node_id: d.address for d in status.devices if d.device_type == self.device_type}
        local = [LocalBackend(c.name, c.address, c in retiring) for c in self.backends]
        action = next_step(decision, local, registered, self.bounds)
        if isinstance(action, Start):
            for _ in range(action.count):
                child = self.start_backend(f"backend-{self.started}")
                self.started += 1
                self.supervisor.add(child, stop_after=self.stop_after)
                self.backends.append(child)
                self._announce.append(child)
                self.log(f"adding {child.name} (pid {child.proc.pid}): {action.reason}")
        elif isinstance(action, Drain):
            for drain in drains(decision, local, registered, self.bounds):
                child = next(c for c in self.backends if c.name == drain.name)
                self.log(f"removing {child.name} ({drain.node_id} at {drain.address}): {drain.reason}; "
                         f"draining it (SIGTERM)")
                self.supervisor.retire(child, self.drain_timeout_s)
