"""The backend's execution engine: per-session deadline-ordered queues and one executor thread.

Contracts:
- :meth:`Engine.submit` is called on the event-loop thread with a request already validated against
  the session's input specs; it never blocks.
- The executor thread is the only caller of ``Runtime.run``. Each turn it picks the session whose
  earliest deadline is soonest (EDF across sessions), asks the session's batch policy what to run
  and what to drop *now* (``BatchPolicy.select(queue, now_s, max_batch, latency_ms)``), runs the
  batch, and hands results back to the loop through ``done`` callbacks (``loop.call_soon_threadsafe``),
  where splitting and serialisation happen, off the executor thread.
- Work-conserving: a batch starts as soon as the device is free and a request waits; under load
  the queue grows while a batch runs, so the next batch is larger, up to the session's max batch
  (the largest b with 2*l(b) <= SLO, never below the planned batch).
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from backend.policies import BatchPolicy, Pending
from common.profile import Profile
from common.tensors import TensorSpec


class ExecError(Exception):
    """A request the engine refuses; ``status`` is a control.ExecStatus value name."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Work:
    """One request inside the engine: decoded inputs (``rows`` leading rows each) and its callback."""

    model: str
    arrays: list[np.ndarray]
    rows: int
    deadline_s: float
    arrival_s: float
    done: Callable[["Outcome"], None]


@dataclass
class Outcome:
    status: str                                  # "EXEC_OK", "EXEC_DEADLINE", "EXEC_INTERNAL", ...
    message: str = ""
    outputs: list[np.ndarray] | None = None
    queue_ns: int = 0
    compute_ns: int = 0
    batch_size: int = 0


@dataclass
class SessionStats:
    inference_count: int = 0      # rows executed
    execution_count: int = 0      # batches executed
    success_count: int = 0
    success_ns: int = 0
    fail_count: int = 0
    queue_ns: int = 0
    compute_ns: int = 0
    dropped: int = 0
    last_inference_ms: int = 0
    batch_histogram: dict[int, int] = field(default_factory=dict)
    batch_compute_ns: dict[int, int] = field(default_factory=dict)


class Session:
    """One model served on this backend: its runtime, queue, policy parameters and statistics."""

    def __init__(self, name: str, runtime, slo_ms: float, planned_batch: int, profile: Profile | None,
                 sha256: str = "", max_queue: int = 4096) -> None:
        self.name = name
        self.runtime = runtime
        self.sha256 = sha256
        self.inputs: tuple[TensorSpec, ...] = tuple(runtime.inputs)
        self.outputs: tuple[TensorSpec, ...] = tuple(runtime.outputs)
        self.slo_ms = slo_ms
        self.profile = profile
        self.planned_batch = max(1, planned_batch)
        self.max_batch = max(self.planned_batch, saturated_batch(profile, slo_ms))
        self.max_queue = max_queue
        self.queue: list[Pending] = []          # sorted by (deadline, id)
        self.stats = SessionStats()
        self.memory_mb = runtime.memory_mb()

    def latency_ms(self, batch: int) -> float:
        """l(b) from the profile, extended linearly past its largest batch; 0 without a profile."""
        p = self.profile
        if p is None:
            return 0.0
        if batch <= p.max_batch:
            return p.latency_ms(batch)
        per_item = (p.latency_ms(p.max_batch) - p.latency_ms(1)) / max(p.max_batch - 1, 1)
        return p.latency_ms(p.max_batch) + per_item * (batch - p.max_batch)


def saturated_batch(profile: Profile | None, slo_ms: float) -> int:
    """Largest b with 2*l(b) <= SLO (DESIGN.md, saturated GPU); 1 when even b=1 misses; 32 unprofiled."""
    if profile is None:
        return 32
    best = 1
    for b in range(1, profile.max_batch + 1):
        if 2 * profile.latency_ms(b) <= slo_ms:
            best = b
    return best


class Engine:
    """Sessions of one device and the thread that executes their batches."""

    def __init__(self, policy: BatchPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.clock = clock
        self.sessions: dict[str, Session] = {}
        self._cv = threading.Condition()
        self._ids = itertools.count(1)
        self._stop = False
        self._busy_s = 0.0
        self._started = clock()
        self._thread = threading.Thread(target=self._loop, name="executor", daemon=True)
        self._thread.start()

    # ---- table changes (loop thread) ---------------------------------------------------------------

    def set_sessions(self, sessions: dict[str, Session]) -> list[Session]:
        """Replace the session table; queued work of removed sessions fails. Returns removed sessions."""
        with self._cv:
            removed = [s for name, s in self.sessions.items() if sessions.get(name) is not s]
            for new in sessions.values():
                old = self.sessions.get(new.name)
                if old is not None and old is not new:   # keep queue and counters across re-plans
                    new.queue, new.stats = old.queue, old.stats
            self.sessions = dict(sessions)
            self._cv.notify()
        return removed

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=5)

    # ---- requests (loop thread) --------------------------------------------------------------------

    def submit(self, work: Work) -> None:
        with self._cv:
            session = self.sessions.get(work.model)
            if session is None:
                raise ExecError("EXEC_NOT_FOUND", f"model {work.model!r} is not loaded on this backend")
            if len(session.queue) >= session.max_queue:
                session.stats.dropped += 1
                raise ExecError("EXEC_OVERLOADED", f"queue of {work.model!r} is full ({session.max_queue})")
            item = Pending(next(self._ids), work.deadline_s, work.arrival_s, work)
            bisect.insort(session.queue, item, key=lambda p: (p.deadline_s, p.request_id))
            self._cv.notify()

    def utilization(self) -> float:
        elapsed = max(self.clock() - self._started, 1e-9)
        return min(1.0, self._busy_s / elapsed)

    # ---- executor thread ---------------------------------------------------------------------------

    def _next(self) -> tuple[Session, list[Pending], list[Pending]] | None:
        """Under the lock: choose a session and what to run/drop now; None when nothing is queued."""
        candidates = [s for s in self.sessions.values() if s.queue]
        if not candidates:
            return None
        session = min(candidates, key=lambda s: s.queue[0].deadline_s)
        now = self.clock()
        selection = self.policy.select(session.queue, now, session.max_batch, session.latency_ms)
        taken = {p.request_id for p in selection.batch} | {p.request_id for p in selection.dropped}
        batch = list(selection.batch)
        # A request may carry several rows: keep the batch within max_batch rows (always run one).
        rows = 0
        kept = []
        for p in batch:
            if kept and rows + p.payload.rows > session.max_batch:
                taken.discard(p.request_id)
                continue
            kept.append(p)
            rows += p.payload.rows
        session.queue = [p for p in session.queue if p.request_id not in taken]
        return session, kept, list(selection.dropped)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop:
                    chosen = self._next()
                    if chosen is not None:
                        break
                    self._cv.wait()
                if self._stop:
                    return
            session, batch, dropped = chosen
            now = self.clock()
            for p in dropped:
                session.stats.dropped += 1
                session.stats.fail_count += 1
                p.payload.done(Outcome("EXEC_DEADLINE", f"dropped: cannot meet its deadline "
                                                        f"({(p.deadline_s - now) * 1000:.1f} ms left)"))
            if batch:
                self._run(session, batch)

    def _run(self, session: Session, batch: list[Pending]) -> None:
        works = [p.payload for p in batch]
        start = self.clock()
        try:
            if len(works) == 1:
                feeds = {spec.name: works[0].arrays[i] for i, spec in enumerate(session.inputs)}
            else:
                feeds = {spec.name: np.concatenate([w.arrays[i] for w in works])
                         for i, spec in enumerate(session.inputs)}
            result = session.runtime.run(feeds)
            outputs = [result[spec.name] for spec in session.outputs]
            error = None
        except Exception as exc:  # a failing batch fails its requests, not the backend
            outputs, error = None, f"{exc.__class__.__name__}: {exc}"
        end = self.clock()
        compute_ns = int((end - start) * 1e9)
        self._busy_s += end - start
        rows = sum(w.rows for w in works)
        stats = session.stats
        stats.execution_count += 1
        stats.inference_count += rows
        stats.compute_ns += compute_ns
        stats.batch_histogram[rows] = stats.batch_histogram.get(rows, 0) + 1
        stats.batch_compute_ns[rows] = stats.batch_compute_ns.get(rows, 0) + compute_ns
        stats.last_inference_ms = int(time.time() * 1000)
        offset = 0
        for w in works:
            queue_ns = int((start - w.arrival_s) * 1e9)
            stats.queue_ns += max(queue_ns, 0)
            if error is not None:
                stats.fail_count += 1
                w.done(Outcome("EXEC_INTERNAL", f"model {session.name!r} failed: {error}"))
                continue
            part = [o[offset:offset + w.rows] for o in outputs]
            offset += w.rows
            stats.success_count += 1
            stats.success_ns += int((end - w.arrival_s) * 1e9)
            w.done(Outcome("EXEC_OK", outputs=part, queue_ns=max(queue_ns, 0), compute_ns=compute_ns,
                           batch_size=rows))
