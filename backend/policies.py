"""Batch selection policies: which queued requests a session runs now, and which it drops.

Policies are pure: the caller passes the queue (sorted by deadline, earliest first), the current
time ``now_s`` on any monotonic clock, the largest batch to run and the profile's latency function
``latency_ms(b)`` (defined for 1 <= b <= max_batch). A policy returns a :class:`Selection`: the
requests to run now as one batch and the requests to drop now; a request is in at most one of the
two, and every request in neither stays queued. Times are floats in seconds; latencies in ms.

- :class:`EarliestFirst`: the ``max_batch`` earliest deadlines. With ``drop_expired`` (the default)
  requests whose deadline has already passed (``deadline_s <= now_s``) are dropped instead of run,
  since a late answer is a failure anyway; with ``drop_expired=False`` nothing is ever dropped
  (plain FIFO for a single SLO; the baseline that collapses under overload).
- :class:`SlidingWindowEarlyDrop`: Nexus's early drop. See its docstring.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Sequence

LatencyFn = Callable[[int], float]
"""l(b): latency in ms of a batch of b requests, for 1 <= b <= max_batch (conservative profile figure)."""


@dataclass(frozen=True)
class Pending:
    """A queued request: its id, absolute deadline and arrival time (seconds, monotonic clock).

    ``payload`` is the caller's (inputs, reply future, ...); it takes no part in equality or hashing.
    """

    request_id: int
    deadline_s: float
    arrival_s: float
    payload: object = field(default=None, compare=False, repr=False)


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
    """Run the ``max_batch`` earliest deadlines; drop only requests already past their deadline.

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
        return Selection(batch=tuple(queue[start:start + max_batch]), dropped=tuple(queue[:start]))

    def __repr__(self) -> str:
        return f"EarliestFirst(drop_expired={self.drop_expired})"


class SlidingWindowEarlyDrop(BatchPolicy):
    """Nexus's early drop: slide a window down the queue until its head can meet its deadline.

    For i = 0, 1, ...: the window is the requests i .. i+b-1 with b = min(max_batch, len(queue) - i),
    as many as possible. If a batch of size b started now finishes by request i's deadline
    (``now_s + l(b)/1000 <= deadline_i``), that window is the batch; every later request in it has a
    later deadline, so the whole batch is on time. Requests before i are dropped: none of them can
    finish on time in a batch of the size the device is about to run.

    Shrinking: when the window is not full (fewer than ``max_batch`` requests from i onwards, i.e.
    the session is below its planned load), b shrinks to the largest size that still meets request
    i's deadline before i is given up, and the rest stay queued for the next batch. A full window
    never shrinks: under overload, trading batch size for a doomed head request would cut
    throughput and make every later request miss too (Nexus's rationale for dropping instead).
    If no request can make it, all are dropped.
    """

    name = PolicyName.EARLY_DROP

    def _select(self, queue: Sequence[Pending], now_s: float, max_batch: int, latency_ms: LatencyFn) -> Selection:
        n = len(queue)
        for i in range(n):
            size = min(max_batch, n - i)
            budget_ms = (queue[i].deadline_s - now_s) * 1000.0
            if latency_ms(size) <= budget_ms:
                return Selection(batch=tuple(queue[i:i + size]), dropped=tuple(queue[:i]))
            if size < max_batch and latency_ms(1) <= budget_ms:
                for smaller in range(size - 1, 0, -1):
                    if latency_ms(smaller) <= budget_ms:
                        return Selection(batch=tuple(queue[i:i + smaller]), dropped=tuple(queue[:i]))
        return Selection(dropped=tuple(queue))


POLICIES: dict[str, type[BatchPolicy]] = {
    PolicyName.EARLY_DROP: SlidingWindowEarlyDrop,
    PolicyName.EARLIEST_FIRST: EarliestFirst,
}
"""Policy name -> class (constructible with no arguments); keys are :class:`PolicyName` (str) values."""


def make_policy(name: str) -> BatchPolicy:
    """A policy by registry name; ValueError lists the known names."""
    try:
        return POLICIES[PolicyName(name)]()
    except ValueError:
        raise ValueError(f"unknown batch policy {name!r}; known: {', '.join(p.value for p in PolicyName)}") from None
