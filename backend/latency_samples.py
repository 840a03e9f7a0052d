"""The batches a backend served since its last report: what the scheduler's measured profiles are made of.

The executor records every serving batch that ran to completion (:meth:`SampleRecorder.record`):
the model, its rows, the runtime's run time (the infer phase: what a profile's l(b) times) and
whether it was *contended*. Warm-up batches never come here (backend/engine.py runs them apart), nor
do batches that failed, nor merged batches of a prefix group (their time is the group's, not one
model's l(b)). The heartbeat takes what accumulated (:meth:`SampleRecorder.take`) and sends it to
the scheduler (common/registration.py); a heartbeat that fails loses its samples, which only delays
a measurement.

Contended, as the backend defines it (backend/engine.py sets the flag):

* the device was behind when the batch started: requests of its session were still queued after
  the batch took its rows (it was capped at its largest batch), or requests were dropped for their
  deadline in the same decision. A plan that is short of capacity shows itself this way, and its
  batches must not lower the plan further (no ratchet under overload);
* on a CPU device only, other work took the cores the model's threads need during the last
  sampling window (common/host_load.py: steal, or other processes beyond the spare cores). A GPU's
  or an emulated device's batches do not run on the host's cores, so this signal does not apply.

Bounded: at most ``max_per_model`` samples per model wait for a report; beyond that the oldest go
and are counted as ``lost``.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass

from common.measured_profile import LatencySample

MAX_SAMPLES_PER_MODEL = 512      # per model and report (a heartbeat a second: 512 batches a second)


@dataclass(frozen=True)
class ModelSamples:
    model: str
    samples: tuple[LatencySample, ...]
    lost: int = 0


class SampleRecorder:
    """Thread-safe: the executor records, the event loop takes."""

    def __init__(self, max_per_model: int = MAX_SAMPLES_PER_MODEL) -> None:
        if max_per_model < 1:
            raise ValueError(f"max_per_model must be at least 1, got {max_per_model}")
        self.max_per_model = max_per_model
        self._lock = threading.Lock()
        self._samples: dict[str, collections.deque[LatencySample]] = {}
        self._lost: dict[str, int] = {}

    def record(self, model: str, batch: int, latency_ms: float, contended: bool) -> None:
        with self._lock:
            q = self._samples.get(model)
            if q is None:
                q = self._samples[model] = collections.deque(maxlen=self.max_per_model)
            if len(q) == self.max_per_model:
                self._lost[model] = self._lost.get(model, 0) + 1
            q.append(LatencySample(batch, latency_ms, contended))

    def take(self) -> list[ModelSamples]:
        """Every model's samples since the last take, oldest first; the recorder is empty afterwards."""
        with self._lock:
            samples, self._samples = self._samples, {}
            lost, self._lost = self._lost, {}
        return [ModelSamples(m, tuple(q), lost.get(m, 0)) for m, q in sorted(samples.items()) if q]
