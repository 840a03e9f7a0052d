"""The one search for the largest offered rate that still passes a load test.

``passes(rate) -> bool`` runs one load step at ``rate`` (an open-loop run against a server, a step of
the profiler's harness, a simulation) and says whether it met its target. The search assumes that a
rate passes when a higher one does. It runs in three phases:

1. ``start`` first (capped at ``max_rate``).
2. If it passes: ``hi`` next when given (the answer if it passes, else the upper end of the
   bracket); without ``hi``, the rate times ``growth`` while steps pass, never above ``max_rate``
   (passing ``max_rate`` ends the search). If ``start`` fails: 0.0 without a ``floor``; with one,
   the rate divided by ``growth`` while steps fail, as long as it stays at or above ``floor``.
3. Bisection between the best passing and the lowest failing rate, until they are within
   ``rel_tol`` of each other (relative to the best), ``refine`` bisections were run, or the search
   ran ``max_steps`` steps in all. With ``bracket=(lo, hi)`` the search starts here: ``lo`` is taken
   to pass and ``hi`` to fail without trying them (``start`` is ``lo``).

The answer is the largest rate that passed (0.0 if none did). :func:`max_passing_rate` drives the
search with a plain function, :func:`max_passing_rate_async` with a coroutine function, and
:func:`rate_steps` is the search itself, a generator that yields each rate to try and is sent
whether it passed, for callers that drive it another way.
"""

from __future__ import annotations

import math
from typing import Awaitable, Callable, Generator


def rate_steps(start: float, *, growth: float = 2.0, hi: float | None = None, max_rate: float = math.inf,
               floor: float | None = None, rel_tol: float = 0.0, refine: int | None = None,
               max_steps: int | None = None,
               bracket: tuple[float, float] | None = None) -> Generator[float, bool, float]:
    """The search described in the module's docstring; its return value is the answer."""
    if not (start > 0 and math.isfinite(start)):
        raise ValueError(f"the start rate must be positive, got {start}")
    if not growth > 1.0:
        raise ValueError(f"growth must be > 1, got {growth}")
    if hi is not None and not hi > start:
        raise ValueError(f"need start < hi, got start={start}, hi={hi}")
    if max_steps is not None and max_steps < 1:
        raise ValueError(f"max_steps must be >= 1, got {max_steps}")
    if rel_tol < 0 or (refine is not None and refine < 0):
        raise ValueError(f"rel_tol and refine must be >= 0, got {rel_tol} and {refine}")
    if bracket is not None and not bracket[0] == start < bracket[1]:
        raise ValueError(f"a bracket (lo, hi) needs lo = start < hi, got {bracket} and start={start}")
    steps = 0

    def room() -> bool:
        return max_steps is None or steps < max_steps

    def step(rate: float) -> Generator[float, bool, bool]:
        nonlocal steps
        steps += 1
        return bool((yield rate))

    if bracket is not None:
        best, fail = bracket
    elif (yield from step(min(start, max_rate))):                  # phase 1 passed: go up
        best, fail = min(start, max_rate), math.inf
        if hi is not None:
            if not room():
                return best
            if (yield from step(hi)):
                return hi
            fail = hi
        while fail == math.inf:
            if best >= max_rate or not room():
                return best
            rate = min(best * growth, max_rate)
            if (yield from step(rate)):
                best = rate
            else:
                fail = rate
    else:                                                           # phase 1 failed: go down, to a floor
        best, fail = 0.0, min(start, max_rate)
        while best == 0.0:
            rate = fail / growth
            if floor is None or rate < floor or not room():
                return 0.0
            if (yield from step(rate)):
                best = rate
            else:
                fail = rate
    bisections = 0
    while room() and (refine is None or bisections < refine) and fail - best > rel_tol * best:
        mid = 0.5 * (best + fail)
        bisections += 1
        if (yield from step(mid)):
            best = mid
        else:
            fail = mid
    return best


def max_passing_rate(passes: Callable[[float], bool], start: float, **search) -> float:
    """The search with a plain ``passes`` function (``search``: the keywords of :func:`rate_steps`)."""
    steps = rate_steps(start, **search)
    try:
        rate = next(steps)
        while True:
            rate = steps.send(bool(passes(rate)))
    except StopIteration as done:
        return done.value


async def max_passing_rate_async(passes: Callable[[float], Awaitable[bool]], start: float, **search) -> float:
    """The search with a coroutine function ``passes``, inside a running event loop."""
    steps = rate_steps(start, **search)
    try:
        rate = next(steps)
        while True:
            rate = steps.send(bool(await passes(rate)))
    except StopIteration as done:
        return done.value
