"""The device's busy time: since the engine started, and over any window of the last ``keep_s`` seconds
(the backend's ``Stats`` and ``nexus_backend_utilization``: the busy fraction over the last 10 s).

Batches are recorded as they end, by the thread that ran them; a window is read by another (the
event loop answering ``Stats`` or a scrape), under a lock that a batch's record takes too. So a read
costs O(log n) in the batches remembered, whatever the window: it never holds up the loop or the
executor's next record for long.
"""

from __future__ import annotations

import bisect
import threading


class BusyTime:
    """Busy seconds of batches that ended at ``end`` after running ``seconds`` (non-overlapping: one
    device runs one batch at a time), remembered for ``keep_s`` seconds after they end."""

    def __init__(self, keep_s: float) -> None:
        if keep_s <= 0:
            raise ValueError(f"keep_s must be positive, got {keep_s}")
        self.keep_s = keep_s
        self.total_s = 0.0
        self._lock = threading.Lock()
        # batch i of the lists ended at _ends[i] after _seconds[i]; _before[i]: total_s before it.
        # Entries before _head are forgotten (and dropped from the lists now and then).
        self._ends: list[float] = []
        self._seconds: list[float] = []
        self._before: list[float] = []
        self._head = 0

    def record(self, end: float, seconds: float) -> None:
        """A batch that ended at ``end`` (on the engine's clock) after ``seconds`` of work."""
        with self._lock:
            self._before.append(self.total_s)
            self._ends.append(end)
            self._seconds.append(seconds)
            self.total_s += seconds
            if len(self._ends) % 64 == 0:       # forget in steps: a record stays a few appends
                self._head = bisect.bisect_left(self._ends, end - self.keep_s, self._head)
                if self._head > 1024 and self._head * 2 > len(self._ends):
                    del self._ends[:self._head], self._seconds[:self._head], self._before[:self._head]
                    self._head = 0

    def busy_since(self, since: float) -> float:
        """Busy seconds after ``since``: of the batches that ended after it, the part of each that ran
        after it (``since`` within the last ``keep_s`` seconds of records)."""
        with self._lock:
            first = bisect.bisect_right(self._ends, since, self._head)
            if first == len(self._ends):
                return 0.0
            after_first = self.total_s - self._before[first] - self._seconds[first]
            return after_first + min(self._seconds[first], self._ends[first] - since)
