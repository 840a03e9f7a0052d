"""Long work on an asyncio event loop, handed back to the loop in slices.

A process whose event loop answers heartbeats (the scheduler) cannot run 100 ms of work in one
piece: nothing else runs meanwhile, and at 1,000 backends a plan's tables and catalog took 150-430
ms each. Such work is written as a generator that yields between its items (a step) and returns its
result; :func:`run_in_slices` runs it on the loop and hands the loop back once a slice of
``SLICE_S`` has run, :func:`drain` runs it in one piece where no loop waits (a status read, a
test). :class:`LoopSlices` does the same for a coroutine's own loop.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable, Generator, TypeVar

T = TypeVar("T")

SLICE_S = 0.01

Steps = Generator[None, None, T]


class LoopSlices:
    """``await slices.due()`` between items: hands the loop back once ``slice_s`` of work has run."""

    def __init__(self, slice_s: float | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        self.slice_s = SLICE_S if slice_s is None else slice_s
        self.clock = clock
        self.ends = clock() + self.slice_s

    async def due(self) -> None:
        if self.clock() > self.ends:
            await asyncio.sleep(0)
            self.ends = self.clock() + self.slice_s


def drain(steps: Steps[T]) -> T:
    """Run ``steps`` to the end in one piece; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


async def run_in_slices(steps: Steps[T], slice_s: float | None = None) -> T:
    """Run ``steps`` to the end on the running loop, handing it back between slices; its result."""
    slices = LoopSlices(slice_s)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
        await slices.due()
