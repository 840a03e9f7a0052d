"""How often a coroutine lets the event loop run other work: for tests of work done in slices
(common/loop_slices.py)."""

from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

T = TypeVar("T")


async def with_turns(work: Awaitable[T]) -> tuple[T, int]:
    """``work``'s result, and how many times a task beside it ran while it was awaited."""
    turns = 0

    async def beside():
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(beside())
    await asyncio.sleep(0)
    start = turns
    try:
        result = await work
    finally:
        task.cancel()
    return result, turns - start
