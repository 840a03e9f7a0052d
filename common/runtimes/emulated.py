"""The emulated GPU: runs a batch by waiting the profile's latency for its size.

Outputs are zeros of the declared shapes and dtypes (a variable dimension is emulated as 1). The
model bytes are never executed: specs come from the ONNX model's declared inputs and outputs, or
from ``io`` when given (then the bytes are not parsed at all). Waiting is precise: ``time.sleep``
for all but the last 0.2 ms, then a short spin on ``time.perf_counter``, so batch latencies follow
the profile closely on an idle machine (``wait`` replaces it, e.g. to advance a virtual clock). A batch larger than the profile's ``max_batch`` is a
``ValueError`` (the profile says nothing about it).
"""

from __future__ import annotations

import time
from typing import Callable, Mapping

import numpy as np

from common.runtimes.base import DeviceSpec, IOSpecs, Runtime, RuntimeKind
from common.model_io import onnx_io
from common.profile import Profile

# The spin covers the sleep's wake-up overshoot (tens of microseconds on an idle Linux host). It was
# 1 ms: on the shared 2-core machine, with tens of emulated devices, that cost 0.47 ms of CPU per batch
# and was preempted anyway (overshoot p90 4.1 ms), where 0.2 ms cost 0.09 ms with a p90 of 1.2 ms
# (benchmarks/long_tail.md). An emulated GPU should not take the host CPU a real one leaves free.
SPIN_S = 0.0002


def precise_sleep(duration_s: float, *, spin_s: float = SPIN_S,
                  clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep) -> None:
    """Return ``duration_s`` after the call: sleep while more than ``spin_s`` is left, then spin."""
    end = clock() + duration_s
    while True:
        left = end - clock()
        if left <= 0:
            return
        if left > spin_s:
            sleep(left - spin_s)


class EmulatedRuntime(Runtime):
    kind = RuntimeKind.EMULATED

    def __init__(self, model_bytes: bytes, device: DeviceSpec, profile: Profile, *, io: IOSpecs | None = None,
                 wait: Callable[[float], None] = precise_sleep) -> None:
        super().__init__()
        if not device.is_emulated:
            raise ValueError(f"the emulated runtime runs on emulated:<gpu> devices, not {device}")
        if not isinstance(profile, Profile):
            raise ValueError(f"profile must be a common.profile.Profile, got {type(profile).__name__}")
        inputs, outputs = io if io is not None else onnx_io(model_bytes)
        self.inputs, self.outputs, self.device = tuple(inputs), tuple(outputs), str(device)
        self.profile = profile
        self._wait = wait
        self._max_batch_seen = 1

    def _run(self, feeds: Mapping[str, np.ndarray], batch: int) -> dict[str, np.ndarray]:
        if batch > self.profile.max_batch:
            raise ValueError(f"batch size {batch} exceeds the profile's largest batch {self.profile.max_batch} "
                             f"on {self.device}")
        self._max_batch_seen = max(self._max_batch_seen, batch)
        self._wait(self.profile.latency_ms(batch) / 1000.0)
        return {spec.name: np.zeros((batch, *(d if d >= 0 else 1 for d in spec.shape)), dtype=spec.dtype)
                for spec in self.outputs}

    def memory_mb(self) -> float:
        """The profile's memory m(b) for the largest batch run so far (m(1) before any run)."""
        return self.profile.memory_mb(self._max_batch_seen)
