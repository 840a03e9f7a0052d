"""A component freezes its start-up heap when it announces itself (nexus/process.py): the objects
alive then are out of the cyclic collector's reach, so a full collection no longer traverses them,
while the cycles made afterwards are still collected. Run in a child process: freezing the test
runner's own heap would outlive the test."""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import gc
from nexus.process import run_until_signalled

async def serve(config, ready):
    assert gc.get_freeze_count() == 0
    ready("127.0.0.1:1")
    frozen = gc.get_freeze_count()
    class Node:
        pass
    a, b = Node(), Node()
    a.other, b.other = b, a       # a cycle made after start-up, then dropped
    del a, b
    print("frozen", frozen, "collected", gc.collect(), flush=True)

raise SystemExit(run_until_signalled("probe", serve, None))
"""


def test_the_start_up_heap_is_frozen_and_later_cycles_are_collected():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "NEXUS-READY probe 127.0.0.1:1"
    words = lines[1].split()
    assert words[0] == "frozen" and int(words[1]) > 10_000     # the modules and what they hold
    assert words[2] == "collected" and int(words[3]) >= 2      # the two nodes (and their __dict__s)
