"""The one batching decision of the system: which queue runs a batch now, of which requests, and
which requests are dropped (:func:`schedule`), with the batch policies it applies and the saturated
batch (:func:`saturated_batch`). The backend's engine, the discrete-event simulation
(:mod:`backend.simulate`) and the profiler's multi-tenant harness (:mod:`profiler.harness`) all call
:func:`schedule`, so what is simulated and measured is batched as what is served.

Batches are counted in rows: a request carries ``rows`` leading rows (1 for a plain request; a client
may send a batch of several), a batch's size is the sum of its requests' rows, ``max_batch`` and the
planned batch are rows, and l(b) is the latency of b rows. A request is never split, and a batch holds
at least one request even when that request alone has more rows than ``max_batch``.

Batch selection policies: which queued requests a queue runs now, and which it drops.

Policies are pure: the caller passes the queue (sorted by deadline, earliest first), the current
time ``now_s`` on any monotonic clock, the largest batch to run and the profile's latency function
``latency_ms(b)`` (defined for 1 <= b <= max_batch). A policy returns a :class:`Selection`: the
requests to run now as one batch and the requests to drop now; a request is in at most one of the
two, and every request in neither stays queued. Times are floats in seconds; latencies in ms.

- :class:`EarliestFirst`: the earliest deadlines, up to ``max_batch`` rows. With ``drop_expired`` (the default)
  requests whose deadline has already passed (``deadline_s <= now_s``) are dropped instead of run,
  since a late answer is a failure anyway; with ``drop_expired=False`` nothing is ever dropped
  (plain FIFO for a single SLO; the baseline that collapses under overload).
- :class:`SlidingWindowEarlyDrop`: Nexus's early drop. See its docstring.
"""

from __future__ import annotations

import enum
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Sequence

LatencyFn = Callable[[int], float]
"""l(b): latency in ms of a batch of b rows, for 1 <= b <= max_batch (conservative profile figure)."""


@dataclass(frozen=True)
class Pending:
    """A queued request: its id, absolute deadline and arrival time (seconds, monotonic clock).

    ``payload`` is the caller's (inputs, reply future, ...); it takes no part in equality or hashing.
    """

    request_id: int
    deadline_s: float
    arrival_s: float
    payload: object = field(default=None, compare=False, repr=False)
    rows: int = field(default=1, compare=False)


@dataclass(frozen=True)
class Selection:
    """What to do now: ``batch`` runs as one batch, ``dropped`` are answered as missed; others stay queued."""

    batch: tuple[Pending, ...] = ()
    dropped: tuple[Pending, ...] = ()

    def __post_init__(self) -> None:
        if self.batch and self.dropped:
            ran = {p.request_id for p in self.batch}
            both = [p.request_id for p in self.dropped if p.request_id in ran]
            if both:
                raise ValueError(f"requests {both} are both in the batch and dropped")


def _window(queue: Sequence[Pending], start: int, max_rows: int) -> tuple[int, int]:
    """(end, rows): the requests ``queue[start:end]`` fit in ``max_rows`` rows (at least one request
    when ``start`` is in the queue) and hold ``rows`` rows."""
    end, rows = start, 0
    n = len(queue)
    while end < n and (end == start or rows + queue[end].rows <= max_rows):
        rows += queue[end].rows
        end += 1
    return end, rows


class PolicyName(enum.StrEnum):
    EARLY_DROP = "early_drop"
    EARLIEST_FIRST = "earliest_first"


class BatchPolicy(ABC):
    """Base class: validates arguments, handles the empty queue, delegates to :meth:`_select`."""

    name: ClassVar[PolicyName]

    def select(self, queue: Sequence[Pending], now_s: float, max_batch: int, latency_ms: LatencyFn) -> Selection:
        """Choose the batch to run at ``now_s`` and the requests to drop; ``queue`` is sorted by deadline."""
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be a positive integer, got {max_batch!r}")
        if not queue:
            return Selection()
        return self._select(queue, now_s, max_batch, latency_ms)

    @abstractmethod
    def _select(self, queue: Sequence[Pending], now_s: float, max_batch: int, latency_ms: LatencyFn) -> Selection:
        """Select from a non-empty queue."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class EarliestFirst(BatchPolicy):
    """Run the earliest deadlines, up to ``max_batch`` rows; drop only requests already past their deadline.

    ``drop_expired=False`` disables even that: every request is run, however late.
    """

    name = PolicyName.EARLIEST_FIRST

    def __init__(self, drop_expired: bool = True) -> None:
        self.drop_expired = drop_expired

    def _select(self, queue: Sequence[Pending], now_s: float, max_batch: int, latency_ms: LatencyFn) -> Selection:
        start = 0
        if self.drop_expired:
            while start < len(queue) and queue[start].deadline_s <= now_s:
                start += 1
        end, _ = _window(queue, start, max_batch)
        return Selection(batch=tuple(queue[start:end]), dropped=tuple(queue[:start]))

    def __repr__(self) -> str:
        return f"EarliestFirst(drop_expired={self.drop_expired})"


class SlidingWindowEarlyDrop(BatchPolicy):
    """Nexus's early drop: slide a window down the queue until its head can meet its deadline.

    For i = 0, 1, ...: the window is the requests from i on, as many as fit in ``max_batch`` rows
    (at least request i), b rows in all. If a batch of b rows started now finishes by request i's deadline
    (``now_s + l(b)/1000 <= deadline_i``), that window is the batch; every later request in it has a
    later deadline, so the whole batch is on time. Requests before i are dropped: none of them can
    finish on time in a batch of the size the device is about to run.

    Shrinking: when the window is not full (the queue from i onwards holds fewer than ``max_batch``
    rows, i.e. the session is below its planned load), the window loses requests from its end until
    it meets request i's deadline, before i is given up, and the rest stay queued for the next batch. A full window
    never shrinks: under overload, trading batch size for a doomed head request would cut
    throughput and make every later request miss too (Nexus's rationale for dropping instead).
    If no request can make it, all are dropped.
    """

    name = PolicyName.EARLY_DROP

    def _select(self, queue: Sequence[Pending], now_s: float, max_batch: int, latency_ms: LatencyFn) -> Selection:
        n = len(queue)
        for i in range(n):
            end, rows = _window(queue, i, max_batch)
            budget_ms = (queue[i].deadline_s - now_s) * 1000.0
            if latency_ms(rows) <= budget_ms:
                return Selection(batch=tuple(queue[i:end]), dropped=tuple(queue[:i]))
            if end == n and rows < max_batch:   # not full: shrink to rescue request i
                while end > i + 1:
                    end -= 1
                    rows -= queue[end].rows
                    if latency_ms(rows) <= budget_ms:
                        return Selection(batch=tuple(queue[i:end]), dropped=tuple(queue[:i]))
        return Selection(dropped=tuple(queue))


POLICIES: dict[str, type[BatchPolicy]] = {
    PolicyName.EARLY_DROP: SlidingWindowEarlyDrop,
    PolicyName.EARLIEST_FIRST: EarliestFirst,
}
"""Policy name -> class (constructible with no arguments); keys are :class:`PolicyName` (str) values."""


SERVE_LATE = EarliestFirst(drop_expired=False)
"""The policy of a queue whose late requests are served (common/late_requests.py): earliest deadlines
first, nothing dropped however late."""


def make_policy(name: str) -> BatchPolicy:
    """A policy by registry name; ValueError lists the known names."""
    try:
        return POLICIES[PolicyName(name)]()
    except ValueError:
        raise ValueError(f"unknown batch policy {name!r}; known: {', '.join(p.value for p in PolicyName)}") from None


def saturated_batch(latency_ms: LatencyFn, slo_ms: float, max_batch: int, eps_ms: float = 0.0) -> int:
    """Nexus's saturated batch (docs/planning.md): the largest b <= ``max_batch`` with 2*l(b) <= SLO + eps;
    0 when even b = 1 misses. Profiles never get faster with the batch, so the scan stops at the
    first miss. Every caller (engine, prefix groups, simulation, profiler harness, planner) uses this
    one rule and decides itself what no fitting batch means."""
    best = 0
    for b in range(1, max_batch + 1):
        if 2.0 * latency_ms(b) > slo_ms + eps_ms:
            break
        best = b
    return best


def batch_ready_at(queue: Sequence[Pending], planned_batch: int, duty_cycle_s: float, latency_ms: LatencyFn) -> float:
    """When the next batch of a non-empty queue should start (Nexus's duty cycle, clock in seconds).

    At once when the queue holds the planned batch (rows); otherwise when its oldest request has
    waited one duty cycle, or when the earliest deadline leaves just the time to run the planned
    batch, whichever comes first. Starting every tiny batch as soon as the device is free would pay
    the fixed cost of a batch again and again: on a GPU-like profile (l(b) = 10b + 30 ms) the device
    then saturates at 40 requests/s where the plan counted on 70. With a planned batch of 1 (low
    rates) or a duty cycle of 0 (eager batch start) this is eager execution.
    """
    if duty_cycle_s <= 0 or planned_batch <= 1:
        return -math.inf
    rows = 0
    for p in queue:
        rows += p.rows
        if rows >= planned_batch:
            return -math.inf
    oldest = min(p.arrival_s for p in queue)
    return min(oldest + duty_cycle_s, queue[0].deadline_s - latency_ms(planned_batch) / 1000)


@dataclass(frozen=True)
class Queue:
    """One schedulable unit's queue, as :func:`schedule` sees it: a session, or a prefix group whose
    members' queues are merged. ``requests`` are in deadline order (then id); ``max_batch`` and
    ``planned_batch`` are rows; ``latency_ms`` is l(b) of the unit."""

    name: str
    requests: tuple[Pending, ...]
    max_batch: int
    latency_ms: LatencyFn = field(compare=False)
    planned_batch: int = 1
    policy: "BatchPolicy | None" = field(default=None, compare=False)   # this queue's own (None: schedule's)


@dataclass(frozen=True)
class Decision:
    """What to do at ``now``: run ``batch`` (``rows`` rows) from queue ``queue`` and answer ``dropped``
    as missed (both from that queue); everything else stays queued. When no queue is ready, ``queue``
    is None and ``wake_s`` says when the earliest batch becomes ready (None: nothing is queued)."""

    queue: str | None = None
    batch: tuple[Pending, ...] = ()
    dropped: tuple[Pending, ...] = ()
    rows: int = 0
    wake_s: float | None = None

    @property
    def taken(self) -> frozenset[int]:
        """Ids leaving the queue: run or dropped."""
        return frozenset(p.request_id for p in self.batch) | frozenset(p.request_id for p in self.dropped)


def schedule(queues: Sequence[Queue], now: float, *, policy: BatchPolicy, duty_cycle_s: float = 0.0) -> Decision:
    """The batching decision at time ``now`` (seconds, any monotonic clock). Pure.

    Among the queues whose batch is ready (:func:`batch_ready_at`; every non-empty queue when
    ``duty_cycle_s`` is 0, the eager batch start), the one whose head has the earliest deadline runs
    (EDF across queues; ties go to the first in ``queues``). ``policy`` (or the queue's own, as
    :data:`SERVE_LATE` for a model that serves its late requests) chooses the batch (at most
    ``max_batch`` rows, at least one request) and the requests to drop (early drop).
    """
    best: Queue | None = None
    best_deadline = math.inf
    wake = math.inf
    for q in queues:
        if not q.requests or q.requests[0].deadline_s >= best_deadline:
            continue
        ready = batch_ready_at(q.requests, q.planned_batch, duty_cycle_s, q.latency_ms)
        if ready <= now:
            best, best_deadline = q, q.requests[0].deadline_s
        else:
            wake = min(wake, ready)
    if best is None:
        return Decision(wake_s=wake if wake < math.inf else None)
    selection = (best.policy or policy).select(best.requests, now, best.max_batch, best.latency_ms)
    return Decision(best.name, selection.batch, selection.dropped, sum(p.rows for p in selection.batch))


def remove_taken(queue: list[Pending], decision: Decision) -> None:
    """Take the decision's requests off ``queue`` in place (fast when they are its head, as the
    built-in policies choose); ValueError when the decision names requests that are not queued."""
    chosen = decision.dropped + decision.batch
    k = len(chosen)
    if k <= len(queue) and all(queue[j] is item for j, item in enumerate(chosen)):
        del queue[:k]
        return
    ids = decision.taken
    if len(ids) != k:
        raise ValueError("the policy selected the same request twice")
    kept = [item for item in queue if item.request_id not in ids]
    if len(queue) - len(kept) != k:
        raise ValueError("the policy selected requests that are not queued")
    queue[:] = kept
