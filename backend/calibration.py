"""How long a session's batches really take against its profile: the estimate the engine's batching
decision uses (early drop, and when a duty-cycle batch must start).

The profile's l(b) is the conservative figure the scheduler plans with (``max((mean + std) * 1.15,
p99)``, common/profile.py), possibly measured while other work shared the device. Planning needs
that margin; the early drop does not. It decides whether *this* batch will finish before a
request's deadline, and a request dropped because the batch *might* take the planning figure is a
request lost that the batch would have served in time. Measured (issue 18): with the planning
figure, ResNet-18 at a 100 ms SLO lost 3-8% of its requests as DEADLINE_EXCEEDED at 250-300 rps
while the answered ones kept p99 within the SLO.

:class:`Calibration` keeps the ratio of each batch's observed time to the profile's l(b) over the
session's last ``window`` batches; the engine predicts a batch of b rows to take l(b) times the
median ratio (1 before any batch ran). The median ignores the odd batch that another process
delayed, and follows a device that is steadily faster or slower than its profile. A profile that
changes starts a new calibration (the ratios are relative to the profile).
"""

from __future__ import annotations

import collections
import statistics

WINDOW = 64                 # batches remembered
MIN_FACTOR = 0.05           # a ratio outside these bounds is a measurement error, not a device
MAX_FACTOR = 20.0


class Calibration:
    """The median ratio of observed batch times to the profile's l(b) (module docstring). Written and
    read by the engine's executor thread only."""

    def __init__(self, window: int = WINDOW) -> None:
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        self._ratios: collections.deque[float] = collections.deque(maxlen=window)
        self.factor = 1.0

    def observe(self, profile_ms: float, observed_ms: float) -> None:
        """One batch took ``observed_ms`` where the profile says ``profile_ms`` (a batch that took no time
        on the engine's clock, as on a test's stopped clock, tells nothing and is left out)."""
        if not (profile_ms > 0 and observed_ms > 0):
            return
        self._ratios.append(min(max(observed_ms / profile_ms, MIN_FACTOR), MAX_FACTOR))
        self.factor = statistics.median(self._ratios)

    @property
    def samples(self) -> int:
        return len(self._ratios)
