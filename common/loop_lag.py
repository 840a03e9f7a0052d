"""How late an asyncio event loop runs what it was asked to run: the lag of a timer that should fire
every ``interval_s``, as a Prometheus histogram. A loop that runs a long computation in line
answers nothing meanwhile (heartbeats, reports, table pushes); this makes that visible.

The monitor's own cost is one timer per interval (a quarter of a second by default).
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from prometheus_client import Histogram

LAG_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class LoopLagMonitor:
    def __init__(self, name: str, interval_s: float = 0.25, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self.histogram = Histogram(name, "how late the event loop ran a timer due every "
                                   f"{interval_s:g} s (seconds)", buckets=LAG_BUCKETS_S, registry=None)
        self.worst_s = 0.0

    async def run(self) -> None:
        """Until cancelled: sleep ``interval_s``, observe how much later than that the loop woke."""
        while True:
            due = self.clock() + self.interval_s
            await asyncio.sleep(self.interval_s)
            lag = max(0.0, self.clock() - due)
            self.worst_s = max(self.worst_s, lag)
            self.histogram.observe(lag)
