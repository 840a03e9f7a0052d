"""Pooled burst headroom: how much execution time beyond its planned batches a device keeps free.

The model. A device runs duty cycles of ``d`` ms; session i on it runs one batch per cycle, planned
at ``b_i`` items, while A_i ~ Poisson(n_i) requests arrive per cycle, n_i = load_i * d / 1000 (the
load is the arrival rate the plan routes to this device; at most its throughput b_i*1000/d). A
batch may grow past b_i (the backend runs up to the saturated batch), and an extra item of session
i costs ``c_i`` ms (:func:`marginal_ms_per_item`). A cycle *overflows* when its executions no longer
fit: sum_i c_i * (A_i - b_i) > d - sum_i l_i(b_i). Overflowed requests wait a cycle more and miss
their SLO, so the device keeps ``H = burst_excess_ms(...)`` ms free so that a cycle overflows with
probability at most ``p = 1 - Phi(z)`` (``z`` is ``--burst-sigma``: the normal quantile users set
before, now for the device instead of for each session on its own).

The statistic. W = sum_i c_i A_i is compound Poisson with mean mu = sum c_i n_i, variance
sigma^2 = sum c_i^2 n_i and third cumulant k3 = sum c_i^3 n_i. A device with one session (with
load) is a lattice: W = c*A, and its quantile is exact, c times the Poisson(n) (1 - p)-quantile.
With several, the (1 - p)-quantile is taken as

    q = mu + sigma * (z + (z^2 - 1) * gamma / 6) + c_max / 2,    gamma = k3 / sigma^3,

the Cornish-Fisher expansion to the skewness term (Poisson arrivals are right-skewed, more so for
few arrivals per cycle), plus half the largest item as a continuity correction: W moves in steps of
c_i, and without it a quantile just below a step under-provisions (a session with 0.7 arrivals per
cycle would overflow 15% of cycles at z = 1.5 instead of 6.7%). The headroom is what the planned
batches do not already cover: H = max(0, q - sum_i c_i b_i). With d fixed, sigma grows with
sqrt(d) and the skew term (z^2-1)/6 * k3/sigma^2 does not depend on d.

For a lone session the exact quantile matters: a GPU whose batch may hold one request carries 0.39
arrivals per cycle at the target, where the expansion would allow 0.03, and at a batch of 34, 26.6
instead of 25.7. Saturated GPUs (one session each, never shared) get the exact figure. A residual
load is planned by the expansion even while it is alone on its GPU
(``globalsched/planning/algorithms/batch_sizing.py``); otherwise it would fill its GPU by the exact figure and
then take no one, since the expansion applies as soon as a second session joins. On the long-tail
benchmarks that costs 3-15% of devices.

Why this and not the alternatives. Per session (n + z*sqrt(n) arrivals each, the earlier rule)
provisions sum_i c_i * z * sqrt(n_i), where independent bursts need about z * sqrt(sum_i c_i^2 n_i):
a long tail of small sessions pays the sum of square roots. A Poisson quantile of the device's total
arrival count weighs a ResNet item like an MLP item; the weighted sum does not. The plain normal
quantile mu + z*sigma (the issue's first suggestion) under-provisions small devices: on random
devices of 1-40 sessions it exceeded the target probability on 22 of 60, the skew term alone on 7,
this statistic on none (worst 6.4% for a 6.7% target, mean 2.8%: conservative where the lattice
forces it; lone sessions exact). ``tests/unit/test_headroom.py`` simulates Poisson arrivals against
planned devices.

The rule a plan keeps (globalsched/planning/plan.py): on every device, sum of executions + H <= duty cycle, and
for every session on it duty cycle + its execution + H <= its SLO budget (a burst of the sessions
running before it in the cycle delays its batch by at most H). ``z <= 0`` turns headroom off.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np

LatencyFn = Callable[[int], float]
_EPS_MS = 1e-6  # as globalsched.planning.plan.EPS_MS (which imports this module)


def overflow_probability_target(z: float) -> float:
    """p = 1 - Phi(z): the share of duty cycles allowed to overflow at ``--burst-sigma z``."""
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def marginal_ms_per_item(latency_ms: LatencyFn, batch: int, largest_batch: int) -> float:
    """c(b): the steepest secant of l from ``batch`` to every larger batch up to ``largest_batch``
    (the saturated batch: what the backend may run), so that l(b + x) <= l(b) + c(b)*x there. At or
    beyond the largest batch, the mean slope (l(K) - l(1))/(K - 1); with K = 1, l(1) (an extra
    request needs a batch of its own)."""
    k = max(1, largest_batch)
    if batch < k:
        base = latency_ms(batch)
        return max(0.0, max((latency_ms(j) - base) / (j - batch) for j in range(batch + 1, k + 1)))
    if k == 1:
        return latency_ms(1)
    return max(0.0, (latency_ms(k) - latency_ms(1)) / (k - 1))


@dataclass(frozen=True)
class BurstTerm:
    """One session on one device: its planned batch, the load routed to the device, c(batch)."""

    batch: int
    load_rps: float
    marginal_ms: float


@dataclass
class BurstSums:
    """Running sums over a device's sessions, so that :meth:`excess_ms` is O(1) for any duty cycle.

    ``s1, s2, s3``: sum of load*c, load*c^2, load*c^3 (load in requests per ms); ``covered``: sum of
    c*batch; ``c_max``: the largest c among sessions with load; ``bursting``: how many sessions have
    load and cost (one: the exact lattice quantile). Mutable working state of the packers.
    """

    s1: float = 0.0
    s2: float = 0.0
    s3: float = 0.0
    covered: float = 0.0
    c_max: float = 0.0
    bursting: int = 0

    def add(self, term: BurstTerm) -> None:
        rate = term.load_rps / 1000.0
        c = term.marginal_ms
        self.s1 += rate * c
        self.s2 += rate * c * c
        self.s3 += rate * c * c * c
        self.covered += c * term.batch
        if rate > 0 and c > 0:
            self.c_max = max(self.c_max, c)
            self.bursting += 1

    def copy(self) -> "BurstSums":
        return BurstSums(self.s1, self.s2, self.s3, self.covered, self.c_max, self.bursting)

    def quantile_ms(self, duty_ms: float, z: float, exact_lone: bool = True) -> float:
        """q of the module docstring at duty cycle ``duty_ms`` (``exact_lone=False``: the several-
        session expansion even for one, the stricter figure a load that may be pooled plans with)."""
        if self.s2 <= 0:
            return self.s1 * duty_ms
        if self.bursting == 1 and exact_lone:  # W = c * A: c = s2/s1, n = s1 * d / c
            c = self.s2 / self.s1
            return c * poisson_quantile_items(self.s1 * duty_ms / c, z)
        sigma = math.sqrt(self.s2 * duty_ms)
        return self.s1 * duty_ms + z * sigma + (z * z - 1) / 6.0 * self.s3 / self.s2 + self.c_max / 2.0

    def excess_ms(self, duty_ms: float, z: float, exact_lone: bool = True) -> float:
        """H: the execution time to keep free beyond the planned batches; 0 when ``z <= 0``."""
        if z <= 0 or self.s2 <= 0:
            return 0.0
        return max(0.0, self.quantile_ms(duty_ms, z, exact_lone) - self.covered)


def burst_excess_ms(terms: Iterable[BurstTerm], duty_ms: float, z: float) -> float:
    """H for a device running ``terms`` at ``duty_ms`` (see the module docstring)."""
    sums = BurstSums()
    for t in terms:
        sums.add(t)
    return sums.excess_ms(duty_ms, z)


def poisson_tail(n: float, j: int) -> float:
    """P(A > j) for A ~ Poisson(n)."""
    term = cdf = math.exp(-n)
    for k in range(1, j + 1):
        term *= n / k
        cdf += term
    return max(0.0, 1.0 - cdf)


@functools.lru_cache(maxsize=4096)
def lone_session_load_items(batch: int, z: float) -> float:
    """The most arrivals per cycle n that one session alone on a device, at batch ``batch`` with no
    idle time (duty = l(batch)), may carry: P(Poisson(n) > batch) <= 1 - Phi(z), exactly (bisection;
    cached). ``batch`` itself when ``z <= 0``."""
    if z <= 0:
        return float(batch)
    p = overflow_probability_target(z)
    lo, hi = 0.0, float(batch)
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if poisson_tail(mid, batch) <= p else (lo, mid)
    return lo


def poisson_quantile_items(n: float, z: float) -> int:
    """The smallest j with P(Poisson(n) > j) <= 1 - Phi(z)."""
    j = max(0, math.floor(n))
    while lone_session_load_items(j, z) < n - 1e-12:
        j += 1
    while j > 0 and lone_session_load_items(j - 1, z) >= n - 1e-12:
        j -= 1
    return j


def own_burst_load_items(batch: int, z: float) -> float:
    """The most arrivals per cycle n at which an allocation at ``batch`` covers its *own* burst by
    the pooled statistic's single-term form, n + z*sqrt(n) + (z^2 - 1)/6 + 1/2 <= batch (z at least
    1). If every allocation of a device keeps this, the device keeps the pooled rule whatever else
    runs there (sqrt(sum c^2 n) <= sum c sqrt(n), the skew term is at most c_max, c_max/2 <= sum c/2;
    a lone one needs less: its quantile is exact): the per-allocation headroom of the CP-SAT model."""
    z = max(1.0, z)
    m = batch - (z * z - 1) / 6.0 - 0.5
    if m <= 0:
        return 0.0
    root = (-z + math.sqrt(z * z + 4 * m)) / 2.0
    return max(0.0, root) ** 2


def simulated_overflow_share(latency_fns: list[LatencyFn], max_batches: list[int], loads_rps: list[float],
                             duty_ms: float, cycles: int, seed: int) -> float:
    """The share of ``cycles`` duty cycles whose executions overflow ``duty_ms`` when each session
    receives Poisson(load * d) requests per cycle and runs them all as one batch (none: no batch;
    beyond its profile, l extended by its last step). A check of the statistic, independent of it:
    the benchmark and the tests compare it with :func:`overflow_probability_target`."""
    rng = np.random.default_rng(seed)
    total = np.zeros(cycles)
    for lat, k, load in zip(latency_fns, max_batches, loads_rps):
        arrivals = rng.poisson(load * duty_ms / 1000.0, size=cycles)
        top = int(arrivals.max(initial=0))
        step = lat(k) - lat(k - 1) if k > 1 else lat(1)
        table = np.array([0.0] + [lat(a) if a <= k else lat(k) + step * (a - k) for a in range(1, top + 1)])
        total += table[arrivals]
    return float(np.mean(total > duty_ms + _EPS_MS))

