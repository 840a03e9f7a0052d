"""A simulated backend and its device: sessions' queues in deadline order, the production batching
decision (:func:`common.batch_decision.schedule` with the backend's policy, and the session's largest batch
by :func:`backend.sessions.session_max_batch`), and batches that take l(b) (or the measured mean)
times a lognormal jitter of mean 1.

Its life: STARTING (the process starts; it registers ``backend_start_s`` later), UP, DRAINING (told
to stop: it leaves the plan, answers what it holds, then exits) and GONE (exited, or killed). A
model table is applied as the backend's ``UpdateModelTable`` applies it: one table at a time, each
taking ``table_update_ms``; its new models load one after another (``model_load_s`` each, off the
device), and each one's warm-up batches that hold the answer (the planned batch, as often as the
emulated runtime's default warm-up runs it, :func:`common.warmup_spec.default_runs`) join the device's
queue as soon as it is loaded, while the next loads (backend/model_table.py). They take the device
between serving batches by the engine's rule (:func:`backend.engine.warmup_turn`); once every model
is loaded and every such batch has run, the table takes effect and the push gets its answer. The
deferred rest (the other sizes of :func:`common.warmup_spec.default_batch_sizes`,
backend/warmup_runner.py) runs afterwards when the device is idle. A session the table drops answers
its queue NOT_FOUND, which the frontend retries elsewhere.

``sim`` is the simulation (nexus/simulate/run.py): its clock (``now``, ``at``), random numbers, the
requests' deadlines, and where answers go.
"""

from __future__ import annotations

import collections
import enum
import math
from typing import AbstractSet, Callable, Mapping

from backend.engine import next_warmup_turn_s, warmup_turn

from backend.sessions import session_max_batch
from common.batch_decision import Pending, Queue, make_policy, remove_taken, schedule
from common.profile import Profile
from common.runtimes.base import RuntimeKind
from common.warmup_spec import default_batch_sizes, default_runs
from nexus.simulate.outcomes import Loss

WARMUP_RUNS = default_runs(RuntimeKind.EMULATED)    # the simulated devices are emulated GPUs


class Life(enum.Enum):
    STARTING = "starting"
    UP = "up"
    DRAINING = "draining"
    GONE = "gone"


def device_times(profile: Profile, measured: bool, cv: float) -> tuple[tuple[float, float], ...]:
    """Per batch size (index b-1), the (mean ms, lognormal sigma) of a batch's time on the device: the
    profile's l(b) with spread ``cv``, or with ``measured`` a row's measured mean and spread where
    it has them."""
    out = []
    for row in profile.rows:
        if measured and row.mean_ms and row.std_ms is not None:
            out.append((row.mean_ms, lognormal_sigma(row.std_ms / row.mean_ms)))
        else:
            out.append((row.latency_ms, lognormal_sigma(cv)))
    return tuple(out)


class SimSession:
    __slots__ = ("name", "slo_ms", "profile", "planned_batch", "max_batch", "queue", "latency_ms", "device_ms")

    def __init__(self, name: str, slo_ms: float, profile: Profile, planned_batch: int,
                 device_ms: tuple[tuple[float, float], ...]) -> None:
        self.name = name
        self.slo_ms = slo_ms
        self.profile = profile
        self.latency_ms = profile.latency_ms
        self.device_ms = device_ms
        self.queue: list[Pending] = []
        self.plan(planned_batch)

    def plan(self, planned_batch: int) -> None:
        self.planned_batch = max(1, planned_batch)
        self.max_batch = min(max(self.planned_batch, session_max_batch(self.profile, self.slo_ms)),
                             self.profile.max_batch)


class SimBackend:
    def __init__(self, sim, node_id: str, started_s: float) -> None:
        self.sim = sim
        self.node_id = node_id
        self.started_s = started_s
        self.ended_s: float | None = None
        self.life = Life.STARTING
        self.sessions: dict[str, SimSession] = {}
        self.policy = make_policy(sim.config.batch_policy)
        self.running: tuple[int, tuple[Pending, ...]] | None = None    # (token, batch) on the device
        self.token = 0
        # model-table pushes not answered yet, oldest first (one applies at a time):
        # (entries, answered, epoch, cold sessions)
        self.table_updates: collections.deque[tuple] = collections.deque()
        self.warmups: collections.deque[float] = collections.deque()   # seconds of each warm-up batch to run
        # deferred warm-up batches (session, seconds): on an idle device, after self.warmups
        self.deferred_warmups: collections.deque[tuple[str, float]] = collections.deque()
        self.warmup_turn_s = 0.0
        self.warming = False                   # the head update's models loaded; its warm-ups run
        self.holding_warmup_runs = False       # the device runs a warm-up batch that holds the answer
        self.loaded_deferred: list[tuple[str, float]] = []     # the head update's deferred warm-ups so far
        self.epoch = 0                         # of the table applied (or being applied)
        self.busy_s = 0.0                      # device time spent on batches
        self.why_gone = Loss.NONE

    # ---- requests --------------------------------------------------------------------------------

    def enqueue(self, request: int, model: str, deadline_s: float, now: float) -> str:
        """Take a request: "" when queued, else why not ("not-found": not loaded here, or gone;
        "overloaded": its queue is full)."""
        session = self.sessions.get(model) if self.life is not Life.GONE else None
        if session is None:
            return "not-found"
        q = session.queue
        if len(q) >= self.sim.config.max_queue:
            return "overloaded"
        item = Pending(request, deadline_s, now)
        if not q or q[-1].deadline_s <= deadline_s:
            q.append(item)
        else:
            lo, hi = 0, len(q)
            while lo < hi:
                mid = (lo + hi) // 2
                if q[mid].deadline_s <= deadline_s:
                    lo = mid + 1
                else:
                    hi = mid
            q.insert(lo, item)
        if self.running is None:
            self.kick(now)
        return ""

    def kick(self, now: float) -> None:
        """The executor's turn: the production batching decision, at ``now``, until a batch runs or
        nothing is ready."""
        sim = self.sim
        while self.running is None and self.life is not Life.GONE:
            queues = [Queue(s.name, tuple(s.queue), s.max_batch, s.latency_ms, s.planned_batch)
                      for s in self.sessions.values() if s.queue]
            if not queues and not self.warmups and not self.deferred_warmups:
                break
            decision = schedule(queues, now, policy=self.policy) if queues else None
            if decision is None or decision.queue is None:
                if self.warmups or self._next_deferred():
                    self._warm_one(now)
                elif decision is not None and decision.wake_s is not None:
                    sim.at(decision.wake_s, self.kick)
                break
            session = self.sessions[decision.queue]
            remove_taken(session.queue, decision)
            for p in decision.dropped:
                sim.dropped(p.request_id, self, now)
            if decision.batch:
                mean_ms, sigma = session.device_ms[decision.rows - 1]
                duration_s = mean_ms / 1000.0 * sim.jitter(sigma)
                self.token += 1
                self.running = (self.token, decision.batch)
                self.busy_s += duration_s
                sim.at(now + duration_s, self._done, self.token)
        if self.life is Life.DRAINING and self.running is None and self.sim.scheduler.left(self.node_id) \
                and not any(s.queue for s in self.sessions.values()):
            self.exit(now)

    def _done(self, now: float, token: int) -> None:
        if self.running is None or self.running[0] != token or self.life is Life.GONE:
            return
        batch = self.running[1]
        self.running = None
        for p in batch:
            self.sim.answered(p.request_id, self, now)
        if batch and self.warmups and warmup_turn(True, now, self.warmup_turn_s):
            self._warm_one(now)          # the engine's turn: a serving batch, then a warm-up batch
            return
        self.kick(now)

    def _next_deferred(self) -> bool:
        """Whether a deferred warm-up batch waits (those of sessions dropped since are let go)."""
        while self.deferred_warmups and self.deferred_warmups[0][0] not in self.sessions:
            self.deferred_warmups.popleft()
        return bool(self.deferred_warmups)

    def _warm_one(self, now: float) -> None:
        self.holding_warmup_runs = bool(self.warmups)
        duration_s = self.warmups.popleft() if self.warmups else self.deferred_warmups.popleft()[1]
        self.token += 1
        self.running = (self.token, ())
        self.busy_s += duration_s
        self.warmup_turn_s = next_warmup_turn_s(now, now + duration_s)
        self.sim.at(now + duration_s, self._warmed, self.token)

    def _warmed(self, now: float, token: int) -> None:
        if self.running is None or self.running[0] != token or self.life is Life.GONE:
            return
        self.running = None
        self.holding_warmup_runs = False
        if not self.warmups and self.warming:
            self._update_done(now)
        self.kick(now)

    # ---- tables and life -------------------------------------------------------------------------

    def apply_table(self, now: float, entries: Mapping[str, tuple[int, float, Profile]],
                    cold: AbstractSet[str] = frozenset()) -> None:
        """The model table ``entries`` (session -> planned batch, SLO, profile) takes effect now;
        ``cold``: the dropped sessions that the plan paged out rather than moved."""
        if self.life is Life.GONE:
            return
        for name in [n for n in self.sessions if n not in entries]:
            session = self.sessions.pop(name)
            for p in session.queue:
                self.sim.let_go(p.request_id, self, now, Loss.EVICTED if name in cold else Loss.SCALE_DOWN)
        for name, (batch, slo_ms, profile) in entries.items():
            session = self.sessions.get(name)
            if session is None or session.profile is not profile or session.slo_ms != slo_ms:
                old = session
                session = SimSession(name, slo_ms, profile, batch, self.sim.device_times(profile))
                if old is not None:
                    session.queue = old.queue
                self.sessions[name] = session
            else:
                session.plan(batch)
        if self.life is Life.STARTING:
            self.life = Life.UP
        self.kick(now)

    def update_table(self, now: float, entries: Mapping[str, tuple[int, float, Profile]],
                     answered: Callable[[float], None], epoch: int = 0,
                     cold: AbstractSet[str] = frozenset()) -> None:
        """A model-table push of plan ``epoch``: ``entries`` take effect once the updates before it are
        done and its new models loaded and warmed up; then ``answered(at)``. A push older than the
        table applied, or than one queued behind it, is answered without effect, as the backend's
        UpdateModelTable does. A backend
        that is gone answers at once (the call fails). ``cold``: the sessions the plan left cold,
        whose queued requests the unload lets go as evicted."""
        if self.life is Life.GONE:
            answered(now)
            return
        self.table_updates.append((entries, answered, epoch, cold))
        if len(self.table_updates) == 1:
            self._next_update(now)

    def _next_update(self, now: float) -> None:
        newest = max((u[2] for u in self.table_updates), default=0)
        while self.table_updates and self.table_updates[0][2] < max(self.epoch, newest):
            _, answered, _, _ = self.table_updates.popleft()       # stale: a newer table is in place or waiting
            answered(now)
        if not self.table_updates:
            return
        entries, _, self.epoch, _ = self.table_updates[0]
        new = [name for name in entries if name not in self.sessions]
        config = self.sim.config
        start_s = now + config.table_update_ms / 1000.0
        if not new:
            self.sim.at(start_s, self._all_loaded)
        # one model loads after another; each one's warm-up joins the device's queue once it is loaded
        for i, name in enumerate(new):
            last = i == len(new) - 1
            self.sim.at(start_s + (i + 1) * config.model_load_s, self._loaded, name, last)

    def _loaded(self, now: float, name: str, last: bool) -> None:
        # one update at a time: the next starts once this one is done, so only a gone backend has stale loads
        if self.life is Life.GONE or not self.table_updates:
            return
        batch, _, profile = self.table_updates[0][0][name]
        times = self.sim.device_times(profile)
        for b in default_batch_sizes(batch):
            mean_ms, sigma = times[min(b, len(times)) - 1]
            runs = [mean_ms / 1000.0 * self.sim.jitter(sigma) for _ in range(WARMUP_RUNS)]
            if b == max(1, batch):
                self.warmups.extend(runs)
            else:       # queued once the table takes effect: the device lets go those of sessions it lacks
                self.loaded_deferred.extend((name, s) for s in runs)
        if last:
            self._all_loaded(now)
        elif self.running is None:
            self.kick(now)

    def _all_loaded(self, now: float) -> None:
        """The head update's models are all loaded: it is done once its warm-ups are."""
        if self.life is Life.GONE or not self.table_updates:
            return
        self.warming = True
        self.deferred_warmups.extend(self.loaded_deferred)
        self.loaded_deferred.clear()
        if not self.warmups and not self.holding_warmup_runs:
            self._update_done(now)
        elif self.running is None:
            self.kick(now)

    def _update_done(self, now: float) -> None:
        self.warming = False
        entries, answered, _, cold = self.table_updates.popleft()
        self.apply_table(now, entries, cold)
        answered(now)
        if self.table_updates and self.life is not Life.GONE:
            self._next_update(now)

    def drain(self, now: float) -> None:
        """SIGTERM: leave the plan; once left, answer what is held and exit (:meth:`kick`)."""
        if self.life in (Life.GONE, Life.DRAINING):
            return
        self.life = Life.DRAINING
        self.sim.scheduler.leave(self.node_id, now)

    def exit(self, now: float) -> None:
        self.life = Life.GONE
        self.ended_s = now
        self._fail_updates(now)
        self.sim.backend_exited(self, now)

    def kill(self, now: float) -> None:
        """SIGKILL: what it held is let go (the frontends retry it elsewhere while time allows)."""
        if self.life is Life.GONE:
            return
        self.life = Life.GONE
        self.ended_s = now
        self.why_gone = Loss.FAULT
        held = [p for s in self.sessions.values() for p in s.queue]
        if self.running is not None:
            held.extend(self.running[1])
            self.running = None
        self.sessions = {}
        for p in sorted(held, key=lambda p: p.request_id):
            self.sim.let_go(p.request_id, self, now, Loss.FAULT)
        self._fail_updates(now)
        self.sim.backend_exited(self, now)

    def _fail_updates(self, now: float) -> None:
        """The process is gone: the table pushes it had not answered fail (the channel closed)."""
        updates, self.table_updates = self.table_updates, collections.deque()
        self.warmups.clear()
        self.deferred_warmups.clear()
        self.warming = False
        self.holding_warmup_runs = False
        self.loaded_deferred.clear()
        for _, answered, _, _ in updates:
            answered(now)

    @property
    def alive(self) -> bool:
        return self.life is not Life.GONE

    def device_seconds(self, end_s: float) -> float:
        return max(0.0, (self.ended_s if self.ended_s is not None else end_s) - self.started_s)


def lognormal_sigma(cv: float) -> float:
    """The sigma of a lognormal of mean 1 with coefficient of variation ``cv``."""
    return math.sqrt(math.log1p(cv * cv))
