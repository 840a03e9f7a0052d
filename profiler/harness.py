"""A small in-process serving harness: real execution, the backend's batching decision, open-loop load.

One executor thread per device serves every model placed on it. Each model has a queue in deadline
order (all of a model's requests carry the same SLO, so deadline order is arrival order). At each
turn the executor admits every request whose arrival time has passed and asks
:func:`common.batch_decision.schedule`, the decision the backend's engine serves with, what to do: EDF
across the models, the backend's early-drop policy within one (eager batch start, at most the
model's max batch: the largest b with 2*l(b) <= SLO, as the backend and the scheduler use, with l(b)
the model's *dedicated* profile latency). So a co-location slowdown measured here is measured under
the batching that serves it.

The chosen batch executes for real through the model's runtime. Latency is completion time minus
scheduled arrival, on the harness's ``clock`` (``time.perf_counter`` unless another is injected, with
the ``sleep`` that waits on it: a virtual clock makes a step exact and instant). A step passes for a model when at most ``max_bad_rate`` of its requests were
dropped or late and the ``percentile`` of its completed latencies is within the SLO.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from common.arrivals import arrival_times
from common.batch_decision import BatchPolicy, Pending, Queue, SlidingWindowEarlyDrop, remove_taken, saturated_batch, schedule
from common.profile import Profile
from profiler.errors import ProfilerError
from profiler.inputs import make_feeds


def max_batch_for_slo(profile: Profile, slo_ms: float) -> int:
    """The largest b with 2*l(b) <= SLO (0 when even batch 1 does not fit)."""
    return saturated_batch(profile.latency_ms, slo_ms, profile.max_batch)


@dataclass
class TenantModel:
    """A model served by the harness: its loaded runtime, dedicated profile and SLO."""

    name: str
    runtime: Any
    profile: Profile
    slo_ms: float
    input_shapes: dict[str, tuple[int, ...]] | None = None
    max_batch: int = 0
    _feeds: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.slo_ms > 0:
            raise ProfilerError(f"{self.name}: SLO must be positive, got {self.slo_ms}")
        self.max_batch = max_batch_for_slo(self.profile, self.slo_ms)
        if self.max_batch < 1:
            raise ProfilerError(f"{self.name}: SLO {self.slo_ms:g} ms is below 2*l(1) = "
                                f"{2 * self.profile.latency_ms(1):.3g} ms; no batch can meet it")
        self._feeds = make_feeds(self.runtime.inputs, self.max_batch, seed=0, overrides=self.input_shapes)

    def feeds(self, batch: int) -> dict[str, np.ndarray]:
        return {k: v[:batch] for k, v in self._feeds.items()}

    @property
    def mean_peak_rps(self) -> float:
        """Best b/mean(b) up to the max batch: what the device could do without the safety margin."""
        best = 0.0
        for row in self.profile.rows[: self.max_batch]:
            best = max(best, row.batch * 1000.0 / (row.mean_ms or row.latency_ms))
        return best

    @property
    def predicted_peak_rps(self) -> float:
        """Saturated throughput the profile predicts: b/l(b) at the max batch for the SLO."""
        return self.max_batch * 1000.0 / self.profile.latency_ms(self.max_batch)


@dataclass
class ModelStepStats:
    """One model's outcome in one harness step."""

    name: str
    rate_rps: float
    offered: int
    completed: int
    dropped: int
    late: int
    p50_ms: float
    p99_ms: float
    percentile_ms: float
    goodput_rps: float
    batches: int
    mean_batch: float
    exec_ms: dict[int, tuple[int, float]]  # batch -> (count, total ms)
    ok: bool

    @property
    def bad_rate(self) -> float:
        return (self.dropped + self.late) / self.offered if self.offered else 0.0

    def to_json_obj(self) -> dict:
        return {"rate_rps": round(self.rate_rps, 3), "offered": self.offered, "completed": self.completed,
                "dropped": self.dropped, "late": self.late, "bad_rate": round(self.bad_rate, 6),
                "p50_ms": _r(self.p50_ms), "p99_ms": _r(self.p99_ms), "percentile_ms": _r(self.percentile_ms),
                "goodput_rps": round(self.goodput_rps, 3), "batches": self.batches,
                "mean_batch": round(self.mean_batch, 3), "ok": self.ok}


def _r(x: float) -> float | None:
    return None if not np.isfinite(x) else round(float(x), 4)


class _Queue:
    """A model's arrivals, queued requests and per-request latencies for one step."""

    def __init__(self, index: int, model: TenantModel, arrivals: np.ndarray) -> None:
        self.name = str(index)
        self.model = model
        self.arrivals = arrivals
        self.latency = np.full(len(arrivals), np.nan)
        self.queue: list[Pending] = []   # arrived, neither served nor dropped
        self.tail = 0  # first request not yet arrived
        self.dropped = 0
        self.slo_s = model.slo_ms / 1000.0
        self.exec_ms: dict[int, list[float]] = {}

    def admit(self, now: float) -> None:
        if self.tail < len(self.arrivals):
            tail = int(np.searchsorted(self.arrivals, now, side="right"))
            for i in range(self.tail, tail):
                t = float(self.arrivals[i])
                self.queue.append(Pending(i, t + self.slo_s, t))
            self.tail = tail

    def view(self) -> Queue:
        return Queue(self.name, tuple(self.queue), self.model.max_batch, self.model.profile.latency_ms)


class Harness:
    """Serves ``models`` on one device with one executor thread; see the module docstring."""

    def __init__(self, models: list[TenantModel], *, percentile: float = 99.0, max_bad_rate: float = 0.01,
                 policy: BatchPolicy | None = None, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        names = [m.name for m in models]
        if len(set(names)) != len(names):
            raise ProfilerError(f"model names must be distinct, got {names}")
        if not 0 < percentile <= 100:
            raise ProfilerError(f"percentile must be in (0, 100], got {percentile}")
        if not 0 <= max_bad_rate < 1:
            raise ProfilerError(f"max bad rate must be in [0, 1), got {max_bad_rate}")
        self.models = {m.name: m for m in models}
        self.percentile = percentile
        self.max_bad_rate = max_bad_rate
        self.policy = policy or SlidingWindowEarlyDrop()
        self.clock = clock
        self.sleep = sleep

    def run_step(self, rates_rps: dict[str, float], duration_s: float, seed: int = 0) -> dict[str, ModelStepStats]:
        """Offer ``rates_rps`` (model -> rate; models not named get no load) for ``duration_s``."""
        unknown = set(rates_rps) - set(self.models)
        if unknown:
            raise ProfilerError(f"unknown model(s) {sorted(unknown)}")
        if duration_s <= 0:
            raise ProfilerError(f"step duration must be positive, got {duration_s}")
        queues = []
        for i, (name, model) in enumerate(self.models.items()):
            rate = float(rates_rps.get(name, 0.0))
            rng = np.random.default_rng([seed, i])
            queues.append(_Queue(i, model, arrival_times(rate, duration_s, rng)))
        error: list[BaseException] = []
        worker = threading.Thread(target=self._execute, args=(queues, error), name="harness-executor", daemon=True)
        worker.start()
        worker.join()
        if error:
            exc = error[0]
            raise ProfilerError(f"execution failed during the load step: {type(exc).__name__}: {exc}") from exc
        return {q.model.name: self._stats(q, float(rates_rps.get(q.model.name, 0.0)), duration_s) for q in queues}

    def _execute(self, queues: list[_Queue], error: list[BaseException]) -> None:
        try:
            self._loop(queues)
        except BaseException as exc:  # reported by run_step
            error.append(exc)

    def _loop(self, queues: list[_Queue]) -> None:
        clock = self.clock
        t0 = clock()
        while True:
            now = clock() - t0
            for q in queues:
                q.admit(now)
            decision = schedule([q.view() for q in queues if q.queue], now, policy=self.policy)
            if decision.queue is None:
                pending = [q.arrivals[q.tail] for q in queues if q.tail < len(q.arrivals)]
                if not pending and decision.wake_s is None:
                    for q in queues:    # a policy that waits, with nothing left to wait for
                        q.dropped += len(q.queue)
                        q.queue.clear()
                    return  # every request served or dropped
                wake = min(pending) if pending else decision.wake_s
                if decision.wake_s is not None:
                    wake = min(wake, decision.wake_s)
                wait = wake - (clock() - t0)
                if wait > 0:
                    self.sleep(wait)
                continue
            q = queues[int(decision.queue)]
            remove_taken(q.queue, decision)
            q.dropped += len(decision.dropped)
            if not decision.batch:
                continue
            b = decision.rows
            start = clock()
            q.model.runtime.run(q.model.feeds(b))
            end = clock()
            ids = np.fromiter((p.request_id for p in decision.batch), dtype=np.int64, count=len(decision.batch))
            q.latency[ids] = (end - t0) - q.arrivals[ids]
            q.exec_ms.setdefault(b, []).append((end - start) * 1000.0)

    def _stats(self, q: _Queue, rate: float, duration_s: float) -> ModelStepStats:
        lat_ms = q.latency[np.isfinite(q.latency)] * 1000.0
        offered = len(q.arrivals)
        late = int(np.sum(lat_ms > q.model.slo_ms))
        completed = len(lat_ms)
        if completed:
            p50, p99, pct = (float(np.percentile(lat_ms, p)) for p in (50, 99, self.percentile))
        else:
            p50 = p99 = pct = float("nan")
        batches = sum(len(v) for v in q.exec_ms.values())
        bad = (q.dropped + late) / offered if offered else 0.0
        ok = offered == 0 or (bad <= self.max_bad_rate and completed > 0 and pct <= q.model.slo_ms)
        return ModelStepStats(
            name=q.model.name, rate_rps=rate, offered=offered, completed=completed, dropped=q.dropped, late=late,
            p50_ms=p50, p99_ms=p99, percentile_ms=pct, goodput_rps=(completed - late) / duration_s,
            batches=batches, mean_batch=completed / batches if batches else 0.0,
            exec_ms={b: (len(v), float(sum(v))) for b, v in q.exec_ms.items()}, ok=ok)
