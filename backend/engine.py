"""The backend's execution engine: per-session deadline-ordered queues and one executor thread.

Contracts:
- :meth:`Engine.submit` is called on the event-loop thread with a request already validated against
  the session's input specs; it never blocks and never takes the executor's lock: it appends the
  request to an inbox (a deque) and sets an event (with inline batches: schedules an inline turn on
  the loop instead). :meth:`Engine.cancel` claims a queued request lock-free as well (a request is
  answered by whoever takes it out of the live set first: the executor, running or dropping it, or
  ``cancel``).
- The executor thread runs the batches (``Runtime.run``), but for the inline batches below: one
  batch at a time either way. Each turn (:meth:`Engine.step`) it moves the inbox into the
  per-session queues and asks :func:`common.batch_decision.schedule` (the one batching decision,
  shared with the simulation and the profiler's harness) what to run and what to drop *now*: EDF
  across sessions, the policy within one. It runs the batch and hands every outcome of the turn back
  in one ``deliver`` call (``loop.call_soon_threadsafe`` in the server: one per batch, not one per
  request); the ``done`` callbacks then run on the loop, where serialisation happens.
- Inline batches (:meth:`Engine.run_inline_on`, CPU devices): on an idle device, a batch expected
  to take at most ``inline_max_ms`` runs on the event loop's thread at the end of the loop's turn
  that queued it, and its outcomes are delivered there. A request to a tiny model then costs no
  hand-over to the executor thread and back (two thread wake-ups, which cost more CPU than such a
  model's compute). ``submit`` schedules at most one inline turn per loop turn, so a turn's requests
  still batch together. The device is one batch at a time either way (``_device``): while the
  executor runs a batch or a warm-up waits, and for a decided batch expected to take longer, the
  inline turn hands over to the executor thread as before.
- Time comes from outside: ``clock`` (monotonic seconds: deadlines, queue and compute times) and
  ``wall_clock`` (``last_inference``). With ``start=False`` no thread runs and a test drives
  :meth:`Engine.step` itself on a fake clock.
- Batches are counted in rows (:mod:`common.batch_decision`): max and planned batches, l(b), the policy's
  window and the statistics' batch sizes.
- The batching decision (early drop, a duty-cycle batch's latest start, the session's max batch)
  estimates a batch of a session outside a prefix group as l(b) times the median ratio of its
  recent batches' observed times to l(b) (:mod:`backend.calibration`): the profile's l(b) is the
  planning figure, with a margin, perhaps measured on a busy machine; a request dropped on that
  margin is one the batch would have served in time, and a batch capped by it leaves throughput
  unused that the SLO allows.
- Work-conserving: a batch starts as soon as the device is free and a request waits; under load
  the queue grows while a batch runs, so the next batch is larger, up to the session's max batch
  (the largest b with 2*l(b) <= SLO on the calibrated estimate below, never below the planned batch). With a duty cycle set
  (``--batch-start duty-cycle``) a batch waits for the planned batch, at most one duty cycle.
- Prefix batching (Nexus section 6.1): the sessions of one :class:`backend.sessions.SharedPrefix`
  are scheduled as one unit (backend/sessions.py says how).

Warm-up (:meth:`Engine.warm_up`): batches of a session not yet in the table (common/warmup_spec.py)
run on the executor thread too, since it is the device's user (inline batches wait while warm-up
does), but they never stall the sessions already serving: a warm-up batch runs when no serving batch
is ready, or, while serving work keeps the device busy, after a serving batch once the executor has
served at least as long as the last warm-up batch took (so warm-up takes at most half of a saturated
device, and a request waits at most one warm-up batch, as it would behind any co-located session).
A *deferred* warm-up job (the sizes a session's requests may meet later, run after its table took
effect: backend/model_table.py) runs only when no serving batch is ready, and after every job that
holds a table's answer: it fills the device's idle moments and never holds a plan back.
Warm-up batches count nowhere in the serving statistics, nor in utilisation: their number and time
come back in the job's :class:`WarmupResult`.

Latency samples (``Engine.samples``, backend/latency_samples.py): every serving batch of a session
outside a prefix group that runs without error records its model, rows, infer-phase time and
whether it was contended: the device was behind (rows of the session left queued once the batch took
its own, or drops in the same decision) or ``host_contended()`` says other work shares the cores.
Warm-up batches record nothing.

Statistics: backend/batch_accounting.py counts every batch, phase by phase, as Triton reports them.
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures
import contextlib
import heapq
import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from backend.latency_samples import SampleRecorder
from backend.batch_accounting import count_batch, gather, outcomes, phases_of, split
from backend.busy_time import BusyTime
from backend.sessions import Session, SharedPrefix
from backend.work import ExecError, Outcome, Work
from common.batch_decision import SERVE_LATE, BatchPolicy, Decision, Pending, Queue, remove_taken, schedule
from common.exec_status import ExecStatus


log = logging.getLogger("nexus.backend.engine")

BUSY_LOG_S = 60.0   # batches remembered for windowed utilisation (the longest window read)


@dataclass(frozen=True)
class WarmupBatch:
    """One warm-up batch: ``run`` executes it on the device (its result is thrown away)."""

    label: str                     # names it in an error: "sample 'x' (batch 4)"
    run: Callable[[], object]


@dataclass(frozen=True)
class WarmupResult:
    batches: int                   # warm-up batches that ran
    ns: int                        # their time on the executor
    error: str = ""                # the first batch that failed, and why (the rest did not run)
    skipped: int = 0               # batches left out: the job's time budget ran out, or the engine stopped


@dataclass
class _WarmupJob:
    batches: list[WarmupBatch]
    deadline_s: float
    future: concurrent.futures.Future
    deferred: bool = False         # runs only on an idle device, after every job that is not
    done: int = 0
    ns: int = 0


def _order(p: Pending) -> tuple[float, int]:
    return p.deadline_s, p.request_id


def warmup_turn(served: bool, now: float, turn_s: float, deferred: bool = False) -> bool:
    """Whether a waiting warm-up batch runs in this executor turn: when the turn's serving step ran
    nothing (``served`` False), or once ``turn_s`` (:func:`next_warmup_turn_s`) has come; a
    ``deferred`` one only in the first case."""
    return not served or (not deferred and now >= turn_s)


def next_warmup_turn_s(start_s: float, end_s: float) -> float:
    """After a warm-up batch ran from ``start_s`` to ``end_s``: when the next one may take the device
    from serving. As long again of serving first, so warm-up takes at most half a busy device."""
    return end_s + (end_s - start_s)


class Engine:
    """Sessions of one device and the thread that executes their batches (module docstring)."""

    def __init__(self, policy: BatchPolicy, clock: Callable[[], float] = time.monotonic, *,
                 wall_clock: Callable[[], float] = time.time,
                 deliver: Callable[..., object] | None = None, start: bool = True,
                 executor_cpus: frozenset[int] = frozenset()) -> None:
        self.policy = policy
        self.executor_cpus = executor_cpus     # the executor thread's CPUs (empty: the process's)
        self.clock = clock
        self.wall_clock = wall_clock
        # deliver(fn, arg) runs fn(arg) where the done callbacks belong (the server passes
        # loop.call_soon_threadsafe); None calls them on the executor thread.
        self.deliver = deliver
        self.sessions: dict[str, Session] = {}
        self.duty_cycle_s = 0.0     # the plan's duty cycle; 0 runs every batch as soon as it can
        self._lock = threading.Lock()     # the executor's: queues and the session table
        self._inbox: collections.deque[Pending] = collections.deque()
        self._live: dict[int, Pending] = {}     # queued requests nobody has taken yet (see cancel)
        self._purge = False                     # a cancelled request may still sit in a queue
        self._wake = threading.Event()
        self._ids = itertools.count(1)
        self._stop = False
        self._busy = BusyTime(BUSY_LOG_S)
        self.stats_lock = threading.Lock()   # guards every session's and group's stats (executor vs Stats)
        self._started = clock()
        self._solo: list[Session] = []
        self.groups: list[SharedPrefix] = []
        self._warmups: collections.deque[_WarmupJob] = collections.deque()   # put by the loop, run here
        self._warmups_lock = threading.Lock()    # puts and removals (the executor reads the head without it)
        self._warmup_turn_s = 0.0     # while serving keeps the device busy, the next warm-up batch waits for this
        # Latency samples of the serving batches (backend/latency_samples.py; None: not recorded), and
        # whether the host's CPU is contended now (a CPU device's backend sets it; the default: never).
        self.samples: SampleRecorder | None = None
        self.host_contended: Callable[[], bool] = lambda: False
        self._device = threading.Lock()       # held while a batch runs: by the executor, or an inline turn
        self._handoff: "tuple[Decision, Session | SharedPrefix | None, list[Pending], list[Pending]] | None" = None
        self._inline_loop = None                # the event loop inline turns run on (None: never inline)
        self._inline_max_ms = 0.0
        self._inline_due = False                # an inline turn is scheduled on that loop
        self._thread: threading.Thread | None = None
        if start:
            self._thread = threading.Thread(target=self._loop, name="executor", daemon=True)
            self._thread.start()

    # ---- table changes (loop thread) ---------------------------------------------------------------

    def set_sessions(self, sessions: dict[str, Session], groups: "list[SharedPrefix] | tuple" = ()) -> list[Session]:
        """Replace the session table (and its prefix groups, whose members must be in ``sessions``).

        Queues and counters of sessions that stay carry over; returns the replaced or removed
        sessions (the caller fails the queued work of removed ones with :meth:`fail_queued`).
        """
        groups = list(groups)
        for g in groups:
            for m in g.members:
                if sessions.get(m.name) is not m:
                    raise ValueError(f"group {g.name!r}: member {m.name!r} is not in the session table")
        with self._lock:
            removed = [s for name, s in self.sessions.items() if sessions.get(name) is not s]
            for new in sessions.values():
                old = self.sessions.get(new.name)
                if old is not None and old is not new:   # keep queue and counters across re-plans
                    new.queue, new.stats, new.depth = old.queue, old.stats, old.depth
                    if new.profile == old.profile:      # ratios to another profile mean nothing
                        new.calibration = old.calibration
            for g in groups:
                old_group = next((o for o in self.groups if o.name == g.name), None)
                if old_group is not None:
                    g.stats = old_group.stats
            self.sessions = dict(sessions)
            self.groups = groups
            self._solo = [s for s in sessions.values() if s.group is None or s.group not in groups]
        self._wake.set()
        return removed

    def fail_queued(self, session: Session, outcome: "Outcome") -> int:
        """Answer every request still queued on a session that left the table with ``outcome`` (on
        the caller's thread); returns how many."""
        with self._lock:
            queue, session.queue = session.queue, []
        n = 0
        for p in queue:
            if self._live.pop(p.request_id, None) is not None:
                p.payload.done(outcome)
                n += 1
        return n

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        while self._warmups:
            job = self._warmups.popleft()
            _finish(job, skipped="the backend is stopping")

    def warm_up(self, batches: "list[WarmupBatch]", budget_s: float, deferred: bool = False
                ) -> concurrent.futures.Future:
        """Run ``batches`` on the executor as warm-up (module docstring); the future's result is a
        :class:`WarmupResult`. The batches run in order and stop at the first failure; those not
        started within ``budget_s`` are skipped. ``deferred``: only on an idle device, after the jobs
        that are not. Call it from any thread; it never blocks."""
        job = _WarmupJob(list(batches), self.clock() + budget_s, concurrent.futures.Future(), deferred)
        if not job.batches:
            job.future.set_result(WarmupResult(0, 0))
            return job.future
        with self._warmups_lock:
            if not deferred and all(j.deferred for j in self._warmups):
                self._warmup_turn_s = self.clock()     # the first batch may follow the serving batch running now
            # before the deferred jobs (the executor takes the head between two batches of a job)
            at = len(self._warmups) if deferred else next(
                (i for i, j in enumerate(self._warmups) if j.deferred), len(self._warmups))
            self._warmups.insert(at, job)
        self._wake.set()
        return job.future

    @property
    def warming(self) -> int:
        """Warm-up jobs not finished yet."""
        return len(self._warmups)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Hold the executor between two decisions (requests submitted meanwhile are decided together)."""
        with self._lock:
            yield

    def run_inline_on(self, loop, max_ms: float) -> None:
        """Run batches expected to take at most ``max_ms`` on ``loop``'s thread (the module docstring's
        inline batches); ``max_ms`` 0 turns it off. Only for a device whose batches compute on the
        host's cores in the calling process: an emulated device's batch sleeps, and a pinned executor
        must keep the compute on its CPUs."""
        self._inline_loop, self._inline_max_ms = (loop, max_ms) if max_ms > 0 else (None, 0.0)

    # ---- requests (loop thread) --------------------------------------------------------------------

    def submit(self, work: Work) -> Pending:
        """Queue ``work``; return its queue entry (for :meth:`cancel`). Takes no lock the executor holds."""
        session = self.sessions.get(work.model)
        if session is None:
            raise ExecError(ExecStatus.NOT_FOUND, f"model {work.model!r} is not loaded on this backend")
        if session.depth.queued >= session.max_queue:
            with self.stats_lock:
                session.stats.dropped += 1
            raise ExecError(ExecStatus.OVERLOADED, f"queue of {work.model!r} is full ({session.max_queue})")
        item = Pending(next(self._ids), work.deadline_s, work.arrival_s, work, work.rows)
        session.depth.submitted += 1
        self._live[item.request_id] = item
        self._inbox.append(item)
        if self._inline_loop is None:
            self._wake.set()
        elif not self._inline_due:
            self._inline_due = True
            self._inline_loop.call_soon(self._inline_turn)
        return item

    def _inline_turn(self) -> None:
        """On the loop's thread, after the turn that queued requests: decide and run a short batch here,
        or leave the work to the executor thread (module docstring)."""
        self._inline_due = False
        if self._stop or self._warmups or not self._device.acquire(blocking=False):
            self._wake.set()        # the executor is busy (it looks again after its batch) or has warm-up to run
            return
        if self._handoff is not None:   # a batch handed over is not yet taken: the executor goes first
            self._device.release()
            self._wake.set()
            return
        try:
            with self._lock:
                decided = self._decide()
            decision, unit, batch, _ = decided
            if unit is not None and batch and _estimate_ms(unit, sum(p.rows for p in batch)) > self._inline_max_ms:
                self._handoff = decided     # the executor runs it first, as soon as this releases the device
                self._wake.set()
                return
            self._execute(decided, inline=True)
        finally:
            self._device.release()
        if (unit is None and decision.wake_s is not None) or self._inbox or any(s.queue for s in self._solo) or \
                any(m.queue for g in self.groups for m in g.members):
            self._wake.set()        # work left: a duty cycle's wait, or a queue the batch did not take

    def cancel(self, item: Pending) -> bool:
        """Take a queued request off its queue: True when it was still queued (it will never run and
        its ``done`` is not called), False when it already ran, runs now or was dropped."""
        if self._live.pop(item.request_id, None) is None:
            return False
        self._purge = True
        session = self.sessions.get(item.payload.model)
        if session is not None:
            session.depth.cancelled += 1
            with self.stats_lock:
                session.stats.cancelled += 1
        return True

    def utilization(self, window_s: float | None = None) -> float:
        """Busy fraction of the device: since start, or over the last ``window_s`` seconds."""
        now = self.clock()
        if window_s is None:
            return min(1.0, self._busy.total_s / max(now - self._started, 1e-9))
        since = max(now - window_s, self._started)
        return min(1.0, self._busy.busy_since(since) / max(now - since, 1e-9))

    # ---- executor thread ---------------------------------------------------------------------------

    def _admit(self) -> None:
        """Under the lock: move the inbox into the queues; drop cancelled requests from them."""
        inbox = self._inbox
        unknown: list[Pending] = []
        while inbox:
            item = inbox.popleft()
            if item.request_id not in self._live:
                continue        # cancelled before it got here
            session = self.sessions.get(item.payload.model)
            if session is None:   # unloaded between submit and here
                unknown.append(item)
                continue
            q = session.queue
            if not q or (q[-1].deadline_s, q[-1].request_id) < (item.deadline_s, item.request_id):
                q.append(item)
            else:
                bisect.insort(q, item, key=_order)
        if self._purge:
            self._purge = False
            for s in self.sessions.values():
                if any(p.request_id not in self._live for p in s.queue):
                    s.queue = [p for p in s.queue if p.request_id in self._live]
        for item in unknown:
            if self._live.pop(item.request_id, None) is not None:
                self._post([(item.payload, Outcome(
                    ExecStatus.NOT_FOUND, f"model {item.payload.model!r} is not loaded on this backend"))])

    def _decide(self) -> "tuple[Decision, Session | SharedPrefix | None, list[Pending], list[Pending]]":
        """Under the lock: the scheduling decision now, its unit, and the requests it runs and drops
        that the executor took (a request cancelled meanwhile is neither)."""
        self._admit()
        units: list[Session | SharedPrefix] = []
        queues: list[Queue] = []
        for s in self._solo:
            if s.queue:
                queues.append(Queue(str(len(units)), tuple(s.queue), s.max_batch, s.expected_ms, s.planned_batch,
                                    SERVE_LATE if s.serve_late else None))
                units.append(s)
        for g in self.groups:
            member_queues = [m.queue for m in g.members if m.queue]
            if not member_queues:
                continue
            merged = member_queues[0] if len(member_queues) == 1 else list(heapq.merge(*member_queues, key=_order))
            queues.append(Queue(str(len(units)), tuple(merged), g.max_batch, g.latency_ms,
                                sum(m.planned_batch for m in g.members),
                                SERVE_LATE if any(m.serve_late for m in g.members) else None))
            units.append(g)
        decision = schedule(queues, self.clock(), policy=self.policy, duty_cycle_s=self.duty_cycle_s)
        if decision.queue is None:
            return decision, None, [], []
        unit = units[int(decision.queue)]
        if isinstance(unit, Session):
            remove_taken(unit.queue, decision)
        else:
            taken = decision.taken
            for m in unit.members:
                if m.queue:
                    m.queue = [p for p in m.queue if p.request_id not in taken]
        live = self._live
        batch = [p for p in decision.batch if live.pop(p.request_id, None) is not None]
        dropped = [p for p in decision.dropped if live.pop(p.request_id, None) is not None]
        for p in batch + dropped:
            session = self.sessions.get(p.payload.model)
            if session is not None:
                session.depth.retired += 1
        return decision, unit, batch, dropped

    def step(self) -> Decision:
        """One turn of the executor: decide at ``clock()``, answer the dropped requests, run the batch.
        Returns the decision (``queue`` None: nothing was ready; ``wake_s``: when something will be)."""
        with self._lock:
            decided = self._decide()
        return self._execute(decided)

    def _execute(self, decided: "tuple[Decision, Session | SharedPrefix | None, list[Pending], list[Pending]]",
                 inline: bool = False) -> Decision:
        """Answer a decision's drops and run its batch; ``inline``: on the event loop's thread."""
        decision, unit, batch, dropped = decided
        if unit is None:
            return decision
        now = self.clock()
        answers: list[tuple[Work, Outcome]] = []
        for p in dropped:
            session = unit if isinstance(unit, Session) else unit.by_name[p.payload.model]
            with self.stats_lock:
                session.stats.dropped += 1
                session.stats.fail_count += 1
            answers.append((p.payload, Outcome(ExecStatus.DEADLINE, f"dropped: cannot meet its deadline "
                                                                     f"({(p.deadline_s - now) * 1000:.1f} ms left)")))
        if batch:
            if isinstance(unit, Session):
                # Behind: rows left queued after the batch took its own (it was capped), or drops.
                self._run(unit, batch, answers, contended=bool(dropped) or bool(unit.queue))
            else:
                self._run_group(unit, batch, answers)
        self._post(answers, inline)
        return decision

    def _post(self, answers: "list[tuple[Work, Outcome]]", inline: bool = False) -> None:
        """Hand a turn's outcomes back in one go: one ``deliver`` call per batch (per consumer); on the
        loop's own thread (``inline``), those for that loop complete at once."""
        if not answers:
            return
        by_consumer: dict[object, list[tuple[Work, Outcome]]] = {}
        for answer in answers:
            by_consumer.setdefault(answer[0].deliver or self.deliver, []).append(answer)
        for deliver, some in by_consumer.items():
            if deliver is None or (inline and getattr(deliver, "__self__", None) is self._inline_loop):
                _complete(some)
                continue
            try:
                deliver(_complete, some)
            except RuntimeError as exc:    # the consumer's loop is closed: nobody waits any more
                log.warning("dropping %d outcomes: %s", len(some), exc)

    def turn(self) -> tuple[Decision, bool]:
        """One turn of the executor: a serving step, then a warm-up batch if one waits and the step
        ran nothing or warm-up's turn has come (module docstring). Returns the step's decision and
        whether a warm-up batch ran."""
        decision = self.step()
        head = self._warmups[0] if self._warmups else None
        if head is None or not warmup_turn(decision.queue is not None, self.clock(), self._warmup_turn_s,
                                           head.deferred):
            return decision, False
        self._warm_one(head)
        return decision, True

    def _warm_one(self, job: _WarmupJob) -> None:
        start = self.clock()
        if start > job.deadline_s:
            self._warmed(job)
            _finish(job, skipped="its time budget ran out")
            return
        batch = job.batches[job.done]
        error = ""
        try:
            batch.run()
        except Exception as exc:    # a failing warm-up fails its session's load, not the backend
            error = f"{batch.label}: {exc.__class__.__name__}: {exc}"
        end = self.clock()
        self._warmup_turn_s = next_warmup_turn_s(start, end)
        job.ns += max(int((end - start) * 1e9), 0)
        job.done += 1
        if error or job.done == len(job.batches):
            self._warmed(job)
            _finish(job, error=error)

    def _warmed(self, job: _WarmupJob) -> None:
        with self._warmups_lock:        # a job may have been put in front of it meanwhile
            if job in self._warmups:    # (not if stop() gave up waiting for this thread and answered it)
                self._warmups.remove(job)

    def _loop(self) -> None:
        if self.executor_cpus:
            try:
                os.sched_setaffinity(0, self.executor_cpus)     # this thread only
            except OSError as exc:      # a cpuset that excludes them: serve unpinned, and say so
                log.error("cannot pin the executor thread to CPUs %s: %s; it runs unpinned",
                          ",".join(map(str, sorted(self.executor_cpus))), exc)
        while not self._stop:
            self._wake.clear()
            with self._device:
                handoff, self._handoff = self._handoff, None
                if handoff is not None:     # decided by an inline turn, too long to run there
                    decision, warmed = self._execute(handoff), False
                else:
                    decision, warmed = self.turn()
            if decision.queue is not None or warmed or self._stop:
                continue
            # Nothing ready: sleep until new work arrives or the earliest batch is due.
            self._wake.wait(None if decision.wake_s is None else max(decision.wake_s - self.clock(), 0.0005))

    def _run(self, session: Session, batch: list[Pending], answers: list, contended: bool = False) -> None:
        """Run one batch of a session; ``contended``: the device was behind when it started (recorded
        with its latency sample, see backend/latency_samples.py)."""
        works = [p.payload for p in batch]
        start = gathered = ran = self.clock()
        parts: list[list[np.ndarray]] = []
        try:
            feeds = gather(session.inputs, works)
            gathered = self.clock()
            result = session.runtime.run(feeds)
            ran = self.clock()
            parts = split([result[spec.name] for spec in session.outputs], works)
            error = None
        except Exception as exc:  # a failing batch fails its requests, not the backend
            error = f"{exc.__class__.__name__}: {exc}"
        end = self.clock()
        phases = phases_of(start, gathered, ran, end, error)
        self._busy.record(end, end - start)
        rows = sum(w.rows for w in works)
        if error is None and session.profile is not None:
            session.calibration.observe(session.latency_ms(rows), (end - start) * 1000)
        with self.stats_lock:       # a Stats snapshot sees the whole batch or none of it
            count_batch(session.stats, works, rows, phases, error, int(self.wall_clock() * 1000))
        if error is None and self.samples is not None:
            self.samples.record(session.model, rows, phases.infer_ns / 1e6, contended or self.host_contended())
        outcomes(works, parts, None if error is None else f"model {session.name!r} failed: {error}", phases, rows,
                  answers)

    def _run_group(self, group: SharedPrefix, batch: list[Pending], answers: list) -> None:
        """The prefix once on every request's rows, then each member's suffix on its slice: the same
        gather, split, counting and outcomes as :meth:`_run`, per member."""
        by_session: dict[str, list[Work]] = {}
        for p in batch:
            by_session.setdefault(p.payload.model, []).append(p.payload)
        order = [(m, by_session[m.name]) for m in group.members if m.name in by_session]
        works = [w for _, ws in order for w in ws]
        start = gathered = prefix_end = self.clock()
        error = None
        try:
            # positional: members' inputs match the prefix's (same hashes)
            feeds = gather(group.runtime.inputs, works)
            gathered = self.clock()
            features = group.runtime.run(feeds)[group.cut_tensor]
        except Exception as exc:  # a failing prefix fails the whole merged batch, not the backend
            features, error = None, f"shared prefix {group.name[:12]!r} failed: {exc.__class__.__name__}: {exc}"
        prefix_end = self.clock()
        results: dict[str, tuple[list[np.ndarray], str | None]] = {}    # per member: outputs, error
        offset = 0
        for m, ws in order:
            rows = sum(w.rows for w in ws)
            if error is not None:
                results[m.name] = ([], error)
            else:
                try:
                    out = m.runtime.run({m.runtime.inputs[0].name: features[offset:offset + rows]})
                    results[m.name] = ([out[spec.name] for spec in m.outputs], None)
                except Exception as exc:
                    results[m.name] = ([], f"model {m.name!r} failed: {exc.__class__.__name__}: {exc}")
            offset += rows
        ran = self.clock()
        parts = {m.name: split(results[m.name][0], ws) if results[m.name][1] is None else []
                 for m, ws in order}
        end = self.clock()
        phases = phases_of(start, gathered, ran, end, error)
        self._busy.record(end, end - start)
        total_rows = offset
        now_ms = int(self.wall_clock() * 1000)
        with self.stats_lock:
            gs = group.stats
            gs.execution_count += 1
            gs.inference_count += total_rows
            gs.compute_ns += phases.total_ns
            gs.prefix_ns += int((prefix_end - start) * 1e9)
            gs.batch_histogram[total_rows] = gs.batch_histogram.get(total_rows, 0) + 1
            for m, ws in order:
                count_batch(m.stats, ws, total_rows, phases, results[m.name][1], now_ms)
        for m, ws in order:
            outcomes(ws, parts[m.name], results[m.name][1], phases, total_rows, answers)


def _finish(job: _WarmupJob, *, error: str = "", skipped: str = "") -> None:
    left = len(job.batches) - job.done
    if skipped:
        log.warning("warm-up: %d of %d batches skipped: %s", left, len(job.batches), skipped)
    if not job.future.done():
        job.future.set_result(WarmupResult(job.done, job.ns, error, left if skipped else 0))


def _estimate_ms(unit: "Session | SharedPrefix", rows: int) -> float:
    """How long a batch of ``rows`` of ``unit`` is expected to take (inf: no profile says)."""
    ms = unit.expected_ms(rows) if isinstance(unit, Session) else unit.latency_ms(rows)
    return ms if ms > 0 else float("inf")


def _complete(answers: "list[tuple[Work, Outcome]]") -> None:
    for work, outcome in answers:
        work.done(outcome)
