"""Short full garbage collections for a process whose long-lived state is built while it runs.

The cyclic collector's full (generation 2) collection traverses every tracked object. A scheduler
with a fleet registered holds its fleet's state, the models' profiles and its plans: at 1,000
devices and 2,400 models it ran a full collection every 3-4 s, each holding the event loop for
150-200 ms, and each freeing almost nothing (benchmarks/elastic.md). Objects that have survived a
while are nearly always live for much longer, and reference counting frees them when they are not
in a cycle. So :class:`HeapFreezer` moves the survivors out of the collector's reach every
``every_s`` (``gc.freeze``), and once every ``thaw_every_s`` puts them back and collects once
(``gc.unfreeze``), which frees the cycles among them: memory stays bounded, and one full pause is
paid per thaw instead of one every few seconds.
"""

from __future__ import annotations

import asyncio
import gc
import time
from typing import Callable

FREEZE_EVERY_S = 2.0       # every 10 s left full collections of 22-65 ms at 1,000 devices; every 2 s, 5-14 ms
THAW_EVERY_S = 3600.0


class HeapFreezer:
    def __init__(self, every_s: float = FREEZE_EVERY_S, thaw_every_s: float = THAW_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s, self.thaw_every_s, self.clock = every_s, thaw_every_s, clock
        self.freezes = self.thaws = 0
        self._thawed_at = clock()

    def tick(self) -> None:
        """Freeze the survivors now; thaw and collect first when ``thaw_every_s`` has passed."""
        now = self.clock()
        if now - self._thawed_at >= self.thaw_every_s:
            gc.unfreeze()
            gc.collect()
            self._thawed_at = now
            self.thaws += 1
        gc.freeze()
        self.freezes += 1

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            self.tick()
