"""Long work on an asyncio event loop, handed back to the loop in slices.

A process whose event loop answers heartbeats (the scheduler) cannot run 100 ms of work in one
piece: nothing else runs meanwhile, and at 1,000 backends a plan's tables and catalog took 150-430
ms each. Such work is written as a generator that yields between its items (a step) and returns its
result; :func:`run_in_slices` runs it on the loop and hands the loop back once a slice of
``SLICE_S`` has run, :func:`drain` runs it in one piece where no loop waits (a status read, a
test). :class:`LoopSlices` does the same for a coroutine's own loop.

A slice's clock sees only the slicing coroutine's own work. Work that schedules more work for the
loop's next turn (a gRPC call starts, serializing its request, in a task of its own) also bounds its
items per slice: the loop runs everything made ready in one turn in one piece, and a 10 ms slice
that started 200 calls held the next turn 55-125 ms.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable, Generator, TypeVar

T = TypeVar("T")

SLICE_S = 0.01

Steps = Generator[None, None, T]


class LoopSlices:
    """``await slices.due()`` between items: hands the loop back once ``slice_s`` of work has run, or
    ``max_items`` items (None: no bound)."""

    def __init__(self, slice_s: float | None = None, clock: Callable[[], float] = time.perf_counter,
                 max_items: int | None = None) -> None:
        if max_items is not None and max_items < 1:
            raise ValueError(f"max_items must be at least 1, not {max_items}")
        self.slice_s = SLICE_S if slice_s is None else slice_s
        self.clock = clock
        self.ends = clock() + self.slice_s
        self.max_items = max_items
        self.items = 0

    async def due(self) -> None:
        self.items += 1
        if self.clock() > self.ends or (self.max_items is not None and self.items >= self.max_items):
            await asyncio.sleep(0)
            self.ends = self.clock() + self.slice_s
            self.items = 0


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
