"""common/heap_freezer.py: each tick freezes the survivors (a full collection no longer traverses
them); a thaw, once ``thaw_every_s`` has passed on the injected clock, unfreezes and collects, which
frees the cycles that formed among frozen objects. In a child process:
freezing the test runner's heap would outlive the test."""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import asyncio, gc, weakref
from common.heap_freezer import HeapFreezer

class Node:
    pass

t = [0.0]
freezer = HeapFreezer(every_s=0.01, thaw_every_s=100.0, clock=lambda: t[0])
a, b = Node(), Node()
a.other, b.other = b, a
alive = weakref.ref(a)
freezer.tick()                                    # the pair is frozen while alive
assert gc.get_freeze_count() > 0
del a, b                                          # now a cycle of garbage, out of the collector's reach
gc.collect()
print("frozen cycle survives a collection", alive() is not None)
t[0] = 99.0
freezer.tick()                                    # before the thaw is due: frozen again, nothing freed
print("before the thaw", alive() is not None, freezer.thaws)
t[0] = 100.0
freezer.tick()                                    # the thaw: unfrozen, collected, then frozen again
print("after the thaw", alive() is not None, freezer.thaws, freezer.freezes)

async def main():
    runner = HeapFreezer(every_s=0.01)
    task = asyncio.ensure_future(runner.run())
    await asyncio.sleep(0.2)
    task.cancel()
    print("run ticks", runner.freezes > 3)

asyncio.run(main())
"""


def test_frozen_survivors_are_collected_at_the_thaw():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "frozen cycle survives a collection True",
        "before the thaw True 0",
        "after the thaw False 1 3",
        "run ticks True",
    ]

