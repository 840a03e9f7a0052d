"""`nexus serve` stops every process it started, on SIGTERM and on SIGINT (Ctrl-C)."""

from __future__ import annotations

import os
import signal

import pytest

from tests.conftest import start_cluster

pytestmark = pytest.mark.slow


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    out, stack = set(), [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            out.add(child)
            stack.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_leaves_no_process_behind(tmp_path, sig):
    cluster = start_cluster(tmp_path, "--backends", "2", "--no-samples")
    children = _descendants(cluster.proc.pid)
    assert len(children) >= 4, children      # scheduler, frontend, two backends
    cluster.proc.send_signal(sig)
    assert cluster.proc.wait(timeout=60) == 0
    left = [pid for pid in children if _alive(pid)]
    assert not left, f"processes left behind: {left}"
