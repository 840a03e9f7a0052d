"""A discrete-event simulation of one device serving one session with a batch policy (pure, no clock).

The device is work-conserving: whenever it is idle and requests are queued, it asks the one
batching decision (:func:`common.batch_decision.schedule`, as the engine does) what to do at the current
simulated time, drops what it drops and runs the batch for ``latency_ms(rows)``. Requests arrive at
the given times (for example :func:`common.arrivals.arrival_times`), each with deadline arrival +
SLO, and queue in deadline order. A request is *on time* when its batch finishes by its deadline,
*late* when it finishes after, *dropped* when the policy drops it (or it is still queued when a policy
that waits has no further arrival to wait for).

Goodput is on-time requests per second over the arrival window (first to last arrival), the
quantity Nexus reports; ``capacity_rps`` gives the device's best throughput at a batch size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from common.batch_decision import BatchPolicy, LatencyFn, Pending, Queue, remove_taken, schedule
from common.batch_decision import saturated_batch as _saturated_batch


@dataclass(frozen=True)
class SimResult:
    offered: int
    on_time: int
    late: int
    dropped: int
    batches: int
    duration_s: float
    goodput_rps: float
    throughput_rps: float
    mean_batch: float
    latency_p50_ms: float
    latency_p99_ms: float

    @property
    def bad_rate(self) -> float:
        """Fraction of offered requests that were late or dropped."""
        return (self.late + self.dropped) / self.offered if self.offered else 0.0


def capacity_rps(latency_ms: LatencyFn, batch: int) -> float:
    """Requests per second of a device running batches of ``batch`` back to back."""
    return batch * 1000.0 / latency_ms(batch)


def saturated_batch(latency_ms: LatencyFn, slo_ms: float, max_batch: int) -> int:
    """Nexus's saturated batch (:func:`common.batch_decision.saturated_batch`); ValueError if none fits."""
    best = _saturated_batch(latency_ms, slo_ms, max_batch)
    if best == 0:
        raise ValueError(f"SLO {slo_ms} ms is below 2*l(1) = {2.0 * latency_ms(1)} ms")
    return best


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return math.nan
    index = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[index]


def simulate(policy: BatchPolicy, arrivals_s: Sequence[float], slo_ms: float, latency_ms: LatencyFn,
             max_batch: int) -> SimResult:
    """Serve requests arriving at ``arrivals_s`` (non-decreasing) with SLO ``slo_ms`` on one device."""
    if not slo_ms > 0:
        raise ValueError(f"slo_ms must be positive, got {slo_ms}")
    arrivals_s = [float(t) for t in arrivals_s]
    if any(b < a for a, b in zip(arrivals_s, arrivals_s[1:])):
        raise ValueError("arrivals_s must be non-decreasing")
    slo_s = slo_ms / 1000.0
    n = len(arrivals_s)
    queue: list[Pending] = []
    latencies_ms: list[float] = []
    on_time = late = dropped = batches = served = 0
    now = arrivals_s[0] if n else 0.0
    next_arrival = 0
    while next_arrival < n or queue:
        if not queue:
            now = max(now, arrivals_s[next_arrival])
        while next_arrival < n and arrivals_s[next_arrival] <= now:
            t = arrivals_s[next_arrival]
            queue.append(Pending(next_arrival, t + slo_s, t))  # one SLO: arrival order is deadline order
            next_arrival += 1
        selection = schedule([Queue("device", tuple(queue), max_batch, latency_ms)], now, policy=policy)
        if selection.rows > max_batch:
            raise ValueError(f"the policy selected {selection.rows} rows, more than max_batch={max_batch}")
        remove_taken(queue, selection)
        dropped += len(selection.dropped)
        if selection.batch:
            finish = now + latency_ms(selection.rows) / 1000.0
            for item in selection.batch:
                latencies_ms.append((finish - item.arrival_s) * 1000.0)
                if finish <= item.deadline_s + 1e-12:
                    on_time += 1
                else:
                    late += 1
            batches += 1
            served += len(selection.batch)
            now = finish
        elif not selection.dropped:  # the policy waits: jump to the next arrival, or give up
            if next_arrival < n:
                now = max(now, arrivals_s[next_arrival])
            else:
                dropped += len(queue)
                queue.clear()
    duration_s = (arrivals_s[-1] - arrivals_s[0]) if n > 1 else 0.0
    rate = (lambda count: count / duration_s) if duration_s > 0 else (lambda count: 0.0)
    latencies_ms.sort()
    return SimResult(offered=n, on_time=on_time, late=late, dropped=dropped, batches=batches, duration_s=duration_s,
                     goodput_rps=rate(on_time), throughput_rps=rate(served),
                     mean_batch=served / batches if batches else 0.0,
                     latency_p50_ms=_percentile(latencies_ms, 0.50), latency_p99_ms=_percentile(latencies_ms, 0.99))
