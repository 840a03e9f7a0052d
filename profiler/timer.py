"""Timing one batch: CUDA events on a GPU when torch can provide them, the monotonic clock otherwise.

Runtimes return host arrays, so ``run`` is synchronous: a batch's latency is the time from the call
to its results being back on the host, which is what a served request sees. On CPU the monotonic
clock measures it. On a GPU the profiler synchronises the device, records a CUDA event, runs the
batch, records a second event and synchronises on it, so the figure is the device timeline between
the two events (it includes the host-device copies the runtime does inside ``run``).
"""

from __future__ import annotations

import time
from typing import Callable

from profiler.environment import cuda_index, is_cuda


class PerfCounterTimer:
    name = "perf_counter"

    def time_ms(self, fn: Callable[[], object]) -> float:
        t0 = time.perf_counter_ns()
        fn()
        return (time.perf_counter_ns() - t0) / 1e6


class CudaEventTimer:
    name = "cuda_events"

    def __init__(self, device: str) -> None:
        import torch  # lazy: torch is an optional extra (~1 s to import)

        self._torch = torch
        self._device = torch.device("cuda", cuda_index(device))

    def time_ms(self, fn: Callable[[], object]) -> float:
        torch = self._torch
        with torch.cuda.device(self._device):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end))


def make_timer(device: str):
    """CUDA events for ``cuda:N`` when torch with CUDA is installed, the monotonic clock otherwise."""
    if is_cuda(device):
        try:
            import torch  # lazy: torch is an optional extra (~1 s to import)

            if torch.cuda.is_available():
                return CudaEventTimer(device)
        except Exception:
            pass
    return PerfCounterTimer()
